"""Convert a llama-architecture GGUF file into an mlx-lm model folder.

The folder holds `model.safetensors`, `config.json` (model_type llama), `tokenizer.json`
(byte-level BPE rebuilt from the GGUF vocab and merges) and `tokenizer_config.json` (with the
chat template), so `mlx_lm.load(folder)` opens it.

llama.cpp's converter permutes the rows of Q and K for interleaved RoPE. We undo that
permutation, so the result is a plain Hugging Face-layout llama that uses mlx-lm's default
(non-traditional) RoPE, like any other mlx-lm llama.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import numpy as np
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .errors import CheckpointError, UnsupportedModel
from .modelfiles import check_gguf

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # every GGUF block type mx.load repacks (Q4_0, Q4_1, Q8_0) uses 32-wide blocks
SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
# llama.cpp pre-tokenizer name -> whether digits are split one by one before byte-level BPE
PRE_TOKENIZERS = {
    "default": False,
    "gpt2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4
SPECIAL_IDS = {"bos": "bos", "eos": "eos", "padding": "pad", "unknown": "unk"}  # GGUF -> HF key

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def mlx_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its mlx-lm llama name."""
    parts = gguf_name.split(".")
    if parts[-1] == "weight":
        if len(parts) == 2 and parts[0] in TOP_NAMES:
            return f"{TOP_NAMES[parts[0]]}.weight"
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
            return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.weight"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} has no counterpart in mlx-lm's llama.")


def quant_bits(weight: mx.array, scales: mx.array, group_size: int = GROUP_SIZE) -> int:
    """Bits per weight of an MLX-quantized matrix, from its packed and scales shapes."""
    in_dim = scales.shape[-1] * group_size
    bits, rest = divmod(weight.shape[-1] * 32, in_dim)
    if rest or bits not in (2, 3, 4, 5, 6, 8):
        raise CheckpointError(
            f"Packed shape {weight.shape} with scales {scales.shape} is not an MLX quantized "
            f"matrix with group size {group_size}."
        )
    return bits


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's `permute(w, n_head)` on the output rows of Q or K (any trailing dims)."""
    # GGUF rows are (head, hd/2, 2): interleaved pairs; HF rows are (head, 2, hd/2): two halves
    return w.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _value(v: Any) -> Any:
    return v.tolist() if isinstance(v, mx.array) else v


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Load tensors (MLX quantized layout) and metadata, refusing what we cannot convert."""
    check_gguf(path)  # counts, lengths and offsets checked against the file before any reader sees it
    # mx.load reads block types it does not know (Q4_K, ...) as garbage, so check types first

    try:
        reader = GGUFReader(path)
        types = {t.name: t.tensor_type.name for t in reader.tensors}
    except (ValueError, TypeError, IndexError, KeyError, OSError) as e:  # gguf-py's errors for bad bytes
        raise CheckpointError(
            f"{path}: not a readable GGUF file, or cut short ({type(e).__name__}: {e}); download or copy it again"
        ) from None
    bad = sorted({f"{name}: {kind}" for name, kind in types.items() if kind not in SUPPORTED_TENSOR_TYPES})
    if bad:
        kinds = sorted({b.split(": ")[1] for b in bad})
        raise UnsupportedModel(
            f"{path.name}: tensor types {kinds} are not supported (supported: "
            f"{', '.join(SUPPORTED_TENSOR_TYPES)}); e.g. {bad[0]}. Use a Q4_0/Q4_1/Q8_0/F16 GGUF."
        )
    try:
        tensors, raw_meta = mx.load(str(path), return_metadata=True)
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable GGUF data ({e}); download or copy it again") from None
    metadata = {k: _value(v) for k, v in raw_meta.items()}
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"{path.name}: GGUF architecture {arch!r} is not supported (only llama).")
    for t in reader.tensors:  # mx.load narrows BF16 to float16; read those bits ourselves
        if t.tensor_type.name == "BF16":
            bits = np.ascontiguousarray(t.data).view(np.uint16)
            tensors[t.name] = mx.array(bits).view(mx.bfloat16)
    return tensors, metadata


def map_weights(
    tensors: dict[str, mx.array],
    *,
    n_head: int,
    n_kv_head: int,
    dtype: Literal["float32", "keep"],
    unpermute_qk: bool = True,
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Rename GGUF tensors to mlx-lm llama names; returns (weights, bits per quantized layer)."""
    weights, bits_by_layer = {}, {}
    for name in sorted(tensors):
        if name.endswith((".scales", ".biases")):
            continue
        layer, base = mlx_name(name).removesuffix(".weight"), name.removesuffix(".weight")
        w = tensors[name]
        if f"{base}.scales" in tensors:
            scales, biases = tensors[f"{base}.scales"], tensors[f"{base}.biases"]
            bits = quant_bits(w, scales)
            if dtype == "float32":  # float32 scales: exact, no float16 rounding of the result
                w = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), GROUP_SIZE, bits)
                parts = {"weight": w}
            else:
                parts = {"weight": w, "scales": scales, "biases": biases}
                bits_by_layer[layer] = bits
        else:
            parts = {"weight": w.astype(mx.float32) if dtype == "float32" else w}
        if unpermute_qk and base.endswith((".attn_q", ".attn_k")):
            heads = n_head if base.endswith(".attn_q") else n_kv_head
            parts = {k: unpermute_rows(v, heads) for k, v in parts.items()}
        weights.update({f"{layer}.{k}": v for k, v in parts.items()})
    return weights, bits_by_layer


def _short(x: float) -> float:
    return float(f"{x:.7g}")  # GGUF stores float32: 9.999999747e-06 -> 1e-05


def make_config(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """An mlx-lm / Hugging Face llama config.json from GGUF metadata."""
    a = metadata["general.architecture"]
    hidden = int(metadata[f"{a}.embedding_length"])
    heads = int(metadata[f"{a}.attention.head_count"])
    head_dim = int(metadata.get(f"{a}.attention.key_length", hidden // heads))
    rope_dim = int(metadata.get(f"{a}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModel(f"Partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported.")
    scaling = metadata.get(f"{a}.rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedModel(f"RoPE scaling {scaling!r} in GGUF metadata is not supported.")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(metadata[f"{a}.block_count"]),
        "intermediate_size": int(metadata[f"{a}.feed_forward_length"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _short(metadata[f"{a}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _short(metadata.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata.get(f"{a}.context_length", 2048)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for key, hf_key in SPECIAL_IDS.items():
        if (i := metadata.get(f"tokenizer.ggml.{key}_token_id")) is not None and hf_key != "unk":
            config[f"{hf_key}_token_id"] = int(i)
    return config


def make_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE) rebuilt from GGUF tokenizer metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2').")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(PRE_TOKENIZERS)}).")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if PRE_TOKENIZERS[pre]:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)],
        )
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    typed = list(zip(tokens, types, strict=True))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == TOKEN_TYPE_CONTROL])
    tk.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == TOKEN_TYPE_USER_DEFINED])
    return tk


def make_tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast, with the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    }
    if (length := metadata.get(f"{metadata['general.architecture']}.context_length")) is not None:
        config["model_max_length"] = int(length)
    for key, hf_key in SPECIAL_IDS.items():
        if (i := metadata.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{hf_key}_token"] = tokens[int(i)]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: Literal["float32", "keep"] = "float32",
    progress: Callable[[int, int, str], None] | None = None,
) -> Path:
    """Convert a llama GGUF (F32/F16/BF16/Q4_0/Q4_1/Q8_0 tensors) into an mlx-lm model folder.

    Args:
        gguf_path: the `.gguf` file.
        out_dir: folder to write (created; existing files of the same names are replaced).
        dtype: "float32" dequantizes every tensor to float32; "keep" keeps quantized tensors
            quantized (group size 32, bits per layer) and float tensors as stored.
        progress: called as ``progress(done, total, tensor name)`` as each tensor is converted,
            then once more when the file is written.

    Returns:
        `out_dir` as a Path, loadable with `mlx_lm.load`.

    Raises:
        UnsupportedModel: unsupported architecture, tensor type, tensor or tokenizer kind.
    """
    if dtype not in ("float32", "keep"):
        raise ValueError(f"dtype must be 'float32' or 'keep', not {dtype!r}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    tensors, metadata = read_gguf(gguf_path)
    config = make_config(metadata, tensors)
    tokenizer = make_tokenizer(metadata)
    weights, bits = map_weights(
        tensors,
        n_head=config["num_attention_heads"],
        n_kv_head=config["num_key_value_heads"],
        dtype=dtype,
    )
    if bits:  # default = the most common width; layers that differ get their own entry
        common = Counter(bits.values()).most_common(1)[0][0]
        quant = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
        quant.update({k: {**quant, "bits": b} for k, b in bits.items() if b != common})
        config["quantization"] = config["quantization_config"] = quant
    out_dir.mkdir(parents=True, exist_ok=True)
    total = len(weights) + 1  # + writing the file
    for i, (name, w) in enumerate(weights.items()):
        if progress is not None:  # one tensor at a time, so a bar can follow
            mx.eval(w)
            progress(i + 1, total, name)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    if progress is not None:
        progress(total, total, "model.safetensors written")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(make_tokenizer_config(metadata), indent=2))
    log.info("converted %s -> %s (%d tensors, dtype=%s)", gguf_path, out_dir, len(weights), dtype)
    return out_dir
