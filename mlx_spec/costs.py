"""Pass costs: what one plain decode step, one draft pass and one B-token verify pass cost here.

One implementation for `mlx_spec bench`, the tuner and the adaptive controller. ``CostMeter``
times each pass alone (synced) at a given context; rounds interleave the passes and can be
interleaved with the runs they explain. ``ceiling`` is the eta ceiling (docs/bench.md):
``tau * T1 / (Td + Tt(B))``, the speedup these two passes allow with zero loop overhead.

Passes grow with the context: every row's attention reads all earlier positions (and on a CPU
its softmax runs an exp per position). A curve may carry a context term, ``ctx_ms[B]``: the
milliseconds a B-row target pass gains per 1000 tokens of context (B = 1: a plain step), and
``ctx_draft_ms[B]`` for the draft pass (the drafter attends over its context cache), read off
passes timed at two context lengths (``context_term``); ``at(n)`` prices the curve at n tokens.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .target import feature_view, make_cache

Progress = Callable[[int, int, str], None]  # (done, total, note)


def ceiling(tau: float, t1_ms: float, td_ms: float, tt_ms: float) -> float:
    """The eta ceiling: the speedup one cycle of these costs allows at acceptance length tau."""
    cost = td_ms + tt_ms
    return tau * t1_ms / cost if cost > 0 else math.nan


def efficiency(speedup: float, ceil: float) -> float:
    return speedup / ceil if ceil and ceil > 0 and not math.isnan(ceil) else math.nan


@dataclass(frozen=True)
class Reach:
    """What drafting at one block size can give on a pass-cost curve (no host overhead, the
    measured passes only). A cycle of ``seqs`` sequences verifies ``block`` rows per sequence
    (the anchor and ``block - 1`` drafts) and commits tau tokens per sequence; it replaces tau
    plain steps of those sequences. ``break_even`` is the tau at which the cycle costs exactly
    the plain steps it replaces, so drafting that commits tau runs ``tau / break_even`` times as
    fast as plain decoding (for "dflash" at one sequence that is the eta ``ceiling`` of tau at
    this block), and ``perfect`` (every draft accepted: tau = block) is the most this block can
    give, whatever the drafter."""

    block: int
    seqs: int
    source: str  # "dflash": the drafter's pass is paid each cycle; "lookup": proposals are free
    break_even: float

    @property
    def perfect(self) -> float:
        return self.speedup(self.block)

    def speedup(self, tau: float) -> float:
        return tau / self.break_even


@dataclass(frozen=True)
class Costs:
    t1_ms: float  # plain decode step of the target (mlx-lm model)
    td_ms: dict[int, float]  # draft pass at block size B
    tt_ms: dict[int, float]  # B-token verify pass (taps included)
    context: int
    t1_draft_ms: float | None = None  # one step of an AR draft model
    # ms a B-row target pass gains per 1000 tokens of context (B = 1: a plain step); empty = flat
    ctx_ms: dict[int, float] = field(default_factory=dict)
    # one pass of each chain drafter ("mtp", "eagle"): a chain of depth k costs k of them
    tc_ms: dict[str, float] = field(default_factory=dict)
    # ms a B-row draft pass gains per 1000 tokens of context; empty = flat
    ctx_draft_ms: dict[int, float] = field(default_factory=dict)

    def ctx_slope(self, B: float) -> float:
        """``ctx_ms`` at B rows (as ``verify`` reads Tt); 0 without a context term."""
        return max(0.0, self._interp(self.ctx_ms, B)) if self.ctx_ms else 0.0

    def ctx_draft_slope(self, B: float) -> float:
        """``ctx_draft_ms`` at B rows (as ``draft`` reads Td); 0 without a draft context term."""
        return max(0.0, self._interp(self.ctx_draft_ms, B)) if self.ctx_draft_ms else 0.0

    def at(self, context: int) -> Costs:
        """This curve priced at ``context`` tokens: T1, every Tt(B) and every Td(B) moved by the
        context terms (never below a tenth of the measured pass); the same curve without one."""
        if not (self.ctx_ms or self.ctx_draft_ms) or context == self.context:
            return self
        k = (context - self.context) / 1000

        def moved(ms: float, slope: float) -> float:
            return max(0.1 * ms, ms + k * slope)

        return replace(
            self,
            t1_ms=moved(self.t1_ms, self.ctx_slope(1)),
            tt_ms={B: moved(v, self.ctx_slope(B)) for B, v in self.tt_ms.items()},
            td_ms={B: moved(v, self.ctx_draft_slope(B)) for B, v in self.td_ms.items()},
            context=context,
        )

    def _interp(self, table: dict[int, float], B: float) -> float:
        """Linear between measured sizes, flat below the first, extrapolated past the last."""
        keys = sorted(table)
        if not keys:
            return math.nan
        if B <= keys[0]:
            return table[keys[0]]
        for lo, hi in zip(keys, keys[1:]):
            if lo <= B <= hi:
                return table[lo] + (table[hi] - table[lo]) * (B - lo) / (hi - lo)
        if len(keys) == 1:
            return table[keys[0]]
        lo, hi = keys[-2:]
        return table[hi] + (table[hi] - table[lo]) / (hi - lo) * (B - hi)

    def verify(self, B: float) -> float:
        return self.tt_ms[B] if B in self.tt_ms else self._interp(self.tt_ms, B)

    def draft(self, B: float) -> float:
        if B <= 1:
            return 0.0
        return self.td_ms[B] if B in self.td_ms else self._interp(self.td_ms, B)

    def step_ms(self, rows: int, drafter_block: int = 0) -> float:
        """One cycle's model time by this curve: the target's pass over ``rows`` (T1 for a plain
        step, Tt(rows) for a verify) plus, where the drafter ran (``drafter_block`` > 0), its
        Td(drafter_block); no host overhead."""
        return (self.t1_ms if rows <= 1 else self.verify(rows)) + self.draft(drafter_block)

    def reach(self, block: int, *, seqs: int = 1, source: str = "dflash") -> Reach:
        """``Reach`` of drafting ``block`` rows per sequence for ``seqs`` sequences at once: the
        cycle is one verify over ``seqs * block`` rows (plus, for "dflash", a draft pass over as
        many rows: Td of that size), against one plain step over ``seqs`` rows (T1 alone, Tt(seqs)
        for a batch: a verify pass of that many rows stands in for a batched plain step). Sizes
        the curve did not measure are read off it as ``verify``/``draft`` read them: linear
        between measured sizes, extrapolated along the last segment past the largest."""
        if block < 2 or seqs < 1:
            raise ValueError(f"reach wants block >= 2 and seqs >= 1 (got {block}, {seqs})")
        if source not in ("dflash", "lookup"):
            raise ValueError(f"unknown draft source {source!r} (dflash, lookup)")
        if not self.tt_ms or (source == "dflash" and not self.td_ms):
            raise ValueError(
                f"reach for {source}: this curve has no {'verify' if not self.tt_ms else 'draft'} pass measured"
            )
        rows = seqs * block
        plain = self.step_ms(seqs)
        be = self.step_ms(rows, rows if source == "dflash" else 0) / plain
        return Reach(block, seqs, source, be)

    def timed(self, step):
        """``step`` (a ``decode.Step``) as this curve times it: ``step_ms`` of its verified rows
        and its drafter's block, booked to verify_ms and draft_ms; no rollback, no host overhead."""
        verify, draft = self.step_ms(step.drafted + 1), self.draft(step.draft_block)
        return replace(step, verify_ms=verify, draft_ms=draft, rollback_ms=0.0, elapsed_ms=verify + draft)

    def smoothed(self) -> Costs:
        """Td and Tt replaced by their least-squares lines in B (pass costs grow with B; single
        medians on a busy machine do not always), for ranking and control; T1, the context term
        and the chain drafters' head passes as they are."""

        def fit(table: dict[int, float]) -> dict[int, float]:
            if len(table) < 3:
                return dict(table)
            xs, ys = list(table), list(table.values())
            mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx_) ** 2 for x in xs)
            b = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
            b = max(b, 0.0)
            return {x: round(my + b * (x - mx_), 3) for x in xs}

        return Costs(
            self.t1_ms,
            fit(self.td_ms),
            fit(self.tt_ms),
            self.context,
            self.t1_draft_ms,
            ctx_ms=dict(self.ctx_ms),
            tc_ms=dict(self.tc_ms),
            ctx_draft_ms=dict(self.ctx_draft_ms),
        )

    def as_dict(self) -> dict:
        return {
            "t1_ms": round(self.t1_ms, 3),
            "context": self.context,
            "td_ms": {str(k): round(v, 3) for k, v in sorted(self.td_ms.items())},
            "tt_ms": {str(k): round(v, 3) for k, v in sorted(self.tt_ms.items())},
            "t1_draft_ms": None if self.t1_draft_ms is None else round(self.t1_draft_ms, 3),
            **({"ctx_ms": {str(k): round(v, 4) for k, v in sorted(self.ctx_ms.items())}} if self.ctx_ms else {}),
            **({"tc_ms": {k: round(v, 3) for k, v in sorted(self.tc_ms.items())}} if self.tc_ms else {}),
            **(
                {"ctx_draft_ms": {str(k): round(v, 4) for k, v in sorted(self.ctx_draft_ms.items())}}
                if self.ctx_draft_ms
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        return cls(
            float(d["t1_ms"]),
            {int(k): float(v) for k, v in d["td_ms"].items()},
            {int(k): float(v) for k, v in d["tt_ms"].items()},
            int(d.get("context", 0)),
            d.get("t1_draft_ms"),
            ctx_ms={int(k): float(v) for k, v in (d.get("ctx_ms") or {}).items()},
            tc_ms={str(k): float(v) for k, v in (d.get("tc_ms") or {}).items()},
            ctx_draft_ms={int(k): float(v) for k, v in (d.get("ctx_draft_ms") or {}).items()},
        )


def context_term(short: Costs, long: Costs) -> Costs:
    """``long`` with the context terms read off the same passes timed at ``short``'s shorter
    context: per B, (Tt_long(B) - Tt_short(B)) per 1000 tokens (T1 for B = 1) and likewise for
    the draft pass (``ctx_draft_ms``), never negative. The terms price any curve timed at one of
    the two contexts at any other (``at``): the tuner keeps them on its short curve."""
    span = long.context - short.context
    if span <= 0:
        raise ValueError(
            f"context_term wants two context lengths, the second longer (got {short.context}, {long.context})"
        )

    def per_k(a: float, b: float) -> float:  # (rounded as ``as_dict`` stores it)
        return round(max(0.0, (b - a) * 1000 / span), 4)

    slope = {B: per_k(short.tt_ms[B], v) for B, v in long.tt_ms.items() if B in short.tt_ms and B > 1}
    slope[1] = per_k(short.t1_ms, long.t1_ms)
    draft = {B: per_k(short.td_ms[B], v) for B, v in long.td_ms.items() if B in short.td_ms}
    return replace(long, ctx_ms=slope, ctx_draft_ms=draft)


class CostMeter:
    """Times the model passes alone at ``context`` tokens: T1 (plain decode step of the mlx-lm
    model), Tt(B) (B-token verify with taps, rolled back), Td(B) (draft pass), optionally one AR
    draft-model step. Each ``round()`` times every pass once, in a rotated order; ``costs()`` is
    the median over the rounds after the first (a warm-up). Rounds can be interleaved with the
    runs they explain, so both see the same machine."""

    def __init__(
        self,
        model,
        target,
        drafter,
        sizes: Sequence[int],
        context: Sequence[int],
        *,
        ar_model=None,
        prefilled: Callable[[], tuple[list, list | None]] | None = None,
        chains: dict | None = None,
    ):
        """``prefilled``: fresh copies of (target caches, drafter context caches) already holding
        ``context`` (from the prefix cache), instead of prefilling it here. ``chains``: chain
        drafters (kind -> ``chain.ChainDrafter``) whose one head pass is timed too (Tc)."""
        self.context = len(context)
        x = mx.array([list(context)], mx.int32)
        if prefilled is not None:
            return self._from_caches(model, target, drafter, sizes, context, prefilled, trim_prompt_cache)
        tok = mx.array([[int(context[-1])]], mx.int32)
        tasks: dict[tuple[str, int], Callable[[], None]] = {}

        def plain_step(m, cache):
            def run():
                mx.eval(mx.argmax(m(tok, cache=cache)[0, -1]))
                trim_prompt_cache(cache, 1)

            return run

        pcache = make_cache(model, getattr(target, "kv", None))  # (the target's K/V setting: --kv-bits)
        mx.eval(model(x, cache=pcache), [c.state for c in pcache])
        tasks[("t1", 1)] = plain_step(model, pcache)
        if ar_model is not None:
            acache = make_prompt_cache(ar_model)
            mx.eval(ar_model(x, cache=acache), [c.state for c in acache])
            tasks[("t1_draft", 1)] = plain_step(ar_model, acache)
        if target is not None:
            tcache = target.make_cache()
            out = target(x, tcache)
            mx.eval(out.logits, out.hidden, [c.state for c in tcache])
            dcache = None
            if drafter is not None:
                dcache = drafter.make_cache()
                # (the target view may tap more layers for other drafters: DFlash's slice)
                drafter.add_context(feature_view(target.taps, drafter.args.target_layer_ids)(out.hidden), dcache)
                mx.eval([c.state for c in dcache])
            anchor = mx.array(int(context[-1]), mx.int32)

            def verify(B):
                ids = mx.array([[int(context[-1])] * B], mx.int32)

                def run():
                    o = target(ids, tcache, record=True)
                    mx.eval(mx.argmax(o.logits[0], axis=-1), o.hidden)
                    target.rollback(tcache, B, 0)

                return run

            def draft(B):
                def run():
                    mx.eval(drafter.propose(anchor, None, dcache, B).tokens)

                return run

            for B in sorted({1, *sizes}):
                tasks[("tt", B)] = verify(B)
                if drafter is not None and B > 1:
                    tasks[("td", B)] = draft(B)
            for kind, chain in (chains or {}).items():
                tasks[("tc:" + kind, 1)] = _head_pass(chain, target, out, context)
        self.tasks = tasks
        self.times: dict[tuple[str, int], list[float]] = {k: [] for k in tasks}
        self.rounds = 0

    def _from_caches(self, model, target, drafter, sizes, context, prefilled, trim) -> None:
        tok = mx.array([[int(context[-1])]], mx.int32)
        pcache, _ = prefilled()
        tcache, dcache = prefilled()
        anchor = mx.array(int(context[-1]), mx.int32)

        def plain():
            mx.eval(mx.argmax(model(tok, cache=pcache)[0, -1]))
            trim(pcache, 1)

        def verify(B):
            ids = mx.array([[int(context[-1])] * B], mx.int32)

            def run():
                o = target(ids, tcache, record=True)
                mx.eval(mx.argmax(o.logits[0], axis=-1), o.hidden)
                target.rollback(tcache, B, 0)

            return run

        def draft(B):
            return lambda: mx.eval(drafter.propose(anchor, None, dcache, B).tokens)

        tasks = {("t1", 1): plain}
        for B in sorted({1, *sizes}):
            tasks[("tt", B)] = verify(B)
            if drafter is not None and dcache is not None and B > 1:
                tasks[("td", B)] = draft(B)
        self.tasks = tasks
        self.times = {k: [] for k in tasks}
        self.rounds = 0

    def round(self, progress: Progress | None = None, note: str = "measuring pass costs") -> None:
        keys = list(self.tasks)
        k = self.rounds % len(keys)
        for i, key in enumerate(keys[k:] + keys[:k]):
            t = time.perf_counter()
            self.tasks[key]()
            if self.rounds:
                self.times[key].append((time.perf_counter() - t) * 1e3)
            if progress:
                progress(i + 1, len(keys), note)
        self.rounds += 1

    def costs(self) -> Costs:
        med = {k: round(statistics.median(v), 3) for k, v in self.times.items() if v}
        return Costs(
            med[("t1", 1)],
            {B: v for (n, B), v in med.items() if n == "td"},
            {B: v for (n, B), v in med.items() if n == "tt"},
            self.context,
            med.get(("t1_draft", 1)),
            tc_ms={n[3:]: v for (n, _), v in med.items() if n.startswith("tc:")},
        )


def _head_pass(chain, target, out, context: Sequence[int]) -> Callable[[], None]:
    """One pass of a chain drafter over its context's features (``out``: the target's prefill
    of ``context``): a one-draft proposal, its row rolled back and its waiting row restored."""
    feats = out.final if chain.final_hidden else feature_view(target.taps, chain.taps)(out.hidden)
    cache = chain.make_cache()
    chain.add_context(feats[:, :-1], mx.array(list(context[:-1]), mx.int32), cache)
    chain.flush(cache)
    mx.eval(cache.state)
    pending, base = cache.pending, cache.offset
    anchor = mx.array(int(context[-1]), mx.int32)

    def run():
        cache.pending = pending
        mx.eval(chain.propose(anchor, 1, cache).tokens)
        chain.rollback(cache, base)

    return run


def measure_costs(
    model,
    target,
    drafter,
    sizes: Sequence[int],
    context: Sequence[int],
    *,
    reps: int = 5,
    ar_model=None,
    progress: Progress | None = None,
) -> Costs:
    """Median cost of each pass at ``context`` tokens over ``reps`` rounds after a warm-up round."""
    meter = CostMeter(model, target, drafter, sizes, context, ar_model=ar_model)
    for r in range(reps + 1):
        meter.round(None if progress is None else (lambda d, t, m, r=r: progress(r * t + d, (reps + 1) * t, m)))
    return meter.costs()
