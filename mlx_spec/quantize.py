"""Quantization at load, for the target and the drafter independently.

Weights are loaded lazily and quantized before they are materialized, one tensor at a time,
so the peak during loading stays near the quantized size. Checkpoints that are already
quantized load as they are. The drafter owns no embedding or head (it borrows the target's),
so quantizing the drafter never touches them a second time.

Byte arithmetic for the memory plan lives here too (``loaded_nbytes``): it reads tensor shapes
from safetensors headers or a lazily built module, never the weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from .errors import BadRequest
from .modelfiles import safetensors_header

log = logging.getLogger(__name__)

BITS_CHOICES = ("4", "8", "none")
DEFAULT_GROUP_SIZE = 64
CPU_FLOAT_REASON = (
    "CPU backend: kept float32, because MLX's quantized CPU kernels cost ~linear in block rows "
    "(a block verify costs ~B x a decode step) while float32 + BLAS amortizes"
)
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
FLOATS = {"F64", "F32", "F16", "BF16"}
# The drafter's precision on a GPU backend (Metal): the cheapest setting whose acceptance stays
# within 2 % of float32 with every hidden state and logit finite, measured by
# benchmarks/precision.py on the shipped drafter (docs/memory.md, "Drafter precision").
GPU_DRAFTER_BITS: int | None = 4
GPU_DRAFTER_ACTIVATIONS = "bfloat16"
GPU_DRAFTER_REASON = (
    "drafter 4-bit weights with bfloat16 activations: the cheapest measured setting within 2 % of "
    "float32 acceptance (-1.8 %) with every pass finite (docs/memory.md, drafter precision); a "
    "non-finite pass switches it to float32 at run time"
)


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: F32, BF16, U32, ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class QuantChoice:
    """What precision each model gets, and why (shown in the plan and the logs)."""

    target_bits: int | None  # None: float (float32 on CPU, the file's dtype on Metal)
    drafter_bits: int | None
    group_size: int
    target_prequantized: bool  # the checkpoint itself is quantized: loaded as it is
    reason: str
    has_drafter: bool = True
    drafter_activations: str | None = (
        None  # "float32" | "float16" | "bfloat16": the drafter computes in it; None: as loaded
    )

    def describe(self) -> str:
        def name(b):
            return f"{b}-bit" if b else "float"

        t = name(self.target_bits) + (" (checkpoint)" if self.target_prequantized else "")
        act = f" with {self.drafter_activations} activations" if self.drafter_activations else ""
        d = f", drafter {name(self.drafter_bits)}{act}" if self.has_drafter else ""
        return f"target {t}{d}, group size {self.group_size}"

    def as_dict(self) -> dict:
        return asdict(self)


def parse_bits(text: str | None) -> int | None:
    """'4' | '8' -> int; 'none' -> 0 (float); None -> None (choose automatically)."""
    if text is None:
        return None
    if text not in BITS_CHOICES:
        raise BadRequest(f"bits must be one of {', '.join(BITS_CHOICES)} (got {text!r})")
    return 0 if text == "none" else int(text)


def checkpoint_quantization(config: dict) -> tuple[int, int] | None:
    """(bits, group_size) of a checkpoint that is already quantized, else None."""
    q = config.get("quantization") or (config.get("text_config") or {}).get("quantization")
    if not q or "bits" not in q:
        return None
    return int(q["bits"]), int(q.get("group_size", DEFAULT_GROUP_SIZE))


def choose(
    target_bits: str | None,
    drafter_bits: str | None,
    group_size: int | None,
    *,
    metal: bool,
    checkpoint: tuple[int, int] | None,
    drafter: bool = True,
) -> QuantChoice:
    """Resolve the --target-bits / --drafter-bits / --group-size flags (None = automatic).

    Defaults: the target stays as its checkpoint is. On a GPU backend (``metal``: Metal or
    another GPU) the drafter takes the measured precision (``GPU_DRAFTER_*``); on the CPU backend
    it stays float32 (see ``CPU_FLOAT_REASON``). An explicit --drafter-bits keeps the loaded
    activations (a 16-bit drafter computes in 16 bits; the run-time check catches non-finite passes).
    """
    group = group_size or DEFAULT_GROUP_SIZE
    why = []
    t = parse_bits(target_bits)
    if checkpoint is not None:
        if t is not None and t != checkpoint[0]:
            why.append(
                f"target checkpoint is already {checkpoint[0]}-bit: loaded as it is "
                f"(--target-bits {target_bits} not applied)"
            )
        t = checkpoint[0]
    t = t or None
    d = parse_bits(drafter_bits) if drafter else 0
    act = None
    if d is None:
        if metal:
            d, act = GPU_DRAFTER_BITS, GPU_DRAFTER_ACTIVATIONS
            why.append(GPU_DRAFTER_REASON)
        else:
            why.append("drafter: " + CPU_FLOAT_REASON)
    d = d or None
    if not metal and (t and checkpoint is None or d):
        why.append("quantized from float32, so scales are float32 (bf16 scales are ~10x slower on CPU)")
    return QuantChoice(t, d, group, checkpoint is not None, "; ".join(why), drafter, act if drafter else None)


# -- byte arithmetic (pure) ---------------------------------------------------------------------


def quantizable(t: Tensor, group_size: int) -> bool:
    """The rule of nn.quantize + mlx-lm: Linear/Embedding/SwitchLinear weights whose last dim
    divides by the group size (conv kernels, norms and biases stay as they are)."""
    named = t.name.endswith(".weight") or t.name.endswith("_codebook")
    return named and len(t.shape) >= 2 and t.shape[-1] % group_size == 0 and t.dtype in FLOATS


def quantized_nbytes(numel: int, bits: int, group_size: int, scale_bytes: int) -> int:
    """Packed weights plus one scale and one bias per group (affine mode)."""
    return numel * bits // 8 + 2 * (numel // group_size) * scale_bytes


def loaded_nbytes(tensors: Iterable[Tensor], *, bits: int | None, group_size: int, float_bytes: int | None) -> int:
    """Bytes the tensors take once loaded: floats cast to ``float_bytes`` (None: as stored),
    quantizable weights quantized to ``bits`` unless the file already holds them quantized."""
    tensors = list(tensors)
    names = {t.name for t in tensors}
    total = 0
    for t in tensors:
        prequant = t.name.endswith(".weight") and t.name[: -len(".weight")] + ".scales" in names
        size = float_bytes if (float_bytes and t.dtype in FLOATS) else DTYPE_BYTES.get(t.dtype, 4)
        if bits and not prequant and quantizable(t, group_size):
            total += quantized_nbytes(t.numel, bits, group_size, size)
        else:
            total += t.numel * size
    return total


def safetensors_tensors(path: str | Path) -> list[Tensor]:
    """Shapes and dtypes of every tensor in a checkpoint folder, read from the file headers."""
    out = []
    for f in sorted(Path(path).glob("*.safetensors")):
        header = safetensors_header(f)  # checked against the file (BadModelFile)
        out += [Tensor(k, v[1], v[0]) for k, v in header.items() if k != "__metadata__"]
    return out


def module_tensors(module) -> list[Tensor]:
    """Parameter shapes of a (possibly lazy, never evaluated) nn.Module."""
    names = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}
    return [Tensor(k, tuple(v.shape), names.get(v.dtype, "F32")) for k, v in tree_flatten(module.parameters())]


def skeleton(config: dict):
    """An mlx-lm model built from a config without evaluating its weights (shapes only)."""
    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


# -- quantizing a module (MLX) ------------------------------------------------------------------


def is_quantized(module) -> bool:
    return any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or "scales" in m for _, m in module.named_modules()
    )


def quantize_module(module, bits: int, group_size: int) -> int:
    """Quantize, in place and lazily, every layer nn.quantize can, honouring an mlx-lm
    ``quant_predicate``. Returns the number of layers quantized."""
    special = getattr(module, "quant_predicate", None)
    count = 0

    def predicate(path, m):
        nonlocal count
        if not hasattr(m, "to_quantized") or m.weight.shape[-1] % group_size:
            return False
        keep = special(path, m) if special is not None else True
        count += bool(keep)
        return keep

    nn.quantize(module, group_size, bits, class_predicate=predicate)
    return count


def materialize(module) -> None:
    """Evaluate parameters one tensor at a time: with lazily loaded weights, each float source is
    freed as soon as its quantized copy exists, so the peak stays near the final size."""
    for _, v in tree_flatten(module.parameters()):
        mx.eval(v)


def prepare(
    module, *, bits: int | None, group_size: int, dtype=None, what: str = "model", before_materialize=None
) -> None:
    """Cast floats to ``dtype`` (None: keep), quantize to ``bits`` unless already quantized,
    then materialize. Cast first: on CPU quantizing from float32 gives float32 scales.
    ``before_materialize(module)`` (e.g. sharding over a group) runs on the still lazy weights."""
    if dtype is not None:
        module.set_dtype(dtype)
    if bits:
        if is_quantized(module):
            log.info("%s is already quantized; loaded as it is", what)
        else:
            n = quantize_module(module, bits, group_size)
            log.info("%s: quantized %d layers to %d bits (group %d)", what, n, bits, group_size)
    if before_materialize is not None:
        before_materialize(module)
    materialize(module)


__all__ = [
    "QuantChoice",
    "Tensor",
    "choose",
    "parse_bits",
    "checkpoint_quantization",
    "quantizable",
    "quantized_nbytes",
    "loaded_nbytes",
    "safetensors_tensors",
    "module_tensors",
    "skeleton",
    "is_quantized",
    "quantize_module",
    "materialize",
    "prepare",
    "BITS_CHOICES",
    "DEFAULT_GROUP_SIZE",
    "CPU_FLOAT_REASON",
    "GPU_DRAFTER_BITS",
    "GPU_DRAFTER_ACTIVATIONS",
]
