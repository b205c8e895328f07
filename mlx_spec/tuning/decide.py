"""The tuner's decision: the cost model, ``decide``, and the race that checks it.

All of it is pure (the race calls the ``run`` it is given and reads the ``clock`` it is given),
so the same inputs always give the same answer.

- **The model.** The speedup of DFlash at block B over plain decoding is
  E(B) * (T1 + plain overhead) / (Td(B) + Tt(B) + overhead): E(B) the expected tokens per cycle
  from the acceptance by position, T1 / Td(B) / Tt(B) the measured pass costs, the overheads the
  loop's time beyond its passes (``predict``, ``cycle_overhead``).
- **The choice.** ``decide`` takes the model speedups with their noise (the standard error of
  each from the pass timings). Candidates within noise of the best (twice the combined standard
  error, at least ``NOISE_FLOOR``) are a tie, broken by a fixed rule: the largest block that
  still buys expected tokens, the default thread count. A block that does not beat plain
  decoding by its own noise loses to plain, the safe choice. Timing noise thus cannot flip the
  answer from run to run: only the deterministic acceptance (where E(B) stops growing) and clear
  differences in cost can.
- **The race.** ``race`` times candidates end to end, interleaved (every round every candidate
  once, the order rotated), and ``race_check`` lets it override the model only on a clear
  margin: faster in every one of at least ``CHECK_ROUNDS`` rounds both ran, by a mean gain of at
  least ``CLEAR_Z`` standard errors of the race's own run-to-run noise (and ``NOISE_FLOOR``).
  A noisy or split race never overrides.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from ..bench import Method, model_ms
from ..costs import Costs
from ..policy import expected_tokens
from .store import Candidate

NOISE_FLOOR = 0.03  # model speedups closer than this are a tie, however small the measured noise
NOISE_CAP = 0.10  # a tie tolerance above this: timings too noisy to separate blocks (no tie, best score)
CHECK_ROUNDS = 3  # the race overrides the model only with this many rounds run by both (one of each prompt kind)
CLEAR_Z = 3.0  # a clear margin: the mean gain at least this many standard errors of the race's run-to-run noise
MIN_NOISE_DF = 4  # ... that noise measured with at least this many degrees of freedom (3 candidates x 3 rounds)


# ---------------------------------------------------------------- the model and the choice


def cycle_overhead(run, costs: Costs, spec: bool, source: str = "dflash") -> float | None:
    """A run's measured time per cycle after the first step minus its passes' model time
    (``bench.model_ms``: a drafted run's last cycle with one token of room verifies the anchor
    alone, a Tt(1) pass, not a plain step's T1; a chain's head passes at Tc each); None for a run
    without cycles. ``source``: what drafted a ``spec`` run ("dflash", or a chain: "mtp", "eagle")."""
    n = sum(run.blocks.values())
    if not n:
        return None
    method = Method(source if spec else "plain")
    return (run.decode_s * 1e3 - model_ms(method, run.blocks, costs, heads=run.heads)) / n


def with_overhead(passes_ms: float, overhead_ms: float) -> float:
    """A loop's time from its passes and the overhead on top, never below half the passes (a loop
    that overlaps passes runs cheaper than the passes alone, but not for free)."""
    return max(passes_ms / 2, passes_ms + overhead_ms)


def predict(
    costs: Costs,
    acceptance_by_position: Sequence[float],
    block: int,
    overhead_ms: float = 0.0,
    plain_ms: float | None = None,
) -> float:
    """Model speedup of DFlash at ``block`` over plain decoding: E(B) * plain step / cycle, the
    plain step ``plain_ms`` (default T1) and the cycle Td(B) + Tt(B) + ``overhead_ms``. The
    overhead may be negative (a loop that overlaps passes runs cheaper than the passes alone);
    a cycle is never taken below half its passes."""
    if block <= 1:
        return 1.0
    passes = costs.step_ms(block, block)
    return (
        expected_tokens(acceptance_by_position, block) * (plain_ms or costs.t1_ms) / with_overhead(passes, overhead_ms)
    )


@dataclass(frozen=True)
class Decision:
    block: int  # 1 = off
    threads: int | None
    why: str  # one line: the tie (if any) and the rule that broke it
    tied: tuple[int, ...] = ()  # blocks within noise of the best at the chosen thread count


def _tie_tolerance(a: Candidate, b: Candidate | None, floor: float) -> float:
    """How far apart two model speedups must be to count as different: twice their combined
    standard error, at least ``floor``."""
    return max(floor, 2 * math.hypot(_noise_of(a), _noise_of(b)))


def _noise_of(c: Candidate | None) -> float:
    """A candidate's noise; an unmeasured one (None, nan, inf; no candidate) counts as none, neither
    a free pass nor a veto."""
    return c.noise if c is not None and c.noise is not None and math.isfinite(c.noise) else 0.0


def _pooled_noise(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates with one noise each: the median of theirs. Their passes were timed in the
    same rounds on the same machine; one block's median absolute deviation over a dozen rounds
    is itself noisy, and one wide estimate must not widen every comparison."""
    xs = [c.noise for c in cands if c.noise is not None and math.isfinite(c.noise)]
    n = statistics.median(xs) if xs else None
    return [replace(c, noise=n) for c in cands]


def _block_label(c: Candidate) -> str:
    return "plain" if c.block == 1 else f"B={c.block}" if c.source == "dflash" else c.label


def join_names(xs: Sequence[str]) -> str:
    return xs[0] if len(xs) == 1 else f"{', '.join(xs[:-1])} and {xs[-1]}"


def decide(
    cands: Sequence[Candidate],
    *,
    default_threads: int | None = None,
    floor: float = NOISE_FLOOR,
    min_gain: float = 0.02,
    cap: float = NOISE_CAP,
) -> Decision:
    """The (block, threads) to store, from the model speedups (``predicted``, with ``noise``) and
    the deterministic expected tokens per cycle (``tau`` = E(B)). Pure: the same inputs always
    give the same answer, and inputs within noise give the same answer by rule, not by chance.

    - Thread count: the one whose best block scores highest; if the ``default_threads`` count
      (all cores, what a machine never tuned runs) has a best block within noise of it, the
      default. (Plain's own thread count is chosen the same way, and is where "off" runs.)
    - Off: no block beats plain by its own noise (twice the standard error of the gain, at least
      ``floor``): plain is the safe choice, and a gain within the noise does not overturn it.
    - Block: the blocks within noise of the best that also beat plain by that much are a tie (a
      block the model puts below that never is). It goes to the largest block that still buys
      expected tokens (E(B) at least ``min_gain`` above the last block kept, going up from the
      smallest tied one). A tolerance above ``cap`` (timings too noisy to separate blocks) makes
      no tie: the best score is taken, and ``why`` says so.
      A tie's lower end moves with the timings; where E(B) stops growing (the drafter's trained
      block) does not, so this lands on the same block run after run. It also leaves the fixed
      engine (``--no-adaptive``) the longer drafts that code and agent edits accept; the per-cycle
      policy chooses each cycle's length itself.
    """
    ok = [c for c in cands if c.predicted is not None and not math.isnan(c.predicted)]
    plains = [c for c in ok if c.block == 1]
    plain = max(plains, key=lambda c: c.predicted, default=None)
    if plain is not None and plain.threads != default_threads:  # a faster plain count must be clearly faster
        dflt = next((c for c in plains if c.threads == default_threads), None)
        if dflt is not None and dflt.predicted >= plain.predicted * (1 - _tie_tolerance(dflt, plain, floor)):
            plain = dflt
    by_t: dict = {}
    for c in ok:
        if c.block > 1:
            by_t.setdefault(c.threads, []).append(c)
    by_t = {t: _pooled_noise(cs) for t, cs in by_t.items()}
    if not by_t:
        t = plain.threads if plain else default_threads
        return Decision(1, t, "off: no block to draft with" if plain else "nothing could be measured: plain decoding")
    tops = {t: max(cs, key=lambda c: (c.predicted, -c.block)) for t, cs in by_t.items()}
    lead_t = max(tops, key=lambda t: (tops[t].predicted, t == default_threads))
    words = []
    if len(tops) > 1:
        lead = tops[lead_t]
        others = sorted((t for t in tops if t != lead_t), key=lambda t: -tops[t].predicted)
        near = [t for t in others if tops[t].predicted >= lead.predicted * (1 - _tie_tolerance(tops[t], lead, floor))]
        if default_threads in near:
            gap = 1 - tops[default_threads].predicted / lead.predicted
            words.append(
                f"{lead_t} and {default_threads} threads within noise ({gap:.1%}); kept {default_threads}, "
                "the default (all cores)"
            )
            lead_t = default_threads
        else:
            nxt = tops[others[0]]
            words.append(f"{lead_t} threads (x{lead.predicted:.2f}) over {others[0]} (x{nxt.predicted:.2f})")
    spec = sorted(by_t[lead_t], key=lambda c: c.block)
    best = tops[lead_t]
    chain = best.source != "dflash"  # (a chain's candidates: its depths, decided as blocks are)
    base = plain.predicted if plain else 1.0
    # a block must beat plain by more than its own noise (twice the standard error of the gain, at
    # least the floor): a gain within the noise does not overturn plain, the safe choice
    noisy = _tie_tolerance(best, plain, 0.0)
    need = max(floor, noisy)
    if best.predicted < base * (1 + need):
        what = "its noise" if noisy >= floor else "the floor"
        why = (
            f"off: the best {'block' if best.source == 'dflash' else 'chain'} {_block_label(best)} "
            f"x{best.predicted:.2f} does not beat plain"
            f"{'' if plain is None or plain.threads is None else f' at {plain.threads} threads'} "
            f"(x{base:.2f}) by {need:.1%} ({what})"
        )
        return Decision(1, plain.threads if plain else lead_t, "; ".join([why] + words))
    tol = _tie_tolerance(best, best, floor)
    if tol > cap:  # a tie this wide would be "the largest block" whatever the timings say
        return Decision(
            best.block,
            lead_t,
            "; ".join(
                [
                    f"{_block_label(best)} x{best.predicted:.2f}: timings too noisy to separate blocks (tolerance {tol:.1%} "  # noqa: E501
                    f"above {cap:.0%}), took the best score"
                ]
                + words
            ),
            (best.block,),
        )
    # only blocks that beat plain by that much themselves can be tied
    tied = [c for c in spec if c.predicted >= max(best.predicted * (1 - tol), base * (1 + need))]
    kept, gain_of = [], {}
    for c in tied:  # smallest first: a larger block must buy expected tokens over the last kept one
        prev = kept[-1] if kept else None
        if prev is None or c.tau is None or prev.tau is None or c.tau >= prev.tau + min_gain:
            kept.append(c)
        else:
            gain_of[c.block] = prev.block
    win = kept[-1]
    if len(tied) == 1:
        rest = [c for c in spec if c is not best]
        nxt = max(rest, key=lambda c: c.predicted, default=None)
        why = f"{_block_label(best)} x{best.predicted:.2f}" + (
            f", next {_block_label(nxt)} x{nxt.predicted:.2f} ({1 - nxt.predicted / best.predicted:.1%} below, "
            f"tolerance {tol:.1%})"
            if nxt
            else ""
        )
    else:
        width = max(1 - c.predicted / best.predicted for c in tied)

        def lab(b: int) -> str:  # (a block, or a chain of b rows)
            return _block_label(replace(best, block=b))

        names = (
            join_names([_block_label(c) for c in tied])
            if len(tied) <= 4
            else f"{lab(tied[0].block)} to {lab(tied[-1].block)} ({len(tied)} {'depths' if chain else 'blocks'})"
        )
        why = (
            f"{names} within noise ({width:.1%} apart, tolerance "
            f"{tol:.1%}); chose {win.block if not chain else lab(win.block)}: the largest that still buys expected "
            "tokens (where E(B) stops growing is set by the deterministic acceptance, not by timings)"
        )
        for a in dict.fromkeys(gain_of.values()):
            bs = [lab(b) for b, x in gain_of.items() if x == a]
            why += f"; {join_names(bs)} add{'s' if len(bs) == 1 else ''} no expected tokens over {lab(a)}"
    return Decision(win.block, lead_t, "; ".join([why] + words), tuple(c.block for c in tied))


def default_candidates(checkpoint_block: int) -> list[int]:
    top = max(checkpoint_block, 16)
    return sorted({b for b in (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32) if b <= top} | {checkpoint_block, top})


# ---------------------------------------------------------------- the race (pure but for run)

Key = (
    tuple  # (block, threads): block 1 = plain decoding; threads None = no thread knob; a chain: (rows, threads, source)
)


@dataclass(frozen=True)
class Lap:
    """One timed run of the race."""

    tps: float  # committed tok/s after the first step
    cycle_s: float | None = None  # seconds per cycle (a plain step or a drafted block); None: not known


def _round_ratios(laps: dict, base: Key, key: Key) -> list[float]:
    """``key``'s tok/s over ``base``'s in the same round (the same prompt), per round it ran in."""
    b = laps[base]
    return [lap.tps / b[r].tps if r in b and b[r].tps > 0 else math.nan for r, lap in sorted(laps[key].items())]


@dataclass(frozen=True)
class RaceResult:
    laps: dict  # key -> {round: its Lap} for every round it ran in; the first key is the baseline (plain)
    final: tuple  # keys still in the race at the end
    dropped: dict  # key -> why
    rounds: int
    order: tuple  # every timed run's key, in the order they ran
    stop: str  # why it stopped: "clear margin" | "budget" | "max rounds"

    @cached_property
    def tps(self) -> dict:
        """key -> its tok/s per round it ran in, in round order."""
        return {k: [lap.tps for _, lap in sorted(rs.items())] for k, rs in self.laps.items()}

    @cached_property
    def ratio(self) -> dict:
        """key -> its tok/s over the baseline's in the same round, per round it ran in."""
        return {k: _round_ratios(self.laps, next(iter(self.laps)), k) for k in self.laps}

    def paired(self, a: Key, b: Key) -> list[tuple[float, float]]:
        """The tok/s of ``a`` and of ``b`` in every round both ran (the same prompt, the same
        machine state)."""
        la, lb = self.laps.get(a, {}), self.laps.get(b, {})
        return [(la[r].tps, lb[r].tps) for r in sorted(la.keys() & lb.keys())]

    @property
    def noise(self) -> float:
        """The race's run-to-run noise (``noise_fit``'s first value)."""
        return self.noise_fit[0]

    @cached_property
    def noise_fit(self) -> tuple[float, int]:
        """(sigma, degrees of freedom): the standard deviation of one run's log(seconds per cycle)
        about a candidate effect plus a round effect, both fitted (alternating means over the
        runs there are; a candidate that joined late or was dropped has fewer). A cycle of a fixed
        block costs the same whatever the prompt's drafts accept (at greedy the prompt sets how
        many cycles a run takes, not what one costs), and what moves every candidate's cycles in
        a round alike (the round's prompt length, the machine's drift within the round) is the
        round effect, which the paired ratios cancel too: what is left is the timing's own noise
        (and a last cycle the run's room cut short). inf with no degree of freedom."""
        cells = {
            (k, r): math.log(lap.cycle_s)
            for k, rs in self.laps.items()
            for r, lap in rs.items()
            if lap.cycle_s is not None and lap.cycle_s > 0
        }
        by_k: dict = {}
        by_r: dict = {}
        for (k, r), v in cells.items():
            by_k.setdefault(k, []).append((r, v))
            by_r.setdefault(r, []).append((k, v))
        df = len(cells) - len(by_k) - len(by_r) + 1
        if df < 1:
            return math.inf, 0
        a, b = dict.fromkeys(by_k, 0.0), dict.fromkeys(by_r, 0.0)
        for _ in range(30):  # additive fit log c = a[k] + b[r], alternating means (small tables: converges fast)
            for k, xs in by_k.items():
                a[k] = sum(v - b[r] for r, v in xs) / len(xs)
            for r, xs in by_r.items():
                b[r] = sum(v - a[k] for k, v in xs) / len(xs)
        ss = sum((v - a[k] - b[r]) ** 2 for (k, r), v in cells.items())
        return math.sqrt(ss / df), df


@dataclass(frozen=True)
class Check:
    """One raced candidate against the chosen one, over the rounds both ran."""

    key: Key
    rounds: int  # rounds both ran
    wins: int  # rounds in which it was the faster
    gain: float  # geometric mean over those rounds of its tok/s / the chosen's (1.12: 12 % faster)
    needed: float  # the gain a clear margin needs (inf: fewer than ``CHECK_ROUNDS`` rounds, or no noise measured)

    @property
    def clear(self) -> bool:
        """Faster in every round it ran with the chosen, by at least ``needed``."""
        return self.rounds > 0 and self.wins == self.rounds and self.gain >= self.needed


def check(
    res: RaceResult,
    key: Key,
    chosen: Key,
    *,
    rounds: int = CHECK_ROUNDS,
    z: float = CLEAR_Z,
    floor: float = NOISE_FLOOR,
    min_df: int = MIN_NOISE_DF,
) -> Check:
    """``key`` against ``chosen`` in the rounds both ran. A clear margin needs at least ``rounds``
    such rounds (one of each prompt kind), a win in every one, a race whose noise was measured
    with at least ``min_df`` degrees of freedom (``RaceResult.noise_fit``: with fewer, sigma
    itself is too uncertain for ``z`` to mean much), and a geometric-mean gain of at least
    ``floor`` and at least ``z`` standard errors of a paired round's noise (sqrt(2) times the
    race's run-to-run noise, over sqrt(rounds)): more rounds let a smaller margin through, a
    noisier race needs a larger one."""
    logs = [math.log(a / b) for a, b in res.paired(key, chosen) if a > 0 and b > 0]
    n = len(logs)
    gain = math.exp(statistics.fmean(logs)) if n else math.nan
    sigma, df = res.noise_fit
    enough = n >= rounds and df >= min_df
    needed = math.exp(max(math.log1p(floor), z * math.sqrt(2 / n) * sigma)) if enough else math.inf
    return Check(key, n, sum(x > 0 for x in logs), gain, needed)


def checks(res: RaceResult, chosen: Key, **kw) -> list[Check]:
    """Every other raced candidate against ``chosen`` (``check``)."""
    return [check(res, k, chosen, **kw) for k, rs in res.laps.items() if k != chosen and rs]


def race_check(res: RaceResult, chosen: Key, **kw) -> Check | None:
    """The raced candidate that beat ``chosen`` by a clear margin (``check``; the largest gain of
    those), else None. Simulated at 3 rounds of 4 candidates (the default budget's race), each
    round's prompt moving every cycle cost alike by ~10 %, the noise estimated as here (20 000
    simulated races per figure): a candidate equal to the chosen one passes about 1
    time in 100 (one of three equal challengers 1 in 36: harmless, equal speed), one 3 % slower
    1 in 500 (6 % run-to-run noise) to 1 in 5000 (3 %), one 20 % faster 3 times in 4 at 6 %
    noise and always at 3 %; a race whose rounds disagree never overrides."""
    return clearest(checks(res, chosen, **kw))


def clearest(got: Sequence[Check]) -> Check | None:
    """The largest gain among the checks with a clear margin, else None."""
    return max((c for c in got if c.clear), key=lambda c: c.gain, default=None)


def race(
    keys: Sequence[Key],
    run: Callable[[Key, int], Lap],
    *,
    n_prompts: int,
    judge_every: int = 1,
    neighbours: Callable[[Key], Sequence[Key]] = lambda k: (),
    clock: Callable[[], float] = time.perf_counter,
    deadline: float = math.inf,
    min_rounds: int = 3,
    max_rounds: int = 12,
    clear_margin: float = 0.15,
    drop_margin: float = 0.03,
    note: Callable[[int, Key], None] | None = None,
    keep: Sequence[Key] = (),
    cost: Callable[[Key], float] | None = None,
) -> RaceResult:
    """Time ``keys`` end to end, interleaved: every round runs every candidate still in the race
    once on the round's prompt (``run(key, prompt_index)`` -> its ``Lap``), the order rotated by one
    each round (A B C, B C A, ...), so all candidates see the same machine. ``keys[0]`` is the
    baseline (plain decoding): every ratio is against it in the same round. Each lap's seconds
    per cycle go to ``RaceResult.noise``, what ``race_check`` measures a margin against.

    After every ``judge_every`` rounds (a whole cycle of the prompt kinds, which disagree), once
    every candidate has ``min_rounds`` rounds: drop candidates (never the baseline nor ``keep``,
    the model's choice the race is there to check) whose best round is below the
    leader's median by ``drop_margin``; add the leader's ``neighbours`` not timed yet, while the
    budget has room for their own ``min_rounds``; stop when the leader's median is ``clear_margin`` above every
    other candidate's best round. Otherwise stop after ``max_rounds``.

    The deadline is checked before every round, the first included: the race stops when the next
    round would end past ``deadline``, ``min_rounds`` or not (the caller plans the candidates so
    that their minimum fits; a machine that slows down mid-race must not overrun the budget).
    ``cost(key)`` is one run's estimated seconds (from the pass costs): a round is predicted as
    the sum over the candidates in it, scaled by how the last round compared with its estimate;
    without it, by the last round's time per candidate (the first round then always runs).
    """
    base = keys[0]
    alive = list(dict.fromkeys(keys))
    laps: dict = {k: {} for k in alive}
    dropped: dict = {}
    order: list = []
    rounds, stop = 0, "max rounds"
    last: tuple[float, float, int] | None = None  # the last round: seconds, its estimate, candidates

    def predict_round(ks: Sequence[Key]) -> float:
        """Seconds the next round over ``ks`` should take."""
        if cost is not None:
            scale = last[0] / last[1] if last and last[1] > 0 else 1.0
            return scale * sum(cost(k) for k in ks)
        return last[0] * len(ks) / last[2] if last else 0.0

    while rounds < max_rounds:
        if clock() + predict_round(alive) > deadline:
            stop = "budget"
            break
        tr = clock()
        k = rounds % len(alive)
        for key in alive[k:] + alive[:k]:
            if note:
                note(rounds, key)
            laps[key][rounds] = run(key, rounds % n_prompts)
            order.append(key)
        rounds += 1
        last = (clock() - tr, sum(cost(k) for k in alive) if cost is not None else 0.0, len(alive))
        if rounds % judge_every or any(len(laps[k]) < min_rounds for k in alive):
            continue
        ratio = {k: _round_ratios(laps, base, k) for k in alive}
        med = {k: statistics.median(ratio[k]) for k in alive if ratio[k]}
        lead = max(med, key=lambda k: med[k])
        for key in list(alive):  # clearly worse: even its best round is below the leader's median
            if key not in (base, lead, *keep) and max(ratio[key]) < med[lead] * (1 - drop_margin):
                alive.remove(key)
                dropped[key] = f"dropped after {rounds} rounds"
        added = False
        for n in neighbours(lead):  # the measured leader's neighbours, each while the budget has
            # room for its own min_rounds in rounds with everyone else (the predicted leader's always ran)
            if n not in laps and clock() + min_rounds * predict_round(alive + [n]) <= deadline:
                alive.append(n)
                laps[n] = {}
                added = True
        if added:
            continue
        if len(alive) > 1 and all(max(ratio[k]) < med[lead] * (1 - clear_margin) for k in alive if k != lead):
            stop = "clear margin"
            break
    return RaceResult(laps=laps, final=tuple(alive), dropped=dropped, rounds=rounds, order=tuple(order), stop=stop)


def key_label(key: Key) -> str:
    B, t, *source = key
    what = "plain" if B == 1 else f"{source[0]} k={B - 1}" if source else f"B={B}"
    return what + (f" {t}T" if t else "")


def median_se(xs: Sequence[float]) -> float:
    """Standard error of the median of ``xs`` (robust: from the median absolute deviation)."""
    if len(xs) < 2:
        return math.inf
    m = statistics.median(xs)
    return 1.2533 * 1.4826 * statistics.median(abs(x - m) for x in xs) / math.sqrt(len(xs))
