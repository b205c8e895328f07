"""Target adapter: one forward over ids returns logits and the drafter's tapped features.

We run the decoder-layer loop ourselves (the same masks mlx-lm builds), so no mlx-lm class or
instance is patched. ``taps`` are layer *outputs*: tap j is the output of decoder layer j,
i.e. Hugging Face ``hidden_states[j + 1]``, before the final norm.

Hybrid targets (qwen3_5, qwen3_5_moe, qwen3_next) mix GatedDeltaNet layers, whose recurrent cache
cannot be trimmed, with attention layers. A verify pass called with ``record=True`` records the
GDN inputs, and ``rollback`` rebuilds the GDN state of the accepted prefix (see hybrid.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from . import gdn
from .errors import MlxSpecError, UnsupportedModel

# model_type -> layer-loop family. Dense families have only trimmable KVCache layers.
DENSE = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}
SUPPORTED = DENSE | gdn.HYBRID


@dataclass(frozen=True, slots=True)
class KVQuant:
    """The target's K/V cache quantized (``--kv-bits``): every attention layer's cache is mlx-lm's
    ``QuantizedKVCache`` from the first row on, so each row is quantized (per ``group_size``
    elements of a head) before any query reads it. Rows are quantized independently, so a prefix
    of a cache, trimmed or stored, is exactly what a prefill of that prefix gives."""

    bits: int
    group_size: int = 64

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"K/V bits must be 4 or 8 (got {self.bits})")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"the K/V group size must be 32, 64 or 128 (got {self.group_size})")

    def describe(self) -> str:
        return f"{self.bits}-bit K/V (group {self.group_size})"


def kv_problem(model: nn.Module, kv: KVQuant) -> str | None:
    """Why ``model``'s K/V cannot be quantized as ``kv`` says (None: it can): a hybrid target's
    recurrent (gated delta-net) state is no K/V rows and is not quantized; a sliding-window
    (rotating) cache is not either; a head width must split into whole groups."""
    cache = make_prompt_cache(model)
    others = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if others:
        what = (
            "a hybrid target: its gated delta-net layers keep a recurrent state, not K/V rows, which is not quantized"
            if "ArraysCache" in others
            else f"its layers keep {', '.join(others)} caches, which are not quantized"
        )
        return f"--kv-bits: target '{_model_type(model)}' is {what} (plain K/V caches only)"
    args = getattr(getattr(model, "language_model", model), "args", None)
    heads = getattr(args, "num_attention_heads", 1) or 1
    head_dim = getattr(args, "head_dim", None) or getattr(args, "hidden_size", 0) // heads
    if head_dim % kv.group_size:
        fits = ", ".join(str(g) for g in (32, 64, 128) if not head_dim % g)
        return f"--kv-bits: the target's head width {head_dim} does not split into groups of {kv.group_size} " + (
            f"(--kv-group-size {fits} does)" if fits else "(no K/V group size fits it)"
        )
    return None


def make_cache(model: nn.Module, kv: KVQuant | None = None) -> list[Any]:
    """mlx-lm's prompt cache for ``model``; with ``kv``, every plain K/V layer quantized
    (``QuantizedKVCache``). The one cache every path makes, plain decoding and ours alike."""
    cache = make_prompt_cache(model)
    if kv is None:
        return cache
    return [QuantizedKVCache(kv.group_size, kv.bits) if type(c) is KVCache else c for c in cache]


class TargetOut(NamedTuple):
    logits: mx.array  # (B, T, V), or (B, 1, V) with last_only
    hidden: mx.array | None  # (B, T, n_taps * H) concat of tapped layer outputs
    final: mx.array | None = None  # (B, T, H) the last hidden after the final norm (final_hidden=True)


class _Tape(NamedTuple):
    """The GDN records of the latest ``record=True`` pass, bound to the cache it advanced."""

    cache: list
    length: int
    records: dict  # layer index -> gdn.GDNRecord


def text_parts(model: nn.Module):
    """(inner decoder, embedding, head, args) of an mlx-lm causal LM."""
    lm = getattr(model, "language_model", model)
    inner = lm.model
    args = lm.args
    head = inner.embed_tokens.as_linear if getattr(args, "tie_word_embeddings", False) else lm.lm_head
    return inner, inner.embed_tokens, head, args


def _model_type(model: nn.Module) -> str | None:
    mt = getattr(model, "model_type", None)
    return mt or getattr(getattr(model, "args", None), "model_type", None)


def _refusal(model: nn.Module, model_type: str | None) -> str:
    msg = f"target architecture '{model_type}' is not supported for speculative decoding"
    try:
        problems = gdn.rollback_problems(list(model.layers), make_prompt_cache(model))
    except Exception:  # an unknown layout: the architecture name is all we can say
        problems = []
    if problems:
        msg += ": " + "; ".join(problems)
    return msg + f" (supported: {', '.join(sorted(SUPPORTED))})"


def feature_view(taps: Sequence[int], want: Sequence[int]) -> Callable[[mx.array], mx.array]:
    """The features of the taps ``want`` (in that order) out of a pass's concatenated ``taps``:
    the whole array when they are the same, a slice when contiguous, else the chunks joined."""
    taps, want = tuple(taps), tuple(want)
    missing = [j for j in want if j not in taps]
    if missing:
        raise UnsupportedModel(f"the target view does not tap layers {missing} (it taps {list(taps)})")
    if want == taps:
        return lambda h: h
    idx = [taps.index(j) for j in want]
    n = len(taps)
    if idx == list(range(idx[0], idx[0] + len(idx))):
        a, b = idx[0], idx[-1] + 1
        return lambda h: h[..., a * (h.shape[-1] // n) : b * (h.shape[-1] // n)]

    def view(h):
        w = h.shape[-1] // n
        return mx.concatenate([h[..., i * w : (i + 1) * w] for i in idx], axis=-1)

    return view


def union_taps(*sets: Sequence[int]) -> tuple[int, ...]:
    """Every tap of ``sets``, each once, in the order first seen: the one target view that
    serves several drafters (each takes its slice with ``feature_view``)."""
    out: list[int] = []
    for taps in sets:
        out += [j for j in taps if j not in out]
    return tuple(out)


class Target:
    """Wraps an mlx-lm model.

    Args:
        model: an mlx-lm model of a supported architecture.
        taps: decoder layers whose outputs the drafter reads.
        restore: GDN rollback function (``gdn.restore``); injectable so tests can break it.
        final_hidden: also return the last hidden state after the final norm (the LM head's
            input) as ``TargetOut.final``: what an MTP head reads (chain.py).
        kv: quantize the K/V cache (``KVQuant``, ``--kv-bits``); refused by name where it
            cannot work (``kv_problem``).
    """

    def __init__(
        self,
        model: nn.Module,
        taps: Sequence[int] = (),
        *,
        restore: Callable[..., None] = gdn.restore,
        final_hidden: bool = False,
        kv: KVQuant | None = None,
    ):
        self.model = model
        self.model_type = _model_type(model)
        if self.model_type not in SUPPORTED:
            raise UnsupportedModel(_refusal(model, self.model_type))
        self.inner, self.embed, self.head, self.args = text_parts(model)
        self.layers = list(self.inner.layers)  # the inner list: `model.layers` is a fresh slice
        self.num_layers = len(self.layers)
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.taps = tuple(taps)
        bad = [j for j in self.taps if not 0 <= j < self.num_layers]
        if bad:
            raise UnsupportedModel(f"tap layers {bad} out of range for a {self.num_layers}-layer target")
        problems = gdn.rollback_problems(self.layers, make_prompt_cache(model))
        if problems:
            raise UnsupportedModel(f"target '{self.model_type}': " + "; ".join(problems))
        self.gdn = {i for i, layer in enumerate(self.layers) if gdn.is_gdn(layer)}
        if self.gdn:
            if getattr(self.inner, "pipeline_size", 1) > 1:
                raise UnsupportedModel(
                    "pipelined hybrid targets are not supported (tensor-parallel sharding with mlx-lm's shard() is)"
                )
            gdn.check_mirror(self.layers[min(self.gdn)], self.model_type)
        self.restore = restore
        self.final_hidden = final_hidden
        self._tape: _Tape | None = None
        if kv is not None and (why := kv_problem(model, kv)) is not None:
            raise UnsupportedModel(why)
        self.kv = kv

    @property
    def head_module(self) -> nn.Module:
        """The module holding the output head's weight: the tied embedding or ``lm_head``."""
        if getattr(self.args, "tie_word_embeddings", False):
            return self.inner.embed_tokens
        return getattr(self.model, "language_model", self.model).lm_head

    def head_rows(self, ids: mx.array) -> Callable[[mx.array], mx.array]:
        """The output head restricted to the rows ``ids``: (..., H) -> (..., len(ids)) logits,
        equal to ``head(h)[..., ids]`` (float or quantized head, tied or not) at K/V the cost."""
        m = self.head_module
        bias = m["bias"][ids] if "bias" in m else None
        if isinstance(m, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
            w, scales = m["weight"][ids], m["scales"][ids]
            biases = m["biases"][ids] if "biases" in m else None
            mx.eval(w, scales, *([biases] if biases is not None else []))

            def head(h):
                return mx.quantized_matmul(
                    h,
                    w,
                    scales=scales,
                    biases=biases,
                    transpose=True,
                    group_size=m.group_size,
                    bits=m.bits,
                    mode=m.mode,
                )
        else:
            w = m["weight"][ids]
            mx.eval(w)

            def head(h):
                return h @ w.T

        if bias is None:
            return head
        return lambda h: head(h) + bias

    def make_cache(self) -> list[Any]:
        return make_cache(self.model, self.kv)

    def __call__(
        self, ids: mx.array, cache: list[Any], *, last_only: bool = False, taps: bool = True, record: bool = False
    ) -> TargetOut:
        """ids (B, T) -> logits and tapped features, advancing ``cache`` by T.

        ``record=True`` marks a verify pass: a later ``rollback`` may keep only a prefix of it.
        """
        h = self.embed(ids)
        if self.gdn:
            fa_mask = create_attention_mask(h, cache[self.inner.fa_idx])
            ssm_mask = create_ssm_mask(h, cache[self.inner.ssm_idx])
        else:
            fa_mask, ssm_mask = create_attention_mask(h, cache[0]), None
        records: dict[int, gdn.GDNRecord] = {}
        feats = []
        want = set(self.taps) if taps else set()
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            if i not in self.gdn:
                h = layer(h, fa_mask, cache=c)
            elif record:
                rec: list = []
                h = gdn.gdn_block(layer, h, ssm_mask, c, rec)
                records[i] = rec[0]
            else:
                h = layer(h, ssm_mask, cache=c)
            if i in want:
                feats.append(h)
        self._tape = _Tape(cache, ids.shape[1], records) if record and self.gdn else None
        final = self.final_hidden and taps
        if last_only and not final:
            h = h[:, -1:]
        normed = self.inner.norm(h)
        logits = self.head(normed[:, -1:] if last_only and final else normed)
        hidden = None
        if feats:
            order = sorted(want)
            hidden = mx.concatenate([feats[order.index(j)] for j in self.taps], axis=-1)
        return TargetOut(logits, hidden, normed if final else None)

    def rollback(self, cache: list[Any], n_verified: int, n_keep: int, wait: Callable = mx.eval) -> None:
        """Keep the first ``n_keep`` positions of the last ``n_verified``-token pass, drop the rest.

        Attention caches are trimmed; GDN caches are rebuilt from the ``record=True`` pass's tape
        and evaluated by ``wait`` (the decode loop's ``DeviceWaits.eval``, so the wait is counted).
        """
        tape, self._tape = self._tape, None
        n = n_verified - n_keep
        if n <= 0:
            return
        if not self.gdn:
            for c in cache:
                c.trim(n)
            return
        if tape is None or tape.cache is not cache or tape.length != n_verified:
            raise MlxSpecError(
                "rolling back a hybrid target needs the verify pass to be run with record=True "
                "on the same cache, immediately before"
            )
        gdn = sorted(self.gdn)
        for i, c in enumerate(cache):
            if i not in self.gdn:
                c.trim(n)
        self.restore(
            [cache[i] for i in gdn], [tape.records[i] for i in gdn], [self.layers[i].linear_attn for i in gdn], n_keep
        )
        wait([cache[i].cache for i in gdn])
