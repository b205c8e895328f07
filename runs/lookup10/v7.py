import sys; sys.path.insert(0, "/tmp/h10a")
import harness
from harness import run, show, policy_factory, CURVES
from mlx_spec.adaptive import Copy, LOOKUP_PRIOR
tops = [t for t, _ in LOOKUP_PRIOR]
def pri(vals):
    return policy_factory(lambda: Copy(tuple(zip(tops, vals))))
V = {"long .98/.99": (0.2, 0.4, 0.6, 0.7, 0.9, 0.98, 0.99),
     "agent-measured": (0.2, 0.67, 0.65, 0.94, 0.94, 0.99, 0.99),
     "pooled-measured": (0.18, 0.6, 0.68, 0.92, 0.92, 0.95, 0.97),
     "4-16 .8/.93": (0.2, 0.4, 0.6, 0.8, 0.93, 0.95, 0.97)}
for c in [k for k in CURVES if k.endswith("~")] + sys.argv[1:]:
    base = run(policy_factory(), costs=c)
    show(f"base [{c}]", base)
    for name, vals in V.items():
        show(f"{name} [{c}]", run(pri(vals), costs=c), base)
