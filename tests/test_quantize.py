"""Quantization at load: choices, lazy peak, checkpoints already quantized, and losslessness."""

import json

import mlx_spec  # noqa: F401  (before mlx: loads the optimized BLAS when this file runs alone)
from mlx_spec import quantize
from mlx_spec.decode import spec_steps
from mlx_spec.errors import BadRequest
from mlx_spec.loading import load_pair, load_target_model

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import TARGET_CONFIGS, greedy_reference, save_tiny_pair, save_tiny_tokenizer
from mlx.utils import tree_flatten

PROMPTS = ([1, 5, 9, 17, 33, 2, 8], [(7 * i + 3) % 120 + 4 for i in range(30)])


def test_choose_defaults():
    cpu = quantize.choose(None, None, None, metal=False, checkpoint=None)
    assert (cpu.target_bits, cpu.drafter_bits, cpu.group_size) == (None, None, 64)
    assert "CPU backend" in cpu.reason and "block rows" in cpu.reason
    metal = quantize.choose("4", None, 32, metal=True, checkpoint=None)
    # on a GPU backend the drafter takes the measured precision (docs/memory.md), not the target's bits
    gpu = (quantize.GPU_DRAFTER_BITS, quantize.GPU_DRAFTER_ACTIVATIONS)
    assert (metal.target_bits, metal.group_size) == (4, 32)
    assert (metal.drafter_bits, metal.drafter_activations) == gpu and "drafter precision" in metal.reason
    # a quantized checkpoint decides the target's bits
    pre = quantize.choose(None, None, None, metal=True, checkpoint=(4, 64))
    assert (pre.target_bits, pre.drafter_bits, pre.target_prequantized) == (4, gpu[0], True)
    assert quantize.choose("4", "4", None, metal=True, checkpoint=None).drafter_activations is None  # as asked
    clash = quantize.choose("8", "none", None, metal=True, checkpoint=(4, 64))
    assert clash.target_bits == 4 and clash.drafter_bits is None and "not applied" in clash.reason
    both = quantize.choose("8", "4", None, metal=False, checkpoint=None)
    assert (both.target_bits, both.drafter_bits) == (8, 4) and "float32" in both.reason
    assert quantize.choose("4", None, None, metal=True, checkpoint=None, drafter=False).drafter_bits is None
    with pytest.raises(BadRequest):
        quantize.parse_bits("3")


def test_quantized_nbytes_matches_mx_quantize():
    w = mx.random.normal((96, 256))
    for bits in (4, 8):
        for g in (32, 64):
            q, s, b = mx.quantize(w, group_size=g, bits=bits)
            assert q.nbytes + s.nbytes + b.nbytes == quantize.quantized_nbytes(w.size, bits, g, 4)


@pytest.fixture(scope="module")
def tiny_pair_dir(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), v2=True, layers=2)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_speculation_equals_quantized_plain(tiny_pair_dir, bits):
    """Greedy speculation over a quantized target == greedy plain decoding of that same target."""
    tdir, ddir = tiny_pair_dir
    pair = load_pair(str(tdir), str(ddir), target_bits=bits, drafter_bits=bits, group_size=32)
    layer = pair.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, nn.QuantizedLinear) and layer.bits == bits and layer.group_size == 32
    assert layer.scales.dtype == mx.float32  # quantized from float32 on CPU
    assert isinstance(pair.drafter.layers[0].mlp.up_proj, nn.QuantizedLinear)
    # the drafter borrows the target's (quantized) embedding and head: one copy, quantized once
    assert pair.drafter._embed is pair.target.embed
    assert isinstance(pair.target.embed, nn.QuantizedEmbedding)
    assert not any("embed" in t.name or "lm_head" in t.name for t in quantize.module_tensors(pair.drafter))
    for prompt in PROMPTS:
        ref = greedy_reference(pair.model, prompt, 24)
        for block in (4, 8):
            steps = list(spec_steps(pair.target, pair.drafter, prompt, block_size=block, max_tokens=24))
            assert [t for s in steps for t in s.tokens] == ref, (bits, block)


def _save_target(path, cfg, model):
    from mlx_lm.utils import save_config, save_model

    save_model(path, model)
    save_config(dict(cfg), path / "config.json")
    save_tiny_tokenizer(path)


def test_lazy_quantized_load_peak_stays_near_quantized_size(tmp_path):
    from mlx_lm.models import qwen3

    cfg = dict(
        TARGET_CONFIGS["qwen3"],
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    float_bytes = sum(t.numel * 4 for t in quantize.module_tensors(model))
    _save_target(tmp_path, cfg, model)
    del model
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    q, _ = load_target_model(str(tmp_path), bits=4, group_size=64)
    loaded = mx.get_active_memory() - base
    peak = mx.get_peak_memory() - base
    expected = quantize.loaded_nbytes(quantize.safetensors_tensors(tmp_path), bits=4, group_size=64, float_bytes=4)
    assert loaded == expected
    assert peak < 0.4 * float_bytes, (peak, loaded, float_bytes)


def test_prequantized_checkpoint_loads_as_is_with_float32_scales(tmp_path):
    from mlx_lm.models import qwen3

    cfg = dict(TARGET_CONFIGS["qwen3"])
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, 32, 4)  # bf16 scales on disk
    mx.eval(model.parameters())
    _save_target(tmp_path, {**cfg, "quantization": {"group_size": 32, "bits": 4}}, model)
    assert quantize.checkpoint_quantization(json.loads((tmp_path / "config.json").read_text())) == (4, 32)
    loaded, _ = load_target_model(str(tmp_path), bits=8, group_size=64)  # asks for 8: loads as it is
    layer = loaded.model.layers[0].mlp.down_proj
    assert layer.bits == 4 and layer.group_size == 32
    assert layer.scales.dtype == mx.float32  # cast on the CPU backend (bf16 scales are slow here)
    planned = quantize.loaded_nbytes(quantize.safetensors_tensors(tmp_path), bits=8, group_size=64, float_bytes=4)
    assert planned == sum(v.nbytes for _, v in tree_flatten(loaded.parameters()))
