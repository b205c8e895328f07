"""Target adapter: one forward over ids returns logits and the drafter's tapped features.

We run the decoder-layer loop ourselves (the same masks mlx-lm builds), so no mlx-lm class or
instance is patched. ``taps`` are layer *outputs*: tap j is the output of decoder layer j,
i.e. Hugging Face ``hidden_states[j + 1]``, before the final norm.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .errors import UnsupportedModel

# model_type -> layer-loop family. Dense families have only trimmable KVCache layers.
DENSE = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}


class TargetOut(NamedTuple):
    logits: mx.array  # (B, T, V), or (B, 1, V) with last_only
    hidden: mx.array | None  # (B, T, n_taps * H) concat of tapped layer outputs


def text_parts(model: nn.Module):
    """(inner decoder, embedding, head, args) of an mlx-lm causal LM."""
    lm = getattr(model, "language_model", model)
    inner = lm.model
    args = lm.args
    head = inner.embed_tokens.as_linear if getattr(args, "tie_word_embeddings", False) else lm.lm_head
    return inner, inner.embed_tokens, head, args


class Target:
    """Wraps an mlx-lm model. Hybrid families extend ``rollback`` (see hybrid.py)."""

    def __init__(self, model: nn.Module, taps: Sequence[int] = ()):
        self.model = model
        self.model_type = getattr(model, "model_type", None) or model.args.model_type
        if self.model_type not in DENSE:
            raise UnsupportedModel(
                f"target architecture '{self.model_type}' is not supported for speculative "
                f"decoding (supported: {', '.join(sorted(DENSE))})"
            )
        self.inner, self.embed, self.head, self.args = text_parts(model)
        self.num_layers = len(self.inner.layers)
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.taps = tuple(taps)
        bad = [j for j in self.taps if not 0 <= j < self.num_layers]
        if bad:
            raise UnsupportedModel(f"tap layers {bad} out of range for a {self.num_layers}-layer target")
        if getattr(self.inner, "swa_idx", None) is not None:
            raise UnsupportedModel(
                f"target '{self.model_type}' has sliding-window layers whose rotating cache cannot "
                "be rolled back exactly"
            )

    def make_cache(self) -> list[Any]:
        cache = make_prompt_cache(self.model)
        bad = {type(c).__name__ for c in cache if not isinstance(c, KVCache)}
        if bad:
            raise UnsupportedModel(f"cannot roll back target cache types {sorted(bad)}")
        return cache

    def __call__(self, ids: mx.array, cache: list[Any], *, last_only: bool = False, taps: bool = True) -> TargetOut:
        """ids (B, T) -> logits and tapped features, advancing ``cache`` by T."""
        h = self.embed(ids)
        mask = create_attention_mask(h, cache[0])
        feats = []
        want = set(self.taps) if taps else set()
        for i, (layer, c) in enumerate(zip(self.inner.layers, cache)):
            h = layer(h, mask, cache=c)
            if i in want:
                feats.append(h)
        if last_only:
            h = h[:, -1:]
        logits = self.head(self.inner.norm(h))
        hidden = None
        if feats:
            order = sorted(want)
            hidden = mx.concatenate([feats[order.index(j)] for j in self.taps], axis=-1)
        return TargetOut(logits, hidden)

    def rollback(self, cache: list[Any], n_verified: int, n_keep: int) -> None:
        """Drop the last ``n_verified - n_keep`` positions of a verify pass."""
        n = n_verified - n_keep
        if n > 0:
            for c in cache:
                c.trim(n)
