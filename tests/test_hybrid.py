"""Hybrid GatedDeltaNet + attention targets (qwen3_5, qwen3_5_moe, qwen3_next) and MoE targets.

Lossless: greedy speculative output == mlx-lm's plain greedy output, and after every cycle each
cache entry (GDN conv + recurrent state, attention K/V) equals the state plain decoding reaches
after the same committed tokens. A deliberately broken rollback must fail these checks.
"""

import importlib
from functools import partial

from mlx_spec import gdn
from mlx_spec.decode import spec_steps
from mlx_spec.errors import MlxSpecError, UnsupportedModel
from mlx_spec.target import Target

import mlx.core as mx
import pytest
from helpers import VOCAB, ScriptedDrafter, greedy_reference, tiny_drafter
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

PROMPT = [1, 5, 9, 17, 33, 2, 8, 40, 77]
N = 28
BLOCKS = (2, 4, 8, 16)
ATOL, RTOL = 2e-5, 1e-4  # batched verify vs single-token decode round differently (float32)

_GDN = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    tie_word_embeddings=False,
)
_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    decoder_sparse_step=1,
)
_ROPE = {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
CONFIGS = {
    "qwen3_5": dict(_GDN, model_type="qwen3_5", rope_parameters=_ROPE),
    "qwen3_5_moe": dict(_GDN, **_MOE, model_type="qwen3_5_moe", rope_parameters=_ROPE),
    "qwen3_next": dict(
        _GDN, **_MOE, model_type="qwen3_next", mlp_only_layers=[], rope_theta=10000.0, partial_rotary_factor=0.25
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
}
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def build(kind: str, seed: int = 0, **over):
    """A tiny float32 model with sharpened embedding/head (random models are near-uniform)."""
    cfg = dict(CONFIGS[kind], **over)
    mod = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    lm = getattr(model, "language_model", model)
    lm.model.embed_tokens.weight = lm.model.embed_tokens.weight * 4
    lm.lm_head.weight = lm.lm_head.weight * 4
    mx.eval(model.parameters())
    return model, cfg


def _snapshot(cache):
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            out.append((c.offset, c.keys[..., : c.offset, :], c.values[..., : c.offset, :]))
        else:
            out.append(tuple(c.cache))
    mx.eval(out)
    return out


def plain_states(model, prompt, tokens):
    """Cache snapshots of plain decoding: [after prompt, after prompt + tokens[0], ...]."""
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    states = [_snapshot(cache)]
    for t in tokens:
        model(mx.array([[t]]), cache=cache)
        states.append(_snapshot(cache))
    return states


@pytest.fixture(scope="module")
def prepared():
    """kind -> (kind, model, cfg, greedy reference, plain-decoding cache states); built once."""
    done = {}

    def get(kind):
        if kind not in done:
            model, cfg = build(kind)
            ref = greedy_reference(model, PROMPT, N)
            done[kind] = (kind, model, cfg, ref, plain_states(model, PROMPT, ref))
        return done[kind]

    return get


@pytest.fixture(params=HYBRIDS + ("qwen3_moe",))
def arch(request, prepared):
    return prepared(request.param)


def run_checked(target, drafter, block, states):
    """Run spec decoding; return (steps, mismatches of any cache entry vs plain decoding)."""
    seen = []
    make = target.make_cache

    def spy():
        seen.append(make())
        return seen[-1]

    target.make_cache = spy
    steps, problems, n = [], [], 0
    for step in spec_steps(target, drafter, PROMPT, block_size=block, max_tokens=N):
        steps.append(step)
        n += len(step.tokens)
        want = states[n - 1]  # the cache holds every committed token but the newest (next anchor)
        for i, (c, got) in enumerate(zip(seen[0], _snapshot(seen[0]))):
            for j, (x, y) in enumerate(zip(got, want[i])):
                if isinstance(x, int):
                    ok = x == y
                else:
                    ok = x.shape == y.shape and mx.allclose(x, y, atol=ATOL, rtol=RTOL).item()
                if not ok:
                    problems.append(f"after {n} tokens: layer {i} ({type(c).__name__}) entry {j}")
    return steps, problems


def _tokens(steps):
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("block", BLOCKS)
def test_lossless_and_cache_exact_after_every_cycle(arch, block):
    kind, model, cfg, ref, states = arch
    full = PROMPT + ref
    for right in (None, 0, 1, block // 2):
        if right == 1 and block == 2:
            continue  # same as the oracle
        target = Target(model, [0, 2])
        steps, problems = run_checked(target, ScriptedDrafter(full, VOCAB, right=right), block, states)
        assert _tokens(steps) == ref, (kind, block, right)
        if right is None:
            assert all(s.accepted == s.drafted for s in steps[1:])
        else:
            assert all(s.accepted == min(right, s.drafted) for s in steps[1:] if not s.finish_reason)
        assert not problems, (kind, block, right, problems[:5])


def _off_by_one(caches, records, attns, n_keep, **kw):
    gdn.restore(caches, records, attns, n_keep - 1 if n_keep > 1 else n_keep + 1, **kw)


@pytest.mark.parametrize("broken", ["no_conv", "no_state", "off_by_one"])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_broken_rollback_is_caught(prepared, kind, broken):
    _, model, _, ref, states = prepared(kind)
    restore = {
        "no_conv": partial(gdn.restore, conv=False),
        "no_state": partial(gdn.restore, state=False),
        "off_by_one": _off_by_one,
    }[broken]
    target = Target(model, [0, 2], restore=restore)
    steps, problems = run_checked(target, ScriptedDrafter(PROMPT + ref, VOCAB, right=1), 4, states)
    assert problems, broken
    entry = {"no_conv": "entry 0", "no_state": "entry 1", "off_by_one": "ArraysCache"}[broken]
    assert entry in problems[0]


def _gdn_layer(model):
    return next(l for l in model.model.layers if getattr(l, "is_linear", False))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_mirror_equals_the_real_layer(kind):
    """gdn_block must compute exactly what mlx-lm's DecoderLayer does (catches mlx-lm drift)."""
    model, cfg = build(kind)
    layer = _gdn_layer(model)
    xs = [mx.random.normal((1, S, cfg["hidden_size"]), key=mx.random.key(S)) for S in (5, 1, 3)]
    masks = [None, None, mx.array([[True, True, False]])]
    real, mine = ArraysCache(2), ArraysCache(2)
    for x, m in zip(xs, masks):
        want = layer(x, m, real)
        records = []
        got = gdn.gdn_block(layer, x, m, mine, records)
        assert mx.array_equal(want, got)
        for w, g in zip(real.cache, mine.cache):
            assert mx.array_equal(w, g)
        rec = records[0]
        assert rec.q.shape[1] == x.shape[1] and rec.conv_input.shape[1] == x.shape[1] + 3


def test_mirror_drift_is_refused():
    """A GDN layer that computes something else than the mirror makes Target refuse the model."""
    model, _ = build("qwen3_5")
    attn = _gdn_layer(model).linear_attn
    base = type(attn)

    class Drifted(base):
        def __call__(self, x, mask=None, cache=None):
            return base.__call__(self, x * 1.5, mask, cache)

    attn.__class__ = Drifted
    with pytest.raises(UnsupportedModel, match="GatedDeltaNet"):
        Target(model, [0])


def test_rollback_without_record_is_an_error():
    model, _ = build("qwen3_5")
    target = Target(model, [0])
    cache = target.make_cache()
    target(mx.array([PROMPT]), cache)
    target(mx.array([[3, 4, 5]]), cache)
    with pytest.raises(MlxSpecError, match="record=True"):
        target.rollback(cache, 3, 1)
    target(mx.array([[3, 4, 5]]), cache, record=True)
    target.rollback(cache, 3, 3)  # full acceptance: nothing to rebuild; the tape is dropped
    with pytest.raises(MlxSpecError, match="record=True"):
        target.rollback(cache, 3, 1)


def test_rollback_to_before_the_pass():
    """n_keep = 0 (bench's repeated verify of one block) restores the pre-verify cache exactly."""
    model, _ = build("qwen3_5")
    target = Target(model, [0])
    cache = target.make_cache()
    target(mx.array([PROMPT]), cache)
    before = _snapshot(cache)
    for T in (1, 4):
        target(mx.array([list(range(3, 3 + T))]), cache, record=True)
        target.rollback(cache, T, 0)
        for got, want in zip(_snapshot(cache), before):
            assert all(x == y if isinstance(x, int) else mx.array_equal(x, y) for x, y in zip(got, want))


def test_unrollable_caches_are_refused_by_name():
    from helpers import TARGET_CONFIGS
    from mlx_lm.models import llama, mamba

    mx.random.seed(0)
    swa = dict(
        TARGET_CONFIGS["llama"],
        sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )
    with pytest.raises(UnsupportedModel, match=r"layers 0-1, 3 use RotatingKVCache \(sliding-window"):
        Target(llama.Model(llama.ModelArgs.from_dict(swa)), [0])
    m = mamba.Model(
        mamba.ModelArgs.from_dict(
            dict(
                model_type="mamba",
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=128,
                state_size=8,
                num_hidden_layers=2,
                conv_kernel=4,
                use_bias=False,
                use_conv_bias=True,
                time_step_rank=8,
            )
        )
    )
    with pytest.raises(UnsupportedModel, match=r"'mamba'.*layers 0-1 use ArraysCache \(recurrent state\)"):
        Target(m, [0])


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_dflash_drafter_on_a_hybrid_target(prepared, kind):
    """A real (random) DFlash 2 drafter reading taps of GDN and attention layers stays lossless."""
    _, model, cfg, ref, _ = prepared(kind)
    target, drafter, _ = tiny_drafter(model, cfg, v2=True, taps=(0, 3))
    for block in (4, 16):
        steps = list(spec_steps(target, drafter, PROMPT, block_size=block, max_tokens=N))
        assert _tokens(steps) == ref
    steps = list(spec_steps(target, ScriptedDrafter(PROMPT + ref, VOCAB, right=2), PROMPT, block_size=8, max_tokens=N))
    assert all(s.rollback_ms > 0 for s in steps[1:] if not s.finish_reason)
