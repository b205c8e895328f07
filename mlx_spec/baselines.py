"""Baseline speculative loops that bench compares DFlash against, as generators of ``Step``s.

``lookup_steps``: prompt-lookup (n-gram) drafting. The draft is the continuation of the latest
earlier occurrence of the context's last n tokens (n = ngram_max .. 1); it costs no model pass.
``ar_draft_steps``: mlx-lm's own ``speculative_generate_step`` with a small autoregressive draft
model, regrouped into one Step per draft round.
``peer_steps``: the official ``dflash`` package's MLX loop (``load_peer``) on the same files.

All are greedy (bench compares at temperature 0) and lossless: every committed token is the
target's argmax given the committed prefix.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import mlx.core as mx
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from . import backend
from .batch import Step, truncate_reply
from .errors import MlxSpecError
from .loading import load_target_model, resolve
from .sampling import accept_greedy


def find_draft(history: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the last n tokens (n large first)."""
    size = len(history)
    if k <= 0:
        return []
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = list(history[size - n :])
        first = tail[0]
        for i in range(size - n - 1, -1, -1):
            if history[i] == first and list(history[i : i + n]) == tail:
                return list(history[i + n : i + n + k])
    return []


def lookup_steps(
    model,
    prompt: Sequence[int],
    *,
    num_draft: int,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    ngram_max: int = 3,
    prefill_step: int = 2048,
) -> Iterator[Step]:
    """Greedy speculative decoding of an mlx-lm model with prompt-lookup drafts."""
    if not prompt:
        raise ValueError("empty prompt")
    eos = frozenset(eos_ids)
    cache = make_prompt_cache(model)
    if not can_trim_prompt_cache(cache):
        raise ValueError("prompt lookup needs a trimmable target cache")
    t0 = time.perf_counter()
    x = mx.array(list(prompt), mx.int32)[None]
    for s in range(0, x.shape[1], prefill_step):
        logits = model(x[:, s : s + prefill_step], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    first = mx.argmax(logits[0, -1]).item()
    toks, reason = truncate_reply([first], 0, max_tokens, eos)
    ms = (time.perf_counter() - t0) * 1e3
    yield Step(tuple(toks), elapsed_ms=ms, verify_ms=ms, prefill=True, prompt_tokens=len(prompt), finish_reason=reason)
    history = list(prompt) + toks
    n = len(toks)
    while reason is None:
        tc = time.perf_counter()
        drafts = find_draft(history, min(num_draft, max_tokens - n - 1), ngram_max)
        td = time.perf_counter()
        logits = model(mx.array([history[-1:] + drafts], mx.int32), cache=cache)
        choice = mx.argmax(logits[0], axis=-1).tolist()
        tv = time.perf_counter()
        a, bonus = accept_greedy(drafts, choice)
        trim_prompt_cache(cache, len(drafts) - a)
        committed, reason = truncate_reply(drafts[:a] + [bonus], n, max_tokens, eos)
        n += len(committed)
        history.extend(committed)
        yield Step(
            tuple(committed),
            drafted=len(drafts),
            accepted=a,
            block_size=len(drafts) + 1,
            source="lookup",
            draft_ms=(td - tc) * 1e3,
            verify_ms=(tv - td) * 1e3,
            elapsed_ms=(time.perf_counter() - tc) * 1e3,
            finish_reason=reason,
        )


def ar_draft_steps(
    model,
    draft_model,
    prompt: Sequence[int],
    *,
    num_draft: int,
    max_tokens: int,
    eos_ids: Sequence[int] = (),
    prefill_step: int = 2048,
) -> Iterator[Step]:
    """mlx-lm's ``speculative_generate_step`` (greedy), one Step per draft round.

    mlx-lm has no separate first token: its first round drafts straight after prefill, so the
    first Step's time includes the prefill.
    """
    eos = frozenset(eos_ids)
    gen = speculative_generate_step(
        mx.array(list(prompt), mx.uint32),
        model,
        draft_model,
        num_draft_tokens=num_draft,
        max_tokens=max_tokens,
        prefill_step_size=prefill_step,
    )
    t = time.perf_counter()
    n, toks, from_draft = 0, [], 0
    try:
        for tok, _, drafted in gen:
            toks.append(tok)
            from_draft += bool(drafted)
            if drafted and tok not in eos and n + len(toks) < max_tokens:
                continue  # the round goes on until the target's own token
            drafts = min(num_draft, max_tokens - n)  # what mlx-lm drafted this round
            committed, reason = truncate_reply(toks, n, max_tokens, eos)
            now = time.perf_counter()
            yield Step(
                tuple(committed),
                drafted=drafts,
                accepted=from_draft,
                block_size=drafts + 1,
                elapsed_ms=(now - t) * 1e3,
                verify_ms=(now - t) * 1e3,
                finish_reason=reason,
            )
            n += len(committed)
            t, toks, from_draft = now, [], 0
            if reason:
                return
    finally:
        gen.close()


class Peer(NamedTuple):
    """The official ``dflash`` package's MLX loop on the same files (a separate target copy:
    that loop wraps the target's tapped layers in place)."""

    module: object
    model: object
    draft: object
    tokenizer: object


def load_peer(pair) -> Peer:
    """Load ``dflash==0.1.0`` (``pip install --no-deps dflash==0.1.0``) on the pair's files."""
    try:
        from dflash import model_mlx as dm  # (optional: the official dflash package, a peer bench compares against)
    except ImportError as e:
        raise MlxSpecError(
            f"the official dflash package is not importable ({e}); install it with: pip install --no-deps dflash==0.1.0"
        ) from None
    model, tokenizer = load_target_model(pair.target_id)
    path = resolve(pair.drafter_id, "drafter")
    cfg = json.loads((path / "config.json").read_text())
    dc = cfg.get("dflash_config", {})
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    n = cfg["num_hidden_layers"]
    # dflash.model_mlx.load_draft only takes hub ids; the same mapping for a local directory.
    config = dm.DFlashConfig(
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=n,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=cfg["max_position_embeddings"],
        block_size=int(dc.get("block_size", cfg.get("block_size", 16))),
        target_layer_ids=tuple(dc["target_layer_ids"]),
        num_target_layers=cfg["num_target_layers"],
        mask_token_id=dc["mask_token_id"],
        rope_scaling=rope,
        layer_types=tuple(cfg.get("layer_types") or ["full_attention"] * n),
        sliding_window=cfg.get("sliding_window"),
        final_logit_softcapping=dc.get("final_logit_softcapping", cfg.get("final_logit_softcapping")),
        input_embedding_scale=float(dc.get("input_embedding_scale", 1.0)),
        output_multiplier=float(dc.get("output_multiplier", 1.0)),
        conv_kernel_size=int(dc.get("conv_kernel_size", 0)),
        conv_group_size=int(dc.get("conv_group_size", 0)),
        selector_rank=int(dc.get("selector_rank", 0)),
        selector_top_k=int(dc.get("selector_top_k", 0)),
        is_causal=cfg.get("is_causal"),
    )
    weights = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    v2 = "DFlash2DraftModel" in (cfg.get("architectures") or [])
    if v2:
        for name in ("predecessor_codebook", "successor_codebook"):
            weights[f"candidate_selector.{name}.weight"] = weights.pop(f"candidate_selector.{name}")
    draft = (dm.DFlash2DraftModel if v2 else dm.DFlashDraftModel)(config)
    draft.eval()
    draft.load_weights(list(weights.items()))

    if backend.current().cast_float32:
        draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    return Peer(dm, model, draft, tokenizer)


def peer_steps(
    peer: Peer, prompt: Sequence[int], *, block_size: int, max_tokens: int, eos_ids: Sequence[int] = ()
) -> Iterator[Step]:
    """The official loop's responses as Steps (it stops at the tokenizer's EOS by itself)."""
    gen = peer.module.stream_generate(
        peer.model, peer.draft, peer.tokenizer, list(prompt), block_size=block_size, max_tokens=max_tokens
    )
    t = time.perf_counter()
    n = 0
    try:
        for r in gen:
            toks = list(r.tokens)
            if not toks:
                return
            now = time.perf_counter()
            ms = (now - t) * 1e3
            L = min(block_size, max_tokens - n + 1)
            n += len(toks)
            reason = r.finish_reason or ("length" if n >= max_tokens else None)
            if n == len(toks):
                yield Step(
                    tuple(toks),
                    elapsed_ms=ms,
                    verify_ms=ms,
                    prefill=True,
                    prompt_tokens=len(prompt),
                    finish_reason=reason,
                )
            else:
                yield Step(
                    tuple(toks),
                    drafted=L - 1,
                    accepted=len(toks) - 1,
                    block_size=L,
                    elapsed_ms=ms,
                    verify_ms=ms,
                    finish_reason=reason,
                )
            t = now
            if reason:
                return
    finally:
        gen.close()


def layer_skip_draft(model, n_layers: int):
    """An AR draft made of the target's first ``n_layers`` layers, final norm and head (shared,
    no copy): the only small draft model a lone target ships with (self-speculation)."""
    lm = getattr(model, "language_model", model)
    if not 0 < n_layers < len(lm.model.layers):
        raise ValueError(f"layer-skip draft needs 0 < layers < {len(lm.model.layers)} (got {n_layers})")
    draft = copy.copy(lm)  # shallow: the submodules below are the target's own
    draft.model = copy.copy(lm.model)
    draft.model.layers = lm.model.layers[:n_layers]
    return draft
