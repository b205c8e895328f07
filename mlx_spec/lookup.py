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

import gc
import time
from typing import Iterator, NamedTuple, Sequence

import mlx.core as mx

from .decode import Step, _finish
from .sampling import accept_greedy


class SuffixIndex:
    """An n-gram index over a growing token sequence, for lookup drafts inside ``spec_steps``.

    For every n in 1..``ngram_max`` it maps each n-gram to the (up to ``keep``) latest positions
    that follow it, updated incrementally as tokens are appended (``extend``: O(ngram_max) per
    token, no rescans). ``propose(k)`` finds the earlier occurrences of the sequence's last n
    tokens (n large first) and, among them, the one whose match extends furthest back (up to
    ``max_match`` tokens; ties: one that does not continue with a ``stop`` token, then the
    latest), and returns ``k`` tokens that followed it (where they run past the end, the copy
    continues periodically: a repeating tail keeps repeating; cut after a ``stop`` token, which
    would end the reply) and that match length.

    With ``follow`` (the default) it also follows the copy the appended tokens make (not the
    constructor's ``ids``, the prompt): a pointer to where the reply is copying from, moved on
    by each token that continues it. So an agent's edit of a file it was given is followed:

    - locality: the pointer's candidate wins ties of match length (the file's next line, not
      the latest line that ends the same way: after a blank line, a fence, a common token);
    - re-sync: when a copy of at least ``long`` tokens breaks (a rename, an inserted docstring,
      a deleted line), the index remembers where in its source it broke; while the tail's own
      match is short (below 4 tokens), a candidate found by the tail's last token from the
      token before that point to ``window`` tokens after it (the reply re-joins the source
      after the edit: after an insertion at the point itself, after a rename or a deletion of
      up to ``window`` tokens further on) wins unless the tail's match is 2 tokens longer. It
      is forgotten once a copy runs again for 3 tokens, or after ``expire`` tokens.

    The index only proposes: the target verifies every draft (greedy output is plain decoding's).
    """

    def __init__(self, ids: Sequence[int] = (), ngram_max: int = 4, *, keep: int = 4, max_match: int = 64,
                 stop: Sequence[int] = (), follow: bool = True, window: int = 16, long: int = 6, expire: int = 48):
        if ngram_max < 1:
            raise ValueError(f"ngram_max must be >= 1 (got {ngram_max})")
        self.ngram_max, self.keep, self.max_match = ngram_max, keep, max_match
        self.stop = frozenset(int(t) for t in stop)
        self.window, self.long, self.expire = window, long, expire
        self.ids: list[int] = []
        self._at: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(ngram_max + 1)]
        self.pointer: int | None = None  # where the copy continues: ids[pointer] is its next token
        self._run = 0  # tokens the pointer has followed since it was taken
        self.broke: int | None = None  # where in its source the last long copy broke
        self._since = 0  # tokens appended since it broke
        self._follow = False  # the constructor's ids (the prompt) are the source, not a copy
        self._chosen: tuple[int, tuple[int | None, int]] | None = None  # (len(ids), _choose()) at that length
        self.extend(ids)
        self._follow = follow

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, ids: Sequence[int]) -> None:
        if len(ids) > 256:  # a prompt: new containers by the thousand would trigger full GC passes
            enabled = gc.isenabled()
            gc.disable()
            try:
                self._extend(ids)
            finally:
                if enabled:
                    gc.enable()
        else:
            self._extend(ids)

    def _extend(self, ids: Sequence[int]) -> None:
        h, keep = self.ids, self.keep
        for t in ids:
            h.append(int(t))
            p = len(h) - 1  # the new token follows the n-grams ending at p - 1
            for n in range(1, min(self.ngram_max, p) + 1):
                key = tuple(h[p - n:p])
                where = self._at[n].get(key)
                if where is None:
                    self._at[n][key] = [p]
                else:
                    where.append(p)
                    if len(where) > keep:
                        del where[0]
            if self._follow:
                self._step(p)

    def _step(self, p: int) -> None:
        """Token ``p`` was appended: move the pointer on, or note where the copy broke and take
        the best candidate for the new tail."""
        h = self.ids
        if self.pointer is not None and self.pointer < p and h[self.pointer] == h[p]:
            self.pointer += 1
            self._run += 1
            if self._run >= 3:  # copying again: the break is behind
                self.broke = None
            return
        if self.pointer is not None and self._run >= self.long:
            self.broke, self._since = self.pointer, 0
        if self.broke is not None:
            self._since += 1
            if self._since > self.expire:
                self.broke = None
        self.pointer = None
        self.pointer, self._run = self._choice()[0], 0

    def _match(self, j: int) -> int:
        """How many tokens before position j equal the sequence's last tokens."""
        h, end, m = self.ids, len(self.ids), 0
        while m < self.max_match and j - 1 - m >= 0 and h[j - 1 - m] == h[end - 1 - m]:
            m += 1
        return m

    def _longest(self) -> tuple[int | None, int]:
        """(position, match) of the kept occurrence of the tail's last n tokens (n large first)
        whose match extends furthest back; ties: not followed by a stop token, then the latest."""
        h = self.ids
        for n in range(min(self.ngram_max, len(h) - 1), 0, -1):
            where = self._at[n].get(tuple(h[-n:]))
            if where:
                best_j, best = where[-1], None
                for j in reversed(where):
                    key = (self._match(j), h[j] not in self.stop)
                    if best is None or key > best:
                        best_j, best = j, key
                return best_j, best[0]
        return None, 0

    def _rejoin(self) -> tuple[int | None, int]:
        """(position, match) after the tail's last token from the token before the break (an
        insertion that ends as the text before it did re-joins at the break) to ``window``
        tokens after it: the longest match, ties: the nearest."""
        h, best_j, best_m = self.ids, None, 0
        t = h[-1]
        for s in range(max(0, self.broke - 1), min(self.broke + self.window + 1, len(h) - 1)):
            if h[s] == t:
                m = self._match(s + 1)
                if m > best_m:
                    best_j, best_m = s + 1, m
        return best_j, best_m

    def _choice(self) -> tuple[int | None, int]:
        """``_choose()`` once per length of the sequence. Where ``_step`` took the pointer from
        it, the pointer it set does not change the choice (the pointer's own match is the one it
        was chosen at, which won then), so ``propose`` reuses it."""
        if self._chosen is None or self._chosen[0] != len(self.ids):
            self._chosen = (len(self.ids), self._choose())
        return self._chosen[1]

    def _choose(self) -> tuple[int | None, int]:
        """(position the proposal copies from, its match length), or (None, 0)."""
        j, m = self._longest()
        if self.pointer is not None:
            pm = self._match(self.pointer)
            if pm > 0 and (j is None or pm >= m):
                return self.pointer, pm
        if self.broke is not None and (j is None or m < 4):
            rj, rm = self._rejoin()
            if rj is not None and (j is None or m < rm + 2):
                return rj, rm
        return j, m

    def propose(self, k: int) -> tuple[list[int], int]:
        """(up to ``k`` tokens that followed the best earlier match of the tail, its length)."""
        h = self.ids
        if k <= 0 or len(h) < 2:
            return [], 0
        j, m = self._choice() if self._follow else self._longest()
        if j is None:
            return [], 0
        out = h[j:j + k]
        period = len(h) - j  # past the end, the copy continues itself
        while len(out) < k:
            out.append(out[len(out) - period])
        for i, t in enumerate(out):
            if t in self.stop:  # the reply would end there
                return out[:i + 1], m
        return out, m


def find_draft(history: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the last n tokens (n large first)."""
    size = len(history)
    if k <= 0:
        return []
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = list(history[size - n:])
        first = tail[0]
        for i in range(size - n - 1, -1, -1):
            if history[i] == first and list(history[i:i + n]) == tail:
                return list(history[i + n:i + n + k])
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
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    if not prompt:
        raise ValueError("empty prompt")
    eos = frozenset(eos_ids)
    cache = make_prompt_cache(model)
    if not can_trim_prompt_cache(cache):
        raise ValueError("prompt lookup needs a trimmable target cache")
    t0 = time.perf_counter()
    x = mx.array(list(prompt), mx.int32)[None]
    for s in range(0, x.shape[1], prefill_step):
        logits = model(x[:, s:s + prefill_step], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    first = mx.argmax(logits[0, -1]).item()
    toks, reason = _finish([first], 0, max_tokens, eos)
    ms = (time.perf_counter() - t0) * 1e3
    yield Step(tuple(toks), elapsed_ms=ms, verify_ms=ms, prefill=True, prompt_tokens=len(prompt),
               finish_reason=reason)
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
        committed, reason = _finish(drafts[:a] + [bonus], n, max_tokens, eos)
        n += len(committed)
        history.extend(committed)
        yield Step(tuple(committed), drafted=len(drafts), accepted=a, block_size=len(drafts) + 1, source="lookup",
                   draft_ms=(td - tc) * 1e3, verify_ms=(tv - td) * 1e3,
                   elapsed_ms=(time.perf_counter() - tc) * 1e3, finish_reason=reason)


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
    from mlx_lm.generate import speculative_generate_step

    eos = frozenset(eos_ids)
    gen = speculative_generate_step(mx.array(list(prompt), mx.uint32), model, draft_model,
                                    num_draft_tokens=num_draft, max_tokens=max_tokens,
                                    prefill_step_size=prefill_step)
    t = time.perf_counter()
    n, toks, from_draft = 0, [], 0
    try:
        for tok, _, drafted in gen:
            toks.append(tok)
            from_draft += bool(drafted)
            if drafted and tok not in eos and n + len(toks) < max_tokens:
                continue  # the round goes on until the target's own token
            drafts = min(num_draft, max_tokens - n)  # what mlx-lm drafted this round
            committed, reason = _finish(toks, n, max_tokens, eos)
            now = time.perf_counter()
            yield Step(tuple(committed), drafted=drafts, accepted=from_draft, block_size=drafts + 1,
                       elapsed_ms=(now - t) * 1e3, verify_ms=(now - t) * 1e3, finish_reason=reason)
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
    import json

    from .errors import MlxSpecError
    from .loading import load_target_model, resolve

    try:
        from dflash import model_mlx as dm
    except ImportError as e:
        raise MlxSpecError(f"the official dflash package is not importable ({e}); "
                           "install it with: pip install --no-deps dflash==0.1.0") from None
    model, tokenizer = load_target_model(pair.target_id)
    path = resolve(pair.drafter_id, "drafter")
    cfg = json.loads((path / "config.json").read_text())
    dc = cfg.get("dflash_config", {})
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    n = cfg["num_hidden_layers"]
    # dflash.model_mlx.load_draft only takes hub ids; the same mapping for a local directory.
    config = dm.DFlashConfig(
        hidden_size=cfg["hidden_size"], num_hidden_layers=n, num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=cfg["max_position_embeddings"],
        block_size=int(dc.get("block_size", cfg.get("block_size", 16))),
        target_layer_ids=tuple(dc["target_layer_ids"]), num_target_layers=cfg["num_target_layers"],
        mask_token_id=dc["mask_token_id"], rope_scaling=rope,
        layer_types=tuple(cfg.get("layer_types") or ["full_attention"] * n),
        sliding_window=cfg.get("sliding_window"),
        final_logit_softcapping=dc.get("final_logit_softcapping", cfg.get("final_logit_softcapping")),
        input_embedding_scale=float(dc.get("input_embedding_scale", 1.0)),
        output_multiplier=float(dc.get("output_multiplier", 1.0)),
        conv_kernel_size=int(dc.get("conv_kernel_size", 0)), conv_group_size=int(dc.get("conv_group_size", 0)),
        selector_rank=int(dc.get("selector_rank", 0)), selector_top_k=int(dc.get("selector_top_k", 0)),
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
    if not mx.metal.is_available():
        draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    return Peer(dm, model, draft, tokenizer)


def peer_steps(peer: Peer, prompt: Sequence[int], *, block_size: int, max_tokens: int,
               eos_ids: Sequence[int] = ()) -> Iterator[Step]:
    """The official loop's responses as Steps (it stops at the tokenizer's EOS by itself)."""
    gen = peer.module.stream_generate(peer.model, peer.draft, peer.tokenizer, list(prompt),
                                      block_size=block_size, max_tokens=max_tokens)
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
                yield Step(tuple(toks), elapsed_ms=ms, verify_ms=ms, prefill=True,
                           prompt_tokens=len(prompt), finish_reason=reason)
            else:
                yield Step(tuple(toks), drafted=L - 1, accepted=len(toks) - 1, block_size=L,
                           elapsed_ms=ms, verify_ms=ms, finish_reason=reason)
            t = now
            if reason:
                return
    finally:
        gen.close()


def layer_skip_draft(model, n_layers: int):
    """An AR draft made of the target's first ``n_layers`` layers, final norm and head (shared,
    no copy): the only small draft model a lone target ships with (self-speculation)."""
    import copy

    lm = getattr(model, "language_model", model)
    if not 0 < n_layers < len(lm.model.layers):
        raise ValueError(f"layer-skip draft needs 0 < layers < {len(lm.model.layers)} (got {n_layers})")
    draft = copy.copy(lm)  # shallow: the submodules below are the target's own
    draft.model = copy.copy(lm.model)
    draft.model.layers = lm.model.layers[:n_layers]
    return draft
