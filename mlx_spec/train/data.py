"""Training data: the target's own responses, with its tapped features, in resumable shards.

A shard is one generation batch, written under ``<out>/shards/``:

- ``NNNNN.feat.npy``  float16 (T_total, n_taps * H): target features of every token of every
  sequence, concatenated (row t of a sequence = taps after reading token t; the last token of a
  sequence was never fed, so its row is zero and never read).
- ``NNNNN.npz``        tokens int32 (T_total,), offsets int64 (n+1,), prompt_lens int32 (n,),
  ids (n,) prompt ids, topk_ids int32 / topk_logp float16 (T_total, K): the target's top-K
  log-probabilities *for* each token (row t = distribution that produced token t; prompt rows 0).

The ``.npz`` is written last and atomically, so its presence marks the shard done; a rerun skips
done prompts. Generation is batched: prompts are left-padded (RoPE is relative, so padding only
needs masking), and finished rows are dropped from the batch and its caches.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import BadRequest
from ..prompts import Prompt
from ..target import Target

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DataConfig:
    max_tokens: int = 256
    """Response length cap (tokens, EOS included)."""
    batch_size: int = 32
    temperature: float = 0.0
    """0 = greedy (the drafter then learns the target's greedy path)."""
    seed: int = 0
    top_k: int = 8
    """Target top-K log-probs stored per response token (soft targets for --loss kl)."""


@dataclass(frozen=True, slots=True)
class Sample:
    id: str
    tokens: np.ndarray  # (T,) int32: prompt + response
    prompt_len: int
    features: np.ndarray  # (T, F) float16, last row zero
    topk_ids: np.ndarray  # (T, K) int32, rows < prompt_len zero
    topk_logp: np.ndarray  # (T, K) float16


def _run_layers(target: Target, ids: mx.array, cache, mask: mx.array, valid: mx.array | None = None):
    """Target forward with an explicit (B, 1, T, S) boolean attention mask; GatedDeltaNet layers
    of a hybrid target get ``valid`` (B, T), the positions that are tokens (left padding is
    skipped: it neither enters the conv window nor updates the recurrent state). Returns
    (last hidden states, tapped features)."""
    h = target.embed(ids)
    feats = {}
    for i, (layer, c) in enumerate(zip(target.inner.layers, cache)):
        h = layer(h, valid if i in target.gdn else mask, cache=c)
        if i in target.taps:
            feats[i] = h
    hidden = mx.concatenate([feats[j] for j in target.taps], axis=-1)  # (B, T, F)
    return h, hidden


def _topk(logits: mx.array, k: int):
    """Top-k ids and log-probs of (B, V) logits (order within the k is irrelevant)."""
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
    return ids, mx.take_along_axis(logp, ids, axis=-1)


def _pick(logits: mx.array, temperature: float, key):
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits.astype(mx.float32) / temperature, key=key)


def generate_batch(
    target: Target,
    prompts: Sequence[list[int]],
    cfg: DataConfig,
    eos_ids: Sequence[int],
    pad_id: int,
    key: mx.array | None = None,
    stop: Callable[[], bool] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray]] | None:
    """Generate responses for a batch of prompt ids; returns per prompt
    (response tokens, features (P+R, F) float16, topk ids (R, K), topk logp (R, K)), or None
    when ``stop()`` turned true between two tokens (the partial batch is dropped).
    ``on_tokens(n)`` hears how many tokens each decoding step produced (for progress)."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    eos = set(eos_ids)
    key = mx.random.key(cfg.seed) if key is None else key
    ids = np.full((B, P), pad_id, np.int32)
    valid = np.zeros((B, P), bool)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = p
        valid[b, P - len(p) :] = True
    causal = np.tril(np.ones((P, P), bool))
    mask = causal[None] & valid[:, None, :]
    mask |= np.eye(P, dtype=bool)[None]  # pad queries see themselves (no empty rows)
    cache = target.make_cache()
    h, hidden = _run_layers(target, mx.array(ids), cache, mx.array(mask[:, None]), mx.array(valid))
    logits = target.head(target.inner.norm(h[:, -1]))  # (B, V)
    feats = [[np.array(hidden[b, P - len(p) :].astype(mx.float16))] for b, p in enumerate(prompts)]
    resp: list[list[int]] = [[] for _ in range(B)]
    tk_ids: list[list[np.ndarray]] = [[] for _ in range(B)]
    tk_lp: list[list[np.ndarray]] = [[] for _ in range(B)]
    rows = list(range(B))  # live rows -> prompt index
    for step in range(cfg.max_tokens):  # noqa: B007
        if stop is not None and stop():
            return None
        key, sub = mx.random.split(key)
        tok = _pick(logits, cfg.temperature, sub)
        ti, tl = _topk(logits, cfg.top_k)
        mx.eval(tok, ti, tl)
        tok_l = tok.tolist()
        if on_tokens is not None:
            on_tokens(len(tok_l))
        ti_np, tl_np = np.array(ti), np.array(tl.astype(mx.float16))
        keep = []
        for j, b in enumerate(rows):
            resp[b].append(tok_l[j])
            tk_ids[b].append(ti_np[j])
            tk_lp[b].append(tl_np[j])
            if tok_l[j] not in eos and len(resp[b]) < cfg.max_tokens:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(rows):
            sel = mx.array(keep)
            for c in cache:
                if hasattr(c, "keys"):
                    c.keys, c.values = c.keys[sel], c.values[sel]
                else:  # a GatedDeltaNet layer's conv window and recurrent state
                    c.filter(sel)
            valid = valid[keep]
            rows = [rows[j] for j in keep]
            tok = tok[sel]
        valid = np.concatenate([valid, np.ones((len(rows), 1), bool)], axis=1)
        h, hidden = _run_layers(target, tok.reshape(-1, 1).astype(mx.int32), cache, mx.array(valid[:, None, None, :]))
        logits = target.head(target.inner.norm(h[:, -1]))
        hid = np.array(hidden[:, 0].astype(mx.float16))
        for j, b in enumerate(rows):
            feats[b].append(hid[j : j + 1])
    out = []
    F = feats[0][0].shape[-1]
    for b in range(B):
        f = np.concatenate(feats[b] + [np.zeros((1, F), np.float16)], axis=0)
        out.append((resp[b], f, np.stack(tk_ids[b]).astype(np.int32), np.stack(tk_lp[b])))
    return out


def featurize_batch(target: Target, seqs: Sequence[list[int]], prompt_lens: Sequence[int], top_k: int, pad_id: int):
    """Teacher-forced target pass over finished sequences (e.g. committed token ids).

    Returns per sequence (features (T, F) float16 with a zero last row, topk ids, topk logp),
    topk rows aligned with the response tokens."""
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = np.full((B, T), pad_id, np.int32)
    valid = np.zeros((B, T), bool)
    for b, s in enumerate(seqs):
        ids[b, T - len(s) :] = s
        valid[b, T - len(s) :] = True
    mask = (np.tril(np.ones((T, T), bool))[None] & valid[:, None, :]) | np.eye(T, dtype=bool)[None]
    h, hidden = _run_layers(target, mx.array(ids), target.make_cache(), mx.array(mask[:, None]), mx.array(valid))
    out = []
    for b, (s, p) in enumerate(zip(seqs, prompt_lens)):
        n = len(s)
        hb = hidden[b, T - n :]
        logits = target.head(target.inner.norm(h[b, T - n + p - 1 : T - 1]))  # predicts s[p:]
        ti, tl = _topk(logits, top_k)
        f = np.array(hb.astype(mx.float16))
        f[-1] = 0
        out.append((f, np.array(ti).astype(np.int32), np.array(tl.astype(mx.float16))))
    return out


def _write_shard(shard_dir: Path, index: int, samples: list[Sample]) -> None:
    tokens = np.concatenate([s.tokens for s in samples]).astype(np.int32)
    offsets = np.cumsum([0] + [len(s.tokens) for s in samples]).astype(np.int64)
    np.save(shard_dir / f"{index:05d}.feat.npy", np.concatenate([s.features for s in samples]))
    tmp = shard_dir / f"{index:05d}.tmp.npz"
    np.savez(
        tmp,
        tokens=tokens,
        offsets=offsets,
        prompt_lens=np.array([s.prompt_len for s in samples], np.int32),
        ids=np.array([s.id for s in samples]),
        topk_ids=np.concatenate([s.topk_ids for s in samples]),
        topk_logp=np.concatenate([s.topk_logp for s in samples]),
    )
    tmp.rename(shard_dir / f"{index:05d}.npz")


def done_ids(out: Path) -> set[str]:
    done = set()
    for f in sorted((out / "shards").glob("[0-9]*[0-9].npz")):
        with np.load(f) as z:
            done.update(z["ids"].tolist())
    return done


def _next_index(shard_dir: Path) -> int:
    idx = [int(f.name.split(".")[0]) for f in shard_dir.glob("[0-9]*[0-9].npz")]
    return max(idx) + 1 if idx else 0


def _eta(done: int, total: int, elapsed: float) -> str:
    if done == 0:
        return "?"
    s = elapsed / done * (total - done)
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{int(s // 60)}m{int(s % 60):02d}s"


def build_dataset(
    target: Target,
    tokenizer,
    prompts: Sequence[Prompt],
    out: str | Path,
    cfg: DataConfig = DataConfig(),
    progress: Progress | None = None,
) -> dict:
    """Generate (or resume) a dataset in ``out``. Returns a summary dict (also in meta.json)."""
    out = Path(out)
    shard_dir = out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    meta = {"config": asdict(cfg), "taps": list(target.taps), "n_prompts": len(prompts)}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old.get("taps") != meta["taps"] or old.get("config", {}).get("top_k") != cfg.top_k:
            raise BadRequest(
                f"{out} holds data made with taps={old.get('taps')} "
                f"top_k={old.get('config', {}).get('top_k')}; use another --out"
            )
    meta_path.write_text(json.dumps(meta, indent=2))
    done = done_ids(out)
    todo = [p for p in prompts if p.id not in done]
    eos = sorted(set(tokenizer.eos_token_ids or []) | {tokenizer.eos_token_id} - {None})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    encoded = [(p, p.encode(tokenizer)) for p in todo]  # the chat template the target is used with
    # Similar prompt lengths share a batch (less padding), sorted only within windows of 8
    # batches so a partial run is still a fair sample of the mix. Deterministic.
    w = cfg.batch_size * 8
    encoded = [
        e for s in range(0, len(encoded), w) for e in sorted(encoded[s : s + w], key=lambda e: (len(e[1]), e[0].id))
    ]
    t0 = time.perf_counter()
    n_tok = 0
    index = _next_index(shard_dir)
    for i in range(0, len(encoded), cfg.batch_size):
        batch = encoded[i : i + cfg.batch_size]
        key = mx.random.key(cfg.seed * 1_000_003 + index)
        results = generate_batch(target, [e[1] for e in batch], cfg, eos, pad, key)
        samples = []
        for (p, pids), (resp, f, ti, tl) in zip(batch, results):
            toks = np.array(pids + resp, np.int32)
            P = len(pids)
            topk_ids = np.zeros((len(toks), cfg.top_k), np.int32)
            topk_logp = np.zeros((len(toks), cfg.top_k), np.float16)
            topk_ids[P:], topk_logp[P:] = ti, tl
            samples.append(Sample(p.id, toks, P, f, topk_ids, topk_logp))
            n_tok += len(resp)
        _write_shard(shard_dir, index, samples)
        index += 1
        el = time.perf_counter() - t0
        msg = (
            f"data: {i + len(batch)}/{len(encoded)} prompts ({len(done)} done before), "
            f"{n_tok} response tokens, {n_tok / el:.1f} tok/s, ETA {_eta(i + len(batch), len(encoded), el)}"
        )
        log.info(msg)
        if progress:
            progress(msg)
    return summarize(out)


def featurize_tokens(
    target: Target,
    tokens_npz: str | Path,
    out: str | Path,
    top_k: int = 8,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: Progress | None = None,
) -> dict:
    """Rebuild shards from committed token ids (``export_tokens`` output) with a target pass."""
    out = Path(out)
    shard_dir = out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    z = np.load(tokens_npz)
    toks, offs, plens, ids = z["tokens"], z["offsets"], z["prompt_lens"], z["ids"].tolist()
    meta = {
        "config": {"top_k": top_k, "from_tokens": str(tokens_npz)},
        "taps": list(target.taps),
        "n_prompts": len(ids),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    done = done_ids(out)
    order = [i for i in np.argsort(offs[1:] - offs[:-1], kind="stable") if ids[i] not in done]
    index, t0, n_tok = _next_index(shard_dir), time.perf_counter(), 0
    for s in range(0, len(order), batch_size):
        sel = order[s : s + batch_size]
        seqs = [toks[offs[i] : offs[i + 1]].tolist() for i in sel]
        res = featurize_batch(target, seqs, [int(plens[i]) for i in sel], top_k, pad_id)
        samples = []
        for i, seq, (f, ti, tl) in zip(sel, seqs, res):
            P = int(plens[i])
            tid = np.zeros((len(seq), top_k), np.int32)
            tlp = np.zeros((len(seq), top_k), np.float16)
            tid[P:], tlp[P:] = ti, tl
            samples.append(Sample(ids[i], np.array(seq, np.int32), P, f, tid, tlp))
            n_tok += len(seq)
        _write_shard(shard_dir, index, samples)
        index += 1
        el = time.perf_counter() - t0
        if progress:
            progress(
                f"featurize: {s + len(sel)}/{len(order)} sequences, {n_tok / el:.1f} tok/s, "
                f"ETA {_eta(s + len(sel), len(order), el)}"
            )
    return summarize(out)


def summarize(out: str | Path) -> dict:
    out = Path(out)
    n_seq = n_tok = n_resp = 0
    for f in sorted((out / "shards").glob("[0-9]*[0-9].npz")):
        with np.load(f) as z:
            n_seq += len(z["prompt_lens"])
            n_tok += len(z["tokens"])
            n_resp += len(z["tokens"]) - int(z["prompt_lens"].sum())
    return {"sequences": n_seq, "tokens": n_tok, "response_tokens": n_resp}


def export_tokens(data_dir: str | Path, path: str | Path) -> dict:
    """All sequences' token ids in one compressed .npz (small enough to commit). ``data_dir`` is
    a `train data` directory (its shards) or a `train run` directory (its ``tokens/``)."""
    toks, lens, plens, ids = [], [], [], []
    sub = "tokens" if (Path(data_dir) / "tokens").is_dir() and not (Path(data_dir) / "shards").is_dir() else "shards"
    for f in sorted((Path(data_dir) / sub).glob("[0-9]*[0-9].npz")):
        with np.load(f) as z:
            o, t = z["offsets"], z["tokens"]  # each z[name] reads the array from the file again
            for j in range(len(o) - 1):
                toks.append(t[o[j] : o[j + 1]])
                lens.append(o[j + 1] - o[j])
            plens.extend(z["prompt_lens"].tolist())
            ids.extend(z["ids"].tolist())
    dtype = np.uint16 if toks and max(int(t.max()) for t in toks) < 65536 else np.int32
    np.savez_compressed(
        path,
        tokens=np.concatenate(toks).astype(dtype),
        offsets=np.cumsum([0] + lens).astype(np.int64),
        prompt_lens=np.array(plens, np.int32),
        ids=np.array(ids),
    )
    return {"sequences": len(ids), "tokens": int(sum(lens)), "bytes": Path(path).stat().st_size}


@dataclass
class Dataset:
    """All shards of a data dir, features memory-mapped."""

    tokens: list[np.ndarray]
    prompt_lens: list[int]
    features: list[np.ndarray]  # memmap slices (T, F) float16
    topk_ids: list[np.ndarray]
    topk_logp: list[np.ndarray]
    ids: list[str]

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def load(cls, data_dir: str | Path, exclude: set[str] = frozenset()) -> Dataset:
        shard_dir = Path(data_dir) / "shards"
        files = sorted(shard_dir.glob("[0-9]*[0-9].npz"))
        if not files:
            raise BadRequest(f"no data shards in {shard_dir}; run `mlx_spec train data` first")
        d = cls([], [], [], [], [], [])
        for f in files:
            feat = np.load(shard_dir / f.name.replace(".npz", ".feat.npy"), mmap_mode="r")
            with np.load(f) as z:
                # each z[name] reads the array from the file again: read each one once
                o, ids, toks, plens = z["offsets"], z["ids"], z["tokens"], z["prompt_lens"]
                tids, tlps = z["topk_ids"], z["topk_logp"]
                for j in range(len(o) - 1):
                    if str(ids[j]) in exclude:
                        continue
                    s, e = int(o[j]), int(o[j + 1])
                    d.tokens.append(toks[s:e])
                    d.prompt_lens.append(int(plens[j]))
                    d.features.append(feat[s:e])
                    d.topk_ids.append(tids[s:e])
                    d.topk_logp.append(tlps[s:e])
                    d.ids.append(str(ids[j]))
        return d


def load_datasets(data_dirs: str | Path | list) -> tuple[Dataset, list[int]]:
    """Several data dirs (a list, or "a,b") made with the same taps and top-K, as one Dataset.
    Returns it and the taps. Sequence ids are prefixed with the dir's index past the first."""
    dirs = [Path(d) for d in (str(data_dirs).split(",") if not isinstance(data_dirs, list) else data_dirs) if str(d)]
    if not dirs:
        raise BadRequest("no data directory given")
    metas = []
    for d in dirs:
        try:
            metas.append(json.loads((d / "meta.json").read_text()))
        except (OSError, ValueError) as e:
            raise BadRequest(f"{d}: not a `mlx_spec train data` directory ({e})") from None
    taps, top_k = metas[0]["taps"], metas[0].get("config", {}).get("top_k")
    for d, m in zip(dirs[1:], metas[1:]):
        if m["taps"] != taps or m.get("config", {}).get("top_k") != top_k:
            raise BadRequest(
                f"{d} was made with taps={m['taps']} top_k={m.get('config', {}).get('top_k')}, "
                f"{dirs[0]} with taps={taps} top_k={top_k}: they cannot be mixed"
            )
    out = Dataset.load(dirs[0])
    for i, d in enumerate(dirs[1:], 1):
        more = Dataset.load(d)
        for name in ("tokens", "prompt_lens", "features", "topk_ids", "topk_logp"):
            getattr(out, name).extend(getattr(more, name))
        out.ids.extend(f"{i}:{x}" for x in more.ids)
    return out, taps


def iter_shards(data_dir: str | Path) -> Iterator[Path]:
    yield from sorted((Path(data_dir) / "shards").glob("[0-9]*[0-9].npz"))


__all__ = [
    "DataConfig",
    "Dataset",
    "build_dataset",
    "generate_batch",
    "featurize_batch",
    "featurize_tokens",
    "export_tokens",
    "summarize",
]
