import sys; sys.path.insert(0, "/tmp/h10a")
import harness
from harness import run, show, policy_factory, CURVES
from mlx_spec.adaptive import Copy, LOOKUP_PRIOR

class HazCopy(Copy):
    """The prior's miss chances scaled by this reply's misses over those the prior expected."""
    alpha = 1.0
    floor = 0.0
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.missed = 0.0; self.expected = 0.0
    def rho(self):
        return max(self.floor, (self.missed + self.alpha) / (self.expected + self.alpha))
    def cond(self, match):
        b = self.bucket(match)
        pr = max(0.0, 1.0 - (1.0 - self.prior[b]) * self.rho())
        return (self.hits[b] + self.weight * pr) / (self.judged[b] + self.weight)
    def update(self, match, reached, hits):
        d = self.decay
        self.missed *= d; self.expected *= d
        for k in range(reached):
            b = self.bucket(match + k)
            self.expected += 1.0 - self.prior[b]
            self.missed += k >= hits
        super().update(match, reached, hits)

def mk(alpha, floor=0.0, weight=4.0):
    return lambda: type("H", (HazCopy,), {"alpha": alpha, "floor": floor})(weight=weight)

only = sys.argv[1:] or list(CURVES)
for c in only:
    base = run(policy_factory(), costs=c)
    show(f"base [{c}]", base)
    for a in (0.5, 1.0, 2.0, 4.0):
        show(f"haz a={a} [{c}]", run(policy_factory(mk(a)), costs=c), base)
