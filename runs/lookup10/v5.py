import sys; sys.path.insert(0, "/tmp/h10a")
import harness
from harness import run, show, policy_factory, CURVES
from mlx_spec.adaptive import Copy, LOOKUP_PRIOR
tops = [t for t, _ in LOOKUP_PRIOR]
def pri(vals):
    return policy_factory(lambda: Copy(tuple(zip(tops, vals))))
for c in CURVES:
    base = run(policy_factory(), costs=c)
    show(f"base [{c}]", base)
    for a, b in ((0.97, 0.97), (0.96, 0.98), (0.97, 0.98), (0.98, 0.98), (0.98, 0.99), (0.99, 0.99)):
        show(f"{a}/{b} [{c}]", run(pri((0.2, 0.4, 0.6, 0.7, 0.9, a, b)), costs=c), base)
