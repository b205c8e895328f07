import sys; sys.path.insert(0, "/tmp/h10a")
import harness
from harness import run, show, CURVES
from lookup_replay import CurveTimed
from mlx_spec.adaptive import LOOKUP, PLAIN

class Gain(CurveTimed):
    """lookup length: argmax E(L) - g T(L), g the reply's running tokens per ms"""
    d = 0.9
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tok, self.ms = 1.0, self.cycle_ms(PLAIN, 1)
    def observe(self, step):
        super().observe(step)
        if not step.prefill:
            t = self.curve.timed(step)
            self.tok = self.d * self.tok + len(step.tokens); self.ms = self.d * self.ms + t.elapsed_ms
    def options(self, ctx):
        out = super().options(ctx)
        if LOOKUP in out:
            n = min(len(ctx.lookup), self.max_lookup, max(1, ctx.room) - 1)
            acc = self.copy.curve(ctx.match, n)
            g = self.tok / self.ms
            cum = [1.0]
            for p in acc: cum.append(cum[-1] + p)
            L = max(range(2, n + 2), key=lambda L: cum[L - 1] - g * self.cycle_ms(LOOKUP, L))
            out[LOOKUP] = (L, cum[L - 1] / self.cycle_ms(LOOKUP, L))
        return out

for c in CURVES:
    base = run(lambda: CurveTimed(harness.COSTS, 8, sources=(LOOKUP,)), costs=c)
    show(f"base [{c}]", base)
    for d in (0.8, 0.9):
        show(f"gain d={d} [{c}]", run(lambda: type("G", (Gain,), {"d": d})(harness.COSTS, 8, sources=(LOOKUP,)), costs=c), base)
