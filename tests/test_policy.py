"""The per-cycle drafting policy (policy.DraftPolicy) and hybrid DFlash + lookup drafting.

- the policy on scripted acceptance: drops to plain after failed drafts, probes back with growing
  spacing, recovers; a long lookup match skips the drafter; ``pick`` after a DFlash pass;
- the suffix index (incremental, periodic continuation, match length);
- lossless greedy output across draft sources, pinned blocks, dense and hybrid targets and the
  prefix cache; top-k 1 sampling through lookup proposals equals greedy;
- timings booked to the right phase (a fake clock); stats that add up.
"""

import random

from mlx_spec import decode
from mlx_spec.baselines import find_draft
from mlx_spec.costs import Costs
from mlx_spec.decode import Step, spec_steps
from mlx_spec.lookup import SuffixIndex
from mlx_spec.policy import DFLASH, LOOKUP, PLAIN, Context, Decision, DraftPolicy, PolicyFactory, estimate_costs
from mlx_spec.prefix import PrefixCache
from mlx_spec.sampling import SamplingConfig
from mlx_spec.stats import Stats
from mlx_spec.target import Target

import mlx.core as mx
import pytest
from helpers import VOCAB, ScriptedDrafter, greedy_reference, tiny_drafter, tiny_model
from test_hybrid import build

COSTS = Costs(100.0, {2: 20.0, 4: 25.0, 8: 35.0, 16: 60.0}, {1: 100.0, 2: 105.0, 4: 115.0, 8: 140.0, 16: 200.0}, 64)


def _cycle(policy, decision, accepted, tokens=None, costs=COSTS):
    L = decision.length
    draft = costs.draft(L) if decision.source == DFLASH else 0.0
    toks = tuple(tokens) if tokens is not None else tuple(range(accepted + 1))
    return Step(
        toks,
        drafted=L - 1,
        accepted=accepted,
        block_size=L,
        source=decision.source,
        verify_ms=costs.verify(L),
        draft_ms=draft,
        elapsed_ms=costs.verify(L) + draft,
    )


# ---------------------------------------------------------------- the policy, scripted


def test_failed_drafts_fall_to_plain_probe_with_growing_spacing_and_recover():
    p = DraftPolicy(COSTS, 16, prior=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], sources=(DFLASH,))
    d = p.choose(Context())
    assert d.source == DFLASH and d.length >= 4  # a good prior: a real block
    first_plain = None
    for i in range(200):  # the drafter stops agreeing: nothing is ever accepted
        p.observe(_cycle(p, d, 0))
        d = p.choose(Context())
        if d.source == PLAIN and first_plain is None:
            first_plain = i + 1
    assert first_plain is not None and first_plain <= 4  # plain within a few failed cycles
    drafts = [i for i, x in enumerate(p.trace) if x.source != PLAIN]
    probes = [x for x in p.trace[first_plain:] if x.source != PLAIN]
    assert probes and all(x.probe and x.length <= 3 for x in probes)  # short probes only
    gaps = [b - a for a, b in zip(drafts, drafts[1:])][first_plain:]
    gaps = [g for g in gaps if g > 1]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0] and max(gaps) <= 65  # growing, bounded
    # bounded cost: probes are a small share of the failing stretch
    assert len(probes) <= 200 / 8
    for _ in range(300):  # the drafter agrees again: whatever is drafted is accepted
        p.observe(_cycle(p, d, d.length - 1) if d.source != PLAIN else _cycle(p, d, 0))
        d = p.choose(Context())
    tail = p.trace[-10:]
    assert all(x.source == DFLASH for x in tail) and tail[-1].length >= 8  # recovered to long blocks


def test_policy_rate_reaches_most_of_the_best_fixed_block():
    """Stationary per-position acceptance c: tokens per ms >= 90 % of the best fixed block's."""
    for cond in (0.3, 0.6, 0.85):
        best = max(
            sum(cond**i for i in range(L)) / (COSTS.draft(L) + COSTS.verify(L) if L > 1 else COSTS.verify(1))
            for L in range(1, 17)
        )
        rates = []
        for seed in range(6):
            rng, p = random.Random(seed), DraftPolicy(COSTS, 16, sources=(DFLASH,))
            toks, ms = 0, 0.0
            for _ in range(150):
                d = p.choose(Context())
                a = 0
                while a < d.length - 1 and rng.random() < cond:
                    a += 1
                s = _cycle(p, d, a)
                toks, ms = toks + a + 1, ms + s.elapsed_ms
                p.observe(s)
            rates.append(toks / ms)
        assert sum(rates) / len(rates) >= 0.9 * best, cond


def test_a_long_reliable_lookup_match_skips_the_drafter():
    p = DraftPolicy(COSTS, 8, prior=[0.5, 0.3, 0.2])
    assert p.choose(Context()).source == DFLASH  # nothing to look up: the drafter
    d = p.choose(Context(lookup=tuple(range(40)), match=30))
    assert d.source == LOOKUP and d.length >= 4
    for _ in range(20):  # the copies are accepted whole: the lookup drafts grow past the drafter's block
        p.observe(_cycle(p, d, d.length - 1))
        d = p.choose(Context(lookup=tuple(range(40)), match=30))
    assert d.source == LOOKUP and 16 < d.length <= 33
    short = p.choose(Context(lookup=(1, 2), match=1))  # a one-token match is a weak guess
    assert short.source == DFLASH
    assert p.choose(Context(lookup=tuple(range(40)), match=30, room=5)).length <= 5  # within the room


def test_lookup_learns_from_cycles_it_did_not_draft():
    p = DraftPolicy(COSTS, 8, prior=[0.9, 0.8, 0.7])
    for _ in range(30):  # the lookup's guesses never match what the target commits
        d = p.choose(Context(lookup=(5, 6, 7, 8), match=10))
        p.observe(
            _cycle(p, d, 0, tokens=[9])
            if d.source == PLAIN
            else _cycle(
                p, d, d.length - 1 if d.source == DFLASH else 0, tokens=[9] * (d.length if d.source == DFLASH else 1)
            )
        )
    assert p.choose(Context(lookup=(5, 6, 7, 8), match=10)).source == DFLASH


def test_pick_after_the_drafter_pass():
    p = DraftPolicy(COSTS, 8, prior=[0.6, 0.4, 0.2])
    ctx = Context(lookup=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), match=6)
    d = Decision(DFLASH, 4)
    # the drafter agrees with the lookup on its whole block: the lookup's longer copy wins
    got = p.pick(d, [1, 2, 3], [0.9, 0.9, 0.9], ctx)
    assert got.source == LOOKUP and got.length > 4
    # they disagree at once, the drafter is sure and the lookup's match is short: keep the drafter's block
    assert p.pick(d, [7, 8, 9], [0.99, 0.99, 0.99], Context(lookup=ctx.lookup, match=2)) == d
    assert p.pick(Decision(PLAIN, 1), [], None, ctx).source == PLAIN


def test_pinned_block_and_sources():
    p = DraftPolicy(COSTS, 16, prior=[0.9] * 15, pinned=4)
    assert p.choose(Context()) == Decision(DFLASH, 4)
    only_lookup = DraftPolicy(COSTS, 16, sources=(LOOKUP,))
    assert only_lookup.choose(Context()).source == PLAIN
    with pytest.raises(ValueError, match="unknown draft sources"):
        DraftPolicy(COSTS, 8, sources=("ngram",))


def test_costs_rescale_from_measured_timings():
    p = DraftPolicy(estimate_costs_stub(), 8, measured=False)
    assert p.scale["verify"] is None  # an estimate: the first measured cycle sets the scale
    p.observe(
        Step(
            (1, 2), drafted=3, accepted=1, block_size=4, source=DFLASH, draft_ms=30.0, verify_ms=120.0, elapsed_ms=155.0
        )
    )
    assert p.verify_ms(4) == pytest.approx(120.0) and p.draft_ms(4) == pytest.approx(30.0)
    assert p.overhead[DFLASH] == pytest.approx(1.0)  # 20 % of the 5 ms of host work


def estimate_costs_stub():
    return Costs(1.0, {2: 0.1, 4: 0.12, 8: 0.15}, {1: 1.0, 2: 1.06, 4: 1.18, 8: 1.42}, 0)


# ---------------------------------------------------------------- the suffix index


def test_suffix_index_is_incremental_and_agrees_with_a_rescan():
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(300)]
    idx = SuffixIndex(seq[:5], ngram_max=3, keep=1, follow=False)  # (following a copy: tests/test_lookup.py)
    for i in range(5, len(seq)):
        idx.extend([seq[i]])
        got, _ = idx.propose(6)
        want = find_draft(seq[: i + 1], 6, ngram_max=3)
        assert got[: len(want)] == want  # past the end the index keeps copying (periodically)


def test_suffix_index_match_length_and_periodic_copy():
    text = [10, 11, 12, 13, 14, 15, 16, 17, 1, 2, 3]
    idx = SuffixIndex(text + [10, 11, 12], ngram_max=4)
    toks, m = idx.propose(8)
    assert toks == [13, 14, 15, 16, 17, 1, 2, 3] and m == 3
    idx = SuffixIndex([7, 8, 9, 7, 8, 9, 7, 8], ngram_max=4)
    toks, m = idx.propose(7)
    assert toks == [9, 7, 8, 9, 7, 8, 9] and m == 5
    assert SuffixIndex([1, 2, 3]).propose(4) == ([], 0)


# ---------------------------------------------------------------- lossless decoding

N = 40
BASE = [(7 * i + 3) % 50 + 4 for i in range(24)]
PROMPTS = {"repeat": BASE + BASE[:8], "plain": [1, 5, 9, 17, 33, 2, 8]}
SOURCE_SETS = {"dflash": (DFLASH,), "lookup": (LOOKUP,), "default": (DFLASH, LOOKUP)}


@pytest.fixture(scope="module")
def dense():
    model, cfg = tiny_model("qwen3")
    target, drafter, _ = tiny_drafter(model, cfg, v2=True)
    refs = {k: greedy_reference(model, p, N) for k, p in PROMPTS.items()}
    return model, target, drafter, refs


def _policy(sources, pinned=None):
    return DraftPolicy(
        Costs(1.0, {2: 0.05, 4: 0.06, 8: 0.08}, {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2}, 0),
        8,
        prior=[0.8, 0.6, 0.4],
        sources=sources,
        pinned=pinned,
        probe_every=2,
    )


def _run(target, drafter, prompt, policy=None, n=N, **kw):
    stats, toks = Stats(), []
    for s in spec_steps(target, drafter, prompt, block_size=4, max_tokens=n, policy=policy, **kw):
        stats.add(s)
        toks += s.tokens
    return toks, stats


@pytest.mark.parametrize("sources", list(SOURCE_SETS), ids=list(SOURCE_SETS))
@pytest.mark.parametrize("pinned", [None, 2, 6])
def test_greedy_is_lossless_across_sources_and_blocks(dense, sources, pinned):
    _, target, drafter, refs = dense
    for name, prompt in PROMPTS.items():
        toks, stats = _run(target, drafter, prompt, _policy(SOURCE_SETS[sources], pinned))
        assert toks == refs[name], (sources, pinned, name)
        used = set(stats.sources)
        assert used <= set(SOURCE_SETS[sources])
        if pinned:
            blocks = [L for (s, L, _) in stats.trace if s == DFLASH]
            assert all(L <= pinned for L in blocks) and blocks.count(pinned) >= len(blocks) - 1  # (room at the end)


def test_the_default_engine_uses_both_sources_and_an_oracle_drafter_mixes_cleanly(dense, monkeypatch):
    """(On a clock that stands still: the policy decides from its prior costs, not from this
    machine's load, which could otherwise price the lookup out of a short run.)"""
    model, target, drafter, refs = dense
    _clocked(monkeypatch, Clock())
    prompt = PROMPTS["repeat"]
    toks, stats = _run(target, drafter, prompt, _policy(SOURCE_SETS["default"]))
    assert toks == refs["repeat"] and stats.sources.get(LOOKUP, {}).get("accepted", 0) > 0
    oracle = ScriptedDrafter(list(prompt) + refs["repeat"], VOCAB)  # always right
    t0 = Target(model, [0])
    toks, stats = _run(t0, oracle, prompt, _policy(SOURCE_SETS["default"]))
    assert toks == refs["repeat"]
    assert stats.sources[DFLASH]["accepted"] > 0


def test_stats_add_up(dense):
    _, target, drafter, _ = dense
    _, st = _run(target, drafter, PROMPTS["repeat"], _policy(SOURCE_SETS["default"]))
    d = st.as_dict(trace=True)
    assert d["plain_cycles"] + d["drafted_cycles"] == d["cycles"] == len(d["cycle_trace"])
    assert sum(d["block_sizes"].values()) == d["cycles"] and d["block_sizes"].get("1", 0) == d["plain_cycles"]
    assert sum(s["cycles"] for s in d["sources"].values()) == d["drafted_cycles"]
    assert sum(s["drafted"] for s in d["sources"].values()) == d["drafted"]
    assert sum(s["accepted"] for s in d["sources"].values()) == d["accepted"]
    assert st.snapshot(trace=True).as_dict() == d and "cycle_trace" not in st.snapshot().as_dict()


def test_prefix_cache_with_the_policy(dense):
    """Turn 2 reuses turn 1's caches (the lookup sees turn 1 in the prompt) and matches a fresh run."""
    _, target, drafter, _ = dense
    cache = PrefixCache(64 << 20)
    turn1 = PROMPTS["repeat"]

    def run(prompt, prefix):
        kw = dict(prefill=prefix.lookup(prompt, drafter=True), on_exit=prefix.store) if prefix is not None else {}
        return _run(target, drafter, prompt, _policy(SOURCE_SETS["default"]), n=24, **kw)

    reply, _ = run(turn1, cache)
    prompt2 = turn1 + reply + [2, 11, 13] + BASE[:6]
    fresh, _ = run(prompt2, None)
    reused, st = run(prompt2, cache)
    assert reused == fresh and st.cached_tokens > len(turn1)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_target_is_lossless_with_lookup(kind):
    model, cfg = build(kind)
    target, drafter, _ = tiny_drafter(model, cfg, v2=False)
    prompt = PROMPTS["repeat"]
    ref = greedy_reference(model, prompt, 28)
    for sources in SOURCE_SETS.values():
        toks, _ = _run(target, drafter, prompt, _policy(sources), n=28)
        assert toks == ref, sources


class _Trimming:
    """A policy that drafts 4 and has pick() verify 1, 2, 3 or 4 rows in turn."""

    sources, max_lookup = (DFLASH,), 0

    def __init__(self):
        self.n, self.picks = 0, []  # picks: (rows verified, rows the drafter's block had)

    def choose(self, ctx):
        return Decision(DFLASH, 4)

    def stays_plain(self, ctx):
        return False

    def pick(self, decision, drafts, confidence, ctx=None, *, trim=False):
        assert trim and confidence is not None and len(confidence) == len(drafts)
        self.n += 1
        L = min(1 + self.n % 4, len(drafts) + 1)
        self.picks.append((L, len(drafts) + 1))
        return Decision(DFLASH, L)

    def observe(self, step):
        pass


@pytest.mark.parametrize("kind", ["dense", "qwen3_5"])
def test_trimmed_blocks_are_lossless(dense, kind):
    """pick() verifying whole blocks, parts of them and the anchor alone: the output is the
    target's own (dense trim and hybrid GDN rollback of the rows verified)."""
    if kind == "dense":
        _, target, _, refs = dense
        prompt, n, ref = PROMPTS["repeat"], N, refs["repeat"]
    else:
        model, cfg = build(kind)
        target, _, _ = tiny_drafter(model, cfg, v2=False)
        prompt, n = PROMPTS["repeat"], 28
        ref = greedy_reference(model, prompt, n)
    drafter = ScriptedDrafter(list(prompt) + ref, VOCAB, right=2)
    policy = _Trimming()
    steps = list(spec_steps(target, drafter, prompt, block_size=4, max_tokens=n, policy=policy))
    assert [t for s in steps for t in s.tokens] == ref
    verified = {s.block_size for s in steps[1:] if s.draft_block == 4}
    assert verified == {1, 2, 3, 4}, verified
    st = Stats()
    for s in steps:
        st.add(s)
    d = st.as_dict()
    # the counters against what the policy itself did: every cycle with room for a draft ran the
    # drafter and was picked (the last one, one token left, is a plain step without the drafter)
    picks = policy.picks
    assert d["drafter_passes"] == len(picks) == len(steps) - 2 and steps[-1].draft_block == 0
    assert d["trimmed"] == sum(L < full for L, full in picks) > 0
    assert d["plain_cycles"] == sum(L == 1 for L, _ in picks) + 1 > 1
    assert [s.block_size for s in steps[1:-1]] == [L for L, _ in picks]
    assert all(
        s.drafted == s.block_size - 1 and (s.source == DFLASH or s.block_size == 1)  # (the room left)
        for s in steps[1:]
    )


class _Rooms:
    """Stays plain, and notes the room each ask (``stays_plain`` one step ahead, ``choose``) had."""

    sources, max_lookup = (DFLASH,), 0

    def __init__(self):
        self.rooms, self.asked = [], []

    def choose(self, ctx):
        self.rooms.append(ctx.room)
        return Decision(PLAIN, 1)

    def stays_plain(self, ctx):
        self.asked.append(ctx.room)
        return True

    def pick(self, *a, **k):
        raise AssertionError("a plain run never picks")

    def observe(self, step):
        pass


def test_a_queued_plain_step_is_asked_with_its_own_room(dense):
    """The pipelined plain run asks about the step it queues before the step in flight is read:
    that token is no longer room. So the policy is asked with N-1 after the prefill's token, one
    less every step, 1 at the last, and never about a step past the reply (room 0)."""
    _, target, drafter, refs = dense
    pol = _Rooms()
    steps = list(spec_steps(target, drafter, PROMPTS["repeat"], block_size=4, max_tokens=N, policy=pol))
    assert [t for s in steps for t in s.tokens] == refs["repeat"]
    assert pol.rooms == list(range(N - 1, 0, -1))
    assert pol.asked == list(range(N - 2, 0, -1))  # every step after the first was queued


def test_top_k_1_sampling_through_lookup_is_greedy(dense):
    """T > 0 with top-k 1: the point-mass lookup proposals and the drafter's go through
    rejection sampling and must give the greedy tokens."""
    _, target, drafter, refs = dense
    cfg = SamplingConfig(0.9, top_k=1, seed=3)
    toks, stats = _run(target, drafter, PROMPTS["repeat"], _policy(SOURCE_SETS["default"]), sampling=cfg)
    assert toks == refs["repeat"] and stats.sources.get(LOOKUP, {}).get("accepted", 0) > 0


def test_sampled_runs_with_the_policy_are_seed_reproducible(dense):
    _, target, drafter, _ = dense
    cfg = SamplingConfig(1.0, seed=7)
    a, _ = _run(target, drafter, PROMPTS["repeat"], _policy(SOURCE_SETS["default"]), sampling=cfg)
    b, _ = _run(target, drafter, PROMPTS["repeat"], _policy(SOURCE_SETS["default"]), sampling=cfg)
    assert a == b


def test_policies_factory_uses_the_tuned_result_or_an_estimate(dense):
    model, target, drafter, _ = dense

    class P:  # the pair's fields PolicyFactory reads
        pass

    pair = P()
    pair.model, pair.target, pair.drafter = model, target, drafter
    make = PolicyFactory(pair, None)
    assert not make.measured and make.costs.verify(8) > make.costs.verify(1) > make.costs.draft(2) > 0
    assert make() is not make() and make().sources == (DFLASH, LOOKUP)
    assert PolicyFactory(pair, None, block_size=3)().pinned == 3
    est = estimate_costs(pair)
    assert est.tt_ms[1] == 1.0 and 0 < est.td_ms[2] < 1.0
    # untuned, a long context is still priced: the attention's arithmetic per row, per 1000 tokens
    assert est.ctx_ms[1] > 0 and est.ctx_ms[8] == pytest.approx(8 * est.ctx_ms[1]) and est.ctx_draft_ms[2] > 0
    assert est.at(8000).verify(8) > 2 * est.verify(8)


# ---------------------------------------------------------------- timings, fake clock


class Clock:
    """A fake ``perf_counter``. A fake pass adds its time to ``debt`` when its graph is built; the
    debt is paid (the clock moves) when the loop submits or waits for work (``mx.eval`` /
    ``mx.async_eval``), as a real pass runs after its graph is queued, not while it is built."""

    def __init__(self):
        self.now, self.debt = 0.0, 0.0

    def __call__(self):
        return self.now

    def pay(self):
        self.now, self.debt = self.now + self.debt, 0.0


class ClockTarget:
    """A Target whose passes take a known (fake) time: 100 ms + 5 ms per extra row."""

    def __init__(self, target, clock):
        self.t, self.clock = target, clock

    def make_cache(self):
        return self.t.make_cache()

    def __call__(self, ids, cache, **kw):
        out = self.t(ids, cache, **kw)
        self.clock.debt += (100 + 5 * (ids.shape[1] - 1)) / 1e3
        return out

    def rollback(self, cache, n, keep):
        self.t.rollback(cache, n, keep)
        self.clock.now += 1 / 1e3


class ClockDrafter(ScriptedDrafter):
    def __init__(self, clock, *a, **kw):
        super().__init__(*a, **kw)
        self.clock = clock

    def propose(self, *a, **kw):
        out = super().propose(*a, **kw)
        self.clock.debt += 10 / 1e3
        return out


def _clocked(monkeypatch, clock):
    monkeypatch.setattr(decode.time, "perf_counter", clock)
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)

        def paid(*a, real=real):
            clock.pay()
            return real(*a)

        monkeypatch.setattr(mx, name, paid)


def _clocked_run(dense, monkeypatch, policy, right: int, max_tokens: int = N) -> list[Step]:
    """The "repeat" prompt through spec_steps on the fake clock, the drafter right for ``right``
    positions per block."""
    model, _, _, refs = dense
    clock = Clock()
    _clocked(monkeypatch, clock)
    prompt = PROMPTS["repeat"]
    target = ClockTarget(Target(model, [0]), clock)
    drafter = ClockDrafter(clock, list(prompt) + refs["repeat"], VOCAB, right=right)
    return list(spec_steps(target, drafter, prompt, block_size=4, max_tokens=max_tokens, policy=policy))


@pytest.mark.parametrize("lookup", [True, False], ids=["default", "dflash"])
def test_timings_are_booked_to_their_phase(dense, monkeypatch, lookup):
    """A greedy DFlash pass is waited for before the verify graph is built (pick() may trim the
    block or switch to the lookup): the drafter's pass is booked to draft_ms and the target's to
    verify_ms (a fixed block's overlap: test_overlapped_draft_timings). A pipelined plain step
    books the wait at its read (0 here: a fake pass is paid when it is queued), and the step
    that queued the next one before reading its own token paid for both passes."""
    steps = _clocked_run(dense, monkeypatch, _policy(SOURCE_SETS["default" if lookup else "dflash"]), right=1)
    seen = set()
    plain = [s for s in steps[1:] if s.source == PLAIN]
    for s in steps[1:]:
        seen.add(s.source)
        # the drafter ran (draft_block: its own block) exactly where its pass was booked
        # (pick() may have trimmed its block: it verified a prefix of it)
        assert (s.draft_block > 0) == (s.draft_ms > 0) and (s.source != DFLASH or s.draft_block >= s.block_size)
        if s.source == PLAIN:
            assert s.draft_ms == 0 and s.rollback_ms == 0 and s.verify_ms == 0
            assert s.elapsed_ms in (0.0, pytest.approx(100.0), pytest.approx(200.0))
            continue
        assert s.verify_ms == pytest.approx(100 + 5 * (s.block_size - 1))
        # the drafter's pass (10 ms) is booked wherever it ran, also when pick() then chose the lookup
        assert s.draft_ms in ((pytest.approx(10.0),) if s.source == DFLASH else (0.0, pytest.approx(10.0)))
        assert s.rollback_ms == pytest.approx(1.0)
        assert s.elapsed_ms == pytest.approx(s.verify_ms + s.draft_ms + s.rollback_ms)  # nothing else is timed
    assert sum(s.elapsed_ms for s in plain) == pytest.approx(100.0 * len(plain))
    # a plain step that paid two passes queued the next (plain) step before reading its own token
    assert all(
        b.source == PLAIN
        for a, b in zip(steps[1:], steps[2:])
        if a.source == PLAIN and a.elapsed_ms == pytest.approx(200.0)
    )
    assert ({DFLASH, LOOKUP} if lookup else {DFLASH, PLAIN}) <= seen
    st = Stats()
    for s in steps:
        st.add(s)
    assert st.verify_ms == pytest.approx(sum(100 + 5 * (L - 1) for src, L, _ in st.trace if src != PLAIN))
    assert st.draft_ms == pytest.approx(10.0 * sum(1 for s in steps[1:] if s.draft_ms > 0))
    assert st.draft_ms >= 10.0 * st.sources[DFLASH]["cycles"] - 1e-6


def test_overlapped_draft_timings(dense, monkeypatch):
    """A fixed block (no policy: nothing to trim or switch) builds the verify graph on the lazy
    drafts and reads them with the target's choices, in one wait: both passes are booked to
    verify_ms (``draft_in_verify``), draft_ms is 0."""
    steps = _clocked_run(dense, monkeypatch, None, right=1, max_tokens=12)
    assert len(steps) > 2
    for s in steps[1:]:
        if s.block_size == 1:  # the room left allowed no draft
            continue
        assert s.source == DFLASH and s.draft_block == s.block_size <= 4  # (the last: the room left)
        assert s.draft_in_verify and s.draft_ms == 0
        assert s.verify_ms == pytest.approx(10 + 100 + 5 * (s.block_size - 1))
    assert steps[1].block_size == 4


def test_a_policy_learns_one_scale_from_a_cycle_timed_in_one_wait():
    """A cycle whose drafts were read with the verify's choices times both passes at once: the
    policy scales its verify and draft costs by their sum (the drafter's share is not booked
    to the verify), and leaves its per-length verify line alone."""
    p = DraftPolicy(CPU, 8, sources=(DFLASH,))
    p.observe(Step((1,), prefill=True, prompt_tokens=8))
    tt, td = p._table(4)
    both = 2 * (tt + td)
    p.observe(
        Step((1, 2), 3, 1, 4, verify_ms=both, elapsed_ms=both, source=DFLASH, draft_block=4, draft_in_verify=True)
    )
    assert p.scale["verify"] == pytest.approx(p.scale["draft"]) and p.scale["verify"] > 1.0
    assert p.verify_ms(4) + p.draft_ms(4) == pytest.approx(p.scale["verify"] * (tt + td))
    assert p.line.at(4) is None


def test_pick_trims_the_block_to_what_the_drafter_is_sure_of():
    """After the drafter's pass: verify the prefix it is sure enough of, the anchor alone when it
    is sure of nothing (a probe too); a pinned block is never trimmed."""
    halving = [0.6 * 0.5**k for k in range(7)]  # a first draft accepted 60 %, each next one half as often
    p = DraftPolicy(CPU, 8, halving, sources=(DFLASH,))
    d = Decision(DFLASH, 8)
    assert p.pick(Decision(DFLASH, 4), [1, 2, 3], [0.99] * 3, trim=True) == Decision(DFLASH, 4)
    got = p.pick(d, list(range(7)), [0.99, 0.99] + [0.0] * 5, trim=True)
    assert got.source == DFLASH and 3 <= got.length <= 4, got
    assert p.pick(d, list(range(7)), [0.0] * 7) == d  # (without trim: as chosen)
    pinned = DraftPolicy(CPU, 8, halving, sources=(DFLASH,), pinned=8)
    assert pinned.pick(d, list(range(7)), [0.0] * 7, trim=True) == d
    weak = DraftPolicy(CPU, 8, [0.2 * 0.5**k for k in range(7)], sources=(DFLASH,))
    assert weak.pick(Decision(DFLASH, 4), [1, 2, 3], [0.0] * 3, trim=True) == Decision(DFLASH, 1)
    assert weak.pick(Decision(DFLASH, 3, probe=True), [1, 2], [0.0] * 2, trim=True) == Decision(DFLASH, 1, True)
    assert weak.pick(Decision(DFLASH, 3, probe=True), [1, 2], [0.95] * 2, trim=True).length > 1


def test_a_drafter_trimmed_to_the_anchor_rests():
    """A pass the drafter was too unsure of to verify (pick() kept the anchor alone) counts as a
    rejected first draft: after a few the policy takes plain steps instead of paying for passes
    it then throws away, and probes only now and then."""
    p = DraftPolicy(CPU, 8, [0.6 * 0.5**k for k in range(7)], sources=(DFLASH,))
    choices = []
    for _ in range(16):
        d = p.choose(Context())
        choices.append(d.source)
        trimmed = d.source == DFLASH
        p.observe(
            Step(
                (5,),
                drafted=0,
                accepted=0,
                block_size=1,
                source=d.source,
                draft_ms=10.0 if trimmed else 0.0,
                verify_ms=90.0 if trimmed else 62.5,
                elapsed_ms=100.0 if trimmed else 62.5,
                draft_block=d.length if trimmed else 0,
            )
        )
    assert choices[0] == DFLASH and choices.count(DFLASH) <= 6 and choices[-3:] == [PLAIN] * 3, choices
    # a trimmed pass (90 ms, unpipelined) is no pipelined plain step (62.5 ms): it does not price them
    assert p.scale["plain"] == pytest.approx(1.0)


def test_a_plain_run_queues_the_next_step_before_reading_the_current_one(dense, monkeypatch):
    """A drafter that is always wrong: plain runs between failed probes. On the fake clock a run's
    first step pays its own pass and the next one's (queued before its token is read), the middle
    ones the next one's, the last one none (already paid); unpipelined steps would pay 100 each."""
    policy = DraftPolicy(
        Costs(100.0, {2: 10.0, 4: 10.0}, {1: 100.0, 2: 105.0, 4: 115.0}, 0), 4, [0.0, 0.0, 0.0], sources=(DFLASH,)
    )
    steps = _clocked_run(dense, monkeypatch, policy, right=0, max_tokens=20)
    assert [t for s in steps for t in s.tokens] == dense[3]["repeat"][:20]
    runs, run = [], []
    for s in steps[1:] + [Step((0,), source=DFLASH)]:  # (a sentinel ends the last run)
        if s.source == PLAIN:
            run.append(s.elapsed_ms)
        else:
            runs, run = runs + [run] * (len(run) >= 2), []
    assert runs and sum(len(r) for r in runs) >= 10, runs
    for r in runs:
        assert r == [pytest.approx(200.0)] + [pytest.approx(100.0)] * (len(r) - 2) + [pytest.approx(0.0)], r


def test_server_reports_what_the_policy_did():
    from mlx_spec.generation import EngineInfo
    from mlx_spec.server import app, schemas

    st = Stats()
    for s in (
        Step((1,), prefill=True),
        Step((1, 2, 3), drafted=3, accepted=2, block_size=4, source=LOOKUP),
        Step((4,), source=PLAIN),
        Step((5, 6), drafted=3, accepted=1, block_size=4, source=DFLASH, draft_block=4),
        Step((7,), source=DFLASH, draft_block=4),
    ):  # (a block trimmed to the anchor)
        st.add(s)
    info = EngineInfo("dflash2", "t", "d", 4, "tuned", adaptive_max=16)
    spec = schemas.speculation(info, st.snapshot(trace=True))
    assert spec["policy"] == "per-cycle"
    assert spec["cycles"]["plain_cycles"] == 2 and spec["cycles"]["drafted_cycles"] == 2
    assert spec["cycles"]["drafter_passes"] == 2 and spec["cycles"]["trimmed"] == 1
    assert spec["cycles"]["sources"]["lookup"]["accepted"] == 2 and len(spec["cycles"]["trace"]) == 4
    assert schemas.speculation(EngineInfo("dflash2", "t", "d", 4, "flag"))["policy"] == "fixed"

    class Engine:
        def snapshot(self):
            return {
                "requests": 1,
                "cancelled": 0,
                "errors": 0,
                "prompt_tokens": 3,
                "cached_tokens": 0,
                "prefix_cache_bytes": 0,
                "tokens": 6,
                "cycles": 2,
                "drafted": 6,
                "accepted": 3,
                "accepted_by_position": [2, 1],
                "drafted_by_position": [2, 2],
                "queue_depth": 0,
                "state": "ready",
                "plain_cycles": st.plain_cycles,
                "block_sizes": dict(st.block_sizes),
                "drafter_passes": st.drafter_passes,
                "trimmed": st.trimmed,
                "sources": {k: dict(v) for k, v in st.sources.items()},
            }

    text = app.prometheus(Engine(), {}, {"rejected": 0, "in_flight": 0})
    assert "mlx_spec:spec_decode_plain_cycles_total 2" in text
    assert "mlx_spec:spec_decode_drafter_passes_total 2" in text and "mlx_spec:spec_decode_trimmed_total 1" in text
    assert 'mlx_spec:spec_decode_cycles_by_block_total{block="4"} 2' in text
    assert 'mlx_spec:spec_decode_source_accepted_tokens_total{source="lookup"} 2' in text


def test_verify_cost_slope_is_learned_from_the_replys_own_cycles():
    """A machine where each verified row costs 25 % of a plain step (the curve says 6 %): after
    cycles of several lengths the policy prices long drafts by what it measured."""
    p = DraftPolicy(estimate_costs_stub(), 8, measured=False)
    for L in (1, 4, 1, 8, 2, 1, 6):
        p.observe(
            Step(
                tuple(range(L)),
                drafted=L - 1,
                accepted=L - 1,
                block_size=L,
                source=LOOKUP if L > 1 else PLAIN,
                verify_ms=100.0 + 25.0 * (L - 1),
                elapsed_ms=100.0 + 25.0 * (L - 1),
            )
        )
    assert p.verify_ms(1) == pytest.approx(100.0, rel=0.05) and p.verify_ms(30) == pytest.approx(825.0, rel=0.05)
    assert p.choose(Context(lookup=tuple(range(40)), match=30)).length < 16  # long copies cost too much here


def test_an_implausible_fit_falls_back_to_the_curve():
    p = DraftPolicy(COSTS, 8, sources=(DFLASH,))
    for L, ms in ((8, 10.0), (2, 100.0), (8, 10.0), (2, 100.0)):  # verify times falling with rows
        p.observe(Step((1,), drafted=L - 1, accepted=0, block_size=L, source=DFLASH, verify_ms=ms, elapsed_ms=ms))
    for L, ms in ((8, 300.0), (8, 300.0), (1, 0.5)):  # a slope through ~0 at one row
        p.observe(
            Step(
                (1,),
                drafted=L - 1,
                accepted=0,
                block_size=L,
                source=DFLASH if L > 1 else PLAIN,
                verify_ms=ms,
                elapsed_ms=ms,
            )
        )
    assert all(p.cycle_ms(s, L) > 0 for s in (PLAIN, DFLASH, LOOKUP) for L in (1, 2, 8))
    p.choose(Context(lookup=(1, 2, 3), match=5))  # no ZeroDivisionError


# ---------------------------------------------------------------- copying replies (the lookup's copy model)

FLAT = Costs(100.0, {2: 15.0, 8: 17.0, 16: 20.0, 33: 25.0}, {1: 100.0, 2: 140.0, 8: 145.0, 16: 170.0, 33: 220.0}, 0)


def _replay(prompt, reply, sources, costs=FLAT, drafter_right=0.0, seed=0):
    """The policy over a known reply, the way spec_steps drives it (suffix index over the prompt
    and the reply so far; a simulated drafter right with chance ``drafter_right`` per position;
    every pass at ``costs``): (model ms, trace of (source, rows, accepted, match))."""
    from mlx_spec.policy import MAX_LOOKUP

    rng = random.Random(seed)
    p = DraftPolicy(costs, 8, prior=[0.4, 0.2, 0.1], sources=sources)
    idx = SuffixIndex(prompt, 4)
    idx.extend(reply[:1])
    n, ms, trace = 1, 0.0, []
    while n < len(reply):
        room = len(reply) - n
        look, m = idx.propose(min(MAX_LOOKUP, room - 1)) if LOOKUP in sources else ([], 0)
        ctx = Context(tuple(look), m, room)
        d = p.choose(ctx)
        drafts, td, Ld = [], 0.0, 0
        if d.source == DFLASH:
            drafts = [
                reply[n + k] if n + k < len(reply) and rng.random() < drafter_right else -1 for k in range(d.length - 1)
            ]
            td, Ld = costs.draft(d.length), d.length
            if look:
                d = p.pick(d, drafts, [0.5] * len(drafts), ctx)
        if d.source == LOOKUP:
            drafts = list(look[: d.length - 1])
        a = 0
        while a < len(drafts) and n + a < len(reply) and drafts[a] == reply[n + a]:
            a += 1
        L = len(drafts) + 1
        step = Step(
            tuple(reply[n : n + a + 1]),
            drafted=L - 1,
            accepted=a,
            block_size=L,
            source=d.source,
            draft_ms=td,
            verify_ms=costs.verify(L),
            elapsed_ms=td + costs.verify(L),
            draft_block=Ld,
        )
        p.observe(step)
        ms += step.elapsed_ms
        n += len(step.tokens)
        idx.extend(step.tokens)
        trace.append((d.source, L, a, m))
    return ms, trace


def _file(n, seed=1):
    rng = random.Random(seed)
    return [rng.randrange(1000, 9000) for _ in range(n)]


def test_accepted_copies_draft_long_and_an_edit_point_drafts_short():
    p = DraftPolicy(FLAT, 8, prior=[0.4, 0.2, 0.1], sources=(DFLASH, LOOKUP))
    copy = tuple(range(40))
    d = p.choose(Context(lookup=copy, match=12))
    assert d.source == LOOKUP and d.length >= 8  # the prior alone: a 12-token match drafts past the drafter's block
    for _ in range(2):  # accepted whole: the next drafts are full length, not capped by a per-position prior
        p.observe(
            Step(
                tuple(range(d.length)),
                drafted=d.length - 1,
                accepted=d.length - 1,
                block_size=d.length,
                source=LOOKUP,
                verify_ms=FLAT.verify(d.length),
                elapsed_ms=FLAT.verify(d.length),
            )
        )
        d = p.choose(Context(lookup=copy, match=40))
    assert d == Decision(LOOKUP, 33)
    # an edit point: the copy breaks after 20 tokens; the match after it is one token long
    p.observe(
        Step(
            tuple(range(21)),
            drafted=32,
            accepted=20,
            block_size=33,
            source=LOOKUP,
            verify_ms=FLAT.verify(33),
            elapsed_ms=FLAT.verify(33),
        )
    )
    short = p.choose(Context(lookup=copy, match=1))
    assert short.source != LOOKUP or short.length <= 9
    assert p.copy.cond(40) > 0.9  # one break hardly moves a long copy's chance
    back = p.choose(Context(lookup=copy, match=10))  # the copy realigned: long drafts again at once
    assert back.source == LOOKUP and back.length >= 24


def test_copy_model_by_match_length():
    from mlx_spec.policy import LOOKUP_PRIOR, Copy

    c = Copy()
    assert [c.cond(top - 1 if top else 99) for top, _ in LOOKUP_PRIOR] == pytest.approx([x for _, x in LOOKUP_PRIOR])
    cur = c.curve(1, 4)  # position k of a draft at match 1 is judged at match 1 + k
    assert cur == pytest.approx([0.2, 0.2 * 0.4, 0.2 * 0.4 * 0.6, 0.2 * 0.4 * 0.6 * 0.7])
    c.update(1, 1, 0)  # rejected at once at match 1: only that bucket learns
    assert c.cond(1) < 0.2 and c.cond(2) == pytest.approx(0.4)
    for _ in range(5):
        c.update(8, 20, 20)  # whole copies from match 8 on
    assert c.cond(8) > 0.95 and c.cond(20) > 0.95 and c.cond(40) == pytest.approx(LOOKUP_PRIOR[-1][1])


def test_a_copying_reply_reaches_most_of_the_copy_ceiling_and_the_default_engine_beats_both_sources():
    """A scripted agent edit: the reply re-emits a 150-token file with two edits (a new line
    inserted, a token changed). The policy's model time against an oracle that drafts every
    copied token (analysis.copy_oracle at the same costs), lookup only, DFlash only (a weak
    drafter) and both."""
    from mlx_spec.analysis import copy_oracle

    file = _file(150)
    reply = [7, 8] + file[:50] + _file(6, seed=2) + file[50:110] + [9] + file[111:150]
    prompt = [1, 2, 3] + file + [4, 5]
    tokens, oracle = copy_oracle(prompt, reply, FLAT)
    share = {
        name: sum(oracle / _replay(prompt, reply, src, drafter_right=0.6, seed=seed)[0] for seed in range(4)) / 4
        for name, src in (("lookup", (LOOKUP,)), ("dflash", (DFLASH,)), ("default", (DFLASH, LOOKUP)))
    }
    assert share["default"] >= 0.6  # of the ceiling (mean over drafter seeds)
    assert share["default"] > share["lookup"] and share["default"] > 3 * share["dflash"]
    _, trace = _replay(prompt, reply, (DFLASH, LOOKUP), drafter_right=0.6)
    long_ = [i for i, (s, L, a, m) in enumerate(trace) if s == LOOKUP and L >= 26]
    assert len(long_) >= 3  # (near) full-length copies: 32 drafts at most, less where the copy runs out
    assert not any(s == DFLASH and m >= 8 for s, _, _, m in trace)  # a long match never pays a draft pass


def test_long_lookup_drafts_are_lossless(dense):
    """Lookup drafts of up to 32 tokens (33 verify rows), accepted or not, commit the target's own
    greedy tokens."""
    from mlx_spec.policy import Copy

    model, target, drafter, _ = dense
    prompt = PROMPTS["repeat"] * 3
    want = greedy_reference(model, prompt, 90)
    for sources in ((LOOKUP,), (DFLASH, LOOKUP)):
        policy = DraftPolicy(Costs(1.0, {2: 0.05, 33: 0.06}, {1: 1.0, 2: 1.01, 33: 1.02}, 0), 8, sources=sources)
        policy.copy = Copy(((None, 0.999),), weight=1e6)  # always the longest draft the index gives
        toks, stats = _run(target, drafter, prompt, policy, n=90)
        assert toks == want
        assert max(L for s, L, _ in stats.trace if s == LOOKUP) == 33


# ---------------------------------------------------------------- never slower than plain (H17p)

# The tuner's curve and prior on a 2-core CPU (float32 SmolLM2-135M + the shipped drafter): a
# verify of 2+ rows costs ~1.3x a plain step, so a draft pays only at tau well above 1.4.
CPU = Costs(
    65.2,
    {2: 9.6, 3: 8.6, 4: 10.2, 5: 12.3, 6: 11.0, 8: 11.2, 10: 13.5, 12: 16.8, 16: 14.8},
    {1: 62.5, 2: 79.1, 3: 80.5, 4: 89.1, 5: 100.5, 6: 101.7, 8: 101.9, 10: 117.8, 12: 140.8, 16: 136.0},
    70,
)
CPU_PRIOR = [0.32, 0.15, 0.094, 0.097, 0.10, 0.077, 0.044]


def _scripted(p0, cond, seed, n=64, costs=CPU, **kw):
    """A DFlash-only reply of ``n`` tokens whose first draft is accepted with chance ``p0`` and
    each later one with ``cond``: (tokens per ms / plain's, trace)."""
    rng, p = random.Random(seed), DraftPolicy(costs, 16, CPU_PRIOR, sources=(DFLASH,), **kw)
    toks, ms = 0, 0.0
    while toks < n:
        d = p.choose(Context())
        a = 0
        while a < d.length - 1 and rng.random() < (p0 if a == 0 else cond):
            a += 1
        step = _cycle(p, d, a, costs=costs)
        toks, ms = toks + a + 1, ms + step.elapsed_ms
        p.observe(step)
    return toks / ms * costs.verify(1), p.trace


def test_a_low_acceptance_reply_runs_at_plain_speed_and_a_good_one_drafts():
    """Prose on a CPU (first draft accepted 20-30 %): every scripted 64-token reply runs at
    >= 0.96x plain; code-like acceptance still drafts long blocks at >= 1.5x plain on average."""
    for p0, cond in ((0.2, 0.4), (0.3, 0.45)):
        rates = [_scripted(p0, cond, seed)[0] for seed in range(12)]
        assert min(rates) >= 0.96 and sum(rates) / len(rates) >= 0.975, (p0, rates)
    rates = [_scripted(0.8, 0.85, seed)[0] for seed in range(12)]
    assert sum(rates) / len(rates) >= 1.5


def test_plain_is_priced_as_measured_and_drafts_must_beat_it_by_the_margin():
    p = DraftPolicy(CPU, 16, CPU_PRIOR, sources=(DFLASH,))
    assert p.verify_ms(1) == pytest.approx(62.5)  # not the smoothed line through the blocks (~73)
    opts = p.options(Context())
    gain = opts[DFLASH][1] / opts[PLAIN][1]
    assert gain < 1.05 and p.choose(Context()).source == PLAIN  # the tuner's prior barely pays: plain
    loose = DraftPolicy(CPU, 16, CPU_PRIOR, sources=(DFLASH,), margin=0.0)
    assert (loose.choose(Context()).source == DFLASH) == (gain > 1.0)
    good = DraftPolicy(CPU, 16, [0.8, 0.6, 0.45, 0.3], sources=(DFLASH,))
    assert good.choose(Context()).source == DFLASH and not good.trace[-1].probe


def test_probes_are_dflash_only_early_then_doubling_and_reset_by_one_that_pays():
    p = DraftPolicy(CPU, 16, CPU_PRIOR)  # both sources; the prior does not beat plain
    look = Context(lookup=tuple(range(40)), match=30)
    seq = []
    for i in range(40):
        ctx = look if 5 <= i < 9 else Context(lookup=(1, 2), match=1)
        d = p.choose(ctx)
        seq.append(d)
        if d.source == LOOKUP:  # the long copies are accepted: lookup cycles do not reset the probes
            p.observe(_cycle(p, d, d.length - 1, tokens=range(40)[: d.length], costs=CPU))
        else:
            p.observe(_cycle(p, d, 0, tokens=[99], costs=CPU))  # every probe fails
    probes = [i for i, d in enumerate(seq) if d.probe]
    assert all(seq[i].source == DFLASH and seq[i].length <= 3 for i in probes)
    assert {d.source for d in seq} == {PLAIN, DFLASH, LOOKUP} and not any(
        d.source == DFLASH and not d.probe for d in seq
    )
    assert probes[0] == 2  # the first after 3 cycles without a DFlash draft
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[0] >= 6 and gaps[-1] >= 12  # 3, 6, 12: doubling while probes fail
    spacing = p.probe_every
    d = p.choose(Context())
    while not d.probe:
        p.observe(_cycle(p, d, 0, costs=CPU))
        d = p.choose(Context())
    p.observe(_cycle(p, d, 2, costs=CPU))  # a probe that pays: the spacing is back to the base
    assert spacing > p.base_probe == p.probe_every


def test_stays_plain_agrees_with_choose():
    """The loop asks stays_plain one token ahead and then chooses with the same context: the two
    must agree on every scripted cycle (else a pipelined plain step is queued for a draft)."""
    rng = random.Random(4)
    p = DraftPolicy(CPU, 16, CPU_PRIOR)
    for i in range(300):
        ctx = rng.choice(
            [
                Context(),
                Context(lookup=tuple(range(20)), match=rng.randrange(40)),
                Context(lookup=(3,), match=1, room=rng.randrange(1, 9)),
            ]
        )
        plain = p.stays_plain(ctx)
        d = p.choose(ctx)
        assert plain == (d.source == PLAIN), (i, d)
        a = rng.randrange(d.length) if rng.random() < 0.5 else 0
        p.observe(_cycle(p, d, a, tokens=tuple(range(a + 1)), costs=CPU))


def test_options_are_computed_once_per_context_between_observations():
    """A plain run asks choose then stays_plain (or stays_plain then choose) with one context:
    the rates are computed once; an observation makes them stale."""
    calls = []

    class Counting(DraftPolicy):
        def options(self, ctx):
            calls.append(ctx)
            return super().options(ctx)

    p = Counting(CPU, 16, CPU_PRIOR)
    ctx = Context(lookup=(1, 2), match=1)
    d = p.choose(ctx)
    p.stays_plain(ctx)
    p.choose(ctx)
    assert len(calls) == 1
    p.observe(_cycle(p, d, 0, tokens=[99], costs=CPU))
    p.stays_plain(ctx)
    p.choose(ctx)
    assert len(calls) == 2
    p.choose(Context())
    assert len(calls) == 3


def test_the_prior_keeps_the_tuners_measured_acceptance():
    """The DFlash prior is only held non-increasing (P(first k+1 accepted) never grows): the
    tuner's CPU prior keeps its measured E(8) (1.88; 1.87 with its one small rise clamped), and a
    conditional acceptance that rises after the first positions (DFlash's usual shape) is kept."""
    from mlx_spec.policy import Acceptance, expected_tokens

    prior = Acceptance(15, CPU_PRIOR).prior
    assert prior[:7] == pytest.approx([0.32, 0.15, 0.094, 0.094, 0.094, 0.077, 0.044])
    assert expected_tokens(prior, 8) == pytest.approx(1 + sum(CPU_PRIOR), rel=0.01)
    assert all(a >= b for a, b in zip(prior, prior[1:]))
    assert Acceptance(3, [0.63, 0.62, 0.62]).prior == pytest.approx([0.63, 0.62, 0.62])


def test_the_verify_line_learns_from_drafts_only():
    """Pipelined plain steps book only the wait at their read: they must not pull the line that
    prices the drafts."""
    p = DraftPolicy(COSTS, 8, sources=(DFLASH,))
    for L in (1, 1, 4, 8, 1, 4, 8, 1):
        ms = 10.0 if L == 1 else 100.0 + 25.0 * (L - 1)
        p.observe(
            Step(
                tuple(range(L)),
                drafted=L - 1,
                accepted=L - 1,
                block_size=L,
                source=PLAIN if L == 1 else DFLASH,
                verify_ms=ms,
                elapsed_ms=ms + 50.0,
            )
        )
    assert p.verify_ms(6) == pytest.approx(225.0)


def test_a_probe_is_not_switched_to_the_lookup():
    """pick() keeps a probe (it is there to judge the drafter); the same draft, not a probe,
    goes to a long reliable lookup match."""
    p = DraftPolicy(CPU, 16, CPU_PRIOR)
    ctx = Context(lookup=tuple(range(40)), match=30)
    probe = Decision(DFLASH, 3, probe=True)
    assert p.pick(probe, [7, 7], [0.1, 0.1], ctx) is probe
    assert p.pick(Decision(DFLASH, 3), [7, 7], [0.1, 0.1], ctx).source == LOOKUP


def test_the_resting_drafters_evidence_fades_and_a_probe_that_pays_wakes_it():
    p = DraftPolicy(CPU, 16, CPU_PRIOR, sources=(DFLASH,))
    for _ in range(5):
        p.observe(_cycle(p, Decision(DFLASH, 3), 0, costs=CPU))  # failed drafts
    before = list(p.dflash.reached)
    d = p.choose(Context())
    assert d.source == PLAIN and p.resting
    n = 0
    while not d.probe:
        p.observe(_cycle(p, d, 0, costs=CPU))
        n += 1
        d = p.choose(Context())
    assert p.dflash.reached[0] == pytest.approx(before[0] * p.rest_decay**n)  # aged while it rested
    p.observe(_cycle(p, d, d.length - 1, costs=CPU))  # the probe is accepted
    assert not p.resting


def test_the_policy_prices_its_choices_at_the_current_context():
    """A curve with a context term: after a long prompt the verify rows cost more, so the policy
    drafts shorter (or not at all) than after a short one; a flat curve does not move."""
    from dataclasses import replace

    prior = [0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]
    slopes = replace(COSTS, ctx_ms={1: 2.0, 2: 6.0, 4: 14.0, 8: 30.0, 16: 62.0})

    def after_prompt(costs, n):
        p = DraftPolicy(costs, 16, prior=prior, sources=(DFLASH,))
        p.observe(Step((5,), prefill=True, prompt_tokens=n))
        return p, p.choose(Context())

    short, d_short = after_prompt(slopes, 64)
    long, d_long = after_prompt(slopes, 8000)
    assert d_short.source == DFLASH and d_short.length >= 4
    assert long.verify_ms(8) > 2 * short.verify_ms(8) and long.verify_ms(1) < 1.25 * short.verify_ms(1)
    assert d_long.length < d_short.length
    flat_short, flat_long = after_prompt(COSTS, 64)[1], after_prompt(COSTS, 8000)[1]
    assert flat_short == flat_long == d_short
