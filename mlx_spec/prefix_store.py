"""The prefix cache's disk tier: long prefixes kept across restarts.

An agent sends nearly the same long prefix (system prompt, tools, the conversation so far) every
turn. The in-memory prefix cache (prefix.py) serves that while the process lives; this store
keeps prefixes of at least ``min_tokens`` tokens on disk, so a restarted server loads the K/V of
a 5 K-token prefix instead of prefilling it again.

One entry is one safetensors file: the target's layer caches (K/V rows, or a hybrid target's
recurrent state), the drafter's context cache over the same positions, and the token ids, with a
JSON header naming the model identity, the ids and how to rebuild each cache. The drafter's
context is stored rather than rebuilt: rebuilding it needs the target's tapped features for
every position, which only a prefill gives (the drafter's K/V is a few layers, small next to the
target's).

Entries live in ``<root>/<identity>/``, where the identity is a digest of what the caches depend
on (both models' weights and quantization, the machine and library versions: a K/V row computed
elsewhere need not be bitwise what a prefill here gives). Writes go to a temporary file that is
renamed into place, so a crash leaves either the old state or the new entry. The whole root is
bounded: past ``budget`` bytes the least recently used entries (by modification time, refreshed
on every hit) are deleted, whichever model they belong to. A file that is cut short, unreadable,
or whose header does not match its folder's identity is skipped with a warning and deleted; it
never fails a request.

Everything here that touches MLX arrays runs on the engine thread; ``list_entries`` and
``clear`` read or delete files only (``mlx_spec cache list|clear``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from .default_target import cache_dir
from .drafter import ContextCache
from .integrity import safetensors_problem
from .prefix import Prefill, common_prefix

log = logging.getLogger(__name__)

FORMAT = "mlx_spec.prefix/1"
SUFFIX = ".safetensors"
DEFAULT_MIN_TOKENS = 1024
DEFAULT_BUDGET_MB = 4096


@dataclass(frozen=True)
class DiskConfig:
    """Where and how much: ``root`` (default ``<user cache>/prefix``), ``budget`` bytes for all
    entries of all models (0 = off), ``min_tokens`` the shortest prefix worth a file."""

    root: Path
    budget: int = DEFAULT_BUDGET_MB << 20
    min_tokens: int = DEFAULT_MIN_TOKENS

    def __post_init__(self):
        if self.budget < 0:
            raise ValueError(f"the disk prefix cache's budget must be >= 0 (got {self.budget})")
        if self.min_tokens < 1:
            raise ValueError(f"the disk prefix cache's shortest prefix must be >= 1 token (got {self.min_tokens})")


def default_root() -> Path:
    return cache_dir() / "prefix"


def identity_of(key: dict) -> str:
    """A folder name for everything the caches depend on (``key``: plain JSON values)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class EntryInfo:
    """One stored entry as its header describes it (no arrays read)."""

    path: Path
    identity: str
    tokens: tuple[int, ...]
    nbytes: int
    drafter: bool  # holds the drafter's context too
    trimmable: bool  # every target layer is K/V rows (a prefix of it can serve)
    models: dict
    last_used: float


def _encode_ids(ids: Sequence[int]) -> str:
    return base64.b64encode(np.asarray(ids, dtype=np.int32).tobytes()).decode()


def _decode_ids(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in np.frombuffer(base64.b64decode(s, validate=True), dtype=np.int32))


def _header(path: Path) -> dict:
    """The JSON metadata of a safetensors file (raises ValueError/OSError when unreadable)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    meta = head.get("__metadata__") if isinstance(head, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return meta


def read_info(path: Path) -> EntryInfo:
    """An entry's header (raises ValueError naming what is wrong)."""
    problem = safetensors_problem(path)
    if problem:
        raise ValueError(problem)
    try:
        meta = _header(path)
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a prefix cache entry (format {meta.get('format')!r})")
        layers = json.loads(meta["layers"])
        st = path.stat()
        return EntryInfo(
            path,
            meta["identity"],
            _decode_ids(meta["tokens"]),
            st.st_size,
            meta.get("drafter") not in (None, "null"),
            all(x["kind"] in ("kv", "qkv") for x in layers),
            json.loads(meta.get("models", "{}")),
            st.st_mtime,
        )
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise ValueError(f"unreadable header ({type(e).__name__}: {e})") from None


def _arrays_of(entry: Prefill) -> tuple[dict, list, list | None] | None:
    """safetensors arrays and the layer descriptions, or None for caches this format cannot hold."""
    arrays = {"tokens": mx.array(list(entry.tokens), mx.int32)}
    layers = []
    n = len(entry.tokens)
    for i, c in enumerate(entry.target):
        if type(c) is KVCache:
            if c.keys is None or c.offset != n:
                return None
            arrays[f"t{i}.k"], arrays[f"t{i}.v"] = c.keys[..., :n, :], c.values[..., :n, :]
            layers.append({"kind": "kv"})
        elif type(c) is QuantizedKVCache:  # packed rows, scales, biases: stored as they are
            if c.keys is None or c.offset != n:
                return None
            for j in range(3):
                arrays[f"t{i}.k{j}"], arrays[f"t{i}.v{j}"] = c.keys[j][..., :n, :], c.values[j][..., :n, :]
            layers.append({"kind": "qkv", "bits": c.bits, "group_size": c.group_size})
        elif type(c) is ArraysCache and c.left_padding is None and c.lengths is None:
            present = [a is not None for a in c.cache]
            for j, a in enumerate(c.cache):
                if a is not None:
                    arrays[f"t{i}.a{j}"] = a
            layers.append({"kind": "arrays", "present": present})
        else:
            return None  # rotating or batched caches: not stored
    ctx = None
    if entry.drafter is not None:
        ctx = []
        for i, c in enumerate(entry.drafter):
            if c.offset != n:
                return None
            if c.keys is not None:
                arrays[f"d{i}.k"], arrays[f"d{i}.v"] = c.keys, c.values
            ctx.append({"window": c.window, "limit": c.limit, "rows": 0 if c.keys is None else int(c.keys.shape[2])})
    return arrays, layers, ctx


def _rebuild(arrays: dict, meta: dict, tokens: tuple[int, ...]) -> Prefill:
    n = len(tokens)
    target = []
    for i, layer in enumerate(json.loads(meta["layers"])):
        if layer["kind"] == "kv":
            c = KVCache()
            c.keys, c.values, c.offset = arrays[f"t{i}.k"], arrays[f"t{i}.v"], n
            if c.keys.shape[-2] != n or c.values.shape[-2] != n:
                raise ValueError(f"layer {i} holds {c.keys.shape[-2]} rows, not {n}")
        elif layer["kind"] == "qkv":
            c = QuantizedKVCache(int(layer["group_size"]), int(layer["bits"]))
            c.keys = tuple(arrays[f"t{i}.k{j}"] for j in range(3))
            c.values = tuple(arrays[f"t{i}.v{j}"] for j in range(3))
            c.offset = n
            if any(a.shape[-2] != n for a in (*c.keys, *c.values)):
                raise ValueError(f"layer {i} holds {c.keys[0].shape[-2]} quantized rows, not {n}")
        else:
            c = ArraysCache(len(layer["present"]))
            c.cache = [arrays[f"t{i}.a{j}"] if p else None for j, p in enumerate(layer["present"])]
        target.append(c)
    ctx = None
    if meta.get("drafter") not in (None, "null"):
        ctx = []
        for i, d in enumerate(json.loads(meta["drafter"])):
            c = ContextCache(d["window"], d.get("limit"))
            if d["rows"]:
                c.keys, c.values = arrays[f"d{i}.k"], arrays[f"d{i}.v"]
            c.offset = n
            ctx.append(c)
    return Prefill(tokens, target, ctx)


class PrefixStore:
    """The entries of one model identity under ``config.root``; engine thread only."""

    def __init__(self, config: DiskConfig, identity: str, models: dict | None = None):
        self.config = config
        self.identity = identity
        self.models = dict(models or {})
        self.dir = Path(config.root) / identity
        self._index: dict[Path, EntryInfo] = {}
        self.hits = 0
        self.writes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.load_ms = 0.0
        self.write_ms = 0.0
        self.skipped = 0  # corrupt or foreign entries found (and deleted)
        self.scan()

    # -- the index -----------------------------------------------------------------------------
    def scan(self) -> None:
        """Read every entry's header in this identity's folder (no arrays)."""
        self._index.clear()
        if not self.dir.is_dir():
            return
        for p in sorted(self.dir.glob("*" + SUFFIX)):
            if p.name.startswith("."):
                continue
            info = self._checked(p)
            if info is not None:
                self._index[p] = info

    def _reject(self, path: Path, why: str) -> None:
        self.skipped += 1
        log.warning("prefix cache: ignoring %s: %s (deleted; the prompt is prefilled instead)", path, why)
        try:
            path.unlink()
        except OSError:
            pass
        self._index.pop(path, None)

    def _checked(self, path: Path) -> EntryInfo | None:
        try:
            info = read_info(path)
        except FileNotFoundError:
            return None
        except ValueError as e:
            self._reject(path, str(e))
            return None
        if info.identity != self.identity:
            self._reject(path, f"it belongs to another model (identity {info.identity}, expected {self.identity})")
            return None
        return info

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self._index.values())

    # -- lookup and load -----------------------------------------------------------------------
    def best(self, ids: Sequence[int], drafter: bool, at_least: int) -> tuple[EntryInfo, int] | None:
        """The entry sharing the longest prefix with ``ids`` (more than ``at_least`` tokens,
        always leaving one token to run), and that length."""
        found = None
        for info in self._index.values():
            if drafter and not info.drafter:
                continue
            keep = min(common_prefix(info.tokens, ids), len(ids) - 1)
            if keep < len(info.tokens) and not info.trimmable:
                continue  # recurrent state: whole entries only
            if keep > at_least and keep >= self.config.min_tokens and (found is None or keep > found[1]):
                found = (info, keep)
        return found

    def load(self, info: EntryInfo) -> Prefill | None:
        """The entry's caches (evaluated), or None (a warning) when the file is damaged."""
        t0 = time.perf_counter()
        try:
            if safetensors_problem(info.path):
                raise ValueError(safetensors_problem(info.path))
            arrays, meta = mx.load(str(info.path), return_metadata=True)
            if meta.get("identity") != self.identity:
                raise ValueError("it belongs to another model")
            tokens = _decode_ids(meta["tokens"])
            if tokens != info.tokens or tuple(np.asarray(arrays["tokens"]).tolist()) != tokens:
                raise ValueError("its token ids disagree with its header")
            entry = _rebuild(arrays, meta, tokens)
            mx.eval([c.state for c in entry.target], [c.state for c in entry.drafter or ()])
        except FileNotFoundError:  # cleared meanwhile (mlx_spec cache clear)
            self._index.pop(info.path, None)
            return None
        except Exception as e:  # a damaged entry must never fail the request
            self._reject(info.path, f"{type(e).__name__}: {e}")
            return None
        self.load_ms += (time.perf_counter() - t0) * 1e3
        self.hits += 1
        self.bytes_read += info.nbytes
        try:
            os.utime(info.path)  # most recently used
        except OSError:
            pass
        return entry

    # -- store ---------------------------------------------------------------------------------
    def save(self, entry: Prefill) -> Path | None:
        """Write ``entry`` (atomically) unless it is short, already held or cannot be stored;
        entries it extends are deleted; then the root is trimmed to the budget."""
        n = len(entry.tokens)
        if not self.config.budget or n < self.config.min_tokens:
            return None
        for info in list(self._index.values()):
            if common_prefix(info.tokens, entry.tokens) == n and (info.drafter or entry.drafter is None):
                return None  # an entry as long or longer already holds it
        got = _arrays_of(entry)
        if got is None:
            return None
        arrays, layers, ctx = got
        t0 = time.perf_counter()
        name = hashlib.sha256(np.asarray(entry.tokens, np.int32).tobytes()).hexdigest()[:32] + SUFFIX
        path = self.dir / name
        tmp = self.dir / f".{name}.{os.getpid()}.tmp{SUFFIX}"
        meta = {
            "format": FORMAT,
            "identity": self.identity,
            "tokens": _encode_ids(entry.tokens),
            "layers": json.dumps(layers),
            "drafter": json.dumps(ctx),
            "models": json.dumps(self.models),
        }
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            nbytes = sum(a.nbytes for a in arrays.values())
            if nbytes > self.config.budget:
                return None
            mx.save_safetensors(str(tmp), arrays, meta)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("prefix cache: could not write %s: %s (the prefix stays in memory only)", path, e)
            try:
                tmp.unlink()
            except OSError:
                pass
            return None
        for p, info in list(self._index.items()):  # what this entry extends is redundant
            if (
                p != path
                and common_prefix(info.tokens, entry.tokens) == len(info.tokens)
                and (entry.drafter is not None or not info.drafter)
            ):
                _unlink(p)
                del self._index[p]
        info = self._checked(path)
        if info is not None:
            self._index[path] = info
            self.writes += 1
            self.bytes_written += info.nbytes
        self.write_ms += (time.perf_counter() - t0) * 1e3
        self.evict()
        return path if path in self._index else None

    def evict(self) -> None:
        """Delete the least recently used entries of the whole root until it fits the budget."""
        files = _all_files(Path(self.config.root))
        total = sum(size for _, size, _ in files)
        for p, size, _ in sorted(files, key=lambda f: f[2]):
            if total <= self.config.budget:
                break
            _unlink(p)
            self._index.pop(p, None)
            total -= size

    def stats(self) -> dict:
        return {
            "entries": len(self),
            "bytes": self.nbytes,
            "budget": self.config.budget,
            "hits": self.hits,
            "writes": self.writes,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "load_ms": round(self.load_ms, 3),
            "write_ms": round(self.write_ms, 3),
            "skipped": self.skipped,
        }


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


def _all_files(root: Path) -> list[tuple[Path, int, float]]:
    out = []
    if root.is_dir():
        for p in root.glob("*/*" + SUFFIX):
            if p.name.startswith("."):
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            out.append((p, st.st_size, st.st_mtime))
    return out


def list_entries(root: Path) -> tuple[list[EntryInfo], list[tuple[Path, str]]]:
    """Every entry under ``root`` (most recently used first) and the files that are not
    readable entries, with why (nothing is deleted here)."""
    good, bad = [], []
    for p, _, _ in _all_files(Path(root)):
        try:
            good.append(read_info(p))
        except (ValueError, OSError) as e:
            bad.append((p, str(e)))
    good.sort(key=lambda i: -i.last_used)
    return good, bad


def clear(root: Path) -> tuple[int, int]:
    """Delete every entry under ``root`` (and left-over temporary files): (files, bytes)."""
    n = size = 0
    root = Path(root)
    if not root.is_dir():
        return 0, 0
    for p in list(root.glob("*/*" + SUFFIX)) + list(root.glob("*/.*.tmp" + SUFFIX)):
        try:
            s = p.stat().st_size
            p.unlink()
        except OSError:
            continue
        n, size = n + 1, size + s
    for d in root.iterdir():
        if d.is_dir():
            try:
                d.rmdir()
            except OSError:
                pass
    return n, size
