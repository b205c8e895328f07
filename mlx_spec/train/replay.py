"""A bounded replay buffer of training sequences with their tapped target features.

`train run` generates the target's responses, and their features, as it trains: features never
go to disk as a data set. The buffer keeps the most recent sequences (whole sequences, oldest
evicted first) up to a byte budget, so memory and the checkpoint's ``replay.npz`` are bounded by
``--replay-mb``, not by how much was generated. It reads like a ``data.Dataset`` (the lists
``make_batch`` samples from).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import BadRequest, CheckpointError

REPLAY_FILE = "replay.npz"


def bytes_per_token(n_features: int, top_k: int) -> int:
    """Buffer bytes per token: float16 features, int32 token id, top-K int32 ids and float16 log-probs."""
    return 2 * n_features + 4 + top_k * (4 + 2)


class ReplayBuffer:
    """Most recent sequences up to ``capacity`` bytes (``nbytes`` never exceeds it)."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise BadRequest(f"replay buffer capacity must be positive (got {capacity} bytes)")
        self.capacity = int(capacity)
        self.tokens: list[np.ndarray] = []
        self.prompt_lens: list[int] = []
        self.features: list[np.ndarray] = []
        self.topk_ids: list[np.ndarray] = []
        self.topk_logp: list[np.ndarray] = []
        self.ids: list[str] = []
        self.nbytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def _size(tokens, features, topk_ids, topk_logp) -> int:
        return tokens.nbytes + features.nbytes + topk_ids.nbytes + topk_logp.nbytes

    def add(
        self,
        sid: str,
        tokens: np.ndarray,
        prompt_len: int,
        features: np.ndarray,
        topk_ids: np.ndarray,
        topk_logp: np.ndarray,
    ) -> None:
        """Append one sequence; evict the oldest until the buffer fits its capacity."""
        tokens = np.asarray(tokens, np.int32)
        features = np.asarray(features, np.float16)
        topk_ids = np.asarray(topk_ids, np.int32)
        topk_logp = np.asarray(topk_logp, np.float16)
        size = self._size(tokens, features, topk_ids, topk_logp)
        if size > self.capacity:
            raise BadRequest(
                f"one sequence ({len(tokens)} tokens, {size / 1024:.0f} KiB with its features) is "
                f"larger than the replay buffer ({self.capacity / 1024:.0f} KiB); raise --replay-mb "
                "or lower --max-tokens"
            )
        while self.tokens and self.nbytes + size > self.capacity:
            self._pop()
        self.tokens.append(tokens)
        self.prompt_lens.append(int(prompt_len))
        self.features.append(features)
        self.topk_ids.append(topk_ids)
        self.topk_logp.append(topk_logp)
        self.ids.append(str(sid))
        self.nbytes += size

    def _pop(self) -> None:
        t, f, ti, tl = self.tokens.pop(0), self.features.pop(0), self.topk_ids.pop(0), self.topk_logp.pop(0)
        self.prompt_lens.pop(0)
        self.ids.pop(0)
        self.nbytes -= self._size(t, f, ti, tl)
        self.evicted += 1

    def save(self, path: str | Path) -> None:
        """Everything in one uncompressed .npz (written by the caller into a fresh directory)."""
        offsets = np.cumsum([0] + [len(t) for t in self.tokens]).astype(np.int64)
        cat = lambda xs, dt, w: np.concatenate(xs).astype(dt) if xs else np.zeros((0, w), dt)
        F = self.features[0].shape[1] if self.features else 0
        K = self.topk_ids[0].shape[1] if self.topk_ids else 0
        np.savez(
            path,
            tokens=cat(self.tokens, np.int32, 0).reshape(-1),
            offsets=offsets,
            prompt_lens=np.array(self.prompt_lens, np.int32),
            ids=np.array(self.ids, dtype=str),
            features=cat(self.features, np.float16, F),
            topk_ids=cat(self.topk_ids, np.int32, K),
            topk_logp=cat(self.topk_logp, np.float16, K),
            evicted=np.array(self.evicted, np.int64),
        )

    def load(self, path: str | Path) -> None:
        """Replace the contents with a saved buffer."""
        try:
            z = np.load(path)
        except OSError as e:
            raise CheckpointError(f"cannot read the replay buffer {path}: {e}") from None
        with z:  # each z[name] reads the array from the file again: read each one once
            o, ids, toks, plens = z["offsets"], z["ids"], z["tokens"], z["prompt_lens"]
            feats, tids, tlps = z["features"], z["topk_ids"], z["topk_logp"]
            self.__init__(self.capacity)
            for j in range(len(o) - 1):
                s, e = int(o[j]), int(o[j + 1])
                self.add(str(ids[j]), toks[s:e], int(plens[j]), feats[s:e], tids[s:e], tlps[s:e])
            self.evicted = int(z["evicted"])


__all__ = ["ReplayBuffer", "bytes_per_token", "REPLAY_FILE"]
