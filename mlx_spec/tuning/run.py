"""The tuner's sweep: measure on this machine, decide, and store the result.

``tune`` runs in named phases, each a method of ``Sweep``:

1. ``measure_acceptance``: the acceptance by position of one deterministic probe (DFlash at the
   checkpoint's block on a fixed, balanced set of built-in prompts; at greedy on fixed prompts
   it is the same every run). E(B) = 1 + the sum of the first B-1 positions, for every block.
   It runs first: it is fixed work, and what it takes tells the rest what a run costs here.
2. ``measure_costs``: the pass-cost curve, T1, Td(B), Tt(B) for every candidate block (and T1 and
   the probe's block at every other BLAS thread count), each pass timed alone in interleaved,
   rotated rounds, medians with their standard errors (``costs.CostMeter``); then
   ``measure_context_term``: T1, Tt(B) and Td(B) for a few blocks again at a longer context
   (``LONG_CONTEXT`` tokens, shorter where ``CONTEXT_SHARE`` of the budget cannot afford its
   prefill), whose difference is the curve's context term (``costs.context_term``: ``ctx_ms``,
   ``ctx_draft_ms``), stored with the curve so the per-cycle policy prices every choice at the
   sequence's real length.
3. ``plan_race`` and ``race``: the candidates the model puts in front, plain decoding, the
   model's own choice and their neighbours, timed end to end within what is left of the budget
   (``decide.race``); candidates it cannot afford are not raced, and ``why`` names them.
4. ``calibrate``: the per-cycle overhead (loop and host time beyond the two passes) and the
   plain loop's overhead beyond T1, each a median of per-run residuals over the race's runs.
5. ``decide``: ``decide.decide`` on the calibrated model; the race overrides it only on a clear
   margin (``decide.race_check``).

A pair without a DFlash drafter that drafts with chain drafters (an MTP head, an EAGLE-3
drafter) runs ``ChainSweep``: the same phases over chains of depth 1..8 instead of blocks.

``ensure_tuned`` stores the result (``store.save_result``) and is what generate, chat and serve
call on start; it also applies the stored BLAS thread count (``apply_threads``). The sweep keeps
to its budget: the deadline is checked before every pass-cost and race round, and the result
reports the time taken against the budget by phase (``TuneResult.timing``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx

from .. import BLAS  # the process's BLAS, loaded by the package root before MLX
from ..bench import Method, Runner, spread
from ..blas import default_threads, set_threads, thread_candidates
from ..costs import CostMeter, Costs, Progress, context_term
from ..errors import BadRequest, MlxSpecError
from ..policy import MAX_CHAIN_DEPTH, expected_tokens
from ..prefix import Prefill, take
from ..prompts import CHAT_KINDS, builtin_prompts, interleave
from ..stats import Stats
from ..target import feature_view
from .decide import (
    CHECK_ROUNDS,
    CLEAR_Z,
    NOISE_FLOOR,
    Check,
    Key,
    Lap,
    RaceResult,
    checks,
    clearest,
    cycle_overhead,
    decide,
    default_candidates,
    join_names,
    key_label,
    median_se,
    predict,
    race,
    with_overhead,
)
from .store import FORMAT, SOURCE_NAMES, Candidate, TuneResult, load_result, save_result, tune_key

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 90.0
BUDGET_RESERVE = 0.05  # share of the budget the plan leaves for a round slower than predicted
MIN_COST_ROUNDS = 3  # timed pass-cost rounds always run (``cost_rounds[0]`` of them while the budget allows)
# How ``tune`` shares out its budget. The pass costs' share is the one that changes what is
# measured: past ``cost_rounds[0]`` a pass-cost round runs only within it. The probe is fixed work
# and the race takes what is left (planned from the measured costs, stopped by the deadline), so
# the probe's share only places the progress bar.
PROBE_SHARE = 0.15
COSTS_SHARE = 0.3
# The context term: the passes timed again at a longer context, its prefill and rounds within
# CONTEXT_SHARE of the budget (the prefill at most half of it, in CONTEXT_CHUNK-token chunks up to
# LONG_CONTEXT tokens); a context that reached fewer than MIN_CONTEXT_SPAN tokens past the short
# one reads no term (too little to tell from the noise), and the phases say so.
CONTEXT_SHARE = 0.12
LONG_CONTEXT = 1024
CONTEXT_CHUNK = 256
MIN_CONTEXT_SPAN = 256
CONTEXT_ROUNDS = (1, 6)  # timed rounds at the long context (after a warm-up): at least, at most


class TuneSkipped(MlxSpecError):
    """The user skipped first-launch tuning (a key in the TUI): nothing is stored."""


def _threads_to_try(blas) -> list[int | None]:
    """Thread counts the tuner times: none where there is no knob or the user pinned it."""
    if not blas.settable:
        return [None]
    if blas.pinned:
        return [blas.pinned]
    return thread_candidates()


def _threads(t: int) -> str:
    return f"{t} thread{'s' if t != 1 else ''}"


def _decode_rate(r) -> float:
    """Committed tokens per second after the first step (the prefill is the same for every
    candidate and only adds noise); the whole run's rate when the reply ended at once."""
    n = len(r.tokens) - r.first_tokens
    return n / r.decode_s if n > 0 and r.decode_s > 0 else len(r.tokens) / r.total_s


def _method(B: int) -> Method:
    return Method("plain") if B == 1 else Method("dflash", B)


def chain_depth(
    costs: Costs, acc: Sequence[float], kind: str, overhead_ms: float, plain_ms: float
) -> tuple[int, float]:
    """The depth k of the chain drafter ``kind`` the model puts first, and its model speedup:
    E(k) * plain step / (k * Tc + Tt(k + 1) + overhead), E(k) = 1 + the first k positions of its
    acceptance (as DFlash's block is chosen: a chain of depth k is a block of k + 1 rows)."""
    tc, smooth = costs.tc_ms[kind], costs.smoothed()
    best = (1, 0.0)
    for k in range(1, MAX_CHAIN_DEPTH + 1):
        x = expected_tokens(acc, k + 1) * plain_ms / with_overhead(k * tc + smooth.verify(k + 1), overhead_ms)
        if x > best[1]:
            best = (k, x)
    return best


class Sweep:
    """One tuning sweep's state, phase by phase (``tune`` runs them in order)."""

    def __init__(
        self,
        pair,
        *,
        budget_s: float,
        progress: Progress | None,
        prompts,
        tokens: int,
        finalists: int,
        min_rounds: int,
        max_rounds: int,
        clear_margin: float,
        candidates: Sequence[int] | None,
        threads: Sequence[int | None] | None,
        blas,
        probe_prompts: int,
        cost_rounds: tuple[int, int],
        noise_floor: float,
        clock: Callable[[], float],
    ):
        self.pair, self.budget_s, self.tokens, self.finalists = pair, budget_s, tokens, finalists
        self.min_rounds, self.max_rounds, self.clear_margin = min_rounds, max_rounds, clear_margin
        self.probe_prompts, self.cost_rounds = probe_prompts, cost_rounds
        self.noise_floor, self.clock = noise_floor, clock
        self.blas = blas or BLAS
        self.t0 = clock()
        self.deadline = self.t0 + (1 - BUDGET_RESERVE) * budget_s  # what the plan aims at: a round may run slow
        self.chains = dict(getattr(pair, "chains", None) or {})  # chain drafters: probed and timed too
        self.cands = self.blocks(candidates)
        prompts = prompts or interleave(builtin_prompts(CHAT_KINDS))
        self.encoded = [(p.id, p.kind, p.encode(pair.tokenizer)) for p in prompts]
        self.note = progress or (lambda d, t, m: None)
        self.tlist = list(dict.fromkeys(threads if threads is not None else _threads_to_try(self.blas)))
        tlist = self.tlist
        self.main_t = tlist[0] if len(tlist) == 1 else (default_threads() if default_threads() in tlist else tlist[-1])
        self.kinds = list(dict.fromkeys(k for _, k, _ in self.encoded))
        self.context = max((ids for _, _, ids in self.encoded), key=len)
        self.probe_block = self.reference_block()
        self.phases: dict = {}
        self.runner = Runner(pair)

    def blocks(self, candidates: Sequence[int] | None) -> list[int]:
        """The candidate blocks (rows per verify, the anchor included)."""
        return sorted(set(candidates or default_candidates(self.pair.drafter.args.block_size)))

    def reference_block(self) -> int:
        """The block timed at every thread count (the probe's). Probe at the trained block: more
        masks than the drafter saw in training lower the early positions too. Positions past it
        are untrained (counted as never accepted)."""
        return min(self.pair.drafter.args.block_size, self.cands[-1])

    def method(self, key: Key) -> Method:
        """What a candidate runs (the race, the probe)."""
        return _method(key[0])

    def source_of(self, key: Key) -> str:
        return key[2] if len(key) > 2 else "dflash"

    def use(self, t: int | None) -> None:
        if t is not None:
            set_threads(self.blas, t)

    def frac(self, x: float, msg: str) -> None:  # progress as a share of the budget
        self.note(min(999, int(1000 * x)), 1000, msg)

    # ------------------------------------------------------------ 1. acceptance

    def measure_acceptance(self) -> None:
        """The deterministic probe: acceptance by position, E(B), and what a run costs here."""
        self.use(self.main_t)
        probe = []
        n_probe = max(1, self.probe_prompts)
        for n, (_, _, ids) in enumerate(self.encoded[:n_probe]):
            probe.append(self.runner.run(Method("dflash", self.probe_block), ids, self.tokens))
            self.frac(PROBE_SHARE * (n + 1) / max(1, self.probe_prompts), "acceptance probe")
        st = Stats.merged([p.stats for p in probe])
        self.acc = st.acceptance_by_position + [0.0] * (self.cands[-1] - self.probe_block)
        self.chain_acc = {}
        for kind in self.chains:  # each chain drafter at the deepest chain, on the same prompts
            runs = [
                self.runner.run(Method(kind, MAX_CHAIN_DEPTH + 1), ids, self.tokens)
                for _, _, ids in self.encoded[:n_probe]
            ]
            got = Stats.merged([r.stats for r in runs])
            self.chain_acc[kind] = got.acceptance_by_position + [0.0] * (MAX_CHAIN_DEPTH - len(got.reached))
        self.E = {B: expected_tokens(self.acc, B) for B in self.cands}
        self.warm = probe[1:] or probe  # the first run pays one-time costs
        self.probe_key = (self.probe_block, self.main_t)  # what the probe's runs ran
        self.probe_run_s = statistics.median(r.total_s for r in self.warm)
        self.prefill_s = statistics.median(r.first_s for r in self.warm)
        self.t_costs = self.clock()
        self.phases["probe_s"] = round(self.t_costs - self.t0, 2)

    # ------------------------------------------------------------ 2. pass costs

    def measure_costs(self) -> None:
        """Every candidate block at the main thread count, the probe block at the others; many
        short rounds, interleaved across thread counts and rotated within a meter.
        ``MIN_COST_ROUNDS`` timed rounds always; up to ``cost_rounds[0]`` while the race's core
        still fits after the next round (plain at T1 so far and the probe's block at the probe's
        run time, a warm-up and ``min_rounds`` each), and past it also only within
        ``COSTS_SHARE`` of the budget."""
        tlist, main_t, clock = self.tlist, self.main_t, self.clock
        meters = {t: self.meter(t) for t in tlist}
        lo, hi = self.cost_rounds
        t_costs, budget_s = self.t_costs, self.budget_s

        def core_s() -> float:
            return self.race_core_s(meters[main_t].costs().t1_ms)

        floor = max(1, min(lo, MIN_COST_ROUNDS))
        r, round_s = 0, 0.0
        while r <= hi:
            if r > floor and (
                clock() + round_s + core_s() > self.deadline or (r > lo and clock() - t_costs >= COSTS_SHARE * budget_s)
            ):
                break
            tr = clock()
            for j, t in enumerate(tlist[r % len(tlist) :] + tlist[: r % len(tlist)]):
                self.use(t)

                def step(d, n, m, j=j, r=r):
                    done = max(
                        (clock() - t_costs) / (COSTS_SHARE * budget_s), (r + (j + d / n) / len(tlist)) / (hi + 1)
                    )
                    self.frac(PROBE_SHARE + COSTS_SHARE * min(1.0, done), m)

                meters[t].round(step, f"pass costs{'' if t is None else f' at {_threads(t)}'} (round {r + 1})")
            r += 1
            round_s = clock() - tr
        # timed rounds (after the warm-up)
        self.phases |= {"costs_s": round(clock() - t_costs, 2), "cost_rounds": r - 1}
        self.meters = meters
        self.all_costs = {t: m.costs() for t, m in meters.items()}
        self.costs = self.all_costs[main_t]
        self.use(main_t)
        self.curves = {t: self.curve(t) for t in tlist}
        self.o_probe = statistics.median(self.residuals(self.probe_key, self.warm) or [0.0])

    def meter(self, t) -> CostMeter:
        """The pass-cost meter at ``t`` threads: every candidate block (and each chain drafter's
        head pass) at the main thread count, the probe's block at the others."""
        main = t == self.main_t
        return CostMeter(
            self.pair.model,
            self.pair.target,
            self.pair.drafter,
            self.cands if main else [self.probe_block],
            self.context,
            chains=self.chains if main else None,
        )

    def ref_ms(self, c: Costs) -> float:
        """The reference cycle's passes on the curve ``c`` (another thread count's is scaled by it)."""
        return c.step_ms(self.probe_block, self.probe_block)

    def curve(self, t) -> Costs:
        """The pass costs at ``t`` threads: the main curve (smoothed), scaled by how the reference
        cycle costs at ``t``; T1 (and a chain drafter's head pass) as measured at ``t``."""
        c, smooth = self.all_costs[t], self.costs.smoothed()
        ref = self.ref_ms(self.costs)
        k = self.ref_ms(c) / ref if t != self.main_t and ref else 1.0
        return Costs(
            c.t1_ms,
            {B: v * k for B, v in smooth.td_ms.items()},
            {B: v * k for B, v in smooth.tt_ms.items()},
            c.context,
            tc_ms=dict(c.tc_ms),
        )

    def race_core_s(self, t1_ms: float) -> float:
        """What the race's core takes: plain decoding (at T1) and the probe's block (at the
        probe's run time), a warm-up and ``min_rounds`` rounds each."""
        plain_run = self.prefill_s + max(0, self.tokens - 1) * t1_ms / 1e3
        return (self.min_rounds + 8 / max(1, self.tokens)) * (plain_run + self.probe_run_s)

    # ------------------------------------------------------------ 2b. the context term

    def long_ids(self, n: int) -> list[int]:
        """``n`` prompt tokens: the short context (the longest built-in prompt) followed by the
        other built-in prompts, round after round (what the passes read does not change their
        cost; only the length does)."""
        ids = list(self.context)
        others = [p for _, _, p in self.encoded if p] or [list(self.context)]
        k = 0
        while len(ids) < n:
            ids += others[k % len(others)]
            k += 1
        return ids[:n]

    def measure_context_term(self) -> None:
        """T1, Tt(B) and Td(B) for B in (2, the probe's block, the largest candidate) at a longer
        context, within ``CONTEXT_SHARE`` of the budget: the prefill (its chunks while half the
        share is left, up to ``LONG_CONTEXT`` tokens) then ``CONTEXT_ROUNDS`` rounds (the passes
        timed alone, as ``measure_costs`` times them, from copies of the prefilled caches). The
        difference from the short curve is its context term, kept on ``self.costs``."""
        clock, pair = self.clock, self.pair
        t0 = clock()
        # within its share, and never into the race's core (plain and the probe's block raced)
        stop = min(t0 + CONTEXT_SHARE * self.budget_s, self.deadline - self.race_core_s(self.costs.t1_ms))
        sizes = sorted({2, self.probe_block, self.cands[-1]})
        # a round there: these passes at the short context, twice over (attention grows), a warm-up and one timed
        c = self.costs
        drafting = pair.drafter is not None  # (a chain-only pair: T1 and Tt alone, no draft pass)
        rounds_s = (
            2
            * 2
            * (c.t1_ms + sum(c.verify(B) + (c.draft(B) if B > 1 and drafting else 0.0) for B in (1, *sizes)))
            / 1e3
        )
        if stop - t0 < rounds_s:
            self.phases |= {"context_s": 0.0, "context_tokens": 0, "context_rounds": 0, "context_term": "budget"}
            log.info("tuner: no context term (the budget leaves no time for it beside the race)")
            return
        half = t0 + min((stop - t0) / 2, stop - t0 - rounds_s)
        self.use(self.main_t)
        self.frac(PROBE_SHARE + COSTS_SHARE, "pass costs at a long context (prefill)")
        ids = self.long_ids(max(LONG_CONTEXT, len(self.context) + MIN_CONTEXT_SPAN))
        tcache = pair.target.make_cache()
        dcache = pair.drafter.make_cache() if drafting else None
        # (the target view may tap more layers for other drafters: the DFlash drafter's slice)
        dview = feature_view(pair.target.taps, pair.drafter.args.target_layer_ids) if drafting else None
        done = 0
        while done < len(ids) and (done == 0 or clock() < half):
            chunk = mx.array([ids[done : done + CONTEXT_CHUNK]], mx.int32)
            out = pair.target(chunk, tcache)
            if drafting:
                pair.drafter.add_context(dview(out.hidden), dcache)
            mx.eval([c.state for c in tcache], [c.state for c in dcache or ()])
            done += int(chunk.shape[1])
        span = done - len(self.context)
        self.phases |= {"context_tokens": done}
        if span < MIN_CONTEXT_SPAN:
            self.phases |= {"context_s": round(clock() - t0, 2), "context_rounds": 0, "context_term": "budget"}
            log.info("tuner: no context term (the budget prefilled %d tokens past the short context)", span)
            return
        entry = Prefill(tuple(ids[:done]), tcache, dcache)

        def copies():
            got = take(entry, done, drafter=drafting)
            return got.target, got.drafter

        meter = CostMeter(pair.model, pair.target, pair.drafter, sizes, ids[:done], prefilled=copies)
        lo, hi = CONTEXT_ROUNDS
        r, last = 0, 0.0
        while r <= hi:  # a warm-up round, then at least ``lo`` timed ones; more while they fit
            if r > lo and clock() + last > stop:
                break
            tr = clock()
            meter.round(None, "pass costs at a long context")
            r, last = r + 1, clock() - tr
        self.costs_long = meter.costs()
        term = context_term(self.costs, self.costs_long)
        self.costs = replace(self.costs, ctx_ms=term.ctx_ms, ctx_draft_ms=term.ctx_draft_ms)
        self.phases |= {"context_s": round(clock() - t0, 2), "context_rounds": r - 1, "context_term": "measured"}

    # ------------------------------------------------------------ the model over the measurements

    def cycle_ms(self, t, B: int) -> float:  # (B = 1: a plain step)
        return self.curves[t].step_ms(B, B)

    def residuals(self, key: Key, runs) -> list[float]:
        """Per run of ``key``, its time per cycle beyond its passes' model time (``cycle_overhead``)."""
        B, t = key[:2]
        src = self.source_of(key)
        return [x for x in (cycle_overhead(r, self.curves[t], B > 1, src) for r in runs) if x is not None]

    def se(self, t, name: str, B: int) -> float:
        return median_se(self.meters[t].times.get((name, B)) or [])

    def noise(self, key: Key) -> float:
        """Relative standard error of a key's model speedup from its own pass timings: blocks at
        one thread count share T1 and the overhead, so only Td(B) and Tt(B) tell them apart."""
        B, t = key
        main_t, se, costs = self.main_t, self.se, self.costs
        c = self.all_costs[t]
        if B == 1:
            return 0.0 if t == main_t else math.hypot(se(t, "t1", 1) / c.t1_ms, se(main_t, "t1", 1) / costs.t1_ms)
        main = math.hypot(se(main_t, "td", B), se(main_t, "tt", B)) / with_overhead(
            self.cycle_ms(main_t, B), self.o_probe
        )
        if t == main_t:
            return main
        ref = c.step_ms(self.probe_block, self.probe_block)
        return math.hypot(main, math.hypot(se(t, "td", self.probe_block), se(t, "tt", self.probe_block)) / ref)

    def model(self, o: dict, op: dict) -> dict[Key, float]:
        """Speedup over plain at the main thread count: E(B) * plain step / cycle."""

        def step(t):  # the plain loop may beat a synced T1 (it overlaps the next step): never below half
            return with_overhead(self.all_costs[t].t1_ms, op.get(t, 0.0))

        plain = step(self.main_t)
        out = {}
        for t in self.tlist:
            out[(1, t)] = plain / step(t)
            for B in self.cands:
                out[(B, t)] = predict(self.curves[t], self.acc, B, o.get(t, self.o_probe), plain)
        return out

    def candidates_of(self, predicted: dict[Key, float]) -> list[Candidate]:
        E = self.E
        return [
            Candidate(
                B,
                False,
                tau=round(E[B], 3) if B > 1 else None,
                predicted=round(x, 4),
                threads=t,
                noise=round(self.noise((B, t)), 4),
            )
            for (B, t), x in predicted.items()
        ]

    def run_s(self, key: Key, n: int) -> float:
        """Estimated seconds of one ``n``-token run (prefill as the probe's, the cycles from the
        pass costs, the expected tokens and the probe's overhead)."""
        B, t = key
        per = with_overhead(self.cycle_ms(t, B), self.o_probe) if B > 1 else self.all_costs[t].t1_ms
        return self.prefill_s + max(0, n - 1) / (self.E[B] if B > 1 else 1.0) * per / 1e3

    # ------------------------------------------------------------ 3. the race

    def plan_race(self) -> None:
        """Which candidates the first model (the probe's overhead) puts in front, to be timed end
        to end to calibrate the overheads and to check the model; planned within what is left of
        the budget."""
        cands, tlist, main_t = self.cands, self.tlist, self.main_t
        predicted = self.model({}, {})
        by_thread = sorted(tlist, key=lambda t: (-max(predicted[(B, t)] for B in [1] + cands), t != main_t))
        lead_t = by_thread[0]
        ranked = sorted(cands, key=lambda B: (-predicted[(B, lead_t)], -B))
        top = ranked[: max(2, self.finalists)]  # the predicted runner-up is always timed
        i = cands.index(ranked[0])
        near = cands[max(0, i - 1) : i + 2]  # and the neighbours of the predicted leader
        keys = [(1, lead_t)] + [(B, lead_t) for B in sorted(set(top) | set(near))]
        if len(by_thread) > 1:  # the runner-up thread count: plain and the predicted leader
            keys += [(1, by_thread[1]), (ranked[0], by_thread[1])]
        dflt = main_t if len(tlist) > 1 else None
        first = decide(self.candidates_of(predicted), default_threads=dflt, floor=self.noise_floor)
        first_key = (first.block, first.threads)
        keys += [first_key]  # what the tie rule would choose: the race checks it too
        keys = list(dict.fromkeys(keys))
        self.lead_t, self.dflt, self.first_key = lead_t, dflt, first_key
        self.afford(keys, [(1, lead_t), first_key] + [(B, lead_t) for B in ranked if (B, lead_t) in keys])

    def afford(self, keys: Sequence[Key], first: Sequence[Key]) -> None:
        """The race's plan: in order of importance (``first``, then ``keys``: plain, the model's
        choice, the predicted leader and runner-up, ...), a candidate is raced only if its warm-up
        and ``min_rounds`` rounds still fit in what is left of the budget. Without room for plain
        and one drafting candidate, no race."""
        min_rounds, tokens, plain = self.min_rounds, self.tokens, (1, self.lead_t)
        left = self.deadline - self.clock()
        need, planned, unaffordable = 0.0, [], []
        for k in dict.fromkeys(list(first) + list(keys)):
            c = self.run_s(k, 8) + min_rounds * self.run_s(k, tokens)
            if need + c <= left:
                planned.append(k)
                need += c
            else:
                unaffordable.append(k)
        if len(planned) < 2 or planned[0] != plain or all(k[0] == 1 for k in planned):  # (one drafting, raced)
            unaffordable, planned = list(dict.fromkeys(planned + unaffordable)), []
        self.keys = [k for k in keys if k in planned]
        self.planned, self.unaffordable, self.left = planned, unaffordable, left

    def neighbours(self, key: Key) -> list[Key]:
        """The next smaller and larger block at its thread count, and its block at the next
        smaller and larger thread count."""
        B, t = key
        j = self.tlist.index(t)
        out = [(B, u) for u in self.tlist[max(0, j - 1) : j + 2] if u != t]
        if B > 1:
            i = self.cands.index(B)
            out += [(b, t) for b in self.cands[max(0, i - 1) : i + 2] if b != B]
        return out

    def race(self) -> None:
        """The planned candidates timed end to end (``decide.race``), after a discarded warm-up."""
        clock, keys, encoded, runner = self.clock, self.keys, self.encoded, self.runner
        start = clock()
        for key in keys:  # warm-up, discarded
            self.use(key[1])
            runner.run(self.method(key), encoded[0][2], 8)

        runs: dict[Key, list] = {}

        def run(key: Key, i: int) -> Lap:
            self.use(key[1])
            r = runner.run(self.method(key), encoded[i][2], self.tokens)
            runs.setdefault(key, []).append(r)
            n = sum(r.blocks.values())
            return Lap(_decode_rate(r), r.decode_s / n if n else None)

        def timing(rnd: int, key: Key) -> None:
            done = (clock() - start) / max(1e-9, self.deadline - start)
            self.frac(
                PROBE_SHARE
                + COSTS_SHARE
                + CONTEXT_SHARE
                + (1 - PROBE_SHARE - COSTS_SHARE - CONTEXT_SHARE) * min(1.0, done),
                f"round {rnd + 1}: timing {key_label(key)}",
            )

        if keys:
            res = race(
                keys,
                run,
                n_prompts=len(encoded),
                judge_every=max(1, len(self.kinds)),
                neighbours=self.neighbours,
                clock=clock,
                deadline=self.deadline,
                min_rounds=self.min_rounds,
                max_rounds=self.max_rounds,
                clear_margin=self.clear_margin,
                note=timing,
                keep=[self.first_key],
                cost=lambda k: self.run_s(k, self.tokens),
            )
        else:
            res = RaceResult(laps={}, final=(), dropped={}, rounds=0, order=(), stop="budget")
        self.left_after = self.deadline - clock()  # (what a race stopped before its first round had left)
        log.debug("tuner race: %d rounds in %.1f s, stopped on %s", res.rounds, clock() - start, res.stop)
        self.phases |= {"race_s": round(clock() - start, 2), "race_rounds": res.rounds, "race_stop": res.stop}
        self.res, self.runs = res, runs

    # ------------------------------------------------------------ 4. calibration

    def calibrate(self) -> None:
        """The per-cycle overhead pooled over every drafted run at a thread count (the main one's
        where another has too few), the plain loop's beyond T1 likewise."""
        o, op = {}, {}
        for t in self.tlist:
            spec_res = [x for k, rs in self.runs.items() if k[1] == t and k[0] > 1 for x in self.residuals(k, rs)]
            plain_res = [x for k, rs in self.runs.items() if k == (1, t) for x in self.residuals(k, rs)]
            if len(spec_res) >= 3:
                o[t] = statistics.median(spec_res)
            if plain_res:
                op[t] = statistics.median(plain_res)
        if self.main_t not in o:
            o[self.main_t] = self.o_probe
        for t in self.tlist:
            o.setdefault(t, o[self.main_t])
            op.setdefault(t, op.get(self.main_t, 0.0))
        self.overhead = o
        self.predicted = self.model(o, op)

    # ------------------------------------------------------------ 5. the decision

    def rows(self) -> list[Candidate]:
        """Every candidate as stored and shown: the model's speedup (what decides), its noise, and
        what the race measured where it ran."""
        res, lead_t, predicted = self.res, self.lead_t, self.predicted
        out = []
        for key in dict.fromkeys(self.shown()):
            B, t = key[:2]
            other = "" if t == lead_t or t is None else _threads(t)
            common = dict(
                tau=self.tau(key),
                predicted=round(predicted[key], 4),
                threads=t,
                noise=round(self.noise(key), 4),
                source=self.source_of(key) if B > 1 else "dflash",
            )
            if res.tps.get(key):
                out.append(
                    Candidate(
                        B,
                        True,
                        round(statistics.median(res.tps[key]), 3),
                        round(spread(res.ratio[key] if B > 1 else res.tps[key]), 4),
                        round(statistics.median(res.ratio[key]), 4),
                        rounds=len(res.tps[key]),
                        note="; ".join(x for x in (other, res.dropped.get(key, "")) if x),
                        final=key in res.final,
                        **common,
                    )
                )
            else:
                why_not = (
                    "not raced: budget"
                    if key in self.unaffordable or (key in self.keys and not res.rounds)
                    else "not raced"
                )
                out.append(Candidate(B, False, note="; ".join(x for x in (other, why_not) if x), **common))
        return out

    def shown(self) -> list[Key]:
        """The rows of the result: plain and every block at the leading thread count, then the rest."""
        lead_t = self.lead_t
        return [(B, lead_t) for B in [1] + self.cands] + [k for k in self.predicted if k[1] != lead_t]

    def tau(self, key: Key) -> float | None:
        """E(B), the expected tokens per cycle, of a drafting candidate (None for plain)."""
        return round(self.E[key[0]], 3) if key[0] > 1 else None

    def decision(self, cands: Sequence[Candidate]) -> tuple[Key, str]:
        """The model's choice (``decide.decide``) and why."""
        d = decide(cands, default_threads=self.dflt, floor=self.noise_floor)
        return (d.block, d.threads), d.why

    def budget_note(self) -> str:
        """What the budget could not afford, and why (for ``why``)."""
        res, keys, min_rounds, tokens = self.res, self.keys, self.min_rounds, self.tokens
        unaffordable = [k for k in self.unaffordable if not res.laps.get(k)]  # (a neighbour may have joined later)
        if unaffordable:
            gone = join_names([key_label(k) for k in unaffordable])
            note = (
                f"{gone} not raced: {max(0.0, self.left):.0f} s of the budget left for the race, "
                f"{min_rounds} rounds of each would need ~"
                f"{sum(self.run_s(k, 8) + min_rounds * self.run_s(k, tokens) for k in unaffordable):.0f}"
                " s more"
            )
            if not self.planned:
                note = f"no race ({note})"
        else:
            note = ""
        if keys and not res.rounds:  # planned, then the warm-ups left too little for one round
            first = (
                f"no race: its first round (~{sum(self.run_s(k, tokens) for k in keys):.0f} s: "
                f"{join_names([key_label(k) for k in keys])}) would have ended past the budget "
                f"({max(0.0, self.left_after):.0f} s left after the warm-ups)"
            )
            note = f"{note}; {first}" if note else first
        return note

    def chain_results(self, rows: Sequence[Candidate], best: Key) -> dict:
        """Per chain drafter: its acceptance, head pass, depth and model speedup (the policy's prior)."""
        chains = {}
        plain_ms = with_overhead(self.costs.t1_ms, 0.0)
        for kind, acc in self.chain_acc.items():
            if kind in self.costs.tc_ms:
                k, x = chain_depth(self.costs, acc, kind, self.overhead[self.main_t], plain_ms)
                chains[kind] = {
                    "acceptance_by_position": [round(a, 4) for a in acc],
                    "pass_ms": self.costs.tc_ms[kind],
                    "depth": k,
                    "predicted": round(x, 4),
                }
        return chains

    def decide(self) -> TuneResult:
        """The model's choice (``decision``), overridden by the race only on a clear margin; the
        result with every candidate and why."""
        res, noise_floor = self.res, self.noise_floor
        out = self.rows()
        chosen, why = self.decision(out)
        model_why = why
        why_budget = self.budget_note()
        every = checks(res, chosen, floor=noise_floor)
        over = clearest(every)
        if over is not None:
            why = (
                f"the race overrode the model ({model_why}): {key_label(over.key)} beat {key_label(chosen)} in every "
                f"one of {over.rounds} rounds, by {over.gain - 1:.1%} (a clear margin here: {over.needed - 1:.1%}, "
                f"{CLEAR_Z:g} standard errors of a paired round, sqrt(2/{over.rounds}) x the race's run-to-run "
                f"noise {res.noise:.1%}, at least {noise_floor:.0%})"
            )
            chosen = over.key
        else:  # say what the race could tell about the stored choice
            why += _unchecked(res, chosen, every)
        if why_budget:
            why += f"; {why_budget}"
        best, best_t = chosen[:2]
        self.use(best_t)
        return TuneResult(
            key=tune_key(self.pair),
            best=best,
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            candidates=tuple(out),
            costs=self.costs,
            acceptance_by_position=tuple(round(x, 4) for x in self.acc),
            prompt_kinds=tuple(self.kinds),
            tokens_per_run=self.tokens,
            budget_s=self.budget_s,
            elapsed_s=round(self.clock() - self.t0, 2),
            format=FORMAT,
            threads=best_t,
            why=why,
            overhead_ms=round(self.overhead[self.main_t], 3),
            phases=self.phases,
            chains=self.chain_results(out, chosen),
            best_source=self.best_source(out, chosen),
        )

    def best_source(self, rows: Sequence[Candidate], chosen: Key) -> str:
        return "dflash"


class ChainSweep(Sweep):
    """The sweep of a pair without a DFlash drafter that drafts with chain drafters (an MTP head,
    an EAGLE-3 drafter): the same phases, over chains instead of blocks. A chain of depth k is a
    candidate of k + 1 rows (a verify of k + 1 rows after k head passes), keyed (rows, threads,
    source).

    1. ``measure_acceptance``: each chain drafter at the deepest chain (``MAX_CHAIN_DEPTH``) on the
       probe prompts: its acceptance by position, E(k + 1) for every depth (deterministic at
       greedy); the first drafter's runs say what a run costs here.
    2. ``measure_costs``: T1, Tt(k + 1) for every candidate depth and each drafter's head pass Tc
       at the main thread count; T1, Tc and Tt of the reference chain at the others.
    3. ``plan_race`` and ``race``: plain decoding against each drafter at the depth the first model
       chooses, the depth it puts first and their neighbours, within the budget, interleaved.
    4. ``calibrate``: the per-cycle overhead over the chain runs (their head passes priced at Tc).
    5. ``decide``: per drafter, ``decide.decide`` over its depths and plain (the rule that chooses
       blocks: depths within noise tie, the deepest that still buys expected tokens wins; plain
       unless a depth beats it by its noise); the drafter whose choice the model puts first is the
       result's ``best``; the race overrules on a clear margin.
    """

    def blocks(self, candidates: Sequence[int] | None) -> list[int]:
        top = MAX_CHAIN_DEPTH + 1
        rows = sorted({int(c) for c in candidates if 2 <= c <= top}) if candidates else list(range(2, top + 1))
        if not rows:
            raise BadRequest(
                f"the candidates {', '.join(str(c) for c in candidates or ())} hold no chain: a pair without "
                f"a DFlash drafter tunes chains of 2..{top} rows (depth 1..{MAX_CHAIN_DEPTH})"
            )
        return rows

    def reference_block(self) -> int:
        return min(4, self.cands[-1])  # a chain of depth 3 (or the deepest candidate)

    @property
    def heads(self) -> list[str]:
        return list(self.chains)

    def method(self, key: Key) -> Method:
        return Method("plain") if key[0] == 1 else Method(key[2], key[0])

    def measure_acceptance(self) -> None:
        """Each chain drafter at the deepest chain on the probe prompts (fixed work, the same every
        run at greedy): acceptance by position, E(rows); what a run costs here."""
        self.use(self.main_t)
        n_probe, top = max(1, self.probe_prompts), MAX_CHAIN_DEPTH + 1
        self.acc, self.chain_acc, self.E, first = [], {}, {}, None
        for i, kind in enumerate(self.heads):
            runs = []
            for n, (_, _, ids) in enumerate(self.encoded[:n_probe]):
                runs.append(self.runner.run(Method(kind, top), ids, self.tokens))
                done = (i * n_probe + n + 1) / (len(self.heads) * n_probe)
                self.frac(PROBE_SHARE * done, f"acceptance probe ({SOURCE_NAMES[kind]})")
            got = Stats.merged([r.stats for r in runs])
            acc = (got.acceptance_by_position + [0.0] * MAX_CHAIN_DEPTH)[:MAX_CHAIN_DEPTH]
            self.chain_acc[kind] = acc
            self.E[kind] = {B: expected_tokens(acc, B) for B in self.cands}
            first = first or runs
        self.warm = first[1:] or first  # the first run pays one-time costs
        self.probe_key = (top, self.main_t, self.heads[0])
        self.probe_run_s = statistics.median(r.total_s for r in self.warm)
        self.prefill_s = statistics.median(r.first_s for r in self.warm)
        self.t_costs = self.clock()
        self.phases["probe_s"] = round(self.t_costs - self.t0, 2)

    def meter(self, t) -> CostMeter:
        main = t == self.main_t
        cands = self.cands if main else [self.probe_block]
        return CostMeter(self.pair.model, self.pair.target, None, cands, self.context, chains=self.chains)

    def ref_ms(self, c: Costs) -> float:
        pb = self.probe_block
        return c.verify(pb) + (pb - 1) * c.tc_ms[self.heads[0]]

    def chain_ms(self, t, B: int, src: str) -> float:
        """A chain's cycle of ``B`` rows at ``t`` threads: B - 1 head passes and a B-row verify."""
        c = self.curves[t]
        return c.t1_ms if B == 1 else (B - 1) * c.tc_ms[src] + c.verify(B)

    def noise(self, key: Key) -> float:
        """As ``Sweep.noise``, the chain's own passes: Tt(B) and B - 1 head passes."""
        B, t = key[:2]
        if B == 1:
            return super().noise(key)
        src, se, main_t, pb = key[2], self.se, self.main_t, self.probe_block

        def spread_ms(u, rows: int) -> float:
            return math.hypot(se(u, "tt", rows), (rows - 1) * se(u, "tc:" + src, 1))

        main = spread_ms(main_t, B) / with_overhead(self.chain_ms(main_t, B, src), self.o_probe)
        if t == main_t:
            return main
        return math.hypot(main, spread_ms(t, pb) / self.ref_ms(self.all_costs[t]))

    def model(self, o: dict, op: dict) -> dict[Key, float]:
        """Speedup over plain at the main thread count: E(rows) * plain step / (k * Tc + Tt(k + 1) + o)."""

        def step(t):
            return with_overhead(self.all_costs[t].t1_ms, op.get(t, 0.0))

        plain = step(self.main_t)
        out = {}
        for t in self.tlist:
            out[(1, t)] = plain / step(t)
            for src in self.heads:
                for B in self.cands:
                    cycle = with_overhead(self.chain_ms(t, B, src), o.get(t, self.o_probe))
                    out[(B, t, src)] = self.E[src][B] * plain / cycle
        return out

    def tau(self, key: Key) -> float | None:
        return round(self.E[key[2]][key[0]], 3) if key[0] > 1 else None

    def candidates_of(self, predicted: dict[Key, float]) -> list[Candidate]:
        return [
            Candidate(
                k[0],
                False,
                tau=self.tau(k),
                predicted=round(x, 4),
                threads=k[1],
                noise=round(self.noise(k), 4),
                source=self.source_of(k) if k[0] > 1 else "dflash",
            )
            for k, x in predicted.items()
        ]

    def run_s(self, key: Key, n: int) -> float:
        B, t = key[:2]
        if B == 1:
            return self.prefill_s + max(0, n - 1) * self.all_costs[t].t1_ms / 1e3
        per = with_overhead(self.chain_ms(t, B, key[2]), self.o_probe)
        return self.prefill_s + max(0, n - 1) / self.E[key[2]][B] * per / 1e3

    def per_source(self, cands: Sequence[Candidate]) -> dict[str, tuple[Key, str, Key]]:
        """Per chain drafter: the key ``decide.decide`` chooses over its depths and plain, why,
        and its best depth by the model alone (the one it would run were plain not safer)."""
        out = {}
        for src in self.heads:
            mine = [c for c in cands if c.block == 1 or c.source == src]
            d = decide(mine, default_threads=self.dflt, floor=self.noise_floor)
            t = d.threads
            own = [c for c in mine if c.block > 1 and c.threads == t] or [c for c in mine if c.block > 1]
            top = max(own, key=lambda c: (c.predicted, -c.block))
            out[src] = ((d.block, d.threads) if d.block == 1 else (d.block, d.threads, src), d.why, top.key)
        return out

    def decision(self, cands: Sequence[Candidate]) -> tuple[Key, str]:
        """The drafter whose choice the model puts first (plain when none beats it by its noise)."""
        by_key = {c.key: c for c in cands}
        each = self.per_source(cands)
        named = {src: f"{SOURCE_NAMES[src]}: {why.removeprefix('off: ')}" for src, (_, why, _) in each.items()}
        drafting = [(by_key[k].predicted, src) for src, (k, _, _) in each.items() if k[0] > 1]
        if not drafting:
            plain = max((k for k, _, _ in each.values()), key=lambda k: by_key[k].predicted)
            return plain, "off: no chain drafter beats plain decoding by its noise (" + "; ".join(named.values()) + ")"
        x, src = max(drafting)
        key = each[src][0]
        why = named[src]
        others = [f"{named[o]}" for o in each if o != src]
        if others:
            why = f"{SOURCE_NAMES[src]} first (x{x:.2f}); {why}; " + "; ".join(others)
        return key, why

    def plan_race(self) -> None:
        """Plain decoding against each chain drafter at the depth the first model chooses (its best
        depth where plain is chosen), the depth the model puts first and its neighbours, and at
        the runner-up thread count plain and the leader; planned within the budget."""
        tlist, main_t = self.tlist, self.main_t
        predicted = self.model({}, {})
        by_thread = sorted(tlist, key=lambda t: (-max(x for k, x in predicted.items() if k[1] == t), t != main_t))
        lead_t = by_thread[0]
        self.dflt = main_t if len(tlist) > 1 else None
        self.lead_t = lead_t
        cands = self.candidates_of(predicted)
        first_key, _ = self.decision(cands)
        each = self.per_source(cands)
        chosen = [k if k[0] > 1 else top for k, _, top in each.values()]  # every drafter races plain
        tops = [(top[0], lead_t, top[2]) for _, _, top in each.values()]
        near = []
        for B, _, src in tops:  # the neighbours of each drafter's predicted best depth
            i = self.cands.index(B)
            near += [(b, lead_t, src) for b in self.cands[max(0, i - 1) : i + 2] if b != B]
        keys = [(1, lead_t), first_key] + chosen + tops + near
        if len(by_thread) > 1:  # the runner-up thread count: plain and the predicted leader
            lead = max(tops, key=lambda k: predicted[k])
            keys += [(1, by_thread[1]), (lead[0], by_thread[1], lead[2])]
        keys = list(dict.fromkeys(keys))
        self.first_key = first_key
        self.afford(keys, [(1, lead_t), first_key] + chosen + tops)

    def neighbours(self, key: Key) -> list[Key]:
        """The next shallower and deeper chain of its drafter at its thread count, and its chain at
        the next smaller and larger thread count."""
        B, t = key[:2]
        j = self.tlist.index(t)
        if B == 1:
            return [(1, u) for u in self.tlist[max(0, j - 1) : j + 2] if u != t]
        src = key[2]
        out = [(B, u, src) for u in self.tlist[max(0, j - 1) : j + 2] if u != t]
        i = self.cands.index(B)
        return out + [(b, t, src) for b in self.cands[max(0, i - 1) : i + 2] if b != B]

    def shown(self) -> list[Key]:
        lead_t = self.lead_t
        first = [(1, lead_t)] + [(B, lead_t, src) for src in self.heads for B in self.cands]
        return first + [k for k in self.predicted if k[1] != lead_t]

    def chain_results(self, rows: Sequence[Candidate], best: Key) -> dict:
        """Per chain drafter: its acceptance, head pass, the depth the tuner chose for it (its
        model's best where plain won), the model's speedup there and the race's, in rounds."""
        res, each = self.res, self.per_source(rows)
        by_key = {c.key: c for c in rows}
        out = {}
        for src, (key, _, top) in each.items():
            if len(best) > 2 and best[2] == src:
                key = best  # (the race may have overruled the model's depth)
            elif key[0] == 1:
                key = top
            ratio = res.ratio.get(key)
            out[src] = {
                "acceptance_by_position": [round(a, 4) for a in self.chain_acc[src]],
                "pass_ms": self.costs.tc_ms[src],
                "depth": key[0] - 1,
                "predicted": by_key[key].predicted,
                "speedup": round(statistics.median(ratio), 4) if ratio else None,
                "rounds": len(ratio or ()),
            }
        return out

    def best_source(self, rows: Sequence[Candidate], chosen: Key) -> str:
        if len(chosen) > 2:
            return chosen[2]
        spec = [c for c in rows if c.block > 1]
        return max(spec, key=lambda c: c.predicted).source if spec else self.heads[0]


def tune(
    pair,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    progress: Progress | None = None,
    prompts=None,
    tokens: int = 24,
    finalists: int = 3,
    min_rounds: int = 3,
    max_rounds: int = 12,
    clear_margin: float = 0.15,
    candidates: Sequence[int] | None = None,
    threads: Sequence[int | None] | None = None,
    blas=None,
    probe_prompts: int = 6,
    cost_rounds: tuple[int, int] = (5, 30),
    noise_floor: float = NOISE_FLOOR,
    clock: Callable[[], float] = time.perf_counter,
) -> TuneResult:
    """Measure and choose the block size and BLAS thread count for this pair on this machine (for a
    pair without a DFlash drafter: each chain drafter's depth, ``ChainSweep``; see the module
    docstring; nothing is stored: ``ensure_tuned`` stores). ``threads``: thread
    counts to try (default: 1, powers of two, all cores; one value where the user pinned it; None
    where there is no knob). ``cost_rounds``: timed pass-cost rounds, past the first number (and
    up to the second) only within ``COSTS_SHARE`` of the budget; ``probe_prompts``: prompts in
    the acceptance probe."""
    if pair.drafter is None and not (getattr(pair, "chains", None) or {}):
        raise BadRequest(
            "nothing to tune: the pair drafts with no model (no DFlash drafter, no chain drafter; "
            "lookup drafts have no pass to time)"
        )
    sweep = (Sweep if pair.drafter is not None else ChainSweep)(
        pair,
        budget_s=budget_s,
        progress=progress,
        prompts=prompts,
        tokens=tokens,
        finalists=finalists,
        min_rounds=min_rounds,
        max_rounds=max_rounds,
        clear_margin=clear_margin,
        candidates=candidates,
        threads=threads,
        blas=blas,
        probe_prompts=probe_prompts,
        cost_rounds=cost_rounds,
        noise_floor=noise_floor,
        clock=clock,
    )
    sweep.measure_acceptance()
    sweep.measure_costs()
    sweep.measure_context_term()
    sweep.plan_race()
    sweep.race()
    sweep.calibrate()
    return sweep.decide()


def _unchecked(res: RaceResult, chosen: Key, every: Sequence[Check]) -> str:
    """What the race said of a choice it did not overrule (for ``why``), from its ``checks``."""
    mine = len(res.laps.get(chosen, {}))
    if not mine:
        return "; not checked by the race (not raced)"
    dropped = f", {res.dropped[chosen]}" if chosen in res.dropped else ""
    enough = [c for c in every if c.rounds >= CHECK_ROUNDS]
    if not enough:
        return (
            f"; not checked by the race (it ran {mine} rounds{dropped}; no other candidate ran "
            f"{CHECK_ROUNDS} rounds with it)"
        )
    c = max(enough, key=lambda c: c.gain)
    need = f"{c.needed - 1:+.1%}" if math.isfinite(c.needed) else "a run-to-run noise measured"
    return (
        f"; checked by the race ({mine} rounds{dropped}): no candidate clearly faster (closest "
        f"{key_label(c.key)}: {c.gain - 1:+.1%} over {c.rounds} rounds, faster in {c.wins}; a clear margin "
        f"needs every round and {need})"
    )


def ensure_tuned(
    pair,
    budget_s: float | None = None,
    progress: Progress | None = None,
    *,
    root: Path | None = None,
    tune_fn: Callable[..., TuneResult] = tune,
) -> TuneResult | None:
    """The stored result for this machine and pair, tuning first (within ``budget_s``, default
    ``DEFAULT_BUDGET_S``) and storing it if there is none; None when the user skipped tuning.
    Applies the result's BLAS thread count. Which block size wins (the flag, --no-tune, this
    result) is decided by ``session.choose_block``; ``best == 1`` means "off"."""
    key = tune_key(pair)
    result = load_result(key, root)
    if result is None:
        budget = budget_s or DEFAULT_BUDGET_S
        log.info("no tuned block size for this machine and pair: tuning (at most ~%.0f s)", budget)
        try:
            result = replace(tune_fn(pair, budget_s=budget, progress=progress), key=key)
        except TuneSkipped:  # skipped by the user: nothing stored, tuned next launch
            apply_threads(None)
            return None
        path = save_result(result, root)
        log.info("tuning result stored in %s", path)
    apply_threads(result)
    return result


def apply_threads(result: TuneResult | None, blas=None) -> int | None:
    """Set the BLAS thread count the engine runs with: the user's pin (OPENBLAS_NUM_THREADS or
    MKL_NUM_THREADS) if set, else the stored choice, else the default (all cores). The count in
    effect; None: no knob."""
    blas = blas or BLAS
    if not blas.settable:
        return None
    n = blas.pinned or (result.threads if result is not None else None)
    return set_threads(blas, n)
