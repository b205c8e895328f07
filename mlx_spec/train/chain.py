"""Training chain drafters: an MTP-style head or an EAGLE-3 layer, for any mlx-lm target.

Data: the same token files the DFlash drafter is trained on (``train export --tokens``; the
shipped ones under models/smollm2-135m-dflash2/data/): the target's own responses to the
training prompts. Features are recomputed with the target each batch (MTP: its final-normed
last hidden; EAGLE-3: three taps), so no feature shards are needed.

Loss: cross-entropy on the committed token two positions ahead of each feature row (row t reads
the target's features at t and token t + 1, and predicts t + 2), response positions only.
Training-time test (``ttt`` steps, the EAGLE-3 recipe): step j > 1 runs the head again with, at
each row, its own step j - 1 output of the row before in place of the target's features, and
the same targets; step j's loss is weighted ``decay ** (j - 1)``. Row t of step j is pass j of
the chain anchored at row t - j + 1, and attends exactly as that pass does at inference
(``ttt_mask``): to the committed rows up to the anchor (step 1's, built from target features)
and to its own chain's rows of the earlier steps. The drafts it reads are the committed tokens
(teacher forcing), so step j's logits at row t equal pass j of ``propose`` fed those tokens.

The forward is the inference code itself (``chain.draft_logits`` and the head's ``step``), and
the output is the published layout: MTP heads as ``mtp.*`` tensors beside a config that declares
one MTP layer (``load_mtp`` reads the folder), EAGLE-3 layers in the authors' or the speculators
layout (``load_eagle`` reads either).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from ..chain import ChainHead
from ..eagle import Eagle3, Eagle3Args, eagle_config, save_eagle
from ..errors import BadRequest
from ..mtp import MTP_TYPES, MTPHead
from ..target import Target


@dataclass(frozen=True)
class ChainTrainConfig:
    kind: str  # "mtp" or "eagle"
    tokens: str  # token-id .npz (train export --tokens)
    out: str
    steps: int = 6000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    ttt: int = 3
    decay: float = 0.8
    seed: int = 0
    held_out: int = 64
    checkpoint_every: int = 100
    eval_every: int = 100
    layout: str = "eagle"  # EAGLE-3 output layout: eagle | speculators
    draft_vocab: int = 0  # EAGLE-3: draft over the N most frequent response tokens (d2t); 0: the full vocabulary
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
        if self.seq_len < 8:
            raise BadRequest("--seq-len must be >= 8")
        if not Path(self.tokens).is_file():
            raise BadRequest(f"--tokens {self.tokens}: no such file (a token-id .npz from `train export --tokens`)")


class Tokens:
    """Sequences of a token file with their prompt lengths; the last ``held_out`` are held out."""

    def __init__(self, path: str | Path, held_out: int):
        try:
            z = np.load(path)
            toks, offs, plens = z["tokens"], z["offsets"], z["prompt_lens"]
        except (OSError, ValueError, KeyError) as e:
            raise BadRequest(f"{path}: not a token file from `train export --tokens` ({e})") from None
        seqs = [toks[offs[i] : offs[i + 1]].astype(np.int32) for i in range(len(offs) - 1)]
        if len(seqs) <= held_out:
            raise BadRequest(f"{path}: {len(seqs)} sequences, fewer than --held-out {held_out} + 1")
        self.train = list(zip(seqs[:-held_out], plens[:-held_out].tolist()))
        self.test = list(zip(seqs[-held_out:], plens[-held_out:].tolist()))


def make_batch(pool, rng: np.random.Generator, n: int, seq_len: int):
    """(ids (n, T) int32, loss mask (n, T - 2) over rows t whose target t + 2 is a response token)."""
    ids = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len - 2), np.float32)
    for r in range(n):
        seq, P = pool[rng.integers(len(pool))]
        hi = max(0, len(seq) - seq_len)
        s = int(rng.integers(0, hi + 1)) if hi else 0
        w = seq[s : s + seq_len]
        ids[r, : len(w)] = w
        pos = np.arange(s + 2, s + len(w))  # absolute positions of the targets
        mask[r, : len(w) - 2] = pos >= P
    return mx.array(ids), mx.array(mask)


def target_features(target: Target, head: ChainHead, ids: mx.array) -> mx.array:
    out = target(ids, target.make_cache())
    return mx.stop_gradient(out.final if head.final_hidden else out.hidden)


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


def loss_fn(
    head: ChainHead, feats: mx.array, ids: mx.array, mask: mx.array, ttt: int, decay: float, capture: list | None = None
):
    """Weighted cross-entropy over ``ttt`` steps; returns (loss, per-step accuracies).
    ``capture`` (a list) receives each step's logits (for tests)."""
    h = head.fuse(feats)[:, :-1]
    inp = ids[:, 1:]
    labels = ids[:, 2:]
    valid = mask
    if head.draft_ids is not None:  # targets in draft ids; a target outside the draft vocabulary is a miss
        index = (
            mx.full((head.vocab_size,), -1, mx.int32)
            .at[head.draft_ids]
            .add(mx.arange(head.draft_ids.shape[0], dtype=mx.int32) + 1)
        )
        labels = index[labels]
        valid = mask * (labels >= 0)
        labels = mx.maximum(labels, 0)
    T = h.shape[1]
    caches = [TTTCache() for _ in range(head.n_layers)]
    total, weight, accs = 0.0, 0.0, []
    for j in range(ttt):
        out, logits = head.step(h, inp, caches, ttt_mask(T, j))
        if capture is not None:
            capture.append(logits)
        lg = logits[:, :-1]
        rows = mx.arange(mask.shape[1]) >= j
        m, v = mask * rows, valid * rows
        ce = nn.losses.cross_entropy(lg, labels, reduction="none")
        w = decay**j
        total = total + w * (ce * v).sum() / mx.maximum(v.sum(), 1)
        weight += w
        accs.append(((mx.argmax(lg, axis=-1) == labels) * v).sum() / mx.maximum(m.sum(), 1))
        h = mx.concatenate([h[:, :1], out[:, :-1]], axis=1)  # row t reads its chain's previous output
    return total / weight, mx.stack(accs)


def frequent_ids(data: Tokens, n: int, vocab: int) -> np.ndarray:
    """The ``n`` most frequent response tokens of the training sequences, sorted (EAGLE-3's
    draft vocabulary rule)."""
    counts = np.zeros(vocab, np.int64)
    for seq, P in data.train:
        np.add.at(counts, seq[P:], 1)
    return np.sort(np.argsort(-counts, kind="stable")[: min(n, vocab)]).astype(np.int64)


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


def save_head(head: ChainHead, cfg: dict, path: Path, layout: str = "eagle") -> None:
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(head, Eagle3):
        save_eagle(head, path, cfg, layout)
        return
    flat = {"mtp." + k: v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(path / "model-mtp.safetensors"), flat, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def held_out_accuracy(head: ChainHead, target: Target, data: Tokens, cfg: ChainTrainConfig, n: int = 16) -> list[float]:
    """Held-out top-1 agreement with the target's committed token at each chain depth."""
    rng = np.random.default_rng(1234)
    ids, mask = make_batch(data.test, rng, min(n, len(data.test)), cfg.seq_len)
    _, accs = loss_fn(head, target_features(target, head, ids), ids, mask, cfg.ttt, cfg.decay)
    return [round(float(a), 4) for a in accs]


def train_chain(cfg: ChainTrainConfig, target: Target, tcfg: dict, log: Callable[[str], None] = print) -> dict:
    """Train, checkpoint (resumable) and write the head to ``cfg.out``/head. Returns a summary."""
    out = Path(cfg.out)
    data = Tokens(cfg.tokens, cfg.held_out)
    ids = frequent_ids(data, cfg.draft_vocab, target.vocab_size) if cfg.draft_vocab else None
    head, hcfg = build_head(cfg.kind, target, tcfg, cfg.seed, ids)
    if cfg.kind == "eagle":
        head.bind(target)
        target = Target(target.model, head.taps)
    ckpt = out / "ckpt"
    state = {"step": 0, "log": []}
    warm = max(1, int(cfg.warmup * cfg.steps))
    sched = optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm),
            optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * 0.1),
        ],
        [warm],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=cfg.weight_decay)
    if cfg.resume:
        if not (ckpt / "state.json").exists():
            raise BadRequest(f"--resume: no checkpoint in {ckpt}")
        state = json.loads((ckpt / "state.json").read_text())
        head.load_weights(str(ckpt / "weights.safetensors"))
        opt_state = mx.load(str(ckpt / "optimizer.safetensors"))
        from mlx.utils import tree_unflatten

        opt.state = tree_unflatten(list(opt_state.items()))
    else:
        init_from_target(head, target)
    mx.eval(head.parameters())
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(asdict(cfg), indent=2))
    rng = np.random.default_rng(cfg.seed + state["step"])
    grad = nn.value_and_grad(head, lambda m, f, i, k: loss_fn(m, f, i, k, cfg.ttt, cfg.decay))
    t_steps, n_timed = 0.0, 0
    while state["step"] < cfg.steps:
        ids, mask = make_batch(data.train, rng, cfg.batch_size, cfg.seq_len)
        t0 = time.perf_counter()
        feats = target_features(target, head, ids)
        (loss, accs), g = grad(head, feats, ids, mask)
        opt.update(head, g)
        mx.eval(head.parameters(), opt.state, loss, accs)
        dt = time.perf_counter() - t0
        state["step"] += 1
        t_steps, n_timed = t_steps + dt, n_timed + 1
        s = state["step"]
        row = {"step": s, "loss": round(float(loss), 4), "acc": [round(float(a), 4) for a in accs], "sec": round(dt, 3)}
        if s % cfg.eval_every == 0 or s == cfg.steps or s == 1:
            row["held_out_acc"] = held_out_accuracy(head, target, data, cfg)
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
    "Tokens",
    "build_head",
    "held_out_accuracy",
    "loss_fn",
    "make_batch",
    "save_head",
    "target_features",
    "train_chain",
]
