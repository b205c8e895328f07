"""GGUF -> MLX conversion on tiny GGUFs written here (llama.cpp layout: Q/K rows permuted)."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_spec.errors import CheckpointError, UnsupportedModel
from mlx_spec.gguf import convert_gguf, map_weights, quant_bits, read_gguf

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "def reverse(s):\n    return s[::-1]  # 12345 reversed is 54321",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHi, can I help?<|im_end|>",
]
# mlx-lm llama name -> GGUF name, written out independently of mlx_spec.gguf
GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# one mix of tensor types to exercise every supported path
MIXED = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0,
         "attn_output": Q.Q4_0, "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.Q4_1,
         "output_norm": Q.BF16}  # fmt: skip


def to_gguf_name(name: str) -> str:
    module = name.removesuffix(".weight")
    if module in GGUF_TOP:
        return f"{GGUF_TOP[module]}.weight"
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{GGUF_LAYER[rest]}.weight"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def train_tokenizer() -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(TEXTS * 4, trainer)
    return tk


def tiny_model(vocab_size: int, *, tied: bool = True, seed: int = 0) -> tuple[llama.Model, dict]:
    args = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                vocab_size=vocab_size, rope_theta=10000.0, max_position_embeddings=256,
                tie_word_embeddings=tied)  # fmt: skip
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(args))
    # random norms, so a swapped norm mapping would show in the logits
    norms = [(k, 1 + 0.2 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters()) if "norm" in k]
    model.load_weights(norms, strict=False)
    mx.eval(model.parameters())
    return model, args


def write_gguf(
    path: Path,
    model: llama.Model,
    args: dict,
    tk: Tokenizer,
    *,
    types: dict | None = None,
    arch: str = "llama",
    pre: str = "smollm",
    extra: dict | None = None,
) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would.

    Returns the weights a reader of the file sees (dequantized), in Hugging Face row order.
    """
    spec = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(args["num_hidden_layers"])
    w.add_context_length(args["max_position_embeddings"])
    w.add_embedding_length(args["hidden_size"])
    w.add_feed_forward_length(args["intermediate_size"])
    w.add_head_count(args["num_attention_heads"])
    w.add_head_count_kv(args["num_key_value_heads"])
    w.add_layer_norm_rms_eps(args["rms_norm_eps"])
    w.add_rope_freq_base(args["rope_theta"])
    w.add_rope_dimension_count(args["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in spec["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    seen = {}
    for name, value in tree_flatten(model.parameters()):
        data = np.array(value, dtype=np.float32)
        gname = to_gguf_name(name)
        kind = gname.split(".")[-2]
        if kind in ("attn_q", "attn_k"):
            heads = args["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
            data = llama_cpp_permute(data, heads)
        qtype = (types or {}).get(kind, Q.F32)
        w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        # blocks run along rows, so quantizing commutes with llama.cpp's row permutation
        seen[name] = _dequantized(np.array(value, dtype=np.float32), qtype)
    for gname, raw in (extra or {}).items():
        w.add_tensor(gname, raw[0], raw_dtype=raw[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return seen


def _dequantized(x: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).reshape(x.shape)


@pytest.fixture(scope="module")
def tk() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture(scope="module")
def source(tk):
    return tiny_model(tk.get_vocab_size())


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tk, source) -> Path:
    folder = tmp_path_factory.mktemp("f32")
    write_gguf(folder / "tiny.gguf", *source, tk)
    return convert_gguf(folder / "tiny.gguf", folder / "mlx", dtype="float32")


IDS = mx.array([[1, 5, 17, 42, 99, 200, 7, 3, 250, 11, 64, 128]])


def logits_of(model) -> np.ndarray:
    return np.array(model(IDS).astype(mx.float32))


@pytest.mark.parametrize("tied", [True, False])
def test_float32_conversion_matches_source(tmp_path, tk, tied):
    model, args = tiny_model(tk.get_vocab_size(), tied=tied, seed=1)
    write_gguf(tmp_path / "tiny.gguf", model, args, tk)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "mlx")
    loaded, _ = load(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and "quantization" not in config
    assert (config["rope_theta"], config["rms_norm_eps"], config["num_key_value_heads"]) == (
        10000.0,
        1e-5,
        2,
    )
    np.testing.assert_allclose(logits_of(loaded), logits_of(model), atol=1e-5, rtol=1e-5)


def test_unpermute_has_power(converted, source):
    """Without undoing llama.cpp's Q/K permutation the logits differ.

    Traditional (interleaved) RoPE on the permuted weights is the equivalent alternative fix.
    """
    model, args = source
    tensors, _ = read_gguf(converted.parent / "tiny.gguf")
    raw, _ = map_weights(tensors, n_head=4, n_kv_head=2, dtype="float32", unpermute_qk=False)
    wrong = llama.Model(llama.ModelArgs.from_dict(args))
    wrong.load_weights(list(raw.items()))
    assert np.abs(logits_of(wrong) - logits_of(model)).max() > 1e-2
    traditional = llama.Model(llama.ModelArgs.from_dict({**args, "rope_traditional": True}))
    traditional.load_weights(list(raw.items()))
    np.testing.assert_allclose(logits_of(traditional), logits_of(model), atol=1e-5, rtol=1e-5)


def test_quantized_types(tmp_path, tk, source):
    model, args = source
    seen = write_gguf(tmp_path / "q.gguf", model, args, tk, types=MIXED)
    reference = llama.Model(llama.ModelArgs.from_dict(args))
    reference.load_weights([(k, mx.array(v)) for k, v in seen.items()])
    want = logits_of(reference)

    f32, _ = load(str(convert_gguf(tmp_path / "q.gguf", tmp_path / "f32", dtype="float32")))
    np.testing.assert_allclose(logits_of(f32), want, atol=1e-4, rtol=1e-4)

    out = convert_gguf(tmp_path / "q.gguf", tmp_path / "keep", dtype="keep")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert (quant["bits"], quant["group_size"]) == (4, 32)
    assert quant["model.embed_tokens"]["bits"] == 8 and quant["model.layers.0.mlp.gate_proj"]["bits"] == 8
    kept, _ = load(str(out))
    layer = kept.model.layers[0]
    assert layer.self_attn.q_proj.bits == 4 and layer.mlp.gate_proj.bits == 8 and kept.model.embed_tokens.bits == 8
    assert not hasattr(layer.mlp.up_proj, "bits")  # F16 stays a plain Linear
    np.testing.assert_allclose(logits_of(kept), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_quant_bits(bits):
    w, scales, _ = mx.quantize(mx.random.normal((64, 256)), group_size=32, bits=bits)
    assert quant_bits(w, scales) == bits
    with pytest.raises(CheckpointError):
        quant_bits(w[:, :-1], scales)


def test_tokenizer_round_trip(converted, tk):
    _, tokenizer = load(str(converted))
    texts = TEXTS + [
        "<|im_start|>system\nDigits 2024 and émoji 🙂 <|im_end|>",
        "  leading spaces\n\n",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == tk.encode(text).ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tokenizer.eos_token_ids == {2}


def test_chat_template(converted, tk):
    _, tokenizer = load(str(converted))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == tk.encode(text).ids


def test_refuses_unsupported_tensor_type(tmp_path, tk, source):
    extra = {"blk.0.attn_q_extra.weight": (np.zeros((64, 144), np.uint8), Q.Q4_K)}
    write_gguf(tmp_path / "k.gguf", *source, tk, extra=extra)
    with pytest.raises(UnsupportedModel, match="Q4_K"):
        convert_gguf(tmp_path / "k.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_unsupported_architecture(tmp_path, tk, source):
    write_gguf(tmp_path / "a.gguf", *source, tk, arch="qwen2")
    with pytest.raises(UnsupportedModel, match="qwen2"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "out")


def test_refuses_unknown_tensor(tmp_path, tk, source):
    write_gguf(
        tmp_path / "r.gguf",
        *source,
        tk,
        extra={"rope_freqs.weight": (np.ones(8, np.float32), Q.F32)},
    )
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        convert_gguf(tmp_path / "r.gguf", tmp_path / "out")


def test_refuses_unknown_pre_tokenizer(tmp_path, tk, source):
    write_gguf(tmp_path / "p.gguf", *source, tk, pre="qwen2")
    with pytest.raises(UnsupportedModel, match="qwen2"):
        convert_gguf(tmp_path / "p.gguf", tmp_path / "out")


def test_convert_command(tmp_path, converted):
    from mlx_spec.cli import main

    out = tmp_path / "cli"
    assert main(["convert", str(converted.parent / "tiny.gguf"), str(out), "--dtype", "keep"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert main(["convert", str(tmp_path / "missing.gguf"), str(out)]) == 1
