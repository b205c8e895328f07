import sys
from mlx_spec import adaptive
from mlx_spec.adaptive import DraftPolicy, Context, LOOKUP, Copy, LOOKUP_PRIOR
from mlx_spec.costs import Costs
from mlx_spec.decode import Step
# a CPU's curve (MKL, 2 cores, the default pair: T1 ~54 ms, a 33-row verify ~4.5 T1)
CPU = Costs(53.7, {2: 9.4, 4: 9.6, 8: 17.4, 16: 15.1, 33: 27.2}, {1: 61.5, 2: 65.2, 4: 88.4, 8: 165.0, 16: 176.1, 33: 246.4}, 239)
for prior in (LOOKUP_PRIOR, tuple(LOOKUP_PRIOR[:5]) + ((32, 0.98), (None, 0.99))):
    p = DraftPolicy(CPU, 8, sources=(LOOKUP,))
    p.copy = Copy(prior)
    copy = tuple(range(100, 160))
    m, out = 2, []
    for _ in range(4):
        d = p.choose(Context(lookup=copy, match=m))
        out.append((m, d.length))
        L = d.length
        p.observe(Step(tuple(range(L)), drafted=L - 1, accepted=L - 1, block_size=L, source=LOOKUP,
                       verify_ms=CPU.verify(L), elapsed_ms=CPU.verify(L)))
        m += L
    print(out)
