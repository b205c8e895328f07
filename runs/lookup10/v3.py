import sys; sys.path.insert(0, "/tmp/h10a")
import harness
from harness import run, show, policy_factory, CURVES
from mlx_spec.adaptive import Copy, LOOKUP_PRIOR

class MaxCopy(Copy):  # monotone: a bucket's chance at least any shorter bucket's
    def cond(self, match):
        b = self.bucket(match)
        return max((self.hits[i] + self.weight * self.prior[i]) / (self.judged[i] + self.weight) for i in range(b + 1))

class UpCopy(Copy):  # an accepted token counts as accepted in every longer bucket too
    def update(self, match, reached, hits):
        d = self.decay
        self.judged = [d * x for x in self.judged]
        self.hits = [d * x for x in self.hits]
        for k in range(reached):
            b = self.bucket(match + k)
            if k < hits:
                for i in range(b, len(self.tops)):
                    self.judged[i] += 1.0; self.hits[i] += 1.0
            else:
                self.judged[b] += 1.0

class UpMax(UpCopy, MaxCopy):
    pass

variants = {"max": MaxCopy, "up": UpCopy, "upmax": UpMax}
only = sys.argv[1:] or list(CURVES)
for c in only:
    base = run(policy_factory(), costs=c)
    show(f"base [{c}]", base)
    for name, cls in variants.items():
        show(f"{name} [{c}]", run(policy_factory(cls), costs=c), base)
