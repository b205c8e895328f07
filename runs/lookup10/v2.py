import sys; sys.path.insert(0, "/tmp/h10a")
import harness
from harness import *
from mlx_spec.adaptive import DraftPolicy
base = run(policy_factory())
show("base", base)
# policy pricing by the raw (monotone) table instead of the smoothed line
class Raw(CurveTimed):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        tt, prev = {}, 0.0
        for L in sorted(self.curve.tt_ms):
            prev = max(prev, self.curve.tt_ms[L]); tt[L] = prev
        self.costs = Costs(self.curve.t1_ms, dict(self.curve.td_ms), tt, self.curve.context)
        self.line.add = lambda L, ms: None  # no line fit
show("raw costs", run(lambda: Raw(COSTS, 8, sources=(LOOKUP,))), base)
class NoLine(CurveTimed):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.line.add = lambda L, ms: None
show("smoothed, no line", run(lambda: NoLine(COSTS, 8, sources=(LOOKUP,))), base)
