"""Train a DFlash 2 (or DFlash 1) drafter on target-generated data (the DFlash recipe, docs/training.md).

Each step takes a few sequences and samples random anchors among their response positions.
Every anchor ``a`` becomes one block ``[x_a, MASK x (B-1)]`` at positions ``a..a+B-1``, run as
its own row (exactly as at inference): it attends to the fused target features of positions
``< a`` of its own sequence (never its anchor's own features or anything later) and to its own
block (bidirectionally or causally); blocks never see each other. Position ``k`` is trained on
``x_{a+k}`` with weight ``exp(-(k-1)/gamma)``; the loss is computed only at those positions, so
the frozen 49152-wide head runs on (anchors x (B-1)) rows, not on every token. The selector
adds a K-way CE over the drafter's top-K (gold injected when outside), teacher-forced on the
gold predecessor. All randomness is numpy's (state saved in checkpoints: resume is exact).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..decode import spec_steps
from ..drafter import DFLASH1, DFLASH2, Drafter, DrafterArgs
from ..errors import BadRequest, CheckpointError
from ..loading import DRAFT_VOCAB_FILE, load_drafter, load_target_model, save_drafter, write_draft_vocab
from ..prompts import interleave, load_prompts
from ..stats import Stats
from ..target import Target
from .data import Dataset, load_datasets
from .plot import line_chart_png

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

# SmolLM2's tokenizer has no mask token. These specials (StarCoder-style repo/Jupyter markers)
# never occur in chat-formatted text, so their embedding rows are free to act as MASK.
MASK_CANDIDATES = ("<|mask|>", "<|MASK|>", "<mask>", "<empty_output>", "<reponame>")


EVAL_PROMPTS = 5
"""Held-out prompts per tau evaluation (`train drafter` and `train run`): one of each built-in kind."""
EVAL_MAX_TOKENS = 64
"""Tokens generated per held-out prompt in a tau evaluation."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """The drafter and how it learns: architecture, loss, blocks per step, optimizer. Shared by
    `train drafter` (``TrainConfig.recipe``) and `train run` (``StreamConfig.recipe``); resuming
    a run requires the same recipe."""

    layers: int = 2
    intermediate_size: int = 1536
    block_size: int = 8
    no_conv: bool = False
    no_selector: bool = False
    selector_rank: int = 64
    selector_top_k: int = 8
    mask_token_id: int | None = None
    loss: str = "ce"  # ce | kl
    attention: str = "bidirectional"  # bidirectional | causal
    corruption: str = "full"  # full | uniform
    gamma: float | None = None
    selector_weight: float = 1.0
    draft_vocab: int = 0
    """Training-only softmax over the K most frequent data tokens + the batch's labels and
    target top-K + ``vocab_negatives`` random others (0 = full vocab). The saved drafter always
    uses the full head; this only makes training steps cheaper."""
    vocab_negatives: int = 1024
    seqs_per_step: int = 4
    anchors: int = 32
    lr: float = 6e-4
    warmup: float = 0.04
    """Warm-up share of the schedule (of the steps, or of `train run`'s budget)."""
    weight_decay: float = 0.01
    clip: float = 1.0

    @property
    def decay(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2))

    @property
    def v1(self) -> bool:
        return self.no_conv and self.no_selector


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """`train drafter`: train on stored data sets for a number of optimizer steps."""

    data: str
    out: str
    target: str = "smollm2-135m-instruct"
    resume: bool = False
    init: str | None = None
    init_target_layers: bool = False
    steps: int = 1000
    seed: int = 0
    checkpoint_every: int = 100
    """Optimizer steps between checkpoints."""
    checkpoint_minutes: float | None = None
    eval_prompts: int = EVAL_PROMPTS
    eval_max_tokens: int = EVAL_MAX_TOKENS
    eval_file: str | None = None
    """JSONL of held-out prompts (default: the first data dir's eval_prompts.jsonl)."""
    export: str | None = None
    recipe: Recipe = Recipe()


RECIPE_FIELDS = frozenset(f.name for f in fields(Recipe))


def settings(config: dict, legacy_nest: str | None = None) -> dict:
    """A saved run config (``train_config.json`` / ``run_config.json``) as flat ``name`` /
    ``recipe.name`` keys, for resume checks. Files written before the recipe had its own
    dataclass held the recipe fields flat (``train_config.json``) or inside ``legacy_nest``
    (``run_config.json``'s ``"train"``, beside a second ``seed`` that was never used): those
    fields are read as the recipe, the rest is dropped."""
    config = dict(config)
    if "recipe" in config:
        recipe = config.pop("recipe")
    elif legacy_nest is not None and isinstance(config.get(legacy_nest), dict):
        old = config.pop(legacy_nest)
        recipe = {k: v for k, v in old.items() if k in RECIPE_FIELDS}
    else:
        recipe = {k: config.pop(k) for k in list(config) if k in RECIPE_FIELDS}
    if not recipe:
        raise CheckpointError(
            "the saved run config holds no drafter recipe; it was not written by "
            "`mlx_spec train`: start a new run (another --out)"
        )
    return {**config, **{f"recipe.{k}": v for k, v in recipe.items()}}


def settings_diff(saved: dict, now: dict, free: set[str]) -> list[str]:
    """The settings (flat keys, ``settings``) that differ between a saved run and this one,
    except those in ``free`` (allowed to change on resume)."""
    return sorted(k for k in set(saved) | set(now) if k not in free and saved.get(k) != now.get(k))


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 (paper Eq. 4)."""
    k = np.arange(1, block_size)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def pick_mask_token(tokenizer) -> int:
    vocab = tokenizer.get_vocab()
    for name in MASK_CANDIDATES:
        if name in vocab:
            return vocab[name]
    raise BadRequest("the tokenizer has no spare special token to use as MASK; pass --mask-token-id")


def drafter_config(target_args, cfg: Recipe, taps: list[int], mask_id: int) -> dict:
    """The official checkpoint config for a drafter of this target."""
    H = target_args.hidden_size
    n_heads = target_args.num_attention_heads
    dc = {"mask_token_id": mask_id, "target_layer_ids": list(taps), "block_size": cfg.block_size}
    if not cfg.v1:
        dc.update(
            conv_kernel_size=2, conv_group_size=16, selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k
        )
    return {
        "architectures": [DFLASH1 if cfg.v1 else DFLASH2],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": getattr(target_args, "num_key_value_heads", n_heads),
        "head_dim": getattr(target_args, "head_dim", None) or H // n_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": target_args.vocab_size,
        "rms_norm_eps": getattr(target_args, "rms_norm_eps", 1e-6),
        "rope_theta": getattr(target_args, "rope_theta", 1e6),
        "max_position_embeddings": getattr(target_args, "max_position_embeddings", 8192),
        "num_target_layers": target_args.num_hidden_layers,
        "is_causal": cfg.attention == "causal",
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "dflash_config": dc,
    }


def identity_init(drafter: Drafter) -> None:
    """Convs start as exact no-ops and the selector as unary argmax."""
    for layer in drafter.layers:
        for name in ("attention_conv", "mlp_conv"):
            if name in layer:
                conv = layer[name]
                bk = mx.zeros(conv.base_kernel.shape)
                bk[:, 0] = 1.0
                conv.base_kernel = bk
                conv.kernel_projection.weight = mx.zeros(conv.kernel_projection.weight.shape)
    if "candidate_selector" in drafter:
        sel = drafter.candidate_selector
        sel.successor_codebook.weight = mx.zeros(sel.successor_codebook.weight.shape)
        sel.predecessor_codebook.weight = 0.02 * mx.random.normal(sel.predecessor_codebook.weight.shape)


def init_from_target(drafter: Drafter, target) -> list[str]:
    """Copy the target's last decoder layers (where shapes match) and final norm into the drafter.

    A warm start for small budgets: the drafter's output feeds the same frozen head.
    Returns the names copied."""
    src = target.inner.layers[-len(drafter.layers) :]
    copied = []
    for i, (mine, theirs) in enumerate(zip(drafter.layers, src)):
        theirs_p = dict(tree_flatten(theirs.parameters()))
        upd = [(k, v) for k, v in tree_flatten(mine.parameters()) if k in theirs_p and theirs_p[k].shape == v.shape]
        mine.load_weights([(k, theirs_p[k]) for k, _ in upd], strict=False)
        copied += [f"layers.{i}.{k}" for k, _ in upd]
    if drafter.norm.weight.shape == target.inner.norm.weight.shape:
        drafter.norm.weight = mx.array(target.inner.norm.weight)
        copied.append("norm.weight")
    return copied


def scale_fc_init(drafter: Drafter, data: Dataset, n: int = 4096) -> np.ndarray:
    """Divide fc's input columns by each feature channel's RMS over the data.

    Target residual streams carry a few "massive" channels (RMS ~1000x the median on SmolLM2)
    that would otherwise fill the fused context ``c`` at init. Returns the per-channel RMS."""
    rows = []
    per = max(1, n // max(1, len(data)))
    for f in data.features:
        rows.append(np.asarray(f[: max(1, len(f) - 1)][:: max(1, (len(f) - 1) // per)], np.float32))
    x = np.concatenate(rows)[:n]
    rms = np.sqrt((x * x).mean(0)) + 1e-3
    scale = np.median(rms) / rms
    drafter.fc.weight = drafter.fc.weight * mx.array(scale[None].astype(np.float32))
    return rms


def calibrate_head_scale(drafter: Drafter, n: int = 64) -> float:
    """Scale the final norm so random unit-RMS hiddens give logits of std 1 through the head.

    Otherwise training starts at CE ~20 and spends its first hundreds of steps shrinking the
    norm weights (Adam moves them ~lr per step). Returns the factor applied."""
    h = mx.random.normal((n, drafter.args.hidden_size), key=mx.random.key(0))
    std = mx.std(drafter.logits(h * drafter.norm.weight)).item()
    factor = 1.0 / max(std, 1e-6)
    drafter.norm.weight = drafter.norm.weight * factor
    return factor


def freeze_disabled(drafter: Drafter, cfg: Recipe) -> None:
    """--no-conv / --no-selector on a DFlash 2 keep those parts frozen at identity."""
    if cfg.no_conv:
        for layer in drafter.layers:
            for name in ("attention_conv", "mlp_conv"):
                if name in layer:
                    layer[name].freeze()
    if cfg.no_selector and "candidate_selector" in drafter:
        drafter.candidate_selector.freeze()


class Batch(NamedTuple):
    features: np.ndarray  # (Bs, S, F) float32 context features
    blocks: np.ndarray  # (N, B) int32 [anchor, MASK...] (uniform corruption: some gold)
    anchors: np.ndarray  # (N,) int32 absolute anchor positions
    seq: np.ndarray  # (N,) int32 row of ``features`` each block reads
    labels: np.ndarray  # (N, B-1) int32 gold x_{a+k}
    prev: np.ndarray  # (N, B-1) int32 gold predecessor (anchor for k=1)
    weights: np.ndarray  # (N, B-1) float32 decay weight, 0 where no loss
    topk_ids: np.ndarray  # (N, B-1, K) target top-K ids at the label positions
    topk_logp: np.ndarray  # (N, B-1, K) and their log-probs


def sample_anchors(prompt_len: int, n_tokens: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``n`` distinct sorted anchors among response positions that have >= 1 label."""
    cands = np.arange(prompt_len, n_tokens - 1)
    if len(cands) <= n:
        return cands
    return np.sort(rng.choice(cands, n, replace=False))


def make_batch(data: Dataset, rng: np.random.Generator, cfg: Recipe, mask_id: int) -> Batch:
    B = cfg.block_size
    rows = rng.choice(len(data), min(cfg.seqs_per_step, len(data)), replace=False)
    w = loss_weights(B, cfg.decay)
    picks = [(r, sample_anchors(data.prompt_lens[r], len(data.tokens[r]), cfg.anchors, rng)) for r in rows]
    S = max(1, max((int(a.max()) for _, a in picks if len(a)), default=1))
    F = data.features[rows[0]].shape[1]
    feats = np.zeros((len(rows), S, F), np.float32)
    blocks, anchors, seq, labels, prev, weights, tki, tkl = [], [], [], [], [], [], [], []
    for i, (r, anc) in enumerate(picks):
        toks = data.tokens[r]
        n = min(S, len(toks))
        feats[i, :n] = data.features[r][:n]
        T = len(toks)
        for a in anc:
            pos = a + np.arange(1, B)
            ok = pos < T
            lab = np.where(ok, toks[np.minimum(pos, T - 1)], 0).astype(np.int32)
            blk = np.full(B, mask_id, np.int32)
            blk[0] = toks[a]
            wt = w * ok
            if cfg.corruption == "uniform":
                # Each block gets a mask ratio t ~ U(0, 1]; unmasked positions show the gold token
                # and carry no loss. At least one position stays masked.
                t = 1.0 - rng.random()
                masked = rng.random(B - 1) < t
                masked[rng.integers(B - 1)] = True
                blk[1:] = np.where(masked, mask_id, lab)
                wt = wt * masked
            blocks.append(blk)
            anchors.append(a)
            seq.append(i)
            labels.append(lab)
            prev.append(np.concatenate([[toks[a]], lab[:-1]]).astype(np.int32))
            weights.append(wt.astype(np.float32))
            tki.append(data.topk_ids[r][np.minimum(pos, T - 1)])
            tkl.append(data.topk_logp[r][np.minimum(pos, T - 1)].astype(np.float32))
    if not blocks:
        raise BadRequest("no anchors: the sampled sequences have no response tokens")
    return Batch(
        feats,
        np.stack(blocks),
        np.array(anchors, np.int32),
        np.array(seq, np.int32),
        np.stack(labels),
        np.stack(prev),
        np.stack(weights),
        np.stack(tki),
        np.stack(tkl),
    )


def block_attention_mask(anchors: np.ndarray, S: int, B: int, causal: bool) -> np.ndarray:
    """(N, 1, B, S + B) bool: context j visible iff j < anchor; own block all (or k <= q)."""
    ctx = np.arange(S)[None, :] < anchors[:, None]  # (N, S)
    blk = np.tril(np.ones((B, B), bool)) if causal else np.ones((B, B), bool)
    N = len(anchors)
    return np.concatenate(
        [np.broadcast_to(ctx[:, None, :], (N, B, S)), np.broadcast_to(blk[None], (N, B, B))], axis=-1
    )[:, None]


def block_hidden(
    drafter: Drafter, features: mx.array, blocks: mx.array, anchors: mx.array, seq: mx.array, mask: mx.array
) -> mx.array:
    """Final-normed hidden (N, B, H) of every block against its own sequence's context: the
    drafter's own batched forward (``Drafter.block_hidden``), the one inference uses."""
    return drafter.block_hidden(blocks, features, anchors, seq, mask)


STEP_SUMS = ("loss", "ce", "sel", "w", "hits", "n", "t")
"""Running sums between two history rows: train_step's loss and aux, steps, seconds."""


def add_step(acc: dict, parts, dt: float) -> None:
    """Add one step's (loss, ce, sel, weight, hits) (evaluated by ``train_step``) and time."""
    for k, v in zip(STEP_SUMS, parts):
        acc[k] += v.item()
    acc["n"] += 1
    acc["t"] += dt


def step_means(acc: dict) -> dict:
    """A history row's means: loss and seconds per step, ce, sel and top-1 per weighted position."""
    w = max(acc["w"], 1e-9)
    return {
        "loss": round(acc["loss"] / acc["n"], 4),
        "ce": round(acc["ce"] / w, 4),
        "sel": round(acc["sel"] / w, 4),
        "top1": round(acc["hits"] / w, 4),
        "step_s": round(acc["t"] / acc["n"], 3),
    }


def loss_fn(drafter: Drafter, batch: dict, cfg: Recipe):
    """(loss, (ce_sum, sel_sum, weight_sum, top1_hits)) for one batch of mx arrays."""
    h = block_hidden(drafter, batch["features"], batch["blocks"], batch["anchors"], batch["seq"], batch["mask"])[
        :, 1:
    ]  # (N, B-1, H)
    idx = batch["idx"]  # flat indices of positions with weight > 0
    h = h.reshape(-1, h.shape[-1])[idx]  # (M, H)
    w = batch["weights"].reshape(-1)[idx]  # (M,)
    sub = "head_w" in batch  # restricted training vocabulary (labels/top-K ids are remapped)
    labels = batch["labels_sub" if sub else "labels"].reshape(-1)[idx]
    if sub:  # the head's rows of this step's vocabulary, through the drafter's own transform
        logits = drafter.logits(h, head=lambda x: x @ batch["head_w"].T).astype(mx.float32)  # (M, V')
    else:
        logits = drafter.logits(h, full=True).astype(mx.float32)  # (M, V)
    lse = mx.logsumexp(logits, axis=-1)
    if cfg.loss == "kl":
        tk = batch["topk_sub" if sub else "topk_ids"]
        tk_ids = tk.reshape(-1, tk.shape[-1])[idx]
        p = mx.softmax(batch["topk_logp"].reshape(-1, tk_ids.shape[-1])[idx], axis=-1)
        logq = mx.take_along_axis(logits, tk_ids, axis=-1) - lse[:, None]
        per = (p * (mx.log(mx.maximum(p, 1e-30)) - logq)).sum(-1)  # KL over the target's top-K
    else:
        per = lse - mx.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    ce_sum = (w * per).sum()
    total = ce_sum
    sel_sum = mx.array(0.0)
    if "candidate_selector" in drafter and not cfg.no_selector and cfg.selector_weight > 0:
        sel = drafter.candidate_selector
        cand = sel.candidates(mx.stop_gradient(logits))  # (M, K)
        K = cand.shape[-1]
        has = (cand == labels[:, None]).any(axis=-1)
        # Slot K-1 holds the K-th best: replace it by the gold token when gold is outside.
        last = mx.arange(K)[None] == K - 1
        cand = mx.where(last & ~has[:, None], labels[:, None], cand)
        gold = mx.argmax(cand == labels[:, None], axis=-1)
        u = mx.take_along_axis(logits, cand, axis=-1)  # (M, K)
        prev = batch["prev"].reshape(-1)[idx][:, None]  # (M, 1): the gold predecessor
        cand_ids = batch["vocab"][cand] if sub else cand
        scores = sel.scores(h, u, prev, cand_ids)[:, 0]  # (M, K): the same formula as inference
        sel_per = mx.logsumexp(scores, axis=-1) - mx.take_along_axis(scores, gold[:, None], axis=-1)[:, 0]
        sel_sum = (w * sel_per).sum()
        total = total + cfg.selector_weight * sel_sum
    wsum = w.sum()
    hits = ((mx.argmax(logits, axis=-1) == labels) * w).sum()
    return total / wsum, (ce_sum, sel_sum, wsum, hits)


def head_weight(target) -> mx.array:
    """(V, H) weight of the target's output head (tied embedding or lm_head)."""
    return target.head_module.weight


def base_vocab(data: Dataset, k: int) -> np.ndarray:
    """The ``k`` most frequent ids over the data's tokens and stored target top-K ids."""
    counts = np.zeros(1 << 20, np.int64)
    for t, ti in zip(data.tokens, data.topk_ids):
        np.add.at(counts, t, 1)
        np.add.at(counts, ti[ti > 0], 1)
    order = np.argsort(-counts, kind="stable")
    return np.sort(order[: min(k, int((counts > 0).sum()))]).astype(np.int32)


def step_vocab(batch: Batch, base: np.ndarray, vocab_size: int, negatives: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted ids of this step's training vocabulary: base + every label + target top-K +
    ``negatives`` random other ids (so rare tokens' logits are pushed down too)."""
    need = np.union1d(base, np.union1d(batch.labels[batch.weights > 0], batch.topk_ids[batch.weights > 0]))
    rest = vocab_size - len(need)
    if negatives and rest > 0:
        extra = rng.integers(0, vocab_size, size=2 * negatives)
        extra = extra[~np.isin(extra, need)][:negatives]
        need = np.union1d(need, extra)
    return need.astype(np.int32)


def to_mx(batch: Batch, cfg: Recipe, vocab: np.ndarray | None = None, head_w: mx.array | None = None) -> dict:
    B = cfg.block_size
    idx = np.nonzero(batch.weights.reshape(-1) > 0)[0].astype(np.int32)
    mask = block_attention_mask(batch.anchors, batch.features.shape[1], B, cfg.attention == "causal")
    extra = {}
    if vocab is not None:
        lookup = np.zeros(
            max(int(vocab.max()) + 1, int(batch.labels.max()) + 1, int(batch.topk_ids.max()) + 1), np.int32
        )
        lookup[vocab] = np.arange(len(vocab), dtype=np.int32)
        extra = {
            "vocab": mx.array(vocab),
            "head_w": head_w[mx.array(vocab)],
            "labels_sub": mx.array(lookup[batch.labels]),
            "topk_sub": mx.array(lookup[batch.topk_ids]),
        }
    return extra | {
        "features": mx.array(batch.features),
        "blocks": mx.array(batch.blocks),
        "anchors": mx.array(batch.anchors),
        "seq": mx.array(batch.seq),
        "mask": mx.array(mask),
        "labels": mx.array(batch.labels),
        "prev": mx.array(batch.prev),
        "weights": mx.array(batch.weights),
        "idx": mx.array(idx),
        "topk_ids": mx.array(batch.topk_ids),
        "topk_logp": mx.array(batch.topk_logp),
    }


def make_optimizer(cfg: Recipe, steps: int) -> optim.Optimizer:
    warm = max(1, int(cfg.warmup * steps))
    sched = optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm),
            optim.cosine_decay(cfg.lr, max(1, steps - warm), cfg.lr * 0.1),
        ],
        [warm],
    )
    return optim.AdamW(learning_rate=sched, weight_decay=cfg.weight_decay)


def train_step(drafter: Drafter, opt: optim.Optimizer, batch: dict, cfg: Recipe):
    """One optimizer step; returns (loss, aux) after evaluation."""
    vg = nn.value_and_grad(drafter, lambda m: loss_fn(m, batch, cfg))
    (loss, aux), grads = vg(drafter)
    grads, gnorm = optim.clip_grad_norm(grads, cfg.clip)
    opt.update(drafter, grads)
    mx.eval(loss, aux, gnorm, drafter.parameters(), opt.state)
    return loss, aux, gnorm


# ---- checkpoints -------------------------------------------------------------------------


def save_checkpoint(
    run: Path,
    drafter: Drafter,
    config: dict,
    opt: optim.Optimizer,
    state: dict,
    vocab: np.ndarray | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Atomically replace ``run/ckpt`` with weights, optimizer state and trainer state (and the
    reduced draft vocabulary ``vocab``, if any, as ``draft_vocab.json``; ``extra(dir)`` writes
    more files into the new checkpoint before it replaces the old one)."""
    tmp = run / "ckpt.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp, config)
    if vocab is not None:
        write_draft_vocab(tmp, vocab, f"the {len(vocab)} most frequent ids of the training data")
    # .npz, not .safetensors: the checkpoint dir must stay loadable by load_drafter.
    mx.savez(str(tmp / "optimizer.npz"), **dict(tree_flatten(opt.state)))
    write_state(tmp, state)
    if extra is not None:
        extra(tmp)
    final = run / "ckpt"
    old = run / "ckpt.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_state(ckpt: Path, state: dict) -> None:
    """Replace ``ckpt/state.json`` atomically (an eval run after the checkpoint's save joins it)."""
    tmp = ckpt / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(ckpt / "state.json")


def load_checkpoint(run: Path, drafter: Drafter, opt: optim.Optimizer) -> dict:
    ckpt = run / "ckpt"
    if not (ckpt / "state.json").exists():
        raise CheckpointError(f"{run}: no checkpoint to resume (expected {ckpt}/state.json)")
    w = drafter.sanitize(mx.load(str(ckpt / "model.safetensors")))
    drafter.load_weights(list(w.items()), strict=True)
    opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.npz")).items()))
    mx.eval(drafter.parameters(), opt.state)
    return json.loads((ckpt / "state.json").read_text())


def export_checkpoint(run: str | Path, out: str | Path, card: str | None = None) -> dict:
    """float16 copy of ``run/ckpt`` in the official layout (+ README.md model card if given)."""
    run, out = Path(run), Path(out)
    drafter, config = load_drafter(run / "ckpt", dtype=mx.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp, config, dtype=mx.float16)
    if drafter.shipped_vocab is not None:
        shutil.copy(run / "ckpt" / DRAFT_VOCAB_FILE, tmp / DRAFT_VOCAB_FILE)
    if card is None and (out / "README.md").exists():
        card = (out / "README.md").read_text()
    if card:
        (tmp / "README.md").write_text(card)
    if (out / "data").exists():
        shutil.copytree(out / "data", tmp / "data")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return {"path": str(out), "bytes": (out / "model.safetensors").stat().st_size}


# ---- evaluation --------------------------------------------------------------------------


def eval_prompts(source: Path, n: int) -> list:
    """The first ``n`` held-out prompts (interleaved by kind) of a JSONL file, or of the
    ``eval_prompts.jsonl`` that ``train data`` wrote into a data directory."""
    path = source / "eval_prompts.jsonl" if source.is_dir() else source
    if n <= 0 or not path.exists():
        return []
    return interleave(load_prompts(path))[:n]


def drop_trained(prompts: list, data: Dataset, tokenizer) -> tuple[list, list]:
    """(held-out prompts, prompts that are also training prompts). Compared by the exact token
    ids of the chat-formatted prompt, so a "held-out" tau never measures memory."""
    seen = {np.asarray(t[:p], np.int32).tobytes() for t, p in zip(data.tokens, data.prompt_lens)}
    keep, dropped = [], []
    for p in prompts:
        (dropped if np.asarray(p.encode(tokenizer), np.int32).tobytes() in seen else keep).append(p)
    return keep, dropped


def evaluate_tau(target, drafter: Drafter, tokenizer, prompts: list, block_size: int, max_tokens: int) -> dict:
    """Real greedy speculative decoding on held-out prompts (``prompts.Prompt``s): tau,
    acceptance by position, and tau per prompt kind."""
    total = Stats()
    by_kind: dict[str, Stats] = {}
    eos = sorted(set(tokenizer.eos_token_ids or []) | {tokenizer.eos_token_id} - {None})
    t0 = time.perf_counter()
    for p in prompts:
        kind = by_kind.setdefault(p.kind, Stats())
        for step in spec_steps(
            target, drafter, p.encode(tokenizer), block_size=block_size, max_tokens=max_tokens, eos_ids=eos
        ):
            total.add(step)
            kind.add(step)
    return {
        "tau": round(total.mean_acceptance_length, 4),
        "acceptance_rate": round(total.acceptance_rate, 4),
        "by_position": [round(x, 4) for x in total.acceptance_by_position],
        "tau_by_kind": {k: round(v.mean_acceptance_length, 4) for k, v in by_kind.items()},
        "cycles": total.cycles,
        "seconds": round(time.perf_counter() - t0, 1),
    }


# ---- the loop ----------------------------------------------------------------------------


def build_drafter(config: dict, target) -> Drafter:
    drafter = Drafter(DrafterArgs.from_config(config))
    identity_init(drafter)
    drafter.bind(target.embed, target.head)
    return drafter


def train(cfg: TrainConfig, progress: Progress | None = None) -> dict:
    """Train (or resume) into ``cfg.out``. Returns the last metrics."""
    say = progress or log.info
    r = cfg.recipe
    run = Path(cfg.out)
    run.mkdir(parents=True, exist_ok=True)
    data, taps = load_datasets(cfg.data)  # "a,b": several data sets made with the same taps
    data_dir = Path(str(cfg.data).split(",")[0])  # held-out prompts come from the first
    model, tokenizer = load_target_model(cfg.target)
    target = Target(model, taps)
    mask_id = r.mask_token_id if r.mask_token_id is not None else pick_mask_token(tokenizer)
    if any((t == mask_id).any() for t in data.tokens):
        raise BadRequest(f"mask token {mask_id} occurs in the training data; choose another --mask-token-id")
    if cfg.resume and (run / "ckpt" / "config.json").exists():
        config = json.loads((run / "ckpt" / "config.json").read_text())
        saved = settings(json.loads((run / "train_config.json").read_text()))
        free = {
            "steps",
            "checkpoint_every",
            "checkpoint_minutes",
            "eval_prompts",
            "eval_max_tokens",
            "eval_file",
            "export",
            "resume",
            "data",
            "init",
            "out",
        }  # paths too: a moved run directory resumes
        diff = settings_diff(saved, settings(asdict(cfg)), free)
        if diff:
            raise BadRequest(f"--resume with different settings than the run: {diff}")
    else:
        config = drafter_config(target.args, r, taps, mask_id)
    drafter = build_drafter(config, target)
    if cfg.init and not cfg.resume:
        init, _ = load_drafter(cfg.init, dtype=mx.float32)
        drafter.load_weights(tree_flatten(init.parameters()), strict=True)
    elif not cfg.resume:
        rms = scale_fc_init(drafter, data)
        say(f"train: fc init scaled by feature RMS (median {np.median(rms):.2f}, max {rms.max():.1f})")
        if cfg.init_target_layers:
            say(f"train: initialised {len(init_from_target(drafter, target))} tensors from the target")
        say(f"train: final norm scaled by {calibrate_head_scale(drafter):.3g} (logit std 1 at init)")
    freeze_disabled(drafter, r)
    opt = make_optimizer(r, cfg.steps)
    rng = np.random.default_rng(cfg.seed)
    state = {"step": 0, "history": [], "evals": []}
    if cfg.resume and (run / "ckpt" / "state.json").exists():
        state = load_checkpoint(run, drafter, opt)
        rng.bit_generator.state = state["rng"]
        say(f"train: resumed {run} at step {state['step']}")
    (run / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    n_params = sum(v.size for _, v in tree_flatten(drafter.trainable_parameters()))
    say(
        f"train: {len(data)} sequences, {sum(len(t) - p for t, p in zip(data.tokens, data.prompt_lens))} "
        f"response tokens; {config['architectures'][0]} {r.layers} layers, {n_params / 1e6:.1f}M trainable; "
        f"mask {mask_id}; loss {r.loss}, {r.attention}, corruption {r.corruption}, gamma {r.decay}"
    )
    base = base_vocab(data, r.draft_vocab) if r.draft_vocab else None
    head_w = head_weight(target) if r.draft_vocab else None
    if r.draft_vocab:
        say(f"train: training softmax over {len(base)} frequent ids + labels + {r.vocab_negatives} negatives")
        # the same ids serve as the checkpoint's reduced draft vocabulary at inference (opt-out:
        # --draft-vocab full): draft_vocab.json beside the checkpoint, which stays official
    prompts, trained = drop_trained(
        eval_prompts(Path(cfg.eval_file) if cfg.eval_file else data_dir, cfg.eval_prompts), data, tokenizer
    )
    if trained:
        say(
            f"train: {len(trained)} eval prompts are also training prompts; not used for tau: "
            + ", ".join(p.id for p in trained)
        )
    eval_target = Target(model, taps)
    t_last_ckpt = time.perf_counter()
    acc = dict.fromkeys(STEP_SUMS, 0.0)
    last = {}
    while state["step"] < cfg.steps:
        t0 = time.perf_counter()
        nb = make_batch(data, rng, r, mask_id)
        vocab = step_vocab(nb, base, target.vocab_size, r.vocab_negatives, rng) if r.draft_vocab else None
        batch = to_mx(nb, r, vocab, head_w)
        drafter.train()
        loss, (ce, sel, wsum, hits), gnorm = train_step(drafter, opt, batch, r)
        state["step"] += 1
        dt = time.perf_counter() - t0
        add_step(acc, (loss, ce, sel, wsum, hits), dt)
        step = state["step"]
        if step % 10 == 0 or step == cfg.steps:
            last = {"step": step, **step_means(acc), "lr": round(float(opt.learning_rate), 6)}
            state["history"].append(last)
            say(
                f"train: step {step}/{cfg.steps} loss {last['loss']:.3f} (ce {last['ce']:.3f} sel "
                f"{last['sel']:.3f}) top1 {last['top1']:.3f} {last['step_s']:.2f}s/step lr {last['lr']:.2e}"
            )
            acc = dict.fromkeys(acc, 0.0)
        due = (
            step % cfg.checkpoint_every == 0
            or step == cfg.steps
            or (cfg.checkpoint_minutes and time.perf_counter() - t_last_ckpt > 60 * cfg.checkpoint_minutes)
        )
        if due:  # saved first, evaluated after: a run killed during the eval keeps its checkpoint
            drafter.eval()
            state["rng"] = rng.bit_generator.state
            ckpt = save_checkpoint(run, drafter, config, opt, state, base)
            if prompts:
                ev = evaluate_tau(eval_target, drafter, tokenizer, prompts, r.block_size, cfg.eval_max_tokens)
                ev["step"] = step
                state["evals"].append(ev)
                say(
                    f"train: eval step {step}: tau {ev['tau']:.3f} acceptance {ev['acceptance_rate']:.3f} "
                    f"by position {ev['by_position']} by kind {ev['tau_by_kind']} ({ev['seconds']}s)"
                )
                write_state(ckpt, state)
            write_curves(run, state, r.block_size)
            if cfg.export:
                export_checkpoint(run, cfg.export)
            t_last_ckpt = time.perf_counter()
    return {"step": state["step"], **last, "evals": state["evals"][-1:]}


def write_curves(run: Path, state: dict, block_size: int) -> None:
    (run / "metrics.json").write_text(json.dumps({"history": state["history"], "evals": state["evals"]}))
    h = state["history"]
    if h:
        line_chart_png(
            run / "loss.png",
            [("loss", [(x["step"], x["loss"]) for x in h]), ("ce", [(x["step"], x["ce"]) for x in h])],
            title="loss",
        )
    if state["evals"]:
        line_chart_png(
            run / "tau.png",
            [("tau", [(x["step"], x["tau"]) for x in state["evals"]])],
            title=f"tau (held-out, block {block_size})",
        )


__all__ = [
    "Recipe",
    "TrainConfig",
    "train",
    "settings",
    "settings_diff",
    "EVAL_PROMPTS",
    "EVAL_MAX_TOKENS",
    "loss_weights",
    "make_batch",
    "sample_anchors",
    "block_attention_mask",
    "block_hidden",
    "loss_fn",
    "identity_init",
    "drafter_config",
    "save_checkpoint",
    "load_checkpoint",
    "export_checkpoint",
    "evaluate_tau",
    "pick_mask_token",
]
