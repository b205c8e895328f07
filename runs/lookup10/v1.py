import sys; sys.path.insert(0, "/tmp/h10a")
from harness import *
from mlx_spec.adaptive import Copy, LOOKUP_PRIOR
base = run(policy_factory())
show("base", base)
def pri(vals, w=4.0):
    return policy_factory(lambda: Copy(tuple(zip([t for t, _ in LOOKUP_PRIOR], vals)), weight=w))
for label, vals in [("agent-measured", (0.2, 0.67, 0.65, 0.94, 0.94, 0.99, 0.99)),
                    ("chat-measured", (0.16, 0.58, 0.71, 0.90, 0.84, 0.64, 0.7)),
                    ("4-8 at .8", (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.97)),
                    ("4-8 at .85", (0.2, 0.4, 0.6, 0.85, 0.9, 0.95, 0.97)),
                    ("long .98/.99", (0.2, 0.4, 0.6, 0.7, 0.9, 0.98, 0.99)),
                    ]:
    show(label, run(pri(vals)), base)
for w in (2.0, 8.0):
    show(f"weight {w}", run(pri([v for _, v in LOOKUP_PRIOR], w)), base)
