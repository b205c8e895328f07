"""Online block-size controller (``--adaptive``): the block size that pays, chosen every cycle.

Pass an ``AdaptiveController`` as ``spec_steps(controller=...)``. It needs the cost curve
(``bench.Costs``: the tuner stores one) and, optionally, a prior acceptance by position (the
tuner's probe). ``choose_block`` is the pure rule it applies each cycle.
"""

from __future__ import annotations

from typing import Sequence

from .costs import Costs


def expected_tokens(acceptance_by_position: Sequence[float], block: int) -> float:
    """Committed tokens per cycle at ``block``: 1 + sum of P(position k accepted), k < block-1."""
    return 1.0 + sum(acceptance_by_position[: block - 1])


class AdaptiveController:
    """Chooses each cycle's block size (``spec_steps(controller=...)``).

    Expected committed tokens per cycle at block L are ``1 + sum(p[:L-1])`` with p[k] the running
    (decayed) share of cycles whose first k+1 drafts were all accepted, started from ``prior``
    (the tuner's probe) as ``prior_weight`` pseudo-cycles that decay like real ones. The cycle
    cost is the stored curve Td(L) + Tt(L) plus the measured per-cycle overhead. The rate of plain decoding is one token
    per Tt(1) + overhead; while no block beats it the controller returns 1 (a plain step) and
    re-tries the best block every ``probe_every`` cycles (doubling after a failed probe), so it
    recovers when drafting starts to pay again.
    """

    def __init__(self, costs: Costs, max_block: int, prior: Sequence[float] = (), *, decay: float = 0.9,
                 prior_weight: float = 3.0, probe_every: int = 8, max_probe_every: int = 64):
        self.costs, self.max_block = costs.smoothed(), max(1, max_block)
        n = self.max_block - 1
        p = [min(1.0, max(0.0, float(x))) for x in prior[:n]]
        while len(p) < n:  # extrapolate geometrically (a neutral guess without a prior)
            r = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else (p[-1] if p else 0.5)
            p.append((p[-1] if p else 1.0) * min(r, 0.95))
        self.prior = p
        # The prior enters as pseudo-counts, which decay like real ones: it fades as cycles come.
        self.hits, self.reached = [prior_weight * x for x in p], [prior_weight] * n
        self.decay = decay
        self.overhead_ms = 0.0
        self.base_probe = self.probe_every = probe_every
        self.max_probe = max_probe_every
        self.plain_run = 0
        self.trace: list[int] = []

    def acceptance(self) -> list[float]:
        """P(first k+1 drafts accepted) per k: the decayed counts where there is evidence, else an
        extrapolation of the previous position's conditional acceptance (so a block longer than
        the ones tried lately is judged by how well the shorter ones did)."""
        out, last, cond = [], 1.0, self.prior[0] if self.prior else 0.5
        for hits, n in zip(self.hits, self.reached):
            w = n / (n + 1.0)
            p = w * (hits / n if n > 0 else 0.0) + (1 - w) * last * cond
            p = min(p, last)  # cannot grow with k
            cond = p / last if last > 0 else 0.0
            last = p
            out.append(p)
        return out

    def rate(self, L: int, acc: Sequence[float] | None = None) -> float:
        acc = self.acceptance() if acc is None else acc
        cost = self.costs.draft(L) + self.costs.verify(L) + self.overhead_ms
        return expected_tokens(acc, L) / cost if L > 1 else 1.0 / (self.costs.verify(1) + self.overhead_ms)

    def best(self) -> int:
        acc = self.acceptance()
        return max(range(2, self.max_block + 1), key=lambda L: self.rate(L, acc), default=1)

    def _observe(self, step) -> None:
        if step.prefill:
            return
        L = step.drafted + 1
        model = self.costs.draft(L) + self.costs.verify(L)
        self.overhead_ms = 0.8 * self.overhead_ms + 0.2 * max(0.0, step.elapsed_ms - model)
        if not step.drafted:
            return  # a plain step says nothing about the drafter
        for k in range(len(self.reached)):  # every position forgets; the drafted ones learn
            self.reached[k] = self.decay * self.reached[k] + (k < step.drafted)
            self.hits[k] = self.decay * self.hits[k] + (k < step.accepted)

    def __call__(self, prev) -> int:
        if prev is not None:
            self._observe(prev)
        best = self.best()
        if best > 1 and self.rate(best) > self.rate(1):
            self.plain_run, self.probe_every = 0, self.base_probe
            choice = best
        else:
            self.plain_run += 1
            choice = 1
            if best > 1 and self.plain_run >= self.probe_every:  # probe: does drafting pay again?
                self.plain_run = 0
                self.probe_every = min(self.max_probe, self.probe_every * 2)
                choice = best
        self.trace.append(choice)
        return choice


class Controllers:
    """A fresh ``AdaptiveController`` per generation (``--adaptive``), all from one cost curve:
    the tuner's stored one, else measured once here (on the engine thread)."""

    def __init__(self, pair, result=None, max_block: int | None = None):
        first = controller_for(pair, result, max_block)
        self.costs, self.max_block, self.prior = first.costs, first.max_block, first.prior

    def __call__(self) -> AdaptiveController:
        return AdaptiveController(self.costs, self.max_block, self.prior)


def controller_for(pair, result=None, max_block: int | None = None, context: Sequence[int] | None = None):
    """A fresh controller for one generation: the tuner's stored cost curve and acceptance prior
    (``result``, a ``tuner.TuneResult``), or pass costs measured now when there is none."""
    if max_block is None:
        tried = [c.block for c in result.candidates] if result is not None else []
        max_block = max(tried + [pair.drafter.args.block_size])
    costs = result.costs if result is not None else None
    if costs is None:
        from .costs import measure_costs

        sizes = sorted({2, 3, 4, 6, 8, 12, 16, max_block} - {s for s in (12, 16) if s > max_block})
        costs = measure_costs(pair.model, pair.target, pair.drafter, sizes, context or list(range(10, 74)), reps=2)
    prior = result.acceptance_by_position if result is not None else ()
    return AdaptiveController(costs, max_block, prior)
