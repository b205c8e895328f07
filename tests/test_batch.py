"""Continuous batching with batched speculation (mlx_spec/batch.py).

Every request's greedy output under batching equals its output alone, token for token (dense,
hybrid GDN and MoE tiny targets; mixed prompt lengths; joins and cancels mid-batch; DFlash 1 and
2; drafts accepted raggedly). T > 0 keeps the target's distribution. Stats never mix.
"""

from mlx_spec.batch import Acceptance, BatchBudget, BatchDecoder, StepCost, batched_steps
from mlx_spec.decode import spec_steps
from mlx_spec.drafter import ContextCache, DrafterArgs, Proposal
from mlx_spec.errors import MlxSpecError
from mlx_spec.policy import PLAIN, Decision
from mlx_spec.prefix import PrefixCache
from mlx_spec.sampling import SamplingConfig, target_probs
from mlx_spec.stats import Stats
from mlx_spec.target import Target

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, greedy_reference, tiny_drafter, tiny_model
from test_hybrid import build
from test_sampling import gof_pvalue

PROMPTS = [
    [1, 5, 9, 17, 33, 2, 8, 40, 77],
    [3, 4, 5],
    list(range(10, 60)),
    [7] * 20,
    [100, 3, 2, 9, 11],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82],
]
N = 24


class AlwaysDraft(BatchBudget):
    """Every sequence drafts the block it wishes (so tests exercise ragged rollback)."""

    def plan(self, wants, accs, plain_runs, probes, extra_rows=0, passes=None):
        return list(wants)


class Scripted:
    """A drafter that knows each sequence's greedy continuation (one per ``make_cache`` call, in
    order) and is right for ``right`` positions per block (None: always right), then wrong."""

    def __init__(self, fulls, rights):
        self.fulls, self.rights = list(fulls), list(rights)
        self.args = DrafterArgs(
            hidden_size=1,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            intermediate_size=1,
            vocab_size=VOCAB,
            num_target_layers=1,
            target_layer_ids=[0],
            mask_token_id=0,
        )

    def make_cache(self):
        c = ContextCache()
        c.full, c.right = self.fulls.pop(0), self.rights.pop(0)
        return [c]

    def add_context(self, features, cache):
        cache[0].offset += features.shape[1]

    def propose(self, anchor, features, cache, block_size, sampling=0.0, key=None, confidence=False):
        # (no confidence even when asked: the policy then verifies the block as drafted)
        c = cache[0]
        if features is not None:
            c.offset += features.shape[1]
        out = []
        for k in range(1, block_size):
            tok = c.full[c.offset + k] if c.offset + k < len(c.full) else 0
            if c.right is not None and k > c.right:
                tok = (tok + 1) % VOCAB
            out.append(tok)
        return Proposal(mx.array(out, mx.int32), None)


def _tokens(steps):
    return [t for s in steps for t in s.tokens]


def _run_batch(dec, jobs, **kw):
    got = {i: [] for i in range(len(jobs))}
    steps = {i: [] for i in range(len(jobs))}
    for j, st in batched_steps(dec, jobs, **kw):
        got[j].extend(st.tokens)
        steps[j].append(st)
    return got, steps


@pytest.fixture(scope="module")
def dense():
    model, cfg = tiny_model("qwen3")
    return model, cfg


@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
@pytest.mark.parametrize("policy", [AlwaysDraft, BatchBudget], ids=["always", "policy"])
def test_batched_equals_alone_dense(dense, v2, policy):
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg, v2=v2)
    alone = [_tokens(spec_steps(target, d, p, block_size=4, max_tokens=N)) for p in PROMPTS]
    dec = BatchDecoder(target, d, block_size=4, max_batch=8, prefill_chunk=16, policy=policy())
    # the packed paths are what is under test here, not the per-sequence fallbacks
    assert dec.packed_drafter and dec.packed.packed
    assert dec.kv is not None and dec.packed.slotted == dec.packed.packed  # attention batched
    got, steps = _run_batch(dec, [dict(prompt=p, max_tokens=N) for p in PROMPTS], joins={3: 2, 4: 5, 5: 9})
    for i, p in enumerate(PROMPTS):  # noqa: B007
        assert got[i] == alone[i], f"prompt {i}"
    assert max(dec.batch_sizes) >= 4
    if policy is AlwaysDraft:
        assert dec.steps["drafted"] > 0
        # fixed blocks, nothing to pick: the drafts are read with the target's choices, one wait
        # per step (a step carrying a prefill chunk waits for that chunk's caches too)
        drafted = [s for ss in steps.values() for s in ss if s.draft_block]
        assert all(s.draft_in_verify and s.draft_ms == 0 for s in drafted)
        assert sum(s.host_syncs == 1 for s in drafted) > len(drafted) / 2, [s.host_syncs for s in drafted]


ARCHS = ("qwen3_5", "qwen3_next", "qwen3_moe", "qwen3_5_moe")


@pytest.mark.parametrize("kind", ARCHS)
def test_ragged_acceptance_is_exact(kind):
    """Scripted drafts accepted for 0, 1, 2 or all positions per sequence: each sequence's cache
    rolls back on its own (GDN state rebuilt, K/V trimmed) and its output is plain greedy."""
    model, _ = build(kind)
    target = Target(model, [0])
    prompts = PROMPTS[:5]
    refs = [greedy_reference(model, p, N) for p in prompts]
    fulls = [list(p) + r for p, r in zip(prompts, refs)]
    rights = [None, 0, 1, 2, None]
    dec = BatchDecoder(
        target, Scripted(fulls, rights), block_size=5, max_batch=8, prefill_chunk=8, policy=AlwaysDraft()
    )
    # (joins in index order: the scripted drafter hands out continuations in order of admission)
    got, steps = _run_batch(dec, [dict(prompt=p, max_tokens=N) for p in prompts], joins={3: 1, 4: 3})
    for i in range(len(prompts)):
        assert got[i] == refs[i], f"prompt {i}"
    assert (dec.kv is not None) == (not target.gdn)  # attention batched over BatchKV rows (MoE)
    acc = {i: sum(s.accepted for s in steps[i]) / max(1, len(steps[i]) - 1) for i in steps}
    assert acc[0] > acc[3] > acc[2] > acc[1] == 0  # ragged acceptance really happened


@pytest.mark.parametrize(
    "split_at,kind",
    [(None, "dense"), (0.0, "dense"), (float("inf"), "dense"), (None, "qwen3_moe")],
    ids=["default", "split", "padded", "moe"],
)
def test_few_drafting_among_plain_rows_attend_split_exactly(dense, split_at, kind):
    """A few sequences drafting (blocks 5, 3, 2) among plain ones: their attention runs split
    (every row's first query in one call, each drafting row's others against its own keys) or
    padded to the longest block; either way each output is plain greedy, drafts accepted
    raggedly."""
    from mlx_spec.batch import RowsPlan

    model = dense[0] if kind == "dense" else build(kind)[0]
    target = Target(model, [0])
    prompts = PROMPTS[:6]
    refs = [greedy_reference(model, p, N) for p in prompts]
    fulls = [list(p) + r for p, r in zip(prompts, refs)]
    blocks = [5, 1, 3, 1, 1, 2]
    dec = BatchDecoder(
        target, Scripted(fulls, [None, None, 1, None, None, 0]), max_batch=8, prefill_chunk=64, policy=AlwaysDraft()
    )
    if split_at is not None:
        dec.kv.split_at = split_at
    plans = []
    plan = dec.kv.plan
    dec.kv.plan = lambda b: plans.append(plan(b)) or plans[-1]
    jobs = [dict(prompt=p, max_tokens=N, block_size=L) for p, L in zip(prompts, blocks)]
    got, steps = _run_batch(dec, jobs)
    for i in range(len(prompts)):
        assert got[i] == refs[i], f"prompt {i}"
    split = [p for p in plans if isinstance(p, RowsPlan) and p.split]
    assert bool(split) == (split_at != float("inf"))
    if split_at is None:  # 6 rows x 5 padded queries against 13 real ones: split
        assert split and all(p.n * p.L >= dec.kv.split_at * p.R for p in split)
    assert sum(s.accepted for s in steps[0]) > sum(s.accepted for s in steps[2]) > 0


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_moe"])
def test_batched_dflash_equals_alone(kind):
    model, cfg = build(kind)
    target, d, _ = tiny_drafter(model, cfg)
    prompts = PROMPTS[:4]
    alone = [_tokens(spec_steps(target, d, p, block_size=4, max_tokens=16)) for p in prompts]
    dec = BatchDecoder(target, d, block_size=4, max_batch=4, prefill_chunk=8, policy=AlwaysDraft())
    got, _ = _run_batch(dec, [dict(prompt=p, max_tokens=16) for p in prompts], joins={3: 2})
    assert [got[i] for i in range(len(prompts))] == alone


def test_plain_batch_equals_greedy(dense):
    model, _ = dense
    dec = BatchDecoder(Target(model), None, max_batch=8, prefill_chunk=8)
    got, steps = _run_batch(dec, [dict(prompt=p, max_tokens=N) for p in PROMPTS], joins={1: 3})
    for i, p in enumerate(PROMPTS):
        assert got[i] == greedy_reference(model, p, N)
        assert all(s.drafted == 0 for s in steps[i])


def test_rows_leave_and_join_mid_batch(dense):
    """Sequences of different lengths leave the batch's K/V (their slots handed to the last
    row) while others join: every output is still plain greedy, and the buffers go at the end."""
    model, _ = dense
    dec = BatchDecoder(Target(model), None, max_batch=4, prefill_chunk=8)
    lengths = [5, 20, 3, 12, 9, 16]
    got, _ = _run_batch(dec, [dict(prompt=p, max_tokens=n) for p, n in zip(PROMPTS, lengths)], joins={4: 4, 5: 7})
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        assert got[i] == greedy_reference(model, p, n), f"prompt {i}"
    assert dec.kv is not None and len(dec.kv) == 0 and dec.kv.nbytes == 0


def _joined_kv(lengths):
    """A one-layer ``BatchKV`` with a row per length joined (keys k, values k + 1): (kv, the rows'
    parked caches, their keys)."""
    from mlx_spec.batch import BatchKV

    from mlx_lm.models.cache import KVCache

    kv, caches, want = BatchKV([0]), [], []
    for n in lengths:
        c = KVCache()
        k = mx.random.normal((1, 2, n, 4), key=mx.random.key(n))
        c.update_and_fetch(k, k + 1)
        want.append(k)
        caches.append([c])
        kv.join(caches[-1])
    return kv, caches, want


def test_batch_kv_rows_hand_back_exactly_their_positions():
    """A row that leaves gets back exactly its positions; the last row moves into its slot intact."""
    kv, caches, want = _joined_kv((3, 7, 5))
    rows = list(kv.rows)
    assert [r.offset for r in rows] == [3, 7, 5] and all(c[0].keys is None for c in caches)  # parked
    kv.leave(rows[0], caches[0])
    c = caches[0][0]
    assert c.offset == 3 and mx.array_equal(c.keys, want[0]) and mx.array_equal(c.values, want[0] + 1)
    assert rows[2].slot == 0 and kv.rows == [rows[2], rows[1]]
    assert mx.array_equal(kv.keys[0][0:1, :, :5], want[2]) and mx.array_equal(kv.keys[0][1:2, :, :7], want[1])
    kv.leave(rows[1], None)
    kv.leave(rows[2], None)
    assert len(kv) == 0 and kv.nbytes == 0


def test_rows_joining_or_leaving_together_copy_the_buffers_once():
    """A step's joiners make room for all of them at once (the first join reserves their slots,
    the others copy nothing), and rows that leave in one step move into the holes in one scatter,
    each row left with exactly its K/V and each leaver's caches given back theirs."""
    from mlx_spec.batch import BatchKV

    from mlx_lm.models.cache import KVCache

    kv, caches, want = BatchKV([0]), [], []
    for j, n in enumerate((3, 7, 5, 6, 4)):
        c = KVCache()
        k = mx.random.normal((1, 2, n, 4), key=mx.random.key(n))
        c.update_and_fetch(k, k + 1)
        want.append(k)
        caches.append([c])
        kv.join(caches[-1], more=4 - j)
        if j == 0:
            first = kv.keys[0]
            assert kv.slots == 5
    assert kv.keys[0] is first  # the later joins wrote into the reserved slots
    rows = list(kv.rows)
    kv.leave_many([(rows[0], caches[0]), (rows[2], None), (rows[4], caches[4])])
    for i in (0, 4):
        assert mx.array_equal(caches[i][0].keys, want[i]) and mx.array_equal(caches[i][0].values, want[i] + 1)
    assert [r.slot for r in kv.rows] == [0, 1] and all(rows[i].slot == -1 for i in (0, 2, 4))
    for r in kv.rows:
        i = rows.index(r)
        assert mx.array_equal(kv.keys[0][r.slot : r.slot + 1, :, : r.offset], want[i])
        assert mx.array_equal(kv.values[0][r.slot : r.slot + 1, :, : r.offset], want[i] + 1)


def test_a_batched_attention_mismatch_is_reported(dense, monkeypatch, caplog):
    """The self-check's fallback is never silent: a batched attention that differs from the
    module (forced here) runs attention per sequence, and the decoder says so and why (logged,
    ``attention``); the output stays plain greedy."""
    import mlx_spec.batch as batch

    model, _ = dense
    real = batch.RowsPlan.attend
    monkeypatch.setattr(batch.RowsPlan, "attend", lambda self, *a: real(self, *a) * 1.5)
    with caplog.at_level("INFO", logger="mlx_spec.batch"):
        dec = BatchDecoder(Target(model), None, max_batch=4, prefill_chunk=8)
    assert dec.kv is None and not dec.packed.slotted
    assert dec.attention.startswith("per sequence (differs from the module by up to")
    assert "float32" in dec.attention and dec.attention in caplog.text
    got, _ = _run_batch(dec, [dict(prompt=p, max_tokens=8) for p in PROMPTS[:3]])
    for i, p in enumerate(PROMPTS[:3]):
        assert got[i] == greedy_reference(model, p, 8)


def test_batched_attention_checks_out_in_bfloat16():
    """The self-check's tolerance follows the dtype: a bf16 model (the usual case) keeps the
    batched attention rather than falling back on a rounding difference."""
    from mlx_spec.batch import PackedTarget

    model, _ = tiny_model("qwen3")
    model.set_dtype(mx.bfloat16)
    packed = PackedTarget(Target(model))
    assert packed.slotted and packed.attention == f"shared K/V over {len(packed.slotted)} layers"


class _StaysPlain:
    """A sequence's draft policy that always takes plain steps (so its plain runs pipeline; no
    draft source, so the batch never offers its steps to the drafter either)."""

    sources = ()
    max_lookup = 0

    def __init__(self):
        self.chosen = self.observed = 0

    def peek(self, ctx):
        return Decision(PLAIN, 1)

    def stays_plain(self, ctx):  # (what a sequence alone is asked, as the single stream asks it)
        return True

    def choose(self, ctx):
        self.chosen += 1
        return Decision(PLAIN, 1)

    def observe(self, step):
        self.observed += not step.prefill  # (the prefill is shown too; a policy ignores it)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "stepwise"])
def test_pipelined_plain_steps_are_exact_and_leave_consistent_caches(dense, pipeline):
    """Plain steps queued ahead of the step before them: outputs equal plain greedy through an EOS,
    a cancel, a late joiner and max_tokens; a sequence that leaves (EOS, cancel, end) hands on
    caches that hold exactly the ids they say (the row queued ahead included), target and
    drafter alike; each policy chooses and learns once per committed step."""
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    refs = [greedy_reference(model, p, N) for p in PROMPTS[:5]]
    eos = refs[2][6]  # sequence 2 ends at its 7th token (or earlier, where that token comes first)
    kept, pols = {}, [_StaysPlain() for _ in range(5)]
    jobs = [
        dict(
            prompt=p,
            max_tokens=N - 2 * i,
            policy=pols[i],
            eos_ids=(eos,) if i == 2 else (),
            on_exit=lambda pf, i=i: kept.__setitem__(i, pf),
        )
        for i, p in enumerate(PROMPTS[:5])
    ]
    dec = BatchDecoder(target, d, max_batch=5, prefill_chunk=64, pipeline=pipeline)
    got, steps = _run_batch(dec, jobs, joins={4: 6}, cancels={1: 9})
    for i in (0, 3, 4):
        assert got[i] == refs[i][: N - 2 * i], f"sequence {i}"
    end = refs[2].index(eos) + 1
    assert got[2] == refs[2][:end] and steps[2][-1].finish_reason == "stop"
    assert got[1] == refs[1][: len(got[1])] and len(got[1]) < N - 2
    for i in range(5):
        pf = kept[i]
        assert pf.target[0].offset == len(pf.tokens) == pf.drafter[0].offset, f"sequence {i}"
        assert list(pf.tokens) == (PROMPTS[i] + got[i])[: len(pf.tokens)]
        assert len(pf.tokens) >= len(PROMPTS[i]) + len(got[i]) - 1
        # their contents too: what a fresh forward over those ids builds, target and drafter
        fresh, dfresh = target.make_cache(), d.make_cache()
        d.add_context(target(mx.array(list(pf.tokens))[None], fresh).hidden, dfresh)
        for c, r in zip(pf.target + pf.drafter, fresh + dfresh):
            n = r.offset
            assert c.offset == n and np.allclose(np.array(c.keys[..., :n, :]), np.array(r.keys[..., :n, :]), atol=1e-4)
            assert np.allclose(np.array(c.values[..., :n, :]), np.array(r.values[..., :n, :]), atol=1e-4)
        decoded = sum(1 for st in steps[i] if not st.prefill)
        assert (
            pols[i].observed == decoded and decoded <= pols[i].chosen <= decoded + 1
        )  # (+1: a step queued at the end)
    assert (dec.pipelined > 10) == pipeline and all(sum(x.drafted for x in steps[i]) == 0 for i in steps)


class _Rooms(_StaysPlain):
    """Stays plain, and notes the room each ask (``peek`` and ``choose``) was given."""

    def __init__(self):
        super().__init__()
        self.peeked, self.rooms = [], []

    def peek(self, ctx):
        self.peeked.append(ctx.room)
        return super().peek(ctx)

    def choose(self, ctx):
        self.rooms.append(ctx.room)
        return super().choose(ctx)


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "stepwise"])
def test_a_step_is_asked_with_the_room_it_has(dense, pipeline):
    """A sequence's policy is asked about each step with the tokens it may still commit then:
    N-1 after the prefill's token, one less each step, 1 at its last (a step queued ahead is
    asked before the step in flight is counted: that token is not room any more). A step queued
    after a sequence's last one (it leaves with that row) is asked with room 0."""
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    pols = [_Rooms(), _Rooms()]
    dec = BatchDecoder(target, d, max_batch=2, prefill_chunk=64, pipeline=pipeline)
    got, _ = _run_batch(
        dec,
        [dict(prompt=PROMPTS[0], max_tokens=N, policy=pols[0]), dict(prompt=PROMPTS[1], max_tokens=2, policy=pols[1])],
    )
    assert [len(got[0]), len(got[1])] == [N, 2] and (dec.pipelined > N // 2) == pipeline
    for pol, n in zip(pols, (N, 2)):
        assert pol.rooms[: n - 1] == list(range(n - 1, 0, -1)) and pol.rooms[n - 1 :] in ([], [0])
        assert all(r in pol.rooms for r in pol.peeked) and min(pol.peeked, default=0) >= 0


def test_pipelined_sampled_plain_steps_draw_as_stepwise(dense):
    """At T > 0 a plain step queued ahead draws its token in the graph with the key an
    unpipelined step would use: seeded replies are the same either way (and pipelining ran)."""
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    outs = {}
    for pipeline in (True, False):
        dec = BatchDecoder(target, d, max_batch=4, prefill_chunk=64, pipeline=pipeline)
        jobs = [
            dict(prompt=p, max_tokens=N, policy=_StaysPlain(), sampling=SamplingConfig(1.0, seed=7 + i))
            for i, p in enumerate(PROMPTS[:3])
        ]
        outs[pipeline], _ = _run_batch(dec, jobs)
        assert (dec.pipelined > N // 2) == pipeline
    assert outs[True] == outs[False]
    assert len({tuple(v) for v in outs[True].values()}) == 3


def test_cancel_without_keep_drops_the_caches(dense):
    """After a failed step the engine cancels with keep=False: half-written caches never reach
    the prefix cache."""
    model, _ = dense
    kept = []
    dec = BatchDecoder(Target(model), None, max_batch=2, prefill_chunk=8)
    sid = dec.add(PROMPTS[0], max_tokens=8, on_exit=kept.append)
    dec.step()
    dec.step()
    dec.cancel(sid, keep=False)
    assert kept == [] and len(dec) == 0 and len(dec.kv) == 0


def test_cancel_leaves_the_others_alone(dense):
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    alone = [_tokens(spec_steps(target, d, p, block_size=4, max_tokens=N)) for p in PROMPTS[:4]]
    kept = {}
    jobs = [
        dict(prompt=p, max_tokens=N, on_exit=lambda pf, i=i: kept.__setitem__(i, pf)) for i, p in enumerate(PROMPTS[:4])
    ]
    dec = BatchDecoder(target, d, block_size=4, max_batch=4, prefill_chunk=8, policy=AlwaysDraft())
    got, _ = _run_batch(dec, jobs, cancels={1: 4, 2: 1})  # 2 is cancelled while prefilling
    assert got[0] == alone[0] and got[3] == alone[3]
    assert got[1] == alone[1][: len(got[1])] and len(got[1]) < N
    # the cancelled sequences' caches are consistent: they hold exactly the ids they say
    for i in (1, 2):
        pf = kept[i]
        assert pf.target[0].offset == len(pf.tokens) == pf.drafter[0].offset
        assert list(pf.tokens) == (PROMPTS[i] + got[i])[: len(pf.tokens)]


def test_prefix_cache_reuse_under_batching(dense):
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    pc = PrefixCache(1 << 24, min_tokens=4)
    first = list(range(10, 40))
    second = first + [5, 6, 7]
    dec = BatchDecoder(target, d, block_size=4, max_batch=4, prefill_chunk=8)
    _run_batch(dec, [dict(prompt=first, max_tokens=8, on_exit=pc.store)])
    alone = _tokens(spec_steps(target, d, second, block_size=4, max_tokens=N))
    pf = pc.lookup(second, drafter=True)
    assert pf is not None and len(pf.tokens) >= 30
    got, steps = _run_batch(dec, [dict(prompt=second, max_tokens=N, prefill=pf), dict(prompt=PROMPTS[0], max_tokens=N)])
    assert got[0] == alone
    assert steps[0][0].cached_tokens == len(pf.tokens)


def test_stats_never_mix(dense):
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    dec = BatchDecoder(target, d, block_size=4, max_batch=8, prefill_chunk=16, policy=AlwaysDraft())
    _, steps = _run_batch(dec, [dict(prompt=p, max_tokens=N - 3 * i) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        st = Stats()
        for s in steps[i]:
            st.add(s)
        assert st.tokens == N - 3 * i
        assert st.prompt_tokens == len(p)
        assert st.drafted == sum(s.drafted for s in steps[i])
        assert st.cycles == len(steps[i]) - 1
        assert steps[i][0].prefill and not any(s.prefill for s in steps[i][1:])


def test_eos_and_max_batch(dense):
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    ref = greedy_reference(model, PROMPTS[0], N)
    eos = ref[5]
    dec = BatchDecoder(target, d, block_size=4, max_batch=2)
    dec.add(PROMPTS[0], max_tokens=N, eos_ids=[eos])
    dec.add(PROMPTS[1], max_tokens=N)
    with pytest.raises(MlxSpecError, match="full"):
        dec.add(PROMPTS[2], max_tokens=N)
    out = {}
    while len(dec):
        for sid, st in dec.step():
            out.setdefault(sid, []).extend(st.tokens)
            if sid == 1 and st.finish_reason:
                assert st.finish_reason == "stop"
    assert out[1] == ref[: ref.index(eos) + 1]


def test_sampled_batch_matches_alone_with_a_seed(dense):
    """Each sequence draws from its own key stream, consumed as spec_steps consumes it."""
    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    samplings = [SamplingConfig(1.0, seed=s) for s in (1, 2, 3)]
    alone = [
        _tokens(spec_steps(target, d, PROMPTS[i], block_size=4, max_tokens=16, sampling=sp))
        for i, sp in enumerate(samplings)
    ]
    dec = BatchDecoder(target, d, block_size=4, max_batch=4, policy=AlwaysDraft())
    got, _ = _run_batch(dec, [dict(prompt=PROMPTS[i], max_tokens=16, sampling=sp) for i, sp in enumerate(samplings)])
    assert [got[i] for i in range(3)] == alone


def test_sampled_batch_keeps_the_target_distribution():
    """Many sequences in one batch, each sampling two tokens at T = 1 through drafted blocks:
    the joint law of (y1, y2) is the target's p(y1) p(y2 | y1)."""
    V = 16
    import importlib

    from helpers import TARGET_CONFIGS

    tcfg = dict(TARGET_CONFIGS["qwen3"], vocab_size=V)
    mod = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(tcfg))
    mx.eval(model.parameters())
    prompt = [1, 5, 9]
    cfg = SamplingConfig(1.0)
    p0 = np.array(target_probs(model(mx.array([prompt]))[0, -1], cfg))
    p1 = np.array(target_probs(model(mx.array([prompt + [a] for a in range(V)]))[:, -1], cfg))
    exact = (p0[:, None] * p1).reshape(-1)
    target, d, _ = tiny_drafter(model, tcfg, seed=5)
    n = 600
    dec = BatchDecoder(target, d, block_size=3, max_batch=n, policy=AlwaysDraft())
    jobs = [dict(prompt=prompt, max_tokens=3, sampling=SamplingConfig(1.0, seed=1000 + i)) for i in range(n)]
    got, steps = _run_batch(dec, jobs)
    counts = np.bincount([got[i][0] * V + got[i][1] for i in range(n)], minlength=V * V)
    assert sum(s.drafted for i in steps for s in steps[i]) > 0
    assert (counts[exact == 0] == 0).all()
    assert gof_pvalue(counts, exact) > 0.001


def test_policy_stops_drafting_when_it_does_not_pay():
    pol = BatchBudget()
    for _ in range(40):  # measured: rows are expensive, a drafting sequence too
        for rows, drafting in ((8, 0), (16, 2), (30, 5), (40, 8)):
            pol.observe(rows, drafting, 20 + 5 * rows + 10 * drafting, 10 * drafting)
    good, bad = Acceptance(7, [0.9] * 7), Acceptance(7, [0.05] * 7)
    L = pol.choose([8] * 8, [good, good] + [bad] * 6, [0] * 8, [8] * 8)
    assert L[2:] == [1] * 6  # poor acceptance: plain rows
    cheap = BatchBudget()
    for _ in range(40):  # rows nearly free (memory-bound): everyone with fair acceptance drafts
        for rows, drafting in ((8, 0), (16, 2), (30, 5), (40, 8)):
            cheap.observe(rows, drafting, 100 + 0.1 * rows + 1 * drafting, 1 * drafting)
    fair = Acceptance(7, [0.6] * 7)
    assert all(x > 1 for x in cheap.choose([8] * 8, [fair] * 8, [0] * 8, [8] * 8))
    # a sequence kept plain long enough is probed where a typical draft (the prior's acceptance)
    # would pay: with nearly free rows, yes; where rows cost more than the prior returns, no
    assert cheap.choose([8] * 8, [bad] * 8, [9] + [0] * 7, [8] * 8)[0] > 1
    assert pol.choose([8] * 8, [bad] * 8, [9] + [0] * 7, [8] * 8) == [1] * 8
    # a batch of one follows its own controller
    assert pol.choose([5], [bad], [0], [8]) == [5]


def test_a_policy_curve_is_judged_at_its_expected_tokens():
    """The batch judges a sequence's wished draft by its own policy's curve (P(the first k+1
    drafts accepted), DFlash by position or the copy model at a match) as an ``Acceptance`` with
    that curve for its prior: its expected tokens are the curve's, at every length."""
    import random

    from mlx_spec import policy as adaptive

    rng = random.Random(0)
    curves = []
    for _ in range(50):
        a = adaptive.Acceptance(rng.randint(1, 15), [rng.random() for _ in range(rng.randint(0, 15))])
        cp = adaptive.Copy()
        for _ in range(rng.randint(0, 20)):
            n = rng.randint(0, len(a.hits))
            a.update(n, rng.randint(0, n))
            m = rng.randint(0, 10)
            cp.update(rng.randint(0, 40), m, rng.randint(0, m))
        curves += [a.curve(), cp.curve(rng.randint(0, 40), rng.randint(1, 31))]
    for c in curves:
        acc = Acceptance(len(c), c)
        assert all(
            acc.expected(L) == pytest.approx(adaptive.expected_tokens(c, L), rel=1e-12) for L in range(1, len(c) + 3)
        )


def test_a_wished_draft_is_judged_by_its_sequences_own_curve():
    """``BatchDecoder._acceptance``: a DFlash wish by the sequence's drafter curve, a lookup wish
    by its copy model at this match and length; a plain wish, or a sequence without a policy,
    by the batch's own count."""
    from types import SimpleNamespace as NS

    from mlx_spec import policy as adaptive

    asked = []
    pol = NS(
        dflash=NS(curve=lambda: [0.9, 0.6, 0.3]), copy=NS(curve=lambda match, n: asked.append((match, n)) or [0.8] * n)
    )
    s = NS(policy=pol, ctx=NS(match=5), acc="counted")
    dflash = BatchDecoder._acceptance(s, Decision(adaptive.DFLASH, 4))
    lookup = BatchDecoder._acceptance(s, Decision(adaptive.LOOKUP, 6))
    assert dflash.expected(4) == pytest.approx(adaptive.expected_tokens([0.9, 0.6, 0.3], 4))
    assert lookup.expected(6) == pytest.approx(adaptive.expected_tokens([0.8] * 5, 6)) and asked == [(5, 5)]
    assert BatchDecoder._acceptance(s, Decision(PLAIN, 1)) == "counted"
    assert BatchDecoder._acceptance(NS(policy=None, acc="counted"), Decision(adaptive.DFLASH, 4)) == "counted"


def _fitted(a, b, c, e, steps=60):
    """A BatchBudget fitted to steps that cost ``a + b*rows + c*drafting + e*[a pass]`` ms."""
    pol = BatchBudget()
    for k in range(steps):
        n = 1 + k % 8
        d = k % (n + 1)
        rows = n + 3 * d
        pol.observe(rows, d, a + b * rows + c * d + (e if d else 0), c * d + (e if d else 0))
    return pol


def test_policy_stops_drafting_at_a_large_batch_and_resumes_when_acceptance_is_high():
    """Measured on a CPU: a plain step of 8 rows ~120 ms, each further row ~6 ms, a drafting
    sequence ~4 ms more and the drafter pass ~12 ms. At 2 sequences fair acceptance (0.5 per
    position) pays, at 8 it does not (plain batched steps, probes included); when acceptance
    runs high, drafting pays again at 8, for the sequences whose acceptance is high."""
    pol = _fitted(72.0, 6.0, 4.0, 12.0)
    a, b = pol.costs.base, pol.costs.row
    assert abs(a - 72) < 3 and abs(b - 6) < 0.5  # the fit finds the scripted costs
    fair = [Acceptance(3, [0.5, 0.25, 0.125], weight=50) for _ in range(8)]
    assert all(x > 1 for x in pol.choose([4] * 2, fair[:2], [0] * 2, [8] * 2))
    assert pol.choose([4] * 8, fair, [0] * 8, [8] * 8) == [1] * 8
    assert pol.choose([4] * 8, fair, [20] * 8, [8] * 8) == [1] * 8  # due probes too: rows cost more
    for acc in fair[:3]:  # three sequences' drafts start to be accepted all through
        for _ in range(30):
            acc.observe(3, 3)
    L = pol.choose([4] * 8, fair, [0] * 8, [8] * 8)
    assert all(x > 1 for x in L[:3]) and L[3:] == [1] * 5
    # drafting step after drafting step: one plain step now and then, so the fit sees its cost
    runs = [pol.choose([4] * 8, fair, [0] * 8, [8] * 8) for _ in range(2 * pol.explore_every)]
    assert 1 <= sum(L == [1] * 8 for L in runs) <= 2


def test_prefill_rows_do_not_bend_the_decoding_rows_cost():
    """Steps carrying a joiner's prompt (hundreds of rows, each cheaper than a decoding row) have
    their own slope: the decoding rows' cost, and so the plain step's, stays what it is."""
    pol = _fitted(72.0, 6.0, 4.0, 12.0, steps=48)
    for _ in range(6):
        pol.observe(8, 0, 72 + 6 * 8 + 2.0 * 500, 0.0, 500)
    a, b = pol.costs.base, pol.costs.row
    assert abs(a - 72) < 5 and abs(b - 6) < 0.5
    assert abs(pol.costs(8, 0) - 120) < 5 and abs(pol.costs(8, 0, 500) - 1120) < 60


def test_a_step_timed_in_one_wait_has_the_drafter_pass_taken_out():
    """A drafting step that read its drafts with the verify's choices has no drafter time of its
    own (``draft_ms`` None): the last fit's drafter pass is taken out of it, so the rest of the
    step keeps its cost (not the drafter's booked to the rows and the drafting sequences)."""
    pol = _fitted(72.0, 6.0, 4.0, 12.0, steps=48)
    timed = pol.costs
    for k in range(48):
        n = 1 + k % 8
        d = 1 + k % n
        rows = n + 3 * d
        pol.observe(rows, d, 72 + 6 * rows + 4 * d + 12, None)
    c = pol.costs
    assert abs(c.base - 72) < 5 and abs(c.row - 6) < 0.5 and c.seq < 1.0
    assert abs(c.drafter_pass - timed.drafter_pass) < 1 and abs(c(14, 2) - timed(14, 2)) < 3


def test_step_costs_are_refitted_only_when_read():
    """A long run of plain steps (no sequence asks to draft, nothing reads the costs) pays for no
    fit; the first read after new steps refits once, and sees all of them."""
    fits = []

    class Counting(BatchBudget):
        def _fit(self):
            fits.append(len(self.obs))
            return super()._fit()

    pol = Counting()
    for _ in range(40):
        pol.observe(8, 0, 120.0)
    assert fits == []
    assert pol.choose([1] * 8, [Acceptance(3)] * 8, [0] * 8, [8] * 8) == [1] * 8  # nobody wishes a draft
    assert fits == []
    c = pol.costs
    assert fits == [40] and pol.costs is c  # one fit, cached until the next step
    pol.observe(9, 0, 126.0)
    assert abs(pol.costs(9, 0) - 126) < 5 and fits == [40, 41]


class _FixedCost(BatchBudget):
    """A BatchBudget whose step costs are given, not measured (the tiny model's are noise)."""

    def __init__(self, theta):
        super().__init__()
        a, b, c, e = theta
        self._costs, self.seen = StepCost(a, b, 0.04, 0.0, c, e), []

    def observe(self, *measured):
        pass

    def choose(self, wants, *a, **kw):
        L = super().choose(wants, *a, **kw)
        self.seen.append((len(wants), L))
        return L


def test_decoder_steps_plain_at_a_large_batch_and_drafts_again_when_it_shrinks(dense):
    """Eight sequences where rows cost more than a typical draft returns: plain batched steps
    (no probes either); once six have left, the two left draft again (drafts right: accepted),
    and every output is still plain greedy."""
    model, _ = dense
    target = Target(model, [0])
    prompts = PROMPTS + [[5, 6, 7, 8], [90, 80, 70, 60, 50]]
    lengths = [N, N] + [6] * 6
    refs = [greedy_reference(model, p, n) for p, n in zip(prompts, lengths)]
    fulls = [list(p) + r for p, r in zip(prompts, refs)]
    pol = _FixedCost((72.0, 6.0, 4.0, 12.0))
    dec = BatchDecoder(target, Scripted(fulls, [None] * 8), block_size=4, max_batch=8, prefill_chunk=256, policy=pol)
    got, steps = _run_batch(dec, [dict(prompt=p, max_tokens=n) for p, n in zip(prompts, lengths)])
    for i in range(len(prompts)):
        assert got[i] == refs[i], f"prompt {i}"
    at8 = [L for n, L in pol.seen if n == 8]
    at2 = [L for n, L in pol.seen if n == 2]
    assert at8 and all(L == [1] * 8 for L in at8)
    assert at2 and sum(max(L) > 1 for L in at2) >= len(at2) // 2
    assert sum(s.accepted for s in steps[0]) > 0


def test_plain_steps_the_batch_decides_are_pipelined_too(dense):
    """Sequences whose own policies wish to draft, in a batch whose rows cost more than drafts
    return: the batch steps plain, and those steps are queued ahead (asked one step early, nothing
    counted twice); outputs stay plain greedy."""
    from mlx_spec.costs import Costs
    from mlx_spec.policy import DraftPolicy

    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    costs = Costs(10.0, {B: 0.5 for B in (2, 4, 8)}, {B: 10.0 + 0.1 * B for B in (1, 2, 4, 8)}, 64)
    prompts = PROMPTS + [[5, 6, 7, 8], [90, 80, 70, 60, 50]]
    pol = _FixedCost((72.0, 6.0, 4.0, 12.0))
    dec = BatchDecoder(target, d, block_size=4, max_batch=8, prefill_chunk=256, policy=pol)
    pols = [DraftPolicy(costs, 8, sources=("dflash",)) for _ in prompts]
    got, steps = _run_batch(dec, [dict(prompt=p, max_tokens=N, policy=q) for p, q in zip(prompts, pols)])
    for i, p in enumerate(prompts):
        assert got[i] == greedy_reference(model, p, N), f"prompt {i}"
    assert all(L == [1] * 8 for n, L in pol.seen if n == 8)
    assert dec.pipelined >= N // 2 and dec.steps["drafted"] == 0


def test_the_batch_drafts_where_a_sequence_alone_would_not(dense):
    """Two sequences whose own policies stay plain (at their single-stream pass costs no draft
    pays, even one always accepted), in a batch where extra rows are cheap next to its plain
    step: the batch offers their steps to the drafter, judges them at its running acceptance,
    and drafts (the drafter is right: accepted); alone, the same sequence never drafts.
    Outputs stay plain greedy."""
    from mlx_spec.costs import Costs
    from mlx_spec.policy import DraftPolicy

    model, _ = dense
    target = Target(model, [0])
    prompts = PROMPTS[:2]
    refs = [greedy_reference(model, p, N) for p in prompts]
    fulls = [list(p) + r for p, r in zip(prompts, refs)]
    dear = Costs(10.0, {B: 5.0 for B in (2, 4, 8)}, {B: 10.0 + 10.0 * B for B in (1, 2, 4, 8)}, 64)
    make = lambda: DraftPolicy(dear, 4, sources=("dflash",))  # noqa: E731
    dec = BatchDecoder(
        target,
        Scripted(fulls, [None] * 2),
        block_size=4,
        max_batch=2,
        prefill_chunk=256,
        policy=_FixedCost((72.0, 6.0, 4.0, 12.0)),
    )
    got, steps = _run_batch(dec, [dict(prompt=p, max_tokens=N, policy=make()) for p in prompts])
    assert [got[0], got[1]] == refs
    assert dec.steps["drafted"] > 0 and sum(st.accepted for st in steps[0]) > N // 3
    alone = BatchDecoder(
        target,
        Scripted(fulls[:1], [None]),
        block_size=4,
        max_batch=1,
        prefill_chunk=256,
        policy=_FixedCost((72.0, 6.0, 4.0, 12.0)),
    )
    got1, steps1 = _run_batch(alone, [dict(prompt=prompts[0], max_tokens=N, policy=make())])
    assert got1[0] == refs[0] and sum(st.drafted for st in steps1[0] if not st.prefill) <= 3  # probes at most


@pytest.mark.parametrize("sources", [("dflash", "lookup"), ("lookup",)], ids=["default", "lookup"])
def test_per_sequence_draft_policies_with_lookup(dense, sources):
    """Each sequence brings its own DraftPolicy (DFlash and/or lookup drafts): still plain greedy."""
    from mlx_spec.costs import Costs
    from mlx_spec.policy import DraftPolicy

    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg)
    costs = Costs(10.0, {B: 2.0 for B in (2, 4, 8)}, {B: 10.0 + 0.1 * B for B in (1, 2, 4, 8)}, 64)
    prompts = [[1, 2, 3, 4, 5, 6] * 4, PROMPTS[0], [9, 8, 7] * 6, PROMPTS[2]]
    dec = BatchDecoder(
        target, d if "dflash" in sources else None, block_size=4, max_batch=4, prefill_chunk=8, policy=AlwaysDraft()
    )
    jobs = [dict(prompt=p, max_tokens=N, policy=DraftPolicy(costs, 8, sources=sources)) for p in prompts]
    got, steps = _run_batch(dec, jobs, joins={3: 2})
    for i, p in enumerate(prompts):
        assert got[i] == greedy_reference(model, p, N), f"prompt {i}"
    used = {s.source for i in steps for s in steps[i] if s.drafted}
    assert "lookup" in used


# ---------------------------------------------------------------------------------------------
# The engine: requests that arrive while others run join the batch.


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from mlx_spec.engine import Engine

    from helpers import tiny_engine_loader

    loader = tiny_engine_loader(tmp_path_factory.mktemp("pair"))
    with Engine(loader, max_batch=4, prefix_cache=1 << 22) as batched, Engine(loader) as single:
        batched.wait_ready(60)
        single.wait_ready(60)
        yield batched, single


REQUESTS = [
    "hello there",
    "write a poem about the sea and the sky",
    "abc",
    "count: 1 2 3 4 5 6",
    "the quick brown fox jumps over the lazy dog",
    "x",
]


def test_engine_batches_concurrent_requests_exactly(engines):
    from mlx_spec.engine import Done, Request

    batched, single = engines
    alone = [single.submit(Request(prompt=p, max_tokens=16 + i)).result() for i, p in enumerate(REQUESTS)]
    handles = [batched.submit(Request(prompt=p, max_tokens=16 + i)) for i, p in enumerate(REQUESTS)]
    dones = [h.result() for h in handles]  # 6 requests, 4 at a time: the rest wait in the queue
    for a, b in zip(alone, dones):
        assert isinstance(b, Done) and b.text == a.text and b.completion_tokens == a.completion_tokens
        assert b.stats.drafted == b.timings["draft_n"]
        assert b.prompt_tokens == a.prompt_tokens
    snap = batched.snapshot()
    assert max(snap["batch_sizes"]) >= 2 and snap["max_batch"] == 4
    assert 0 <= snap["batch_pipelined"] <= snap["batch_steps"]["plain"]
    # plain decoding (speculation off for these requests): its steps run pipelined, and say so
    before = snap["batch_pipelined"]
    plain = [batched.submit(Request(prompt=p, max_tokens=12, speculate=False)) for p in REQUESTS[:2]]
    for h, p in zip(plain, REQUESTS[:2]):
        assert h.result().text == single.submit(Request(prompt=p, max_tokens=12, speculate=False)).result().text
    assert batched.snapshot()["batch_pipelined"] > before
    assert snap["batch_attention"].startswith("shared K/V over") and single.snapshot()["batch_attention"] is None
    assert snap["batch_drafter"] == "one pass for all" and single.snapshot()["batch_drafter"] is None
    assert snap["tokens"] >= sum(d.completion_tokens for d in dones)


def test_engine_prefix_cache_under_batching(engines):
    """A request that repeats an earlier one's prompt reuses its K/V (the cache starts empty: an
    empty cache must still be looked up and stored), and its reply is the same."""
    from mlx_spec.engine import Request

    batched, _ = engines
    prompt = "a prompt long enough for the prefix cache: " + "lorem ipsum " * 4
    first = batched.submit(Request(prompt=prompt, max_tokens=8)).result()
    again = [batched.submit(Request(prompt=prompt, max_tokens=8)) for _ in range(2)]
    for h in again:
        d = h.result()
        assert d.text == first.text
        assert d.stats.cached_tokens >= d.prompt_tokens - 1 - 8 > 0
    assert batched.snapshot()["cached_tokens"] > 0


def test_engine_cancel_one_of_a_batch(engines):
    from mlx_spec.engine import Delta, Request

    batched, single = engines
    want = single.submit(Request(prompt=REQUESTS[1], max_tokens=24)).result()
    keep = batched.submit(Request(prompt=REQUESTS[1], max_tokens=24))
    drop = batched.submit(Request(prompt=REQUESTS[2], max_tokens=200))
    seen = []
    for ev in drop:
        seen.append(ev)
        if isinstance(ev, Delta):
            drop.cancel()
    assert seen[-1].finish_reason == "cancelled" and seen[-1].completion_tokens < 200
    got = keep.result()
    assert got.text == want.text
    assert batched.submit(Request(prompt="abc", max_tokens=3)).result().completion_tokens == 3


def test_engine_stop_strings_and_bad_requests_in_a_batch(engines):
    from mlx_spec.engine import Failed, Request

    batched, single = engines
    want = single.submit(Request(prompt=REQUESTS[4], max_tokens=20)).result()
    stop = want.text[5:7]
    a = batched.submit(Request(prompt=REQUESTS[4], max_tokens=20, stop=(stop,)))
    bad = batched.submit(Request(prompt="abc", max_tokens=0))
    b = batched.submit(Request(prompt=REQUESTS[0], max_tokens=12))
    got = a.result()
    assert got.finish_reason == "stop" and got.text == want.text[: want.text.find(stop)]
    assert isinstance(list(bad)[-1], Failed)
    assert b.result().completion_tokens == 12


def test_plan_refuses_a_sequence_that_would_not_fit_and_keeps_serving(tmp_path):
    """Admission by the plan's K/V per sequence: a request whose caches cannot fit is refused
    before it runs (PlanError); requests that fit wait for room and run; serving goes on."""
    from mlx_spec.engine import Engine, Failed, Request
    from mlx_spec.generation import engine_info
    from mlx_spec.loading import load_pair
    from mlx_spec.memory import Item, MemoryPlan, batch_room
    from mlx_spec.session import Session

    from helpers import save_tiny_pair

    kv = 1000  # bytes per position, planned for 512 positions
    plan = MemoryPlan(
        (Item("target weights", 10**6), Item("target KV cache", 512 * kv)),
        256,
        4,
        256,
        10**6 + 3 * 512 * kv,
        "test",
        256,
    )
    room = batch_room(plan)
    assert room.room == 3 * 512 * kv and room.need(30) == 256 * kv and room.max_batch(256) == 3
    t, d = save_tiny_pair(tmp_path)

    def loader():
        pair = load_pair(str(t), str(d))
        return Session.of(pair, engine_info(pair, 4, "flag"), plan=plan)

    with Engine(loader, max_batch=8) as e:
        e.wait_ready(60)
        assert e.max_batch == 8
        huge = list(e.submit(Request(prompt="abc", max_tokens=2000)))[-1]
        assert isinstance(huge, Failed) and huge.kind == "PlanError" and "memory plan" in huge.error
        # 8 small requests: at most 6 fit at once (256 positions each), the rest wait, all run
        hs = [e.submit(Request(prompt="abc", max_tokens=20)) for _ in range(8)]
        assert all(h.result().completion_tokens == 20 for h in hs)
        assert max(e.snapshot()["batch_sizes"]) <= 6


def test_batch_kv_shrinks_to_the_rows_left():
    """A long row leaves: the buffers shrink to the rows left and their longest offset (rounded
    up to a step), and the rows keep exactly their K/V."""
    kv, _, want = _joined_kv((600, 7, 5))
    assert kv.slots == 3 and kv.length == 768
    rows = list(kv.rows)
    kv.leave(rows[0], None)  # the long one: the last row moves into its slot, the buffers shrink
    assert kv.slots == 2 and kv.length == 256 and kv.nbytes == 2 * 2 * 2 * 256 * 4 * 4
    assert mx.array_equal(kv.keys[0][0:1, :, :5], want[2]) and mx.array_equal(kv.values[0][1:2, :, :7], want[1] + 1)
    kv.leave(rows[2], None)  # a short one: one slot less, the length stays (nothing to free)
    assert kv.slots == 1 and kv.length == 256 and mx.array_equal(kv.keys[0][0:1, :, :7], want[1])


def test_a_row_leaving_and_another_joining_copy_no_buffer():
    """Churn at a steady batch: the slot a row leaves is kept for the next one (no copy of every
    layer's K/V per leave and per join); the rows keep exactly their K/V."""
    kv, caches, want = _joined_kv((7, 5, 6))
    rows = list(kv.rows)
    before = kv.keys[0]
    kv.leave(rows[0], None)
    assert kv.slots == 3 and kv.keys[0] is before  # a spare slot, nothing copied
    assert mx.array_equal(kv.keys[0][0:1, :, :6], want[2]) and mx.array_equal(kv.keys[0][1:2, :, :5], want[1])
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    k = mx.random.normal((1, 2, 4, 4), key=mx.random.key(4))
    c.update_and_fetch(k, k + 1)
    joined = kv.join([c])  # into the spare slot
    assert kv.slots == 3 and kv.keys[0] is before and mx.array_equal(kv.keys[0][2:3, :, :4], k)
    kv.leave(rows[1], None)
    kv.leave(joined, None)  # one row in three slots: shrink
    assert kv.slots == 1 and mx.array_equal(kv.keys[0][0:1, :, :6], want[2])


def test_admission_after_a_long_request_leaves(tmp_path, monkeypatch):
    """Long leaves, short ones arrive (an explicit --max-batch above what the plan holds at the
    longest length): the shared K/V never holds more than the plan's room (rows x the buffers'
    real length), and once the long request has left the short ones fill the room it freed."""
    from mlx_spec.engine import Engine, Request
    from mlx_spec.generation import engine_info
    from mlx_spec.loading import load_pair
    from mlx_spec.memory import Item, MemoryPlan, batch_room
    from mlx_spec.session import Session

    from helpers import save_tiny_pair

    kv = 1000
    plan = MemoryPlan(
        (Item("target weights", 10**6), Item("target KV cache", 512 * kv)),
        256,
        4,
        256,
        10**6 + 3 * 512 * kv,
        "test",
        256,
    )
    room = batch_room(plan)
    assert room.need(290) == 512 * kv and room.need(160) == 256 * kv  # 3 long rows fit, or 6 short
    t, d = save_tiny_pair(tmp_path)

    def loader():
        pair = load_pair(str(t), str(d))
        return Session.of(pair, engine_info(pair, 4, "flag"), plan=plan)

    held = []  # (rows, bytes the shared K/V's buffers stand for) after every step
    real = BatchDecoder.step

    def step(self):
        out = real(self)
        if self.kv is not None and self.kv.slots:
            held.append((len(self.kv), self.kv.slots * room.need(self.kv.length - room.block)))
        return out

    monkeypatch.setattr(BatchDecoder, "step", step)
    with Engine(loader, max_batch=8) as e:
        e.wait_ready(60)
        long = e.submit(Request(prompt="x", max_tokens=280))  # (prompts that meet no EOS early)
        shorts = [e.submit(Request(prompt="q", max_tokens=150)) for _ in range(8)]
        assert long.result().completion_tokens == 280
        assert all(h.result().completion_tokens == 150 for h in shorts)
        assert e.snapshot()["requests"] == 9  # a request that waited for memory counts once
    assert held and all(b <= room.room for _, b in held)
    assert max(n for n, _ in held) >= 4  # more than 3 rows only once the long one left


def test_server_concurrent_openai_clients_and_metrics(tmp_path):
    import threading

    from mlx_spec.engine import Engine
    from mlx_spec.generation import GenConfig, engine_info, run
    from mlx_spec.loading import load_pair
    from mlx_spec.server.app import create_app
    from mlx_spec.session import Session
    from mlx_spec.text import encode_prompt

    import httpx
    import openai
    from helpers import save_tiny_pair
    from test_server import serve_in_thread

    t, d = save_tiny_pair(tmp_path)

    def loader():
        pair = load_pair(str(t), str(d))
        return Session.of(pair, engine_info(pair, 4, "flag"))

    prompts = [f"tell me about {w}" for w in ("the sea", "rain", "a cat sitting on a mat", "x")]
    pair = load_pair(str(t), str(d))
    info = engine_info(pair, 4, "flag")
    want = [
        run(
            pair,
            info,
            encode_prompt(pair.tokenizer, messages=[{"role": "user", "content": p}]),
            GenConfig(max_tokens=20),
        ).text
        for p in prompts
    ]
    with Engine(loader, max_batch=4, max_queue=8) as e, serve_in_thread(create_app(e)) as url:
        e.wait_ready(60)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        got = [None] * len(prompts)

        def ask(i):
            kw = dict(
                model=e.info.target, messages=[{"role": "user", "content": prompts[i]}], max_tokens=20, temperature=0
            )
            if i % 2:
                parts = client.chat.completions.create(stream=True, **kw)
                got[i] = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            else:
                got[i] = client.chat.completions.create(**kw).choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert got == want
        metrics = httpx.get(f"{url}/metrics").text
        assert 'mlx_spec:batch_size_bucket{le="+Inf"}' in metrics
        assert "mlx_spec:batch_steps_total" in metrics and "mlx_spec:batch_max 4" in metrics
        assert "mlx_spec:batch_pipelined_steps_total" in metrics


def test_loadtest_levels_against_a_server_in_process(tmp_path):
    """bench --concurrency's client side (loadtest.run_level / table) against our server in a
    thread (the real command also starts both servers as child processes)."""
    import time

    from mlx_spec import loadtest
    from mlx_spec.engine import Engine
    from mlx_spec.server.app import create_app

    from helpers import tiny_engine_loader
    from test_server import serve_in_thread

    with Engine(tiny_engine_loader(tmp_path), max_batch=2) as e, serve_in_thread(create_app(e)) as url:
        e.wait_ready(60)
        server = loadtest.Server(loadtest.OURS, [], int(url.rsplit(":", 1)[1]))
        prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "tell me a story"}]]
        rows = [loadtest.run_level(server, c, 2, prompts, 8, 60, time.monotonic() + 120) for c in (1, 2)]
    assert [r.tokens for r in rows] == [16, 32] and all(r.failed == 0 for r in rows)
    assert all(r.p95_s >= r.p50_s > 0 for r in rows)
    assert "mlx_spec serve" in loadtest.table(rows)


def test_mlx_lm_server_multiplies_with_our_blas_and_keeps_a_users_preload(monkeypatch):
    """bench --concurrency preloads the library our process loaded (MKL or OpenBLAS) into
    mlx_lm.server, before a preload of the user's own (which our server inherits too)."""
    from mlx_spec import loadtest

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert loadtest.mlx_lm_server("m", "/x/libmkl_rt.so.3").env == {"LD_PRELOAD": "/x/libmkl_rt.so.3"}
    assert loadtest.mlx_lm_server("m", None).env == {}  # the reference BLAS: nothing to preload
    monkeypatch.setenv("LD_PRELOAD", "/y/libjemalloc.so")
    assert loadtest.mlx_lm_server("m", "/x/libmkl_rt.so.3").env["LD_PRELOAD"] == "/x/libmkl_rt.so.3:/y/libjemalloc.so"


def _rounded_apart(h: mx.array) -> mx.array:
    """``h`` moved by about two float16 ulps (relative 2**-9), in its own dtype: what kernels that
    sum in another order give a 16-bit pass (far below a wrong mirror's differences of order one)."""
    return (h.astype(mx.float32) * (1 + 2**-9)).astype(h.dtype)


@pytest.mark.parametrize("form", ["4-bit", "8-bit", "float16"])
def test_the_packed_drafter_pass_checks_out_on_quantized_and_16_bit_drafters(dense, form, monkeypatch):
    """A quantized drafter's ``fc`` holds packed weights (its width is not the features'), and a
    float16 drafter rounds at 16 bits: both still get one drafter pass for all sequences. This
    CPU's packed pass and the drafter's own agree bit for bit in float16, so the float16 case
    rounds the packed pass apart by about two float16 ulps (as another kernel order may): the
    check's 16-bit tolerance takes it, float32's would not."""
    from mlx_spec import batch, quantize

    model, cfg = dense
    if form == "float16":  # the pair in float16: the drafter's activations too (its block's embedding is the target's)
        model, cfg = tiny_model("qwen3")
        model.set_dtype(mx.float16)
    target, d, _ = tiny_drafter(model, cfg, v2=True)
    if form == "float16":
        d.set_dtype(mx.float16)
        real = batch.draft_hidden_many
        monkeypatch.setattr(batch, "draft_hidden_many", lambda *a, **k: _rounded_apart(real(*a, **k)))
    else:
        assert quantize.quantize_module(d, int(form[0]), 32) > 0 and quantize.is_quantized(d)
    dec = BatchDecoder(target, d, block_size=4, max_batch=4)
    assert dec.packed_drafter and dec.drafter_path == "one pass for all", dec.drafter_path


def test_a_float32_drafter_gets_no_16_bit_allowance(dense, monkeypatch):
    """The same two-ulp-of-float16 difference in a float32 drafter's packed pass is a mirror
    that is wrong (float32 rounds at ~1e-7): the packed pass is off, and says by how much."""
    from mlx_spec import batch

    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg, v2=True)
    real = batch.draft_hidden_many
    monkeypatch.setattr(batch, "draft_hidden_many", lambda *a, **k: _rounded_apart(real(*a, **k)))
    dec = BatchDecoder(target, d, block_size=4, max_batch=4)
    assert not dec.packed_drafter
    assert "in mlx.core.float32 (tolerance 1e-05)" in dec.drafter_path, dec.drafter_path


def test_a_failing_drafter_self_check_is_said_at_warning_and_in_the_decoder(dense, monkeypatch, caplog):
    import logging

    from mlx_spec import batch

    model, cfg = dense
    target, d, _ = tiny_drafter(model, cfg, v2=True)
    real = batch.draft_hidden_many
    monkeypatch.setattr(batch, "draft_hidden_many", lambda *a, **k: real(*a, **k) + 0.5)  # a wrong mirror
    with caplog.at_level(logging.INFO, logger="mlx_spec.batch"):
        dec = BatchDecoder(target, d, block_size=4, max_batch=4)
    assert not dec.packed_drafter
    assert dec.drafter_path.startswith("per sequence (the packed pass differs from the drafter's by up to 0.5")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "packed pass is off" in r.getMessage()]
    assert warned and dec.drafter_path[len("per sequence (") : -1] in warned[0].getMessage()
    monkeypatch.undo()
    alone = [_tokens(spec_steps(target, d, p, block_size=4, max_tokens=8)) for p in PROMPTS[:2]]
    got, _ = _run_batch(dec, [dict(prompt=p, max_tokens=8) for p in PROMPTS[:2]])
    assert [got[0], got[1]] == alone  # (the per-sequence drafter path, taken instead, stays exact)


@pytest.mark.parametrize("vocab", [2, 4, 5])
def test_the_packed_drafter_pass_checks_out_on_a_vocabulary_under_six_tokens(vocab):
    """The self-check feeds anchor ids inside the drafter's vocabulary (they were once fixed at
    3 and 5): with an embedding that refuses any id outside it, a 2-, 4- or 5-token drafter still
    checks out and keeps one drafter pass for all sequences."""
    import importlib

    from helpers import TARGET_CONFIGS

    cfg = dict(TARGET_CONFIGS["qwen3"], vocab_size=vocab)
    mod = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    for v2 in (False, True):
        target, d, _ = tiny_drafter(model, cfg, v2=v2)

        def embed(ids, real=target.embed):
            if int(mx.max(ids)) >= vocab:  # (an out-of-range id reads past the table: refuse it)
                raise ValueError(f"token id {int(mx.max(ids))} outside the vocabulary of {vocab}")
            return real(ids)

        d.bind(embed, target.head)
        dec = BatchDecoder(target, d, block_size=4, max_batch=2)
        assert dec.packed_drafter and dec.drafter_path == "one pass for all", dec.drafter_path
