"""Training chain drafters: an MTP-style head or an EAGLE-3 layer, for any mlx-lm target.

Data: the same token files the DFlash drafter is trained on (``train export --tokens``; the
shipped ones under models/smollm2-135m-dflash2/data/): the target's own responses to the
training prompts. Several files train together (``--tokens a.npz,b.npz``). Held out: the last
``held_out`` sequences, or a separate token file (``--eval-tokens``: the target's responses to
held-out prompts), whose prompts are then dropped from the training files by name.

Features: the target's final-normed last hidden (MTP) or three taps (EAGLE-3) of the whole
sequence up to each row, as at inference. Either recomputed by the target for each batch, or
read from a feature store (``build_features``, ``train features``): one target pass over each
token file, written as memory-mapped float16 arrays (the final hidden and the three EAGLE taps
of the same pass, so one store feeds both kinds). A training step then costs only the head.

Loss: cross-entropy on the committed token two positions ahead of each feature row (row t reads
the target's features at t and token t + 1, and predicts t + 2), response positions only.
Training-time test (``ttt`` steps, the EAGLE-3 recipe): step j > 1 runs the head again with, at
each row, its own step j - 1 output of the row before in place of the target's features, and
the same targets; step j's loss is weighted ``decay ** (j - 1)``. Row t of step j is pass j of
the chain anchored at row t - j + 1, and attends exactly as that pass does at inference
(``ttt_mask``): to the committed rows up to the anchor (step 1's, built from target features)
and to its own chain's rows of the earlier steps. The drafts it reads are the committed tokens
(teacher forcing), so step j's logits at row t equal pass j of ``propose`` fed those tokens.
An MTP head may train its softmax over a subset of the target's head (``softmax_vocab``: the
most frequent response ids + every label of the step + random negatives, the DFlash recipe);
those logits are the inference logits at those ids, and the held-out evaluation uses the full
head.

The forward is the inference code itself (``chain.draft_logits`` and the head's ``step``), and
the output is the published layout: MTP heads as ``mtp.*`` tensors beside a config that declares
one MTP layer (``load_mtp`` reads the folder), EAGLE-3 layers in the authors' or the speculators
layout (``load_eagle`` reads either), float16.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from ..chain import ChainHead
from ..eagle import Eagle3, Eagle3Args, default_layer_ids, eagle_config, save_eagle
from ..errors import BadRequest
from ..mtp import MTP_TYPES, MTPHead
from ..target import Target

FEATURE_DTYPE = np.float16
EVAL_SEQS = 64  # held-out sequences in each evaluation (all of them when fewer)


def split_paths(paths: str | Sequence[str]) -> list[str]:
    """``a.npz,b.npz`` (or a list) -> the paths, in order."""
    items = paths.split(",") if isinstance(paths, str) else list(paths)
    return [p.strip() for p in items if p.strip()]


@dataclass(frozen=True)
class ChainTrainConfig:
    kind: str  # "mtp" or "eagle"
    tokens: str  # token-id .npz files (train export --tokens), comma-separated
    out: str
    steps: int = 6000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0  # gradient norm clip (0: none)
    ttt: int = 3
    decay: float = 0.8
    seed: int = 0
    held_out: int | None = None  # the files' last N sequences (default 64; none with eval_tokens)
    eval_tokens: str | None = None  # a token file of held-out sequences instead
    features: str | None = None  # a feature store (build_features); None: the target recomputes
    grow: bool = False  # a store still being built: read what it holds, the target computes the rest
    checkpoint_every: int = 100
    eval_every: int = 100
    layout: str = "eagle"  # EAGLE-3 output layout: eagle | speculators
    draft_vocab: int = 0  # EAGLE-3: draft over the N most frequent response tokens (d2t); 0: the full vocabulary
    softmax_vocab: int = 0  # MTP: training softmax over the N most frequent ids + labels + negatives; 0: full
    vocab_negatives: int = 1024  # random other ids per step with softmax_vocab
    resume: bool = False

    def __post_init__(self):
        if self.kind not in ("mtp", "eagle"):
            raise BadRequest(f"kind must be mtp or eagle, not {self.kind!r}")
        if self.layout not in ("eagle", "speculators"):
            raise BadRequest(f"--layout must be eagle or speculators, not {self.layout!r}")
        for name in ("steps", "batch_size", "ttt", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise BadRequest(f"--{name.replace('_', '-')} must be >= 1")
        if self.draft_vocab < 0 or (self.draft_vocab and self.kind != "eagle"):
            raise BadRequest("--draft-vocab is an EAGLE-3 option (N >= 1; 0 = the full vocabulary)")
        if self.softmax_vocab < 0 or (self.softmax_vocab and self.kind != "mtp"):
            raise BadRequest(
                "--softmax-vocab is an MTP option (N >= 1; 0 = the full head); an EAGLE-3 layer "
                "trains over its draft vocabulary (--draft-vocab)"
            )
        if self.vocab_negatives < 0:
            raise BadRequest("--vocab-negatives must be >= 0")
        if self.seq_len < 8:
            raise BadRequest("--seq-len must be >= 8")
        if self.clip < 0:
            raise BadRequest("--clip must be >= 0 (0: no clipping)")
        if self.held_out is not None and self.eval_tokens is not None:
            raise BadRequest("--held-out and --eval-tokens both name a held-out set: give one")
        if self.held_out is not None and self.held_out < 1:
            raise BadRequest("--held-out must be >= 1 (or give --eval-tokens)")
        files = split_paths(self.tokens) + ([self.eval_tokens] if self.eval_tokens else [])
        if not split_paths(self.tokens):
            raise BadRequest("--tokens names no file")
        for f in files:
            if not Path(f).is_file():
                raise BadRequest(f"{f}: no such file (a token-id .npz from `train export --tokens`)")
        if self.grow and self.features is None:
            raise BadRequest("--grow reads a feature store still being built: give --features")
        if self.features is not None and not Path(self.features).is_dir():
            raise BadRequest(f"--features {self.features}: no such directory (build it with `train features`)")

    @property
    def n_held_out(self) -> int:
        return 0 if self.eval_tokens else (64 if self.held_out is None else self.held_out)


class Seq(NamedTuple):
    """One sequence: its token ids, prompt length, and where it sits (file index, first token,
    index in its file)."""

    tokens: np.ndarray
    prompt_len: int
    file: int
    start: int
    id: str
    index: int


@dataclass(frozen=True)
class TokenFile:
    path: str
    sha256: str
    n_tokens: int


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_token_file(path: str | Path, index: int) -> tuple[TokenFile, list[Seq]]:
    try:
        z = np.load(path)
        toks, offs, plens = z["tokens"], z["offsets"], z["prompt_lens"]
        names = z["ids"].tolist() if "ids" in z.files else [str(i) for i in range(len(plens))]
    except (OSError, ValueError, KeyError) as e:
        raise BadRequest(f"{path}: not a token file from `train export --tokens` ({e})") from None
    if len(offs) != len(plens) + 1 or offs[-1] != len(toks):
        raise BadRequest(f"{path}: offsets and prompt_lens disagree with the tokens (a damaged token file)")
    seqs = [
        Seq(toks[offs[i] : offs[i + 1]].astype(np.int32), int(plens[i]), index, int(offs[i]), str(names[i]), i)
        for i in range(len(plens))
    ]
    return TokenFile(str(path), file_sha256(path), len(toks)), seqs


class Tokens:
    """The training and held-out sequences of one or more token files.

    Held out: the last ``held_out`` sequences of the concatenated files, or every sequence of
    ``eval_path``; then a training sequence whose prompt (token ids) is a held-out prompt is
    dropped (``dropped`` names them)."""

    def __init__(self, paths: str | Sequence[str] | Path, held_out: int = 64, eval_path: str | None = None):
        self.files: list[TokenFile] = []
        seqs: list[Seq] = []
        for p in split_paths(str(paths)) if isinstance(paths, (str, Path)) else list(paths):
            f, s = read_token_file(p, len(self.files))
            self.files.append(f)
            seqs.extend(s)
        self.dropped: list[str] = []
        if eval_path is not None:
            f, test = read_token_file(eval_path, len(self.files))
            self.files.append(f)
            held = {s.tokens[: s.prompt_len].tobytes() for s in test}
            train = []
            for s in seqs:
                (self.dropped.append(s.id) if s.tokens[: s.prompt_len].tobytes() in held else train.append(s))
            if not train:
                raise BadRequest("every training sequence has a held-out prompt")
            self.train, self.test = train, test
            return
        if len(seqs) <= held_out:
            raise BadRequest(f"{paths}: {len(seqs)} sequences, fewer than --held-out {held_out} + 1")
        self.train, self.test = seqs[:-held_out], seqs[-held_out:]


# -- the feature store -------------------------------------------------------------------------


def store_name(f: TokenFile) -> str:
    return f"{Path(f.path).stem}-{f.sha256[:12]}"


class _FileJob:
    """One token file's part of a feature build: its store folder, order, progress, arrays."""

    def __init__(self, path: str, out: Path, target: Target, target_id: str, block: int):
        self.path = path
        tf, self.seqs = read_token_file(path, 0)
        self.n = len(self.seqs)
        self.dir = out / store_name(tf)
        self.dir.mkdir(exist_ok=True)
        self.meta_path = self.dir / "meta.json"
        meta = json.loads(self.meta_path.read_text()) if self.meta_path.exists() else {}
        self.want = {"tokens": Path(path).name, "sha256": tf.sha256, "n_tokens": tf.n_tokens, "n_seqs": self.n}
        self.want |= {"taps": list(target.taps), "hidden": target.hidden_size, "target": target_id, "dtype": "float16"}
        if meta and any(meta.get(k) != v for k, v in self.want.items()):
            raise BadRequest(f"{self.dir} holds features of another token file, target or taps; use another --out")
        self.done = self.n if meta.get("complete") else int(meta.get("done_seqs", 0))
        self.was_done = self.done == self.n
        if self.was_done:
            return
        if self.done:
            self.order = np.load(self.dir / "order.npy")
        else:
            self.order = feature_order([len(q.tokens) for q in self.seqs], block)
            np.save(self.dir / "order.npy", self.order)
        mode = "r+" if self.done else "w+"
        shape = (tf.n_tokens, target.hidden_size)
        self.final = np.lib.format.open_memmap(self.dir / "final.npy", mode, FEATURE_DTYPE, shape)
        shape = (tf.n_tokens, len(target.taps) * target.hidden_size)
        self.taps = np.lib.format.open_memmap(self.dir / "taps.npy", mode, FEATURE_DTYPE, shape)

    def run_block(self, target: Target, block: int, batch_size: int) -> int:
        """Run the next block of sequences (batches of similar length), store it; tokens run."""
        n_tok = 0
        end = min(self.done + block, self.n)
        for i in range(self.done, end, batch_size):
            part = [self.seqs[k] for k in self.order[i : min(i + batch_size, end)]]
            ids = np.zeros((len(part), max(len(q.tokens) for q in part)), np.int32)
            for r, q in enumerate(part):
                ids[r, : len(q.tokens)] = q.tokens
            o = target(mx.array(ids), target.make_cache(), last_only=True)
            f, h = o.final.astype(mx.float16), o.hidden.astype(mx.float16)
            mx.eval(f, h)
            f, h = np.array(f), np.array(h)
            for r, q in enumerate(part):
                self.final[q.start : q.start + len(q.tokens)] = f[r, : len(q.tokens)]
                self.taps[q.start : q.start + len(q.tokens)] = h[r, : len(q.tokens)]
                n_tok += len(q.tokens)
        self.final.flush()
        self.taps.flush()
        self.done = end
        meta = dict(self.want, done_seqs=end, complete=end == self.n)
        self.meta_path.write_text(json.dumps(meta, indent=2))
        return n_tok


def build_features(
    target: Target,
    token_paths: Sequence[str],
    out: str | Path,
    *,
    target_id: str = "",
    batch_size: int = 8,
    log: Callable[[str], None] = print,
    flush_every: int = 64,
) -> dict:
    """One target pass over every sequence of each token file; writes, per file, ``final.npy``
    (n_tokens, H) the final-normed last hidden (MTP) and ``taps.npy`` (n_tokens, len(taps) * H)
    the tapped layers' outputs (EAGLE-3), float16, row i = the features at token i of the file.
    Each sequence is run from its first token; ``batch_size`` sequences of similar length run
    together, padded on the right (causal attention: the padding is after every real row, so it
    changes none).

    A store may be read while it is being built (``FeatureStore(partial=True)``, ``--grow``:
    what it holds is read, the rest recomputed), and what is done at any point is a fair sample
    of the data: each file's sequences go in a
    seeded random order (``order.npy``; sorted by length within each block of
    ``flush_every``), and the files advance together, the next block always from the file with
    the smallest share done. Resumable: a file's ``meta.json`` records how many sequences of
    its order are done; a finished file is skipped."""
    if not target.final_hidden or not target.taps:
        raise BadRequest("build_features needs a target built with taps and final_hidden=True")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [_FileJob(p, out, target, target_id, flush_every) for p in token_paths]
    for j in jobs:
        if j.was_done:
            log(f"features: {j.path}: done before ({j.dir})")
    t0, n_tok = time.perf_counter(), 0
    while live := [j for j in jobs if j.done < j.n]:
        j = min(live, key=lambda j: j.done / j.n)
        n_tok += j.run_block(target, flush_every, batch_size)
        log(f"features: {j.path}: {j.done}/{j.n} sequences, {n_tok / (time.perf_counter() - t0):.0f} tok/s")
    return {"files": [str(j.dir) for j in jobs], "taps": list(target.taps)}


def feature_order(lengths: Sequence[int], block: int, seed: int = 0) -> np.ndarray:
    """The order ``build_features`` runs a file's sequences in: a seeded permutation, sorted by
    length within each block of ``block`` (similar lengths share a batch; any prefix of whole
    blocks is a fair sample of the file)."""
    perm = np.random.default_rng(seed).permutation(len(lengths))
    lengths = np.asarray(lengths)
    return np.concatenate(
        [
            perm[a : a + block][np.argsort(lengths[perm[a : a + block]], kind="stable")]
            for a in range(0, len(perm), block)
        ]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)


class FeatureStore:
    """The stored features of ``data``'s token files (memory-mapped), checked against them: each
    file's store must exist, match the file's sha256, hold what ``kind`` reads and be complete.
    ``partial=True`` reads a store still being built: ``ready`` says which sequences are done
    (``refresh`` re-reads the builder's progress), and a file not started yet has none."""

    def __init__(
        self,
        root: str | Path,
        files: Sequence[TokenFile],
        *,
        final: bool,
        taps: Sequence[int] = (),
        partial: bool = False,
    ):
        self.root, self.files, self.final, self.taps, self.partial = Path(root), list(files), final, list(taps), partial
        self.arrays: list[np.ndarray | None] = [None] * len(self.files)
        self.done: list[np.ndarray] = [np.zeros(0, bool)] * len(self.files)
        self.width = 0
        self.refresh()
        if not self.width:
            raise BadRequest(f"{self.root}: no features of these token files yet")

    def refresh(self) -> None:
        for i, f in enumerate(self.files):
            if self.done[i].size and self.done[i].all():
                continue
            d = self.root / store_name(f)
            hint = f"build it with `mlx_spec train features --tokens {f.path} --out {self.root}`"
            try:
                meta = json.loads((d / "meta.json").read_text())
            except (OSError, ValueError):
                if self.partial:
                    continue
                raise BadRequest(f"{f.path}: no features in {self.root} ({d.name}); {hint}") from None
            if meta.get("sha256") != f.sha256 or meta.get("n_tokens") != f.n_tokens:
                raise BadRequest(f"{d}: features of another token file than {f.path}; {hint}")
            if not self.final and list(meta.get("taps", [])) != self.taps:
                raise BadRequest(f"{d}: features tap layers {meta.get('taps')}, the EAGLE-3 layer reads {self.taps}")
            n = int(meta.get("done_seqs", 0))
            if not meta.get("complete") and not self.partial:
                raise BadRequest(f"{d}: features incomplete ({n} sequences); {hint} (resumes)")
            done = np.zeros(int(meta["n_seqs"]), bool)
            done[np.load(d / "order.npy")[:n]] = True
            if self.arrays[i] is None:
                self.arrays[i] = np.load(d / ("final.npy" if self.final else "taps.npy"), mmap_mode="r")
                self.width = self.arrays[i].shape[1]
            self.done[i] = done

    def n_ready(self, seqs: Sequence[Seq]) -> int:
        """How many of ``seqs`` have their features stored (as of the last ``refresh``)."""
        return sum(map(self.ready, seqs))

    def ready(self, s: Seq) -> bool:
        """Whether the features of ``s`` are stored."""
        done = self.done[s.file]
        return bool(done.size and done[s.index])

    def window(self, s: Seq, start: int, length: int) -> np.ndarray:
        a = s.start + start
        return self.arrays[s.file][a : a + length]


# -- batches and features ----------------------------------------------------------------------


class Span(NamedTuple):
    seq: Seq
    start: int
    length: int


def make_batch(pool: Sequence[Seq], rng: np.random.Generator, n: int, seq_len: int):
    """(ids (n, T) int32, loss mask (n, T - 2) over rows t whose target t + 2 is a response
    token, the spans): a random window of ``seq_len`` tokens of a random sequence per row."""
    spans = []
    for _ in range(n):
        s = pool[rng.integers(len(pool))]
        hi = max(0, len(s.tokens) - seq_len)
        start = int(rng.integers(0, hi + 1)) if hi else 0
        spans.append(Span(s, start, min(seq_len, len(s.tokens))))
    return (*batch_arrays(spans, seq_len), spans)


def batch_arrays(spans: Sequence[Span], T: int):
    ids = np.zeros((len(spans), T), np.int32)
    mask = np.zeros((len(spans), T - 2), np.float32)
    for r, (s, start, n) in enumerate(spans):
        ids[r, :n] = s.tokens[start : start + n]
        pos = np.arange(start + 2, start + n)  # absolute positions of the targets
        mask[r, : n - 2] = pos >= s.prompt_len
    return mx.array(ids), mx.array(mask)


def target_features(target: Target, head: ChainHead, ids: mx.array) -> mx.array:
    out = target(ids, target.make_cache(), last_only=True)
    return mx.stop_gradient(out.final if head.final_hidden else out.hidden)


def span_features(
    spans: Sequence[Span], T: int, *, store: FeatureStore | None = None, target: Target | None = None, head=None
) -> mx.array:
    """(n, T, F) float32 features of the spans, each row computed over its sequence from the
    first token (as at inference): read from ``store`` where it holds the sequence, else
    recomputed by ``target`` (a store still being built, ``--grow``, serves what it has)."""
    rows = []
    for s, start, n in spans:
        if store is not None and store.ready(s):
            f = mx.array(store.window(s, start, n)).astype(mx.float32)[None]
        elif target is not None:
            f = target_features(target, head, mx.array(s.tokens[None, : start + n]))[:, start:].astype(mx.float32)
        else:
            raise BadRequest(f"{store.root if store else 'no feature store'}: no features of sequence {s.index}")
        rows.append(mx.pad(f, [(0, 0), (0, T - n), (0, 0)]) if n < T else f)
    return mx.concatenate(rows, axis=0)


# -- the loss ----------------------------------------------------------------------------------


class TTTCache:
    """One layer's keys and values of the earlier training-time-test steps: a step's attention
    reads them beside its own (the drafter's layers take it where they take a K/V cache)."""

    offset = 0  # every step's rows sit at the sequence's own positions 0..T-1

    def __init__(self):
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []

    def update_and_fetch(self, k: mx.array, v: mx.array):
        self.keys.append(k)
        self.values.append(v)
        return mx.concatenate(self.keys, axis=2), mx.concatenate(self.values, axis=2)


def ttt_mask(T: int, j: int) -> mx.array:
    """(T, j*T) visibility for step j (0-based) of the training-time test. Row t of step j is
    pass j + 1 of the chain whose anchor row is t - j: it sees step 0's rows up to that anchor
    (the committed rows, built from target features) and, in each later step s <= j, the one
    row of its own chain, t - (j - s)."""
    t = mx.arange(T)[:, None]
    u = mx.arange(T)[None]
    parts = [u <= t - j] + [u == t - (j - s) for s in range(1, j + 1)]
    return mx.concatenate(parts, axis=1)


def _in_subset(labels: mx.array, mask: mx.array, ids: mx.array, vocab_size: int):
    """Labels as indices into the sorted target ids ``ids``; a label outside them is invalid."""
    index = mx.full((vocab_size,), -1, mx.int32).at[ids].add(mx.arange(ids.shape[0], dtype=mx.int32) + 1)
    sub = index[labels]
    return mx.maximum(sub, 0), mask * (sub >= 0)


def loss_fn(
    head: ChainHead,
    feats: mx.array,
    ids: mx.array,
    mask: mx.array,
    ttt: int,
    decay: float,
    capture: list | None = None,
    softmax: tuple[mx.array, Callable] | None = None,
    hits: list | None = None,
):
    """Weighted cross-entropy over ``ttt`` steps; returns (loss, per-step accuracies).

    ``softmax`` = (sorted target ids containing every label, their logits from the head's
    output): train over those rows only (an MTP head, whose logits are the target head's
    rows). ``capture`` (a list) receives each step's logits (for tests); ``hits`` each step's
    (n, T - 2) top-1 agreement with the label (for the chain-depth evaluation)."""
    h = head.fuse(feats)[:, :-1]
    inp = ids[:, 1:]
    labels = ids[:, 2:]
    valid = mask
    if head.draft_ids is not None:  # targets in draft ids; a target outside the draft vocabulary is a miss
        labels, valid = _in_subset(labels, mask, head.draft_ids, head.vocab_size)
    if softmax is not None:
        labels, valid = _in_subset(labels, valid, softmax[0], head.vocab_size)
    T = h.shape[1]
    caches = [TTTCache() for _ in range(head.n_layers)]
    total, weight, accs = 0.0, 0.0, []
    for j in range(ttt):
        out, logits = head.step(h, inp, caches, ttt_mask(T, j))
        if softmax is not None:  # the full logits above are never evaluated (MLX is lazy)
            logits = softmax[1](out)
        if capture is not None:
            capture.append(logits)
        lg = logits[:, :-1]
        rows = mx.arange(mask.shape[1]) >= j
        m, v = mask * rows, valid * rows
        ce = nn.losses.cross_entropy(lg, labels, reduction="none")
        w = decay**j
        total = total + w * (ce * v).sum() / mx.maximum(v.sum(), 1)
        weight += w
        hit = (mx.argmax(lg, axis=-1) == labels) * v
        if hits is not None:
            hits.append(hit)
        accs.append(hit.sum() / mx.maximum(m.sum(), 1))
        h = mx.concatenate([h[:, :1], out[:, :-1]], axis=1)  # row t reads its chain's previous output
    return total / weight, mx.stack(accs)


def response_counts(data: Tokens, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, np.int64)
    for s in data.train:
        np.add.at(counts, s.tokens[s.prompt_len :], 1)
    return counts


def frequent_ids(data: Tokens, n: int, vocab: int) -> np.ndarray:
    """The ``n`` most frequent response tokens of the training sequences, sorted (EAGLE-3's
    draft vocabulary rule)."""
    counts = response_counts(data, vocab)
    return np.sort(np.argsort(-counts, kind="stable")[: min(n, vocab)]).astype(np.int64)


def step_vocab(base: np.ndarray, labels: np.ndarray, vocab: int, negatives: int, rng: np.random.Generator):
    """Sorted ids of a step's training softmax: ``base`` + every label + ``negatives`` random
    other ids (so rare tokens' logits are pushed down too)."""
    need = np.union1d(base, labels)
    if negatives and vocab > len(need):
        extra = rng.integers(0, vocab, size=2 * negatives)
        need = np.union1d(need, extra[~np.isin(extra, need)][:negatives])
    return need.astype(np.int32)


def head_rows(target: Target, ids: np.ndarray) -> mx.array:
    """Rows ``ids`` of the target's output head, as floats."""
    m = target.head_module
    if isinstance(m, (nn.QuantizedEmbedding, nn.QuantizedLinear)):
        w = mx.dequantize(m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits)
    else:
        w = m["weight"]
    return w[mx.array(ids)].astype(mx.float32)


def build_head(
    kind: str, target: Target, tcfg: dict, seed: int, draft_ids: np.ndarray | None = None
) -> tuple[ChainHead, dict]:
    mx.random.seed(seed)
    mt = target.model_type
    if kind == "mtp":
        if mt not in MTP_TYPES:
            raise BadRequest(f"train mtp: no MTP layer family for {mt} targets (known: {', '.join(sorted(MTP_TYPES))})")
        cfg = dict(tcfg, num_nextn_predict_layers=1)
        head = MTPHead(mt, cfg).bind(target.embed, target.head)
        return head, cfg
    cfg = eagle_config(tcfg, draft_vocab_size=None if draft_ids is None else len(draft_ids))
    head = Eagle3(Eagle3Args.from_config(cfg))
    if draft_ids is not None:
        head.set_d2t(draft_ids - np.arange(len(draft_ids)))
    return head, cfg


def eagle_taps(n_target_layers: int) -> list[int]:
    """The target taps (layer outputs) an EAGLE-3 layer built by ``train eagle`` reads."""
    return [i - 1 for i in default_layer_ids(n_target_layers)]


def init_from_target(head: ChainHead, target: Target) -> None:
    """Warm start: the MTP layer from the target's last decoder layer, the final norms from the
    target's (where names and shapes match)."""
    src = target.layers[-1]
    layer = head.layers[0] if isinstance(head, MTPHead) else head.midlayer
    theirs = dict(tree_flatten(src.parameters()))
    mine = dict(tree_flatten(layer.parameters()))
    layer.load_weights([(k, v) for k, v in theirs.items() if k in mine and mine[k].shape == v.shape], strict=False)
    head.norm.weight = target.inner.norm.weight
    if isinstance(head, Eagle3):  # the draft head starts as the target's rows
        ids = head.draft_ids if head.draft_ids is not None else mx.arange(head.vocab_size)
        head.lm_head.weight = head_rows(target, np.array(ids))


def save_head(head: ChainHead, cfg: dict, path: Path, layout: str = "eagle", dtype=mx.float16) -> None:
    """The head in its published layout, float weights as ``dtype`` (float16: what ships)."""
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(head, Eagle3):
        copy = Eagle3(head.args, own_embedding="embed_tokens" in head)
        copy.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(head.parameters())])
        copy.d2t = head.d2t
        save_eagle(copy, path, cfg, layout)
        return
    flat = {"mtp." + k: v.astype(dtype) for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(path / "model-mtp.safetensors"), flat, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def chain_counts(hits: Sequence[np.ndarray], mask: np.ndarray) -> tuple[np.ndarray, int]:
    """Teacher-forced acceptance of a ``len(hits)``-deep chain, as counts: entry k - 1 of the
    first is the number of anchors whose first k drafts all equal the target's tokens (step j's
    row a + j is depth j + 1 of the chain anchored at row a); the second, the anchors counted
    (those whose every depth is a response row)."""
    K = len(hits)
    n = mask.shape[1] - K + 1
    if n <= 0:
        return np.zeros(K, np.int64), 0
    ok = np.ones(mask[:, :n].shape, bool)
    for j in range(K):
        ok &= mask[:, j : j + n] > 0
    run = ok.copy()
    counts = []
    for j in range(K):
        run &= hits[j][:, j : j + n] > 0
        counts.append(int(run.sum()))
    return np.array(counts, np.int64), int(ok.sum())


def held_out_eval(
    head: ChainHead,
    data: Tokens,
    cfg: ChainTrainConfig,
    *,
    store: FeatureStore | None = None,
    target: Target | None = None,
    n: int = EVAL_SEQS,
    chunk: int = 4,
) -> dict:
    """Held-out top-1 agreement with the target's committed tokens by chain depth, over the
    whole of the first ``n`` held-out sequences (full head, teacher forcing): ``acc`` per depth
    given the earlier drafts right, and ``chain``, the share of anchors whose first k drafts
    are all right (k = 1..ttt)."""
    seqs = data.test[:n]
    hit_sum = np.zeros(cfg.ttt)
    rows = np.zeros(cfg.ttt)
    run_num = np.zeros(cfg.ttt)
    anchors = 0
    for i in range(0, len(seqs), chunk):
        part = seqs[i : i + chunk]
        T = max(len(s.tokens) for s in part)
        spans = [Span(s, 0, len(s.tokens)) for s in part]
        ids, mask = batch_arrays(spans, T)
        feats = span_features(spans, T, store=store, target=target, head=head)
        hits: list = []
        _, _ = loss_fn(head, feats, ids, mask, cfg.ttt, cfg.decay, hits=hits)
        mx.eval(hits)
        h = [np.array(x) for x in hits]
        m = np.array(mask)
        for j in range(cfg.ttt):
            hit_sum[j] += h[j][:, j:].sum()
            rows[j] += m[:, j:].sum()
        c, a = chain_counts(h, m)
        run_num += c
        anchors += a
    return {
        "acc": [round(float(a), 4) for a in hit_sum / np.maximum(rows, 1)],
        "chain": [round(float(a), 4) for a in run_num / max(anchors, 1)],
    }


GROW_EVERY = 50  # steps between looks at a store still being built (--grow)


def _schedule(cfg: ChainTrainConfig):
    warm = max(1, int(cfg.warmup * cfg.steps))
    return optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm),
            optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * 0.1),
        ],
        [warm],
    )


def train_chain(cfg: ChainTrainConfig, target: Target, tcfg: dict, log: Callable[[str], None] = print) -> dict:
    """Train, checkpoint (resumable) and write the head to ``cfg.out``/head. Returns a summary."""
    out = Path(cfg.out)
    data = Tokens(cfg.tokens, cfg.n_held_out, cfg.eval_tokens)
    if data.dropped:
        log(
            f"train {cfg.kind}: {len(data.dropped)} training sequences have a held-out prompt; dropped: "
            + ", ".join(data.dropped[:8])
            + (" ..." if len(data.dropped) > 8 else "")
        )
    ids = frequent_ids(data, cfg.draft_vocab, target.vocab_size) if cfg.draft_vocab else None
    head, hcfg = build_head(cfg.kind, target, tcfg, cfg.seed, ids)
    if cfg.kind == "eagle":
        head.bind(target)
        target = Target(target.model, head.taps)
    store = None
    if cfg.features:
        store = FeatureStore(cfg.features, data.files, final=cfg.kind == "mtp", taps=head.taps, partial=cfg.grow)
        if not all(store.ready(s) for s in data.test):
            raise BadRequest(f"{cfg.features}: the held-out sequences' features are not all stored yet")
    base = frequent_ids(data, cfg.softmax_vocab, target.vocab_size) if cfg.softmax_vocab else None
    ckpt = out / "ckpt"
    state = {"step": 0, "log": []}
    opt = optim.AdamW(learning_rate=_schedule(cfg), weight_decay=cfg.weight_decay)
    if cfg.resume:
        if not (ckpt / "state.json").exists():
            raise BadRequest(f"--resume: no checkpoint in {ckpt}")
        state = json.loads((ckpt / "state.json").read_text())
        head.load_weights(str(ckpt / "weights.safetensors"))
        opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
    else:
        init_from_target(head, target)
    mx.eval(head.parameters())
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(asdict(cfg), indent=2))
    rng = np.random.default_rng(cfg.seed + state["step"])
    vrng = np.random.default_rng(cfg.seed + 7919 + state["step"])

    def loss(m, f, i, k, sm):
        return loss_fn(m, f, i, k, cfg.ttt, cfg.decay, softmax=sm)

    grad = nn.value_and_grad(head, loss)
    t_steps, n_timed = 0.0, 0
    evaluate = {"store": store, "target": target}
    while state["step"] < cfg.steps:
        if cfg.grow and state["step"] % GROW_EVERY == 0:
            store.refresh()  # the builder's progress since
        ids, mask, spans = make_batch(data.train, rng, cfg.batch_size, cfg.seq_len)
        t0 = time.perf_counter()
        feats = span_features(spans, cfg.seq_len, store=store, target=target, head=head)
        sm = None
        if base is not None:
            m = np.array(mask) > 0
            labels = np.array(ids)[:, 2:][m]
            vocab = step_vocab(base, labels, target.vocab_size, cfg.vocab_negatives, vrng)
            sm = (mx.array(vocab), target.head_rows(mx.array(vocab)))
        (lv, accs), g = grad(head, feats, ids, mask, sm)
        if cfg.clip:
            g, _ = optim.clip_grad_norm(g, cfg.clip)
        opt.update(head, g)
        mx.eval(head.parameters(), opt.state, lv, accs)
        dt = time.perf_counter() - t0
        state["step"] += 1
        t_steps, n_timed = t_steps + dt, n_timed + 1
        s = state["step"]
        n_pos = int(sum(float(mask[:, j:].sum()) for j in range(cfg.ttt)))
        row = {"step": s, "loss": round(float(lv), 4), "acc": [round(float(a), 4) for a in accs], "sec": round(dt, 3)}
        row["time"] = round(time.time())
        row["positions"] = n_pos
        if cfg.grow:
            row["stored"] = store.n_ready(data.train)  # read from the store; the rest are recomputed
        if s % cfg.eval_every == 0 or s == cfg.steps or s == 1:
            row["held_out"] = held_out_eval(head, data, cfg, **evaluate)
        state["log"].append(row)
        log(json.dumps(row))
        if s % cfg.checkpoint_every == 0 or s == cfg.steps:
            ckpt.mkdir(parents=True, exist_ok=True)
            head.save_weights(str(ckpt / "weights.safetensors"))
            mx.save_safetensors(str(ckpt / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
            (ckpt / "state.json").write_text(json.dumps(state))
            save_head(head, hcfg, out / "head", cfg.layout)
    return {
        "steps": state["step"],
        "sec_per_step": round(t_steps / max(n_timed, 1), 3),
        "last": state["log"][-1] if state["log"] else None,
        "head": str(out / "head"),
    }


__all__ = [
    "ChainTrainConfig",
    "FeatureStore",
    "Tokens",
    "build_features",
    "build_head",
    "chain_counts",
    "eagle_taps",
    "held_out_eval",
    "loss_fn",
    "make_batch",
    "save_head",
    "span_features",
    "target_features",
    "train_chain",
]
