"""Quantized K/V (``--kv-bits``): the target's caches are mlx-lm's ``QuantizedKVCache`` on every
path, so speculative decoding equals plain decoding with the same cache setting, greedy, token for
token: one stream, a batch, and a turn started from a prefix cached in memory or on disk. The
memory plan counts the bytes the quantized cache holds; a hybrid target is refused by name."""

import importlib
import json

from mlx_spec import memory
from mlx_spec.batch import BatchDecoder, batched_steps
from mlx_spec.cli import main
from mlx_spec.config import LoadConfig
from mlx_spec.decode import plain_steps, spec_steps
from mlx_spec.errors import BadRequest, UnsupportedModel
from mlx_spec.loading import Pair
from mlx_spec.prefix import PrefixCache
from mlx_spec.prefix_store import DiskConfig, PrefixStore
from mlx_spec.target import KVQuant, Target, make_cache

import mlx.core as mx
import pytest
from helpers import TARGET_CONFIGS, save_tiny_pair, tiny_drafter
from mlx_lm.models.cache import QuantizedKVCache
from test_hybrid import build

# head_dim 32: one K/V group of 32 per head (the shared test models' 16 splits into none)
CFG = dict(TARGET_CONFIGS["qwen3"], head_dim=32)
PROMPTS = ([1, 5, 9, 17, 33, 2, 8], [(7 * i + 3) % 120 + 4 for i in range(40)], [3, 3, 4, 3, 3, 4, 3, 3, 4, 9])
N = 24


def tiny(seed: int = 0):
    mod = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(CFG))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 4
    model.lm_head.weight = model.lm_head.weight * 4
    mx.eval(model.parameters())
    return model


def tokens(steps):
    return [t for s in steps for t in s.tokens]


@pytest.fixture(scope="module", params=[4, 8], ids=["4-bit", "8-bit"])
def quantized(request):
    model = tiny()
    kv = KVQuant(request.param, 32)
    target, drafter, _ = tiny_drafter(model, CFG, v2=True)
    target = Target(model, drafter.args.target_layer_ids, kv=kv)
    plain = {tuple(p): tokens(plain_steps(model, p, max_tokens=N, kv=kv)) for p in PROMPTS}
    return model, kv, target, drafter, plain


def test_greedy_speculation_equals_plain_decoding_with_the_same_kv_bits(quantized):
    model, kv, target, drafter, plain = quantized
    assert all(type(c) is QuantizedKVCache and c.bits == kv.bits for c in target.make_cache())
    for p in PROMPTS:
        for block in (2, 4, 8):
            assert tokens(spec_steps(target, drafter, p, block_size=block, max_tokens=N)) == plain[tuple(p)], block
    # the setting is in effect: unquantized plain decoding is another computation (on some prompt)
    assert any(tokens(plain_steps(model, p, max_tokens=N)) != plain[tuple(p)] for p in PROMPTS) or kv.bits == 8


def test_a_batch_with_quantized_kv_attends_per_sequence_and_equals_plain(quantized):
    model, kv, target, drafter, plain = quantized
    dec = BatchDecoder(target, drafter, block_size=4, max_batch=4)
    assert dec.attention.startswith("per sequence") and f"{kv.bits}-bit K/V" in dec.attention
    jobs = [dict(prompt=p, max_tokens=N) for p in PROMPTS]
    got = {i: [] for i in range(len(jobs))}
    for i, st in batched_steps(dec, jobs, joins={2: 3}):
        got[i].extend(st.tokens)
    assert [got[i] for i in range(len(jobs))] == [plain[tuple(p)] for p in PROMPTS]


def test_a_turn_from_a_quantized_prefix_in_memory_and_on_disk_equals_plain(quantized, tmp_path):
    model, kv, target, drafter, _ = quantized
    first = PROMPTS[1]
    memory_cache = PrefixCache(64 << 20)
    memory_cache.attach(PrefixStore(DiskConfig(tmp_path, 64 << 20, 8), "kv"))
    reply = tokens(spec_steps(target, drafter, first, block_size=4, max_tokens=N, on_exit=memory_cache.store))
    second = first + reply + [2, 11, 13]
    want = tokens(plain_steps(model, second, max_tokens=N, kv=kv))
    restarted = PrefixCache(64 << 20)  # memory empty, the same disk
    restarted.attach(PrefixStore(DiskConfig(tmp_path, 64 << 20, 8), "kv"))
    for cache, tier in ((memory_cache, "memory"), (restarted, "disk")):
        pre = cache.lookup(second, drafter=True)
        assert pre is not None and len(pre.tokens) == len(first) + len(reply) - 1, tier
        assert all(type(c) is QuantizedKVCache for c in pre.target), tier
        got = list(spec_steps(target, drafter, second, block_size=4, max_tokens=N, prefill=pre))
        assert got[0].cached_tokens == len(pre.tokens) and tokens(got) == want, tier
    assert restarted.disk.hits == 1
    # plain decoding from the stored prefix too
    pre = restarted.lookup(second, drafter=False)
    assert tokens(plain_steps(model, second, max_tokens=N, kv=kv, prefill=pre)) == want


@pytest.mark.parametrize("bits", [4, 8])
def test_the_plans_kv_bytes_are_what_the_quantized_cache_holds(bits):
    model = tiny()
    kv = KVQuant(bits, 32)
    cache = make_cache(model, kv)
    mx.eval(model(mx.array([[1, 5, 9, 17, 33]]), cache=cache))
    held = sum(sum(a.nbytes for a in (*c.keys, *c.values)) // c.keys[0].shape[-2] for c in cache)
    dims = memory.target_dims(CFG)
    assert memory.kv_bytes(dims, 4, bits, 32) * dims.layers == held
    assert memory.kv_bytes(dims, 4) * dims.layers > 3 * held  # (float32 rows: 4 bytes an element)
    pair = Pair(model, None, None, None, "tiny", None, None, kv)
    assert memory.loaded_sizes(pair).target_kv_per_token == held
    # the plan's row: those bytes per position over the allocated positions
    p = memory.PlanInputs(dims, 0, kv_bits=bits, kv_group_size=32)
    row = next(i for i in memory.items(p, 500, 1) if i.name == "target KV cache")
    assert row.bytes == held * 512 and f"{bits}-bit K/V" in row.detail


def test_a_hybrid_target_and_a_head_width_without_whole_groups_are_refused_by_name():
    model, _ = build("qwen3_next")
    with pytest.raises(UnsupportedModel, match="hybrid target: its gated delta-net layers keep a recurrent state"):
        Target(model, [0], kv=KVQuant(4))
    with pytest.raises(UnsupportedModel, match="head width 32 does not split into groups of 64"):
        Target(tiny(), [0], kv=KVQuant(4, 64))


def test_the_flags_reach_the_engine_and_bad_ones_are_named(tmp_path, capsys):
    """``generate --kv-bits 4 --draft-window 16`` on a pair that can take them runs with both (the
    engine line says so, the text is plain decoding's with the same cache); on a head width
    without whole groups, and with values out of range, it is refused by name. The bundled
    drafter's default window is 512 positions, 0 asks for all of them; others default to all."""
    from mlx_spec.loading import DEFAULT_DRAFTER, draft_window

    assert draft_window(None, f"models/{DEFAULT_DRAFTER}") == 512 and draft_window(0, DEFAULT_DRAFTER) is None
    assert draft_window(None, "other/drafter") is None and draft_window(64, "other/drafter") == 64
    t, d = save_tiny_pair(tmp_path / "hd32", target_over={"head_dim": 32})
    args = ["generate", "--target", str(t), "--drafter", str(d), "--prompt", "hello world", "--max-tokens", "12"]
    assert main([*args, "--no-tune", "--kv-bits", "4", "--kv-group-size", "32", "--draft-window", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"]["kv_cache"] == "4-bit K/V (group 32)" and out["engine"]["draft_window"] == 16
    assert main([*args, "--no-draft", "--kv-bits", "4", "--kv-group-size", "32", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["text"] == out["text"] and plain["engine"]["kv_cache"] == "4-bit K/V (group 32)"
    assert main([*args, "--no-tune", "--kv-bits", "4"]) == 1  # group 64 over a head width of 32
    assert "head width 32 does not split into groups of 64 (--kv-group-size 32 does)" in capsys.readouterr().err
    for bad, what in (
        (dict(kv_bits=3), "--kv-bits must be 4 or 8"),
        (dict(kv_group_size=16), "--kv-group-size must be 32, 64 or 128"),
        (dict(draft_window=-1), "--draft-window must be >= 1 position, or 0 for all"),
        (dict(draft_window=8, no_draft=True), "no use with --no-draft"),
        (dict(kv_bits=4, ranks=2), "--kv-bits is not offered for a target sharded"),
    ):
        with pytest.raises(BadRequest, match=what):
            LoadConfig(**bad)
