"""Greedy speculative output == mlx-lm's own greedy output, token for token."""

from mlx_spec.decode import spec_steps
from mlx_spec.target import Target

import mlx.core as mx
import pytest
from helpers import VOCAB, ScriptedDrafter, greedy_reference, tiny_drafter, tiny_model

SHORT = [1, 5, 9, 17, 33, 2, 8]
LONG = [(7 * i + 3) % 120 + 4 for i in range(40)]  # longer than the sliding window below
N = 36


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target_model(request):
    model, cfg = tiny_model(request.param)
    refs = {tuple(p): greedy_reference(model, p, N) for p in (SHORT, LONG)}
    return model, cfg, refs


def _tokens(steps):
    return [t for s in steps for t in s.tokens]


# Each drafter attention (full, sliding window) and version on each target, and each target with
# both: every pair of the three choices once (the whole cross product repeats the pairs).
@pytest.mark.parametrize(
    "target_model, window, v2",
    [("qwen3", None, False), ("qwen3", 16, True), ("llama", None, True), ("llama", 16, False)],
    ids=["qwen3-full-dflash1", "qwen3-swa16-dflash2", "llama-full-dflash2", "llama-swa16-dflash1"],
    indirect=["target_model"],
)
def test_random_drafter_matches_mlx_lm(target_model, v2, window):
    model, cfg, refs = target_model
    target, drafter, _ = tiny_drafter(model, cfg, v2=v2, window=window, layers=2)
    n = 24  # (SHORT's context passes the window of 16 too; a random drafter: ~n cycles a run)
    for prompt in (SHORT, LONG):
        for B in (2, 3, 4, 8, 16):
            steps = list(spec_steps(target, drafter, prompt, block_size=B, max_tokens=n))
            assert _tokens(steps) == refs[tuple(prompt)][:n], (B, prompt[:3])
            assert steps[1].drafted == B - 1 and all(s.drafted <= B - 1 for s in steps)


# (acceptance is counted by the loop, the same over any target: on one target, every block size)
@pytest.mark.parametrize("target_model", ["qwen3"], indirect=True)
@pytest.mark.parametrize("B", [2, 3, 4, 8, 16])
def test_oracle_accepts_everything_and_wrong_accepts_nothing(target_model, B):
    model, cfg, refs = target_model
    target = Target(model, [0])
    for prompt in (SHORT, LONG):
        ref = refs[tuple(prompt)]
        full = list(prompt) + ref
        oracle = list(spec_steps(target, ScriptedDrafter(full, VOCAB), prompt, block_size=B, max_tokens=N))
        assert _tokens(oracle) == ref
        assert all(s.accepted == s.drafted for s in oracle[1:])
        assert sum(s.accepted for s in oracle) > 0
        wrong = list(spec_steps(target, ScriptedDrafter(full, VOCAB, right=0), prompt, block_size=B, max_tokens=N))
        assert _tokens(wrong) == ref
        assert all(s.accepted == 0 and len(s.tokens) == 1 for s in wrong[1:])
        if B > 3:
            part = list(spec_steps(target, ScriptedDrafter(full, VOCAB, right=2), prompt, block_size=B, max_tokens=N))
            assert _tokens(part) == ref
            assert all(s.accepted == min(2, s.drafted) for s in part[1:] if not s.finish_reason)


def test_cache_offset_tracks_committed_tokens(target_model):
    model, cfg, refs = target_model
    target = Target(model, [0])
    full = SHORT + refs[tuple(SHORT)]
    seen = []
    orig = target.make_cache

    def spy():
        c = orig()
        seen.append(c)
        return c

    target.make_cache = spy
    n = 0
    for s in spec_steps(target, ScriptedDrafter(full, VOCAB, right=3), SHORT, block_size=8, max_tokens=N):
        n += len(s.tokens)
        # the cache holds the prompt and every committed token except the newest (next anchor)
        assert seen[0][0].offset == len(SHORT) + n - 1


def test_eos_mid_block_and_max_tokens(target_model):
    model, cfg, refs = target_model
    ref = refs[tuple(SHORT)]
    target = Target(model, [0])
    full = SHORT + ref
    eos = ref[10]
    first = ref.index(eos)
    steps = list(spec_steps(target, ScriptedDrafter(full, VOCAB), SHORT, block_size=8, max_tokens=N, eos_ids=[eos]))
    assert _tokens(steps) == ref[: first + 1]
    assert steps[-1].finish_reason == "stop"
    for m in (1, 2, 7, 8, 9):
        steps = list(spec_steps(target, ScriptedDrafter(full, VOCAB), SHORT, block_size=8, max_tokens=m))
        assert _tokens(steps) == ref[:m]
        assert steps[-1].finish_reason == "length"


def test_taps_are_layer_outputs(target_model):
    """Tap j must be the output of decoder layer j (HF hidden_states[j+1]); off-by-one fails."""
    model, cfg, _ = target_model
    target = Target(model, [0, 2])
    ids = mx.array([SHORT])
    out = target(ids, target.make_cache())
    h = model.model.embed_tokens(ids)
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h, None)
    outs = []
    for layer in model.model.layers:
        h = layer(h, mask, cache=None)
        outs.append(h)
    H = cfg["hidden_size"]
    assert mx.allclose(out.hidden[..., :H], outs[0], atol=1e-5)
    assert mx.allclose(out.hidden[..., H:], outs[2], atol=1e-5)
    assert not mx.allclose(out.hidden[..., H:], outs[1], atol=1e-3)
    assert mx.allclose(out.logits, model(ids), atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_pipelined_plain_runs_keep_caches_consistent(kind):
    """A policy that never drafts runs pipelined plain steps (the next step queued before the
    current token is read). Output equals the target alone; the caches handed to ``on_exit`` hold
    exactly the ids they name (target and drafter context), whether the reply ends at
    max_tokens, at EOS with a step in flight, or the generator is closed mid-run; a next turn
    from those caches equals a fresh run."""
    from mlx_spec.costs import Costs
    from mlx_spec.policy import DraftPolicy
    from mlx_spec.prefix import Prefill

    from test_hybrid import build

    model, cfg = tiny_model(kind) if kind == "qwen3" else build(kind)
    target, drafter, _ = tiny_drafter(model, cfg, v2=True)
    ref = greedy_reference(model, LONG, N)

    def policy():
        return DraftPolicy(Costs(1.0, {2: 0.1, 4: 0.12}, {1: 1.0, 2: 1.06, 4: 1.18}, 0), 4, sources=())

    def check(pf: Prefill):
        kv = [c.offset for c in pf.target if hasattr(c, "offset")]  # (hybrid: the attention layers)
        assert kv and set(kv) == {len(pf.tokens)} and pf.drafter[0].offset == len(pf.tokens)

    kept = []
    steps = list(spec_steps(target, drafter, LONG, block_size=4, max_tokens=N, policy=policy(), on_exit=kept.append))
    assert _tokens(steps) == ref and all(s.source == "plain" for s in steps[1:]) and len(steps) == N
    check(kept[-1])
    assert list(kept[-1].tokens) == LONG + ref[:-1]
    eos = ref[12]
    steps = list(
        spec_steps(
            target, drafter, LONG, block_size=4, max_tokens=N, eos_ids=[eos], policy=policy(), on_exit=kept.append
        )
    )
    assert _tokens(steps) == ref[: ref.index(eos) + 1] and steps[-1].finish_reason == "stop"
    check(kept[-1])  # the step queued with the EOS token stays fed: the caches hold it too
    gen = spec_steps(target, drafter, LONG, block_size=4, max_tokens=N, policy=policy(), on_exit=kept.append)
    got = [t for _, s in zip(range(6), gen) for t in s.tokens]
    gen.close()
    check(kept[-1])
    assert got == ref[:6] and list(kept[-1].tokens[: len(LONG) + 5]) == LONG + ref[:5]
    turn2 = list(kept[-1].tokens) + [3, 5, 7]
    fresh = _tokens(spec_steps(target, drafter, turn2, block_size=4, max_tokens=12))
    reused = _tokens(spec_steps(target, drafter, turn2, block_size=4, max_tokens=12, prefill=kept[-1], policy=policy()))
    assert reused == fresh


def test_pipelined_plain_runs_sample_the_targets_law():
    """T > 0: the steps of a pipelined plain run (the second and third tokens, each fed the
    previous one while it was still lazy) are drawn from the target's distribution given the
    tokens before them (chi-square against the mixture of the exact conditionals)."""
    from mlx_spec.costs import Costs
    from mlx_spec.policy import DraftPolicy
    from mlx_spec.sampling import SamplingConfig, target_probs

    import numpy as np
    from test_sampling import gof_pvalue

    model, cfg = tiny_model("qwen3")
    target, drafter, _ = tiny_drafter(model, cfg, v2=True)
    costs = Costs(1.0, {2: 0.1, 4: 0.12}, {1: 1.0, 2: 1.06, 4: 1.18}, 0)
    n = 240
    # one run per seed gives both positions (each position's test is against its own runs' exact
    # conditionals, so the two tests may share the runs)
    counts, expect = {pos: np.zeros(VOCAB) for pos in (1, 2)}, {pos: np.zeros(VOCAB) for pos in (1, 2)}
    for seed in range(n):
        sc = SamplingConfig(1.0, top_k=5, seed=1000 + seed)
        toks = _tokens(
            spec_steps(
                target,
                drafter,
                SHORT,
                block_size=4,
                max_tokens=3,
                sampling=sc,
                policy=DraftPolicy(costs, 4, sources=()),
            )
        )
        for pos in (1, 2):
            counts[pos][toks[pos]] += 1
            logits = model(mx.array([SHORT + toks[:pos]]))[0, -1:]
            expect[pos] += np.array(target_probs(logits, sc)[0])
    for pos in (1, 2):
        assert gof_pvalue(counts[pos], expect[pos] / n) > 0.001, pos


class _CountingWaits:
    """Stands in for ``batch.DeviceWaits``: every wait the loop takes, by kind."""

    def __init__(self):
        self.count, self.calls = 0, []

    def eval(self, *arrays):
        self.count += 1
        self.calls.append("eval")
        mx.eval(*arrays)

    def read(self, *arrays):
        self.count += 1
        self.calls.append("read")
        mx.eval(*arrays)
        return [a.tolist() for a in arrays]


class _Script:
    """A greedy policy that follows a script of sources ("dflash", "lookup" while the lookup has
    a proposal, else "plain")."""

    sources, max_lookup = ("dflash", "lookup"), 8

    def __init__(self, script):
        self.script = list(script)

    def _next(self, ctx):
        from mlx_spec.policy import DFLASH, LOOKUP, PLAIN, Decision

        kind = self.script[0] if self.script else "plain"
        if kind == "dflash":
            return Decision(DFLASH, 4)
        if kind == "lookup" and ctx.lookup:
            return Decision(LOOKUP, min(4, len(ctx.lookup) + 1))
        return Decision(PLAIN, 1)

    def stays_plain(self, ctx):
        return self._next(ctx).source == "plain"

    def choose(self, ctx):
        d = self._next(ctx)
        self.script = self.script[1:]
        return d

    def pick(self, decision, drafts, confidence, ctx=None, *, trim=False):
        return decision

    def observe(self, step):
        pass


def test_host_syncs_per_cycle_are_pinned_and_counted_through_the_wrapper():
    """Waits for the device per cycle, single stream, with a greedy policy: a DFlash cycle two
    (its drafts and the drafter's confidence, which ``pick`` decides the verify from; then the
    target's choices), a lookup cycle and a plain step one (the target's choices).
    ``Step.host_syncs`` says the same."""
    model, cfg = tiny_model("qwen3")
    target, drafter, _ = tiny_drafter(model, cfg)
    prompt = LONG + LONG[:20]  # the lookup finds the prompt's own repeat
    script = ["dflash", "plain", "plain", "lookup", "dflash", "plain", "lookup", "lookup", "plain"]
    waits = _CountingWaits()
    steps = list(spec_steps(target, drafter, prompt, block_size=4, max_tokens=12, policy=_Script(script), waits=waits))
    assert sum(s.host_syncs for s in steps) == waits.count == len(waits.calls)
    per = {}
    for s in steps[1:]:
        per.setdefault(s.source, set()).add(s.host_syncs)
    assert per == {"dflash": {2}, "lookup": {1}, "plain": {1}}, per
    ref = greedy_reference(model, prompt, 12)
    assert _tokens(steps) == ref


def test_a_prefill_budget_cancels_between_chunks_and_drops_the_caches():
    """The prefill budget is checked before every chunk after the first (a clock that moves one
    second per reading, a 2.5 s budget: three chunks run, the fourth never starts); the caches
    are dropped, not handed to the prefix cache. Both loops: ours, and mlx-lm's plain one."""
    import itertools

    from mlx_spec.decode import plain_steps
    from mlx_spec.errors import PrefillTimeout

    model, cfg = tiny_model("qwen3")
    target, drafter, _ = tiny_drafter(model, cfg, v2=True)
    kept = []
    runs = {
        "spec": lambda clock: spec_steps(
            target,
            drafter,
            LONG,
            block_size=4,
            max_tokens=4,
            prefill_step=8,
            on_exit=kept.append,
            prefill_budget_s=2.5,
            clock=clock,
        ),  # 40 tokens: 5 chunks of 8
        "plain": lambda clock: plain_steps(
            model, LONG, max_tokens=4, prefill_step=8, on_exit=kept.append, prefill_budget_s=2.5, clock=clock
        ),  # 39 tokens in chunks of 8, then the last one: 6
    }
    for name, run in runs.items():
        with pytest.raises(PrefillTimeout, match=f"cut after 3 of {5 if name == 'spec' else 6} prefill chunks"):
            list(run(itertools.count().__next__))
    assert kept == []
    # without a budget, or with one it keeps to, the same runs decode
    ref = greedy_reference(model, LONG, 4)
    assert _tokens(spec_steps(target, drafter, LONG, block_size=4, max_tokens=4, prefill_step=8)) == ref
    assert _tokens(runs["plain"](lambda: 0.0)) == ref


@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
def test_a_drafting_window_bounds_the_drafters_cache_and_keeps_the_output(target_model, v2):
    """``--draft-window 8``: every drafter context cache keeps at most the last 8 positions (the
    single stream, and a batch whose drafter pass runs once for all), at the positions a full
    cache would give them; the output is the target's, as without a window."""
    from mlx_spec.batch import BatchDecoder, batched_steps
    from mlx_spec.prefix import PrefixCache

    model, cfg, refs = target_model
    target, drafter, _ = tiny_drafter(model, cfg, v2=v2, layers=2)
    drafter.context_limit = 8
    made, orig = [], drafter.make_cache

    def spy():
        made.append(orig())
        return made[-1]

    drafter.make_cache = spy
    kept = PrefixCache(64 << 20)
    for prompt in (SHORT, LONG):
        for B in (2, 4, 8):
            got = []
            for s in spec_steps(target, drafter, prompt, block_size=B, max_tokens=N, on_exit=kept.store):
                got += s.tokens
                assert all(c.keys is None or c.keys.shape[2] <= 8 for c in made[-1]), (B, len(got))
            assert got == refs[tuple(prompt)], (B, prompt[:3])
            assert all(c.limit == 8 and c.offset == len(prompt) + N - 1 for c in made[-1])
    dec = BatchDecoder(target, drafter, block_size=4, max_batch=2)
    assert dec.packed_drafter
    out = {0: [], 1: []}
    for i, st in batched_steps(dec, [dict(prompt=p, max_tokens=N) for p in (SHORT, LONG)]):
        out[i] += st.tokens
        assert all(c.keys is None or c.keys.shape[2] <= 8 for m in made[-2:] for c in m)
    assert [out[0], out[1]] == [refs[tuple(SHORT)], refs[tuple(LONG)]]
    # a prefix cached with the window serves the next turn (its last 8 rows are all it needs)
    turn2 = LONG + refs[tuple(LONG)] + [2, 11]
    fresh = _tokens(spec_steps(target, drafter, turn2, block_size=4, max_tokens=8))
    pre = kept.lookup(turn2, drafter=True)
    assert pre is not None and all(c.limit == 8 for c in pre.drafter)
    assert _tokens(spec_steps(target, drafter, turn2, block_size=4, max_tokens=8, prefill=pre)) == fresh
    # a prompt that departs from the cached one 5 tokens before its end still reuses its prefix:
    # the window holds what it kept of the rows before the departure (3 of 8), the output is exact
    edited = LONG + refs[tuple(LONG)][:-6] + [2, 11]
    pre = kept.lookup(edited, drafter=True)
    assert pre is not None and len(pre.tokens) == len(LONG) + N - 6
    assert all(c.offset == len(pre.tokens) and c.keys.shape[2] == 3 for c in pre.drafter)
    fresh = _tokens(spec_steps(target, drafter, edited, block_size=4, max_tokens=8))
    assert _tokens(spec_steps(target, drafter, edited, block_size=4, max_tokens=8, prefill=pre)) == fresh


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_cycle_without_a_pick_waits_once(sampled):
    """No pick to make (a fixed block, no policy; or a sampled cycle): the verify is built on the
    lazy drafts, and the drafts are read with the target's choices in one wait per cycle, booked
    as one time (``draft_in_verify``: ``verify_ms`` times both passes, ``draft_ms`` is 0). The
    output is still the target's."""
    from mlx_spec.sampling import SamplingConfig

    model, cfg = tiny_model("qwen3")
    target, drafter, _ = tiny_drafter(model, cfg)
    sampling = SamplingConfig(1.0, seed=3) if sampled else SamplingConfig()
    waits = _CountingWaits()
    steps = list(spec_steps(target, drafter, SHORT, block_size=4, max_tokens=12, sampling=sampling, waits=waits))
    cycles = [s for s in steps[1:] if s.draft_block]
    assert cycles and sum(s.host_syncs for s in steps) == waits.count == len(waits.calls)
    assert {s.host_syncs for s in cycles} == {1}, [s.host_syncs for s in cycles]
    assert all(s.draft_in_verify and s.draft_ms == 0 and s.verify_ms > 0 for s in cycles)
    if not sampled:
        assert _tokens(steps) == greedy_reference(model, SHORT, 12)
    else:  # the same seed, the same text (the drafts read later change no key)
        again = list(spec_steps(target, drafter, SHORT, block_size=4, max_tokens=12, sampling=sampling))
        assert _tokens(again) == _tokens(steps)


def test_a_hybrid_targets_rollback_waits_through_the_counted_waits():
    """A hybrid (GDN) target's rollback rebuilds its state and waits for it: that wait goes
    through ``DeviceWaits`` too, one more on every cycle that rolled back."""
    from test_hybrid import build

    model, cfg = build("qwen3_next")
    target, drafter, _ = tiny_drafter(model, cfg)
    waits = _CountingWaits()
    steps = list(spec_steps(target, drafter, SHORT, block_size=4, max_tokens=12, waits=waits))
    cycles = [s for s in steps[1:] if s.draft_block]
    rolled = [s for s in cycles if s.accepted < s.drafted]
    assert rolled and sum(s.host_syncs for s in steps) == waits.count == len(waits.calls)
    # the rollbacks' waits counted (and the prefill's caches, evaluated once)
    assert waits.calls.count("eval") == len(rolled) + 1 and steps[0].host_syncs == 2
    assert all(s.host_syncs == 2 for s in rolled) and all(s.host_syncs == 1 for s in cycles if s not in rolled)
    assert _tokens(steps) == greedy_reference(model, SHORT, 12)
