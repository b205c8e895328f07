"""Autoregressive chain drafters (MTP heads, EAGLE-3 layers): one interface beside DFlash.

A chain drafter proposes one token per pass of a small head over its own K/V cache and runs k
passes per cycle, feeding its own output hidden state into the next pass. DFlash proposes a
whole block in one pass (drafter.py); both hand the decode loop a ``drafter.Proposal``, so
acceptance (``sampling.accept_greedy`` / ``accept_sampled``) is shared unchanged.

The interface (``ChainDrafter``), for the decode loop:

- ``make_cache() -> ChainCache``: a fresh draft-side cache for one sequence.
- ``add_context(features, tokens, cache)``: committed rows. ``features`` (1, n, F) are the
  target's taps at n consecutive committed positions, ``tokens`` (n,) the committed ids *at those
  same positions* (the ids the target was fed there). Row i is paired with the token after it
  (``tokens[i + 1]``); the last row waits for its successor, which is the next ``propose``'s
  anchor (or the next ``add_context``'s ``tokens[0]``). So the prefill calls it with the prompt's
  features and ids, and each cycle with the features of ``[anchor, accepted drafts]`` and those
  ids — exactly what the verify pass fed and returned. Cheap: rows are queued and run inside the
  next ``propose``'s first pass.
- ``propose(anchor, k, cache, *, sampling, key) -> Proposal``: k drafts after ``anchor`` (the
  last committed token). Pass 1 runs the queued rows and the row (last feature, anchor); pass
  j > 1 runs (own hidden of pass j-1, draft j-1). ``Proposal.tokens`` (k,) are target ids;
  at T > 0 ``Proposal.q`` (k, V) is the exact distribution each draft was drawn from (the
  target's sampling rule applied to the head's logits, scattered back to the full target
  vocabulary when the head drafts over a reduced one), which ``accept_sampled`` takes as is.
- ``rollback(cache, n_keep=None)``: drop draft rows. With no ``n_keep`` it keeps the rows built
  from target features (what ``add_context`` and the anchor gave), dropping the k - 1 rows built
  from the head's own hidden states: the accepted drafts come back through ``add_context`` with
  the target's real features, as vLLM and the EAGLE authors' loop do. ``n_keep`` keeps exactly
  the first ``n_keep`` rows (for a loop that rolls back further, e.g. a cancelled prefix).
- ``pass_count``: head passes run since the drafter was built (``propose`` adds k);
  ``taps`` / ``final_hidden``: what the target must return (below).

What the target must expose (``target.Target``):

- MTP heads read the target's **last hidden state after its final norm** (the input of the LM
  head), as vLLM and SGLang feed Qwen3-Next and DeepSeek MTP: build the target with
  ``Target(model, (), final_hidden=True)``; ``TargetOut.final`` is (B, T, H).
- EAGLE-3 reads three target layers: EAGLE layer id i is the *input* of decoder layer i (Hugging
  Face ``hidden_states[i]``), which is our tap ``i - 1`` (the output of layer i - 1). The
  published default is layer ids (2, N // 2, N - 3); ``eagle.Eagle3.taps`` holds the mapped
  taps, so ``Target(model, drafter.taps)`` and ``TargetOut.hidden`` (B, T, 3H) are its features.

Per-position acceptance is counted by the loop in ``stats.Stats`` exactly as for DFlash (drafted
position j accepted or not); a chain drafter's cost per cycle is ``k`` head passes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .drafter import Proposal
from .sampling import SamplingConfig, sample_probs, target_probs


class ChainCache:
    """A chain drafter's cache for one sequence: mlx-lm K/V per head layer, plus the rows that
    are waiting (``queued`` features paired with their next tokens, not yet run; ``pending``, the
    last feature row, waiting for its next token). ``committed`` counts the K/V rows built from
    target features (the rest, after a ``propose``, were built from the head's own outputs)."""

    def __init__(self, n_layers: int):
        self.layers = [KVCache() for _ in range(n_layers)]
        self.queued_h: list[mx.array] = []  # (1, n, H) fused feature rows
        self.queued_ids: list[mx.array] = []  # (n,) their next tokens
        self.pending: mx.array | None = None  # (1, 1, H) the last fused feature row
        self.committed = 0

    @property
    def offset(self) -> int:
        """K/V rows held (= the position of the next row)."""
        return self.layers[0].offset

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if c.keys is not None)

    @property
    def state(self) -> list:
        """The arrays it holds (to evaluate them)."""
        return [a for c in self.layers if c.keys is not None for a in (c.keys, c.values)] + (
            [self.pending] if self.pending is not None else []
        )

    def copy(self, keep: int | None = None) -> ChainCache:
        """A copy sharing no cache object with this one (the arrays are immutable). ``keep``: the
        first ``keep`` K/V rows only and no waiting row (``pending`` None), a state the next
        ``add_context`` continues from when the row ``keep - 1`` was paired with the token the
        sequence really has at ``keep`` (the prefix cache re-runs one prompt token for it).
        Queued rows must have been run first (``ChainHead.flush``)."""
        if self.queued_h:
            raise ValueError("copy a chain cache after flushing its queued rows")
        out = ChainCache(len(self.layers))
        n = self.offset if keep is None else keep
        if not 0 <= n <= self.offset:
            raise ValueError(f"copy: keep {n} of {self.offset} rows")
        for src, dst in zip(self.layers, out.layers):
            if src.keys is not None and n:
                dst.keys, dst.values = src.keys[..., :n, :], src.values[..., :n, :]
                dst.offset = n
        out.pending = self.pending if keep is None else None
        out.committed = min(self.committed, n)
        return out


@runtime_checkable
class ChainDrafter(Protocol):
    """What the decode loop needs from an autoregressive drafter (see the module docstring)."""

    kind: str  # "mtp" or "eagle"
    taps: tuple[int, ...]  # target taps the drafter reads (EAGLE-3); () for MTP
    final_hidden: bool  # reads the target's final-normed last hidden (MTP)
    pass_count: int

    def make_cache(self) -> ChainCache: ...

    def add_context(self, features: mx.array, tokens: mx.array, cache: ChainCache) -> None: ...

    def propose(
        self,
        anchor: mx.array,
        k: int,
        cache: ChainCache,
        *,
        sampling: SamplingConfig | float = 0.0,
        key: mx.array | None = None,
    ) -> Proposal: ...

    def rollback(self, cache: ChainCache, n_keep: int | None = None) -> None: ...


class ChainHead(nn.Module):
    """The shared chain loop. A kind defines ``fuse`` (target features -> head input rows),
    ``step`` (input rows + token ids -> (hidden fed forward, logits over the draft vocabulary))
    and the draft vocabulary ``draft_ids`` (None: the full target vocabulary)."""

    kind = "chain"
    n_layers = 1

    def __init__(self):
        super().__init__()
        self.pass_count = 0
        self._draft_ids: mx.array | None = None  # draft index -> target id (reduced vocabulary)
        self._vocab = 0

    # -- what a kind provides ---------------------------------------------------------------
    def fuse(self, features: mx.array) -> mx.array:
        return features

    def step(self, h: mx.array, ids: mx.array, caches: list[KVCache], mask) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    # -- the interface ----------------------------------------------------------------------
    @property
    def draft_ids(self) -> mx.array | None:
        """Target id of each draft-vocabulary index (None: the full target vocabulary)."""
        return self._draft_ids

    @property
    def vocab_size(self) -> int:
        """The target vocabulary the proposals are in."""
        return self._vocab

    def make_cache(self) -> ChainCache:
        return ChainCache(self.n_layers)

    def add_context(self, features: mx.array, tokens: mx.array, cache: ChainCache) -> None:
        n = features.shape[1]
        if n == 0:
            return
        tokens = tokens.reshape(-1).astype(mx.int32)
        if tokens.shape[0] != n:
            raise ValueError(f"add_context: {n} feature rows but {tokens.shape[0]} tokens")
        h = self.fuse(features)
        if cache.pending is not None:
            cache.queued_h.append(cache.pending)
            cache.queued_ids.append(tokens[:1])
        if n > 1:
            cache.queued_h.append(h[:, :-1])
            cache.queued_ids.append(tokens[1:])
        cache.pending = h[:, -1:]

    def flush(self, cache: ChainCache) -> None:
        """Run the queued rows into the K/V now, without proposing (lazy: evaluate
        ``cache.state``): a sequence that has not drafted with this head for a while keeps its
        features from piling up. The waiting row stays waiting."""
        if not cache.queued_h:
            return
        h = cache.queued_h[0] if len(cache.queued_h) == 1 else mx.concatenate(cache.queued_h, axis=1)
        ids = cache.queued_ids[0] if len(cache.queued_ids) == 1 else mx.concatenate(cache.queued_ids)
        cache.queued_h, cache.queued_ids = [], []
        self._run(h, ids, cache)
        cache.committed = cache.offset

    def _run(self, h: mx.array, ids: mx.array, cache: ChainCache):
        mask = create_attention_mask(h, cache.layers[0])
        return self.step(h, ids[None], cache.layers, mask)

    def propose(
        self,
        anchor: mx.array,
        k: int,
        cache: ChainCache,
        *,
        sampling: SamplingConfig | float = 0.0,
        key: mx.array | None = None,
    ) -> Proposal:
        cfg = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig(float(sampling))
        if cache.pending is None:
            raise ValueError("propose before any add_context: the head needs the target's features")
        if k < 1:
            raise ValueError(f"propose: k must be >= 1 (got {k})")
        if not cfg.greedy and key is None:
            raise ValueError("propose at T > 0 needs a PRNG key")
        keys = mx.random.split(key, k) if not cfg.greedy else [None] * k
        h = mx.concatenate([*cache.queued_h, cache.pending], axis=1)
        ids = mx.concatenate([*cache.queued_ids, anchor.reshape(1).astype(mx.int32)])
        cache.queued_h, cache.queued_ids, cache.pending = [], [], None
        tokens, qs = [], []
        for j in range(k):
            out, logits = self._run(h, ids, cache)
            if j == 0:
                cache.committed = cache.offset
            tok, q = self._pick(logits[0, -1], cfg, keys[j])
            tokens.append(tok)
            qs.append(q)
            h, ids = out[:, -1:], tok.reshape(1)
        self.pass_count += k
        toks = mx.stack(tokens).astype(mx.int32)
        return Proposal(toks, None if cfg.greedy else mx.stack(qs))

    def _pick(self, logits: mx.array, cfg: SamplingConfig, key):
        """One draft (target id) and, at T > 0, its proposal row over the target vocabulary."""
        ids = self.draft_ids
        if cfg.greedy:
            best = mx.argmax(logits, axis=-1)
            return (best if ids is None else ids[best]), None
        qd = target_probs(logits, cfg)
        tok = sample_probs(qd, key)
        if ids is None:
            return tok, qd
        q = mx.zeros((self.vocab_size,), mx.float32).at[ids].add(qd)  # ids are distinct
        return ids[tok], q

    def rollback(self, cache: ChainCache, n_keep: int | None = None) -> None:
        keep = cache.committed if n_keep is None else n_keep
        if not 0 <= keep <= cache.offset:
            raise ValueError(f"rollback: keep {keep} of {cache.offset} rows")
        n = cache.offset - keep
        if n:
            for c in cache.layers:
                c.trim(n)
        cache.committed = min(cache.committed, keep)


def draft_logits(head: ChainHead, features: mx.array, tokens: mx.array) -> mx.array:
    """Reference (no cache): the head's first-pass logits at every row of one sequence:
    row i reads (feature i, token i + 1); (1, n - 1, V_draft). Used by tests and trainers."""
    h = head.fuse(features)[:, :-1]
    ids = tokens.reshape(1, -1)[:, 1:].astype(mx.int32)
    mask = "causal" if h.shape[1] > 1 else None
    caches = [None] * head.n_layers
    return head.step(h, ids, caches, mask)[1]


__all__ = ["ChainCache", "ChainDrafter", "ChainHead", "draft_logits"]
