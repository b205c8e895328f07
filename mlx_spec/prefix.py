"""Prefix cache: reuse the K/V of a conversation's earlier tokens across turns and requests.

A finished (or cancelled) run leaves a ``Prefill`` behind: the token ids its caches hold, the
target's cache and, for speculative runs, the drafter's context cache over the same rows. The
next request that starts with a prefix of those ids takes a copy trimmed to the longest common
prefix and prefills only the rest. Entries are never mutated (a taken copy shares no array
object with them) and are evicted least-recently-used to stay within a byte budget.

Exactness: target K/V rows depend only on earlier tokens, drafter context rows only on their
own target features, so a trimmed copy equals what a fresh prefill would build (bitwise on the
CPU backend; tests compare token streams). Quantized K/V (``--kv-bits``) is quantized row by
row, so it trims the same way. Caches that cannot be trimmed (hybrid targets' recurrent GDN
state) are reused only when the whole entry is a prefix of the new prompt; rotating K/V is not
reused. Everything here runs on the engine thread.

With a disk tier attached (``attach``: a ``prefix_store.PrefixStore``), long entries are also
written to disk, and a lookup that finds a longer stored prefix there than in memory loads it
(and keeps it in memory for the next turn): the prefix survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from .drafter import ContextCache


@dataclass(frozen=True)
class Prefill:
    """Caches holding exactly ``tokens`` (target) and, if not None, the drafter's context rows
    for the same positions; ``chains``: each chain drafter's cache (kind -> ``chain.ChainCache``,
    its queued rows run) over the same positions."""

    tokens: tuple[int, ...]
    target: list
    drafter: list[ContextCache] | None = None
    chains: dict | None = None

    @property
    def nbytes(self) -> int:
        n = sum(_nbytes(c) for c in self.target)
        n += sum(c.nbytes for c in self.chains.values()) if self.chains else 0
        return n + (sum(c.nbytes for c in self.drafter) if self.drafter else 0)


def _nbytes(c) -> int:
    if isinstance(c, QuantizedKVCache):
        return 0 if c.keys is None else sum(a.nbytes for a in (*c.keys, *c.values))
    if isinstance(c, KVCache):
        return 0 if c.keys is None else c.keys.nbytes + c.values.nbytes
    if isinstance(c, ArraysCache):
        return sum(a.nbytes for a in c.cache if a is not None)
    try:
        return int(c.nbytes)
    except (AttributeError, NotImplementedError):
        return 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _clone_target(c, keep: int, total: int):
    """A copy of one target layer cache holding its first ``keep`` of ``total`` rows, or None."""
    if type(c) is KVCache:
        if c.keys is None or c.offset != total:
            return None
        new = KVCache()
        new.keys, new.values = c.keys[..., :keep, :], c.values[..., :keep, :]
        new.offset = keep
        return new
    if type(c) is QuantizedKVCache:  # quantized row by row: a prefix of rows is exact too
        if c.keys is None or c.offset != total:
            return None
        new = QuantizedKVCache(c.group_size, c.bits)
        new.keys = tuple(a[..., :keep, :] for a in c.keys)
        new.values = tuple(a[..., :keep, :] for a in c.values)
        new.offset = keep
        return new
    if type(c) is ArraysCache and keep == total:  # recurrent state: exact entries only
        new = ArraysCache(len(c.cache))
        new.cache, new.left_padding, new.lengths = list(c.cache), c.left_padding, c.lengths
        return new
    return None


def _clone_context(c: ContextCache, keep: int, total: int) -> ContextCache | None:
    if c.offset != total:
        return None
    new = ContextCache(c.window, c.limit)
    if keep == 0 or c.keys is None:
        return new if keep == 0 else None
    kept = c.keys.shape[2]
    first = c.offset - kept  # absolute position of the first kept row
    need = 0 if c.kept is None else max(0, keep - c.kept)
    if first > need and c.limit is None:  # the rows a trained window at `keep` sees were already dropped
        return None
    # (a drafting window, ``--draft-window``, takes what it still holds of the rows before `keep`:
    # fewer than its window where they were dropped, which changes drafts, never the output)
    lo, n = max(0, need - first), keep - first
    if n <= lo:
        new.offset = keep
        return new
    new.keys, new.values, new.offset = c.keys[:, :, lo:n], c.values[:, :, lo:n], keep
    return new


def take(entry: Prefill, keep: int, drafter: bool, chains: Sequence[str] = ()) -> Prefill | None:
    """Independent caches for ``entry.tokens[:keep]`` (None if these caches cannot give that).

    ``chains``: the chain drafters whose caches the taker needs (the entry must hold them). A
    chain cache's last K/V row pairs its feature with the *next* token, which a shorter reuse
    may not share: a partial reuse is taken one token shorter, so every kept row was paired with
    a token of the common prefix (the prefill re-runs that one prompt token, and the head's
    waiting row is rebuilt from its features)."""
    total = len(entry.tokens)
    if chains:
        if entry.chains is None or any(k not in entry.chains for k in chains):
            return None
        if keep < total:
            keep -= 1
        if keep < 1:
            return None
    target = [_clone_target(c, keep, total) for c in entry.target]
    if any(c is None for c in target):
        return None
    ctx = None
    if drafter:
        if entry.drafter is None:
            return None
        ctx = [_clone_context(c, keep, total) for c in entry.drafter]
        if any(c is None for c in ctx):
            return None
    heads = None
    if chains:
        heads = {k: entry.chains[k].copy(None if keep == total else keep) for k in chains}
    return Prefill(entry.tokens[:keep], target, ctx, heads)


class PrefixCache:
    """LRU of ``Prefill`` entries within ``budget`` bytes (0 disables it)."""

    def __init__(self, budget: int, min_tokens: int = 16):
        self.budget = max(0, int(budget))
        self.min_tokens = min_tokens  # shorter matches are not worth the bookkeeping
        self._entries: OrderedDict[int, Prefill] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.disk = None  # prefix_store.PrefixStore (attach), or None: memory only
        self.disk_tokens = 0  # of reused_tokens, loaded from disk
        self._prefill = [0, 0.0]  # tokens prefilled, ms they took (note_prefill): the saved-time estimate

    def attach(self, store) -> None:
        """Add a disk tier (a ``prefix_store.PrefixStore``; None detaches it)."""
        self.disk = store

    def note_prefill(self, tokens: int, ms: float) -> None:
        """A request prefilled ``tokens`` in ``ms`` (what a reused token is estimated to save)."""
        if tokens > 0 and ms > 0:
            self._prefill[0] += tokens
            self._prefill[1] += ms

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int], drafter: bool, chains: Sequence[str] = ()) -> Prefill | None:
        """Caches for the longest reusable prefix of ``ids`` (always leaving >= 1 token to run).
        ``chains``: the chain drafters whose caches the run needs (memory entries only: the disk
        tier does not keep chain caches)."""
        if not self.budget and self.disk is None:
            return None
        best = None
        for key, e in self._entries.items():
            keep = min(common_prefix(e.tokens, ids), len(ids) - 1)
            if keep >= self.min_tokens and (best is None or keep > best[1]):
                got = take(e, keep, drafter, chains)
                if got is not None:
                    best = (key, len(got.tokens), got)
        if self.disk is not None and not chains:
            got = self._from_disk(ids, drafter, best[1] if best else 0)
            if got is not None:
                self.hits += 1
                self.reused_tokens += len(got.tokens)
                self.disk_tokens += len(got.tokens)
                return got
        if best is None:
            self.misses += 1
            return None
        key, keep, got = best
        self._entries.move_to_end(key)
        self.hits += 1
        self.reused_tokens += keep
        return got

    def _from_disk(self, ids: Sequence[int], drafter: bool, beyond: int) -> Prefill | None:
        """Caches for a stored prefix longer than ``beyond`` tokens (kept in memory too), or None."""
        found = self.disk.best(ids, drafter, beyond)
        if found is None:
            return None
        info, keep = found
        entry = self.disk.load(info)
        if entry is None:
            return None
        got = take(entry, keep, drafter)
        if got is not None:
            self._keep(entry)
        return got

    def store(self, entry: Prefill) -> None:
        """Keep ``entry`` (evaluated now), replacing entries it extends; evict LRU over budget;
        with a disk tier, write it there too when it is long enough."""
        if (not self.budget and self.disk is None) or len(entry.tokens) < self.min_tokens:
            return
        arrays = [c.keys for c in entry.target if isinstance(c, KVCache) and c.keys is not None]
        arrays += [a for c in entry.target if type(c) is QuantizedKVCache and c.keys for a in (*c.keys, *c.values)]
        arrays += [a for c in entry.target if isinstance(c, ArraysCache) for a in c.cache if a is not None]
        arrays += [c.keys for c in entry.drafter or () if c.keys is not None]
        arrays += [a for c in (entry.chains or {}).values() for a in c.state]
        mx.eval(
            arrays,
            [c.values for c in entry.drafter or () if c.values is not None],
            [c.values for c in entry.target if isinstance(c, KVCache) and c.values is not None],
        )
        if self.disk is not None:
            self.disk.save(entry)
        self._keep(entry)

    def _keep(self, entry: Prefill) -> None:
        if not self.budget or entry.nbytes > self.budget:
            return
        for key, e in list(self._entries.items()):  # an entry this one extends is redundant
            if (
                common_prefix(e.tokens, entry.tokens) == len(e.tokens)
                and (e.drafter is None or entry.drafter is not None)
                and set(e.chains or ()) <= set(entry.chains or ())
            ):
                del self._entries[key]
        self._entries[self._next] = entry
        self._next += 1
        while self.nbytes > self.budget and len(self._entries) > 1:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def stats(self) -> dict:
        """Counters; ``saved_ms`` estimates the prefill time the reused tokens saved (at the
        prefill rate this process measured, less the disk loads' time)."""
        out = {
            "entries": len(self),
            "bytes": self.nbytes,
            "budget": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
            "disk_tokens": self.disk_tokens,
        }
        rate = self._prefill[1] / self._prefill[0] if self._prefill[0] else 0.0
        load = self.disk.load_ms if self.disk is not None else 0.0
        out["saved_ms"] = round(max(0.0, self.reused_tokens * rate - load), 3)
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out
