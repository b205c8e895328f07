"""The per-cycle drafting policy: before every cycle, a plain step, a DFlash draft of length L, or
a lookup draft of length L, whichever commits the most tokens per millisecond.

One ``DraftPolicy`` per sequence (a reply). ``spec_steps(policy=...)`` asks it, before each
cycle, ``choose(Context)`` -> ``Decision(source, length)``; at greedy, after a DFlash pass,
``pick`` may trim its block to the prefix the drafter is sure enough of (to the anchor alone:
a plain step) or switch to the lookup's proposal (the drafter's pass is paid either way); after
the cycle, ``observe(step)``. Everything it knows:

- acceptance from this reply's own cycles (decayed counts), started from a prior: for DFlash by
  position, the tuner's measured acceptance as pseudo-cycles; for the lookup a copy model
  (``Copy``): the chance a copied token is right given the ones before it were, by how many
  tokens the copy has matched (a guess per match-length bucket as pseudo-tokens), so a long
  accepted copy drafts long (up to ``MAX_LOOKUP``) and the short match after an edit point
  drafts short;
- the pass-cost curve (``costs.Costs``: the tuner's stored one, or ``estimate_costs`` from the
  models' sizes when there is none), rescaled online by the draft and verify times the loop
  measures at its synchronisation points (so a long context or a busy machine is seen); once
  the reply has verified blocks of several lengths, a decayed straight-line fit of its own verify
  times over rows replaces the curve's Tt(L) (a machine where a row costs more than the curve
  says is seen);
- the per-cycle host overhead, measured the same way;
- the context: where the curve carries a context term (``Costs.ctx_ms``), every price is the
  curve's at the sequence's current length (prompt plus committed tokens, re-priced every
  ``REPRICE`` tokens), so a long prompt's dearer verify rows are priced before they are measured.

Rates: plain ``1 / (Tt(1) + o)``; DFlash ``E(L) / (Td(L) + Tt(L) + o)``; lookup
``E(L) / (Tt(L) + o)`` with ``E(L) = 1 + sum_{k < L-1} P(first k+1 drafts accepted)``. A
draft is chosen only when its rate beats plain's by ``margin``. A source whose last drafts were
all rejected outright, a streak its own estimate made unlikely (chance below ``fail_odds``; at
least ``fail_limit`` drafts), is benched at once (before its decayed estimate catches up). When
the drafter loses to a plain step it rests: the estimate no longer chooses it, and only probes
run, one short DFlash draft (at most ``probe_block`` rows) once ``probe_every`` cycles have
passed without a DFlash draft (lookup cycles count), the first after ``first_probe`` cycles;
the spacing doubles after each probe rejected outright (up to ``max_probe_every``) and goes
back to ``probe_every`` after one that is accepted, which also ends the rest. While it rests
(on every cycle without a DFlash draft) its evidence fades by ``rest_decay``. So a reply whose
drafts keep failing costs at most one short draft every N plain steps. The lookup is never
probed: its guesses are scored on the cycles it did not draft too (its proposal against the
tokens the target committed), so it is benched and recovered for free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx.utils import tree_flatten

from .costs import Costs

PLAIN, DFLASH, LOOKUP, MTP, EAGLE = "plain", "dflash", "lookup", "mtp", "eagle"
SOURCES = (DFLASH, LOOKUP)  # the default engine's draft sources (config.DEFAULT_DRAFT says what runs)
CHAINS = (MTP, EAGLE)  # the autoregressive (chain) drafters: k head passes for a draft of k
KNOWN = (DFLASH, LOOKUP, MTP, EAGLE)  # every draft source
MODELS = (DFLASH, MTP, EAGLE)  # the sources with a model pass: they rest and are probed
MAX_CHAIN_DEPTH = 8  # the deepest chain a cycle drafts (head passes) unless the tuner measured deeper
# A chain drafter's acceptance by position before anything is measured: P(the first k+1 drafts
# accepted), a first draft accepted half the time and each later one 60 % of the time given the
# ones before it were (a stated guess: the tuner's measured prior replaces it, and each reply's
# own cycles quickly outweigh it).
CHAIN_PRIOR = (0.5, 0.3, 0.18, 0.108, 0.065, 0.039, 0.023, 0.014)
MAX_LOOKUP = 32  # the longest lookup draft (tokens, excluding the anchor)
REPRICE = 256  # tokens of context growth after which the policy re-prices its curve (Costs.at)
# The lookup's prior chance that a copied token is right given the ones before it were, by how
# many tokens the copy has matched so far (upper bound of each bucket, None: open). Measured on
# greedy replies of the default target to the built-in prompts (agent edits: 0.23 below 2 matched
# tokens, 0.85-0.9 at 3-7, 0.97-1.0 from 8 on; code, math and prose: 0.16-0.26, 0.45-0.78,
# 0.7-1.0), set between the two; from 8 matched tokens on nearer the agent edits' (a long match
# is a copy in every kind, and a long copy drafted short pays a verify per ~10 tokens: on the 17
# built-in prompts at 64 tokens, 0.9 / 0.95 / 0.97 there instead of 0.85 / 0.9 / 0.93 modelled
# the agent edits 0-17 % faster at the measured Tt(L), math, prose and code within 4 %; a model-time
# estimate, not kept; timed A/B within the noise, docs/bench.md).
LOOKUP_PRIOR = ((2, 0.2), (3, 0.4), (4, 0.6), (8, 0.7), (16, 0.9), (32, 0.95), (None, 0.97))


def expected_tokens(acceptance_by_position: Sequence[float], block: int) -> float:
    """Committed tokens per cycle at ``block``: 1 + sum of P(position k accepted), k < block-1."""
    return 1.0 + sum(acceptance_by_position[: block - 1])


@dataclass(frozen=True, slots=True)
class Decision:
    source: str  # "plain" | "dflash" | "lookup" | "mtp" | "eagle"
    length: int  # verify rows including the anchor (1: a plain step); a chain's depth is length - 1
    probe: bool = False  # a probe after a run of plain steps


@dataclass(frozen=True, slots=True)
class ChainPrior:
    """What a policy starts a chain drafter's source from: its acceptance by position (P(the
    first k+1 drafts accepted)), the cost of one head pass in the cost curve's units, the deepest
    chain it may draft, and whether the tuner measured them (else: ``CHAIN_PRIOR`` and an
    estimate from the head's size, rescaled by the first measured cycles)."""

    acceptance: tuple[float, ...] = CHAIN_PRIOR
    pass_ms: float = 0.1
    depth: int = MAX_CHAIN_DEPTH
    measured: bool = False


@dataclass(frozen=True, slots=True)
class Context:
    """What the loop knows before a cycle."""

    lookup: tuple[int, ...] = ()  # the lookup's proposal (may be longer than it will draft)
    match: int = 0  # how many tokens of the sequence's tail matched where it was found
    room: int = 1 << 30  # tokens the reply may still commit
    greedy: bool = True


class Acceptance:
    """P(first k+1 drafts accepted) per position k, from decayed counts and a prior.

    The prior enters as ``weight`` pseudo-cycles that fade faster than real evidence
    (``prior_decay`` per cycle against ``decay``), so positions never drafted lately are soon
    judged by extrapolating the ones that were, not by the prior."""

    def __init__(
        self, n: int, prior: Sequence[float] = (), *, weight: float = 3.0, decay: float = 0.9, prior_decay: float = 0.8
    ):
        p = []
        for x in prior[:n]:  # a measured tail (few samples) may rise: P(first k+1 accepted) is
            p.append(min(max(0.0, float(x)), p[-1] if p else 1.0))  # held non-increasing, nothing more
        while len(p) < n:  # extrapolate geometrically (a neutral guess without a prior)
            r = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else (p[-1] if p else 0.5)
            p.append((p[-1] if p else 1.0) * min(r, 0.95))
        self.prior = p
        self.weight = weight
        self.hits, self.reached = [0.0] * n, [0.0] * n
        self.decay, self.prior_decay = decay, prior_decay

    def update(self, reached: int, hits: int) -> None:
        """One cycle: positions < ``reached`` were judged, the first ``hits`` of them accepted.
        Every position forgets a little; the judged ones learn."""
        d = self.decay
        self.weight *= self.prior_decay
        for k in range(len(self.reached)):
            self.reached[k] = d * self.reached[k] + (k < reached)
            self.hits[k] = d * self.hits[k] + (k < hits)

    def fade(self, f: float) -> None:
        """A cycle this source did not draft: its evidence ages by ``f`` (the prior does not)."""
        self.hits = [f * x for x in self.hits]
        self.reached = [f * x for x in self.reached]

    def curve(self) -> list[float]:
        """The counts (prior included) where there is evidence, else an extrapolation of the
        previous position's conditional acceptance (a block longer than those tried lately is
        judged by how well the shorter ones did); never growing with k."""
        out, last, cond = [], 1.0, self.prior[0] if self.prior else 0.5
        wp = self.weight
        for hits, n, prior in zip(self.hits, self.reached, self.prior):
            n, hits = n + wp, hits + wp * prior
            w = n / (n + 1.0)
            p = w * (hits / n if n > 0 else 0.0) + (1 - w) * last * cond
            p = min(p, last)
            cond = p / last if last > 0 else 0.0
            last = p
            out.append(p)
        return out


class Copy:
    """The lookup's acceptance: a copy goes on token by token until the reply departs from what
    it copies (an edit point), and the longer it has matched, the likelier the next token is
    right. Per match-length bucket (``LOOKUP_PRIOR``), the chance a draft token is accepted when
    the ones before it were: decayed counts of judged and accepted tokens, started from the
    prior as ``weight`` pseudo-tokens. Position k of a draft found at match length m has matched
    m + k tokens once the k before it are accepted, so it is judged in bucket(m + k): a draft
    starts at its match's chance and grows more confident along a long copy, and accepted copies
    lengthen the drafts at once (no per-position evidence needed); one break (an edit point)
    costs its bucket one judged token, and the short match after it starts the next drafts short.
    """

    def __init__(
        self, prior: Sequence[tuple[int | None, float]] = LOOKUP_PRIOR, *, weight: float = 4.0, decay: float = 0.9
    ):
        self.tops = [top for top, _ in prior]
        self.prior = [c for _, c in prior]
        self.weight, self.decay = weight, decay
        self.judged = [0.0] * len(prior)
        self.hits = [0.0] * len(prior)

    def bucket(self, match: int) -> int:
        return next(i for i, top in enumerate(self.tops) if top is None or match < top)

    def cond(self, match: int) -> float:
        """P(a draft token is accepted | the ones before it were), matched ``match`` tokens."""
        b = self.bucket(match)
        return (self.hits[b] + self.weight * self.prior[b]) / (self.judged[b] + self.weight)

    def conditional(self, match: int, n: int) -> list[float]:
        """The per-position conditional chances of an ``n``-token draft found at ``match``."""
        return [self.cond(match + k) for k in range(n)]

    def curve(self, match: int, n: int) -> list[float]:
        """P(the first k+1 draft tokens accepted), k < n."""
        return _cumprod(self.conditional(match, n))

    def update(self, match: int, reached: int, hits: int) -> None:
        """One cycle's judgement of a draft found at ``match``: positions < ``reached`` were
        judged, the first ``hits`` of them accepted (``reached`` = hits + 1 where one was
        rejected). Every bucket forgets a little."""
        d = self.decay
        self.judged = [d * x for x in self.judged]
        self.hits = [d * x for x in self.hits]
        for k in range(reached):
            b = self.bucket(match + k)
            self.judged[b] += 1.0
            self.hits[b] += k < hits


class Line:
    """Decayed least squares of verify time on rows: ``y = a + b * (L - 1)`` from the cycles this
    reply drafted (blocks of several lengths; plain steps run pipelined, a regime of their own
    with its own scale, so they are not points of it); None until the lengths seen spread."""

    def __init__(self, decay: float = 0.95):
        self.decay, self.s = decay, [0.0] * 5  # sum w, w x, w x^2, w y, w x y

    def add(self, L: int, ms: float) -> None:
        x, d = L - 1.0, self.decay
        self.s = [d * v for v in self.s]
        for i, v in enumerate((1.0, x, x * x, ms, x * ms)):
            self.s[i] += v

    def at(self, L: int) -> float | None:
        n, sx, sxx, sy, sxy = self.s
        if n < 2:
            return None
        var = sxx / n - (sx / n) ** 2
        if var < 1.0:  # the lengths seen are too close to tell a slope
            return None
        b = max(0.0, (sxy / n - sx / n * sy / n) / var)
        a = sy / n - b * sx / n
        if a <= 0:  # a plain step is never free: the points do not tell a line yet
            return None
        return a + b * (L - 1)


def _ema(old: float | None, new: float, alpha: float = 0.3) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class DraftPolicy:
    """Chooses each cycle's source and length for one sequence (see the module docstring).

    Args:
        costs: the pass-cost curve (smoothed here); its absolute level is rescaled online.
        max_block: the longest DFlash block (verify rows); ``pinned`` fixes the DFlash block.
        prior: the DFlash acceptance by position the tuner measured (may be empty).
        sources: the draft sources allowed ("dflash", "lookup", "mtp", "eagle").
        chains: per chain source in ``sources`` ("mtp", "eagle"), its ``ChainPrior``: a chain of
            depth k costs k head passes plus a verify of k + 1 rows, and is chosen, rested and
            probed exactly as DFlash is (each model source has its own rest and probe spacing).
        measured: True when ``costs`` were measured on this machine (the tuner's), False for an
            estimate: then the first measured cycle sets the scale outright.
        margin: a draft is chosen only when its expected rate beats a plain step's by this share
            (plain is the safe choice: a draft that barely pays on its estimate loses on a reply
            whose acceptance is a little below the estimate).
        first_probe: the first DFlash probe of a reply comes after this many cycles without a
            DFlash draft, the spacing doubling after each failed probe (3, 6, 12, ... up to
            ``max_probe_every``; back to ``probe_every`` after one that pays): a prior that does
            not beat plain by the margin is tried early on the reply's own text.
        rest_decay: per cycle without a DFlash draft, the drafter's evidence ages by this factor,
            so a probe that succeeds after a long plain stretch is not outweighed by old failures.
    """

    def __init__(
        self,
        costs: Costs,
        max_block: int,
        prior: Sequence[float] = (),
        *,
        sources: Sequence[str] = SOURCES,
        pinned: int | None = None,
        max_lookup: int = MAX_LOOKUP,
        measured: bool = True,
        decay: float = 0.9,
        prior_weight: float = 3.0,
        probe_every: int = 8,
        max_probe_every: int = 64,
        probe_block: int = 3,
        fail_limit: int = 3,
        fail_odds: float = 0.002,
        margin: float = 0.05,
        first_probe: int = 3,
        rest_decay: float = 0.97,
        chains: dict[str, ChainPrior] | None = None,
    ):
        bad = set(sources) - set(KNOWN)
        if bad:
            raise ValueError(f"unknown draft sources {sorted(bad)} (known: {', '.join(KNOWN)})")
        chains = dict(chains or {})
        for src in CHAINS:
            if src in sources and src not in chains:
                chains[src] = ChainPrior()  # the stated default prior, its cost unknown until measured
        if pinned is not None and pinned < 2:
            raise ValueError(f"a pinned DFlash block must be >= 2 (got {pinned})")
        self.costs = costs.smoothed()
        # Tt(1) as measured where that is below the smoothed line: on a CPU the step from one row
        # to two is far above the blocks' slope (a line through all blocks puts a plain step ~15 %
        # above its measured cost)
        self.t1 = min(costs.verify(1), self.costs.verify(1))
        self._tables: dict[int, tuple[float, float]] = {}
        self.position = self.costs.context  # tokens in the sequence (prompt + committed), from observe
        self._priced, self._t1_priced = self.costs, self.t1  # the curve at the context it was last priced at
        self.line = Line()
        self.sources = tuple(sources)
        self.max_block = max(1, pinned or max_block)
        self.pinned = pinned
        self.max_lookup = max(0, max_lookup)
        # The tuner's DFlash prior was measured: it fades like evidence. The lookup's is a guess
        # by match length (Copy): accepted copies lengthen the lookup drafts at once.
        self.dflash = Acceptance(self.max_block - 1, prior, weight=prior_weight, decay=decay, prior_decay=decay)
        self.copy = Copy(decay=decay)
        self.scale = {k: 1.0 if measured else None for k in ("plain", "verify", "draft")}
        self.overhead = {PLAIN: 0.0, DFLASH: 0.0, LOOKUP: 0.0}
        # each model source's running acceptance by position (DFlash's block positions, a chain's
        # depth); a chain's measured prior fades like evidence, the stated default faster
        self.acceptance = {DFLASH: self.dflash}
        self.chain_pass: dict[str, float] = {}  # a chain's head pass, in the curve's units
        self.max_depth: dict[str, int] = {}
        for src in CHAINS:
            if src not in self.sources:
                continue
            c = chains[src]
            self.max_depth[src] = max(1, c.depth)
            self.acceptance[src] = Acceptance(
                self.max_depth[src],
                c.acceptance,
                weight=prior_weight,
                decay=decay,
                prior_decay=decay if c.measured else 0.8,
            )
            self.chain_pass[src] = max(1e-6, c.pass_ms)
            self.scale[src] = 1.0 if c.measured and measured else None
            self.overhead[src] = 0.0
        self.models = tuple(m for m in MODELS if m in self.sources or m == DFLASH)
        self.base_probe = probe_every
        self.max_probe, self.probe_block = max_probe_every, max(2, probe_block)
        self.margin, self.rest_decay = max(0.0, margin), rest_decay
        # per model source: cycles since its last draft (plain, lookup and other sources' cycles):
        # a probe is due at its spacing, the first one early (then the spacing doubles from there
        # while probes fail)
        first = max(1, min(first_probe, probe_every))
        self.runs = {m: 0 for m in self.models}
        self.spacing = {m: first for m in self.models}
        self.fail_limit, self.fail_odds = fail_limit, fail_odds
        # a model source or a lookup bucket -> (drafts rejected outright in a row, P(first accepted) before them)
        self.fails: dict[object, tuple[int, float]] = {}
        self._ctx = Context()
        self._peek: tuple[Context, dict] | None = None  # (ctx, options(ctx)) until the next observe
        self._probing: str | None = None  # the source the last decision probed (observe sets its next spacing)
        # a model source that lost to a plain step rests: only a probe that pays lets the estimate
        # choose it again (its evidence fades while it rests, which alone must not bring back long drafts)
        self.rest = {m: False for m in self.models}
        self.trace: list[Decision] = []

    # DFlash's rest and probe spacing, by their old names
    @property
    def resting(self) -> bool:
        return self.rest[DFLASH]

    @resting.setter
    def resting(self, value: bool) -> None:
        self.rest[DFLASH] = bool(value)

    @property
    def plain_run(self) -> int:
        return self.runs[DFLASH]

    @plain_run.setter
    def plain_run(self, value: int) -> None:
        self.runs[DFLASH] = value

    @property
    def probe_every(self) -> int:
        return self.spacing[DFLASH]

    @probe_every.setter
    def probe_every(self, value: int) -> None:
        self.spacing[DFLASH] = value

    # ---------------------------------------------------------------- costs

    def _table(self, L: int) -> tuple[float, float]:
        """(Tt(L), Td(L)) of the stored curve, computed once per L."""
        got = self._tables.get(L)
        if got is None:  # a plain step as measured: the line through the blocks misprices it
            c = self._priced
            got = self._tables[L] = (self._t1_priced if L == 1 else c.verify(L), c.draft(L))
        return got

    def _reprice(self) -> None:
        """Price the curve at the current context (``Costs.at``) when it has moved ``REPRICE``
        tokens since the last time; nothing for a curve without a context term."""
        if not (self.costs.ctx_ms or self.costs.ctx_draft_ms) or abs(self.position - self._priced.context) < REPRICE:
            return
        self._priced = self.costs.at(self.position)
        k = (self.position - self.costs.context) / 1000
        self._t1_priced = max(0.1 * self.t1, self.t1 + k * self.costs.ctx_slope(1))
        self._tables.clear()

    def verify_ms(self, L: int, piped: bool = True) -> float:
        """Tt(L) as this reply sees it. A plain step (L = 1) runs pipelined in a run of them (the
        host's work hidden behind the pass: its own scale); ``piped=False`` prices a lone 1-row
        verify (a drafter's block trimmed to the anchor) like the drafted ones."""
        if L == 1 and piped:
            return self._table(1)[0] * (self.scale["plain"] or self.scale["verify"] or 1.0)
        fit = self.line.at(L)  # this reply's own verify times, once they tell a slope
        if fit is not None and fit > 0:
            return fit
        return self._table(L)[0] * (self.scale["verify"] or self.scale["plain"] or 1.0)

    def draft_ms(self, L: int) -> float:
        return self._table(L)[1] * (self.scale["draft"] or self.scale["verify"] or self.scale["plain"] or 1.0)

    def head_ms(self, source: str) -> float:
        """One pass of the chain drafter ``source`` as this reply sees it."""
        scale = self.scale.get(source) or self.scale["verify"] or self.scale["plain"] or 1.0
        return self.chain_pass[source] * scale

    def cycle_ms(self, source: str, L: int) -> float:
        ms = self.verify_ms(L) + self.overhead[source]
        if source == DFLASH:
            ms += self.draft_ms(L)
        elif source in self.chain_pass:  # a chain of depth L - 1: that many head passes
            ms += (L - 1) * self.head_ms(source)
        return max(ms, 1e-6)

    # ---------------------------------------------------------------- rates

    @staticmethod
    def _best(acc: Sequence[float], lengths, ms: Callable[[int], float]) -> tuple[int, float]:
        """(L, tokens per ms) of the length in ``lengths`` whose cycle of ``ms(L)`` commits the
        most per ms, ``acc`` being P(the first k+1 drafts accepted); the shortest of ties."""
        best, rate = 1, 0.0
        cum = [1.0]  # cum[L - 1] = expected_tokens(acc, L)
        for p in acc:
            cum.append(cum[-1] + p)
        for L in lengths:
            r = cum[min(L - 1, len(cum) - 1)] / max(ms(L), 1e-6)
            if r > rate:
                best, rate = L, r
        return best, rate

    def options(self, ctx: Context) -> dict[str, tuple[int, float]]:
        """{source: (best length, tokens per ms)} for this context; "plain" always present.
        Benched sources included (``choose`` filters them with ``_is_benched``)."""
        room = max(1, ctx.room)
        out = {PLAIN: (1, 1.0 / self.cycle_ms(PLAIN, 1))}
        if DFLASH in self.sources and room > 1:
            lengths = [min(self.pinned, room)] if self.pinned else range(2, min(self.max_block, room) + 1)
            out[DFLASH] = self._best(self.dflash.curve(), lengths, lambda L: self.cycle_ms(DFLASH, L))
        n = min(len(ctx.lookup), self.max_lookup, room - 1)
        if LOOKUP in self.sources and n > 0:
            out[LOOKUP] = self._best(self.copy.curve(ctx.match, n), range(2, n + 2), lambda L: self.cycle_ms(LOOKUP, L))
        for src in CHAINS:
            if src in self.chain_pass and room > 1:
                lengths = range(2, min(self.max_depth[src] + 1, room) + 1)
                out[src] = self._best(self.acceptance[src].curve(), lengths, lambda L, src=src: self.cycle_ms(src, L))
        return out

    def _is_benched(self, source: str, ctx: Context) -> bool:
        """Plain is never benched; the lookup is judged per match-length bucket."""
        if source == PLAIN:
            return False
        return self.benched(source if source in MODELS else self.copy.bucket(ctx.match))

    def benched(self, key) -> bool:
        n, p0 = self.fails.get(key, (0, 0.0))
        return n >= self.fail_limit and (1.0 - p0) ** n < self.fail_odds

    def _judge(self, key, p_first: float, accepted: bool) -> None:
        """``p_first``: the source's P(first draft accepted) before this cycle."""
        if accepted:
            self.fails.pop(key, None)
        else:
            n, p0 = self.fails.get(key, (0, None))
            self.fails[key] = (n + 1, p_first if p0 is None else p0)

    # ---------------------------------------------------------------- the interface

    def _plan(self, ctx: Context, every: dict[str, tuple[int, float]]) -> Decision:
        """The decision for ``ctx`` (nothing changed): the unbenched draft with the best rate if it
        beats plain by the margin (a model source only when not resting), else a probe of the
        model source most overdue for one, else a plain step."""
        plain = every[PLAIN][1] * (1.0 + self.margin)
        drafts = {
            s: v
            for s, v in every.items()
            if s != PLAIN and v[1] > plain and not self._is_benched(s, ctx) and not self.rest.get(s, False)
        }
        if drafts:
            s = max(drafts, key=lambda k: drafts[k][1])
            return Decision(s, drafts[s][0])
        due = [m for m in self.models if m in every and self.runs[m] + 1 >= self.spacing[m]]
        if due:  # does a resting drafter pay again? (the most overdue first; DFlash on ties)
            m = max(due, key=lambda m: ((self.runs[m] + 1) / self.spacing[m], m == DFLASH))
            best = every[m][0]
            pinned = m == DFLASH and self.pinned
            return Decision(m, best if pinned else min(best, self.probe_block), probe=True)
        return Decision(PLAIN, 1)

    def stays_plain(self, ctx: Context) -> bool:
        """Would ``choose(ctx)`` take a plain step (not a probe)? Changes nothing but the context
        the next ``observe`` scores the lookup by: the loop asks it one token ahead, to queue the
        next plain step before it reads the current one (a pipelined run of plain steps), and
        then calls ``choose`` with the same ``ctx``."""
        return self.peek(ctx).source == PLAIN

    def peek(self, ctx: Context) -> Decision:
        """What ``choose(ctx)`` would decide, changing nothing but that context (``stays_plain``);
        the batched decoder asks it one step ahead, then lets the batch decide."""
        self._ctx = ctx
        return self._plan(ctx, self._options(ctx))

    def _options(self, ctx: Context) -> dict[str, tuple[int, float]]:
        """``options(ctx)``, computed once per context between two ``observe`` calls (a queued
        plain step is asked ``stays_plain`` then ``choose``, the batch's ``peek`` then ``choose``,
        with one context; only ``observe`` changes what the options depend on)."""
        if self._peek is None or self._peek[0] is not ctx:
            self._peek = (ctx, self.options(ctx))
        return self._peek[1]

    def choose(self, ctx: Context) -> Decision:
        """Before a cycle: plain, or the source and length with the best expected rate (see
        ``_plan``). Probes are DFlash drafts only: the lookup is scored on every cycle for free."""
        self._ctx = ctx
        d = self._plan(ctx, self._options(ctx))
        self._probing = d.source if d.probe else None
        for m in self.models:
            if d.source == m:
                self.runs[m] = 0
                if not d.probe:  # the estimate says the drafter pays: probes start over from the base
                    self.spacing[m] = self.base_probe
            else:
                self.runs[m] += 1
                if d.source == PLAIN and m in self.sources:  # the drafter did not pay: it rests
                    self.rest[m] = True
        self.trace.append(d)
        return d

    def pick(
        self,
        decision: Decision,
        drafts: Sequence[int],
        confidence: Sequence[float] | None,
        ctx: Context | None = None,
        *,
        trim: bool = False,
    ) -> Decision:
        """Greedy only, after a DFlash pass (its cost is paid): what to verify. Each draft
        position's chance is the mean of the drafter's own top probability there
        (``confidence``) and its running conditional acceptance.

        - ``trim`` (not with a pinned block): verify the prefix of ``drafts`` that promises the
          most tokens per verify millisecond: all of it, part of it, or none (``length`` 1: the
          anchor alone, a plain step; the drafter was not sure enough to pay for a row). A
          verify row costs real time on a CPU, and the drafter's confidence tells a draft worth
          verifying from one that is not (measured on the default pair: top probability below
          0.2 accepted 16 % of the time, above 0.9 89 %). A probe is trimmed too: one cut to the
          anchor is a failed probe.
        - While the lookup also has a proposal: switch to it when it promises more (the
          drafter's proposal unused). Its chance is its copy model's (``Copy``); where the two
          proposals agree, the better of both counts. A probe is not switched: it is there to
          judge the drafter."""
        ctx = self._ctx if ctx is None else ctx
        n = min(len(ctx.lookup), self.max_lookup, max(1, ctx.room) - 1) if LOOKUP in self.sources else 0
        trim = trim and not self.pinned
        if decision.source != DFLASH or ((decision.probe or n <= 0) and not trim):
            return decision
        dcur = _conditional(self.dflash.curve())
        conf = list(confidence) if confidence is not None else []
        pd = [0.5 * (conf[k] + dcur[k]) if k < len(conf) else dcur[k] for k in range(len(drafts))]
        full = len(drafts) + 1  # the pass is paid: only the verify (1 row: unpipelined) is priced
        Ld, rate_d = self._best(
            _cumprod(pd),
            range(1, full + 1) if trim else (full,),
            lambda L: self.verify_ms(L, piped=False) + self.overhead[DFLASH],
        )
        got = decision if Ld == full else Decision(DFLASH, Ld, decision.probe)
        if n > 0 and not decision.probe:
            agree = 0
            while agree < min(len(drafts), n) and drafts[agree] == ctx.lookup[agree]:
                agree += 1
            lcur = self.copy.conditional(ctx.match, n)
            pl = [max(lcur[k], pd[k]) if k < agree else lcur[k] for k in range(n)]
            best, rate_l = self._best(_cumprod(pl), range(2, n + 2), lambda L: self.cycle_ms(LOOKUP, L))
            if rate_l > rate_d:
                got = Decision(LOOKUP, best)
        if got is not decision and self.trace and self.trace[-1] is decision:
            self.trace[-1] = got
        return got

    def observe(self, step) -> None:
        """After a cycle (a ``decode.Step``): learn acceptance and costs. The prefill only sets
        the context (its prompt tokens)."""
        self.position = (step.prompt_tokens if step.prefill else self.position) + len(step.tokens)
        self._reprice()
        if step.prefill:
            return
        L = step.drafted + 1
        source = step.source or (DFLASH if step.drafted else PLAIN)
        trimmed = source == DFLASH and L == 1  # pick(trim=True) verified the anchor alone
        heads = getattr(step, "head_passes", 0)
        if step.draft_in_verify and step.verify_ms > 0:
            # one wait timed both passes (the drafts read with the verify's choices): one scale
            # for both, from their sum (the line prices the verify alone: not fed); a chain's
            # draft phase is its k head passes
            chain = heads and source in self.chain_pass
            ran = step.draft_block or L
            drafted = heads * self.chain_pass[source] if chain else self._table(ran)[1]
            r = step.verify_ms / max(self._table(L)[0] + drafted, 1e-6)
            self.scale["verify"] = _ema(self.scale["verify"], r)
            self.scale[source if chain else "draft"] = _ema(self.scale[source if chain else "draft"], r)
        elif step.verify_ms > 0 and not trimmed:  # a plain step (pipelined in the loop) has its own scale
            kind = "plain" if L == 1 else "verify"
            self.scale[kind] = _ema(self.scale[kind], step.verify_ms / max(self._table(L)[0], 1e-6))
            if L > 1:  # the line prices drafts: pipelined plain steps are another regime
                self.line.add(L, step.verify_ms)
        if step.draft_ms > 0 and heads and source in self.chain_pass:  # a chain's k head passes
            per = step.draft_ms / heads
            self.scale[source] = _ema(self.scale[source], per / self.chain_pass[source])
        elif step.draft_ms > 0:  # (also a pass whose block pick() then dropped for the lookup's)
            ran = step.draft_block or L
            self.scale["draft"] = _ema(self.scale["draft"], step.draft_ms / max(self._table(ran)[1], 1e-6))
        if source in self.overhead:
            passes = (
                step.verify_ms + step.draft_ms
                if step.verify_ms > 0
                else self.cycle_ms(source, L) - self.overhead[source]
            )  # no timings: the model's
            rest = step.elapsed_ms - passes
            self.overhead[source] = _ema(self.overhead[source], max(0.0, rest), 0.2)
        if source in self.models and source == self._probing:  # a probe that failed doubles the spacing
            m = source
            self.spacing[m] = self.base_probe if step.accepted else min(self.max_probe, 2 * self.spacing[m])
            self.rest[m] = self.rest[m] and not step.accepted  # one that paid wakes the drafter
        self._probing = None
        for m, acc in self.acceptance.items():  # a drafter's evidence ages while it rests (stale failures fade)
            if m != source:
                acc.fade(self.rest_decay)
        if source in self.acceptance:  # (a DFlash pass trimmed to the anchor counts as its first draft
            # rejected: a drafter too unsure to be verified does not pay for its pass)
            acc = self.acceptance[source]
            self._judge(source, acc.curve()[0], step.accepted > 0)
            acc.update(max(1, step.drafted), step.accepted)
        look, m = self._ctx.lookup, self._ctx.match
        b = self.copy.bucket(m)
        if source == LOOKUP:
            self._judge(b, self.copy.cond(m), step.accepted > 0)
            self.copy.update(m, min(step.accepted + 1, step.drafted), step.accepted)
        elif look and step.tokens:  # what the lookup would have got, as far as the tokens tell
            a = 0
            while a < min(len(look), len(step.tokens)) and look[a] == step.tokens[a]:
                a += 1
            self._judge(b, self.copy.cond(m), a > 0)  # (its first guess against the first token)
            self.copy.update(m, min(a + 1, len(look), len(step.tokens)), a)
        self._ctx, self._peek = Context(), None


def _conditional(curve: Sequence[float]) -> list[float]:
    out, last = [], 1.0
    for p in curve:
        out.append(p / last if last > 0 else 0.0)
        last = p
    return out


def _cumprod(xs: Sequence[float]) -> list[float]:
    """The running products: P(the first k+1 accepted) from per-position conditional chances."""
    out, run = [], 1.0
    for x in xs:
        run *= x
        out.append(run)
    return out


# ---------------------------------------------------------------- construction


def _params(m) -> int:
    return sum(v.size for _, v in tree_flatten(m.parameters()))


def chain_pass_ratio(pair, head) -> float:
    """A chain head's pass as a share of a plain step, from the weights each reads: the head's
    own, plus the target's output head when it drafts over the full vocabulary through it (an
    MTP head; an EAGLE-3 drafter's ``lm_head`` over its draft vocabulary is its own)."""
    target = max(1, _params(pair.model))
    own = _params(head)
    args = getattr(getattr(pair, "target", None), "args", None)
    if getattr(head, "kind", "") == "mtp":
        own += getattr(args, "vocab_size", 0) * getattr(args, "hidden_size", 0)
    return min(1.0, own / target)


def chain_prior(kind: str, pair, head, result, costs: Costs, measured: bool) -> ChainPrior:
    """The ``ChainPrior`` of the chain drafter ``kind``: the tuner's measured acceptance, pass
    cost and depth (``TuneResult.chains``) when it stored them with a measured curve, else
    ``CHAIN_PRIOR`` and a pass priced from the head's size (``chain_pass_ratio`` of the curve's
    plain step; the first measured cycles set the scale)."""
    got = (getattr(result, "chains", None) or {}).get(kind) if result is not None else None
    if got and measured:
        return ChainPrior(
            tuple(got["acceptance_by_position"]),
            float(got["pass_ms"]),
            max(MAX_CHAIN_DEPTH, int(got.get("depth", 0))),
            True,
        )
    return ChainPrior(CHAIN_PRIOR, chain_pass_ratio(pair, head) * costs.t1_ms, MAX_CHAIN_DEPTH, False)


def estimate_costs(pair, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> Costs:
    """A cheap cost curve when the tuner has stored none (no timing at all): relative units,
    verify rows 6 % of a plain step each (what a CPU's memory-bound forward shows; flatter on
    GPUs, which the online rescaling sees), a draft pass the drafter's share of the weights
    read. The policy rescales both from the first measured cycles. Its context term is the
    attention's arithmetic: per row and 1000 tokens of context, 4 flops per key and head
    dimension in every attention layer, against a plain step's 2 per weight (a floor: on a CPU
    the softmax's exps cost more than their flops; the tuner measures the real term)."""
    params = _params

    target = max(1, params(pair.model))
    drafter = params(pair.drafter) if pair.drafter is not None else 0
    args = getattr(pair.target, "args", None)
    head = (
        (pair.drafter.vocab_size_drafted or getattr(args, "vocab_size", 0)) * getattr(args, "hidden_size", 0)
        if pair.drafter is not None
        else 0
    )
    ratio = min(1.0, (drafter + head) / target)
    tt = {B: 1.0 + 0.06 * (B - 1) for B in sizes}
    td = {B: ratio * (1.0 + 0.03 * (B - 1)) for B in sizes if B > 1}
    row = _attention_per_row(pair.target if pair.target is not None else None, args) / target
    ctx = {B: 2000 * B * row for B in sizes} if row else {}
    drow = _drafter_attention_per_row(pair.drafter) / target if pair.drafter is not None else 0.0
    dctx = {B: 2000 * B * drow for B in sizes if B > 1} if drow else {}
    return Costs(1.0, td, tt, 0, ctx_ms=ctx, ctx_draft_ms=dctx)


def _attention_per_row(target, args) -> float:
    """Multiply-adds per verified row and context position over the target's attention layers
    (heads x head width each; 0 when the shapes are not known)."""
    heads = getattr(args, "num_attention_heads", 0) or 0
    if not heads or target is None:
        return 0.0
    hd = getattr(args, "head_dim", None) or getattr(args, "hidden_size", 0) // heads
    layers = len(getattr(target, "layers", ())) - len(getattr(target, "gdn", ()))
    return float(max(0, layers) * heads * hd)


def _drafter_attention_per_row(drafter) -> float:
    a = getattr(drafter, "args", None)
    if a is None or not getattr(a, "num_attention_heads", 0):
        return 0.0
    return float(a.num_hidden_layers * a.num_attention_heads * a.head_dim)


class PolicyFactory:
    """A fresh ``DraftPolicy`` per sequence, all from one cost curve and prior: the tuner's
    stored result (``tuner.TuneResult``) or ``estimate_costs``. ``block_size`` pins the DFlash
    block; ``sources`` limits the draft sources."""

    def __init__(
        self,
        pair,
        result=None,
        *,
        block_size: int | None = None,
        max_block: int | None = None,
        sources: Sequence[str] = SOURCES,
        **kw,
    ):
        heads = getattr(pair, "chains", None) or {}
        # (the session refuses a requested source the pair cannot run, by name: here a source
        # without its model is only left out of a policy built for a narrower pair)
        sources = tuple(
            s for s in sources if (s != DFLASH or pair.drafter is not None) and (s not in CHAINS or s in heads)
        )
        if max_block is None:
            tried = [c.block for c in result.candidates] if result is not None else []
            ckpt = pair.drafter.args.block_size if pair.drafter is not None else 2
            max_block = max(tried + [ckpt])
        self.costs = result.costs if result is not None and result.costs is not None else estimate_costs(pair)
        self.measured = result is not None and result.costs is not None
        self.prior = tuple(result.acceptance_by_position) if result is not None and pair.drafter is not None else ()
        self.chains = {
            k: chain_prior(k, pair, heads[k], result, self.costs, self.measured) for k in CHAINS if k in sources
        }
        self.max_block, self.pinned, self.sources, self.kw = max_block, block_size, tuple(sources), kw

    def __call__(self) -> DraftPolicy:
        return DraftPolicy(
            self.costs,
            self.max_block,
            self.prior,
            sources=self.sources,
            pinned=self.pinned,
            measured=self.measured,
            chains=self.chains,
            **self.kw,
        )
