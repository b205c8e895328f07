"""`train run`: generate the target's responses and train the drafter on them, in one process.

Each round generates one batch of responses (``data.generate_batch``: the tapped features come
for free from the generation passes), pushes the sequences into a bounded replay buffer
(``replay.ReplayBuffer``), keeps their token ids under ``<out>/tokens/`` (small: a later run can
rebuild features with ``train data --from-tokens``), then runs ``steps_per_batch`` optimizer steps
on blocks sampled from the buffer (the drafter and its training: ``StreamConfig.recipe``, the same
``trainer.Recipe`` as `train drafter`'s). Features are never written out as a data set: memory and disk
stay bounded by the buffer, whatever the budget. The learning rate follows the share of the
budget spent (warm-up, then cosine to 10%).

A checkpoint (``<out>/ckpt/``: weights, optimizer, trainer state, the buffer) is written every
``checkpoint_batches`` batches, at the end, and when ``stop`` is set (Ctrl+C); ``resume`` continues
from it exactly: same buffer, same random state, same weights after the same steps (tested).
Nothing here is tied to a backend: it runs wherever MLX runs (CPU, Metal, CUDA).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..drafter import build_target_layer_ids
from ..errors import BadRequest, CheckpointError, PlanError
from ..loading import load_drafter, load_target_model
from ..memory import device_budget
from ..prompts import Prompt, interleave, load_prompts
from ..target import Target
from .data import DataConfig, generate_batch
from .prompts import broad_prompts, builtin_prompts, prompt_key, wide_prompts
from .replay import REPLAY_FILE, ReplayBuffer, bytes_per_token
from .trainer import (
    EVAL_MAX_TOKENS,
    EVAL_PROMPTS,
    STEP_SUMS,
    Recipe,
    add_step,
    base_vocab,
    build_drafter,
    calibrate_head_scale,
    drafter_config,
    evaluate_tau,
    freeze_disabled,
    head_weight,
    load_checkpoint,
    make_batch,
    pick_mask_token,
    save_checkpoint,
    scale_fc_init,
    settings,
    settings_diff,
    step_means,
    step_vocab,
    to_mx,
    train_step,
    write_curves,
    write_state,
)

log = logging.getLogger(__name__)

MIXES = ("broad", "wide", "narrow")


@dataclass(frozen=True, slots=True)
class StreamConfig:
    out: str
    target: str
    prompts: str = "broad"
    """A built-in mix (broad, wide, narrow), a JSONL file, or a directory of chat-data JSONL files."""
    tokens: int | None = None
    """Budget: generated response tokens (over the whole run, resumes included)."""
    minutes: float | None = None
    """Budget: wall minutes (over the whole run, resumes included)."""
    batch_size: int = 16
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 8
    replay_mb: float = 256.0
    steps_per_batch: int = 8
    checkpoint_batches: int = 8
    """Generated batches between checkpoints (each one also measures held-out tau)."""
    num_prompts: int = 20000
    """Size of a built-in mix (training part)."""
    eval_per_kind: int = 4
    """Prompts of each kind held out of the training prompts."""
    eval_prompts: int = EVAL_PROMPTS
    eval_max_tokens: int = EVAL_MAX_TOKENS
    init: str | None = None
    """Warm start: a drafter directory (its architecture and weights)."""
    resume: bool = False
    seed: int = 0
    """The one seed: prompt mix, drafter init, sampling of anchors and batches, generation."""
    recipe: Recipe = Recipe(anchors=16)
    """The drafter and how it learns (layers, block size, loss, lr, anchors, ...)."""

    @property
    def budget_label(self) -> str:
        parts = ([f"{self.tokens} tokens"] if self.tokens else []) + ([f"{self.minutes:g} min"] if self.minutes else [])
        return " or ".join(parts)


@dataclass(frozen=True, slots=True)
class StreamProgress:
    """A snapshot for the progress bar (plain values)."""

    phase: str  # generate | train | eval | checkpoint | done | stopped
    tokens: int
    budget_tokens: int | None
    seconds: float
    budget_seconds: float | None
    gen_tok_s: float
    steps: int
    steps_s: float
    loss: float | None
    tau: float | None
    replay_bytes: int
    replay_seqs: int
    message: str = ""

    @property
    def fraction(self) -> float:
        f = [self.tokens / self.budget_tokens] if self.budget_tokens else []
        f += [self.seconds / self.budget_seconds] if self.budget_seconds else []
        return min(1.0, max(f, default=0.0))

    @property
    def eta_s(self) -> float | None:
        f = self.fraction
        return self.seconds * (1 - f) / f if f > 0 else None


@dataclass(frozen=True, slots=True)
class PlanRow:
    what: str
    bytes: int


def memory_rows(cfg: StreamConfig, target_bytes: int, n_features: int, drafter_params: int) -> list[PlanRow]:
    """The run's memory plan: the target's weights, the drafter with AdamW's two moments and its
    gradients (float32), and the replay buffer at its cap."""
    return [
        PlanRow("target weights", target_bytes),
        PlanRow("drafter + gradients + AdamW state", 4 * 4 * drafter_params),
        PlanRow(
            f"replay buffer (--replay-mb; {bytes_per_token(n_features, cfg.top_k)} B per token)",
            int(cfg.replay_mb * 2**20),
        ),
    ]


def check_plan(rows: list[PlanRow], budget: int, source: str) -> None:
    total = sum(r.bytes for r in rows)
    if total > budget:
        detail = ", ".join(f"{r.what} {r.bytes / 2**30:.2f} GiB" for r in rows)
        raise PlanError(
            f"train run needs {total / 2**30:.2f} GiB ({detail}) but {source} is "
            f"{budget / 2**30:.2f} GiB; lower --replay-mb"
        )


def lr_at(recipe: Recipe, frac: float) -> float:
    """Linear warm-up over the first ``warmup`` share of the budget, then cosine to 10%."""
    frac = min(max(frac, 0.0), 1.0)
    if recipe.warmup > 0 and frac < recipe.warmup:
        return recipe.lr * (0.01 + 0.99 * frac / recipe.warmup)
    t = (frac - recipe.warmup) / max(1e-9, 1 - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# ---- prompts -----------------------------------------------------------------------------


def _chat_dir_prompts(path: Path) -> list[Prompt]:
    """``{"messages": [...]}`` lines of every *.jsonl in a directory; a conversation's trailing
    assistant turns are dropped (the target writes the reply)."""
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise BadRequest(f"{path}: no *.jsonl chat-data files")
    out = []
    for f in files:
        for p in load_prompts(f):
            msgs = list(p.messages or [])
            while msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
                msgs.pop()
            if p.messages is not None and not msgs:
                continue
            kind = p.kind if p.kind != "user" else "chat"
            out.append(
                Prompt(f"{f.stem}:{p.id}", kind, p.text, tuple(msgs) if p.messages is not None else None, p.chat)
            )
    if not out:
        raise BadRequest(f"{path}: no conversations with a user turn")
    return out


def held_out_by_kind(prompts: list[Prompt], per_kind: int) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts): the last ``per_kind`` prompts of each kind are held
    out, and no training prompt has the content of a held-out one (or repeats another)."""
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    evals = [p for v in by_kind.values() for p in (v[-per_kind:] if per_kind else [])]
    held = {prompt_key(p) for p in evals}
    train = {}
    for p in prompts:
        k = prompt_key(p)
        if k not in held and k not in train:
            train[k] = p
    return list(train.values()), interleave(evals)


def stream_prompts(cfg: StreamConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts in order, held-out prompts) for a prompt source. Deterministic."""
    n = cfg.num_prompts + 8 * cfg.eval_per_kind
    if cfg.prompts in MIXES:
        make = {"broad": broad_prompts, "wide": wide_prompts, "narrow": builtin_prompts}[cfg.prompts]
        allp = make(n, seed=cfg.seed)
    else:
        path = Path(cfg.prompts).expanduser()
        if path.is_dir():
            allp = _chat_dir_prompts(path)
        elif path.exists():
            allp = load_prompts(path)
        else:
            raise BadRequest(
                f"--prompts {cfg.prompts!r}: not a built-in mix ({', '.join(MIXES)}), "
                "a JSONL file or a chat-data directory"
            )
    return held_out_by_kind(allp, cfg.eval_per_kind)


EVAL_FILE = "eval_prompts.jsonl"
"""The run's held-out prompts (``<out>/eval_prompts.jsonl``), for `train eval --prompts`."""


def write_eval_prompts(path: Path, prompts: list[Prompt]) -> None:
    """Held-out prompts as JSONL that ``prompts.load_prompts`` reads back to equal prompts."""
    rows = [
        {
            "id": p.id,
            "kind": p.kind,
            **({"messages": list(p.messages)} if p.messages is not None else {"prompt": p.text}),
            **({} if p.chat else {"chat": False}),
        }
        for p in prompts
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---- the run -----------------------------------------------------------------------------


class _Stopped(Exception):
    pass


def _token_file(run: Path, batch: int) -> Path:
    return run / "tokens" / f"{batch:05d}.npz"


def _write_tokens(run: Path, batch: int, seqs: list[tuple[str, np.ndarray, int]]) -> None:
    path = _token_file(run, batch)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(
        tmp,
        tokens=np.concatenate([t for _, t, _ in seqs]).astype(np.int32),
        offsets=np.cumsum([0] + [len(t) for _, t, _ in seqs]).astype(np.int64),
        prompt_lens=np.array([p for _, _, p in seqs], np.int32),
        ids=np.array([i for i, _, _ in seqs], dtype=str),
    )
    tmp.rename(path)


def _trained_prompt_ids(run: Path, upto: int) -> set[bytes]:
    """Prompt token ids (as bytes) of every trained sequence in token files ``< upto``; files
    at or past ``upto`` belong to an unsaved batch and are removed."""
    seen = set()
    for f in sorted((run / "tokens").glob("[0-9]*[0-9].npz")):
        if int(f.name.split(".")[0]) >= upto:
            f.unlink()
            continue
        with np.load(f) as z:
            o, pl, toks = z["offsets"], z["prompt_lens"], z["tokens"]  # each z[name] reads the file
            for j in range(len(pl)):
                seen.add(toks[o[j] : o[j] + pl[j]].astype(np.int32).tobytes())
    return seen


RESUME_FREE = frozenset(
    {"tokens", "minutes", "checkpoint_batches", "eval_prompts", "eval_max_tokens", "resume", "out", "init"}
)
"""StreamConfig fields a resume may change (the budget, checkpoint and eval cadence, paths)."""


def _compare_settings(run: Path, cfg: StreamConfig) -> None:
    """Refuse a resume whose settings differ from the run's ``run_config.json`` (except
    ``RESUME_FREE``). A file from before the recipe had its own field (the recipe under
    ``"train"``, ``checkpoint_every`` counting batches) is read as such and rewritten."""
    path = run / "run_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: cannot read the run's settings ({e}); start a new run (another --out)"
        ) from None
    legacy = "recipe" not in raw
    if legacy and "checkpoint_every" in raw:
        raw["checkpoint_batches"] = raw.pop("checkpoint_every")
    saved = settings(raw, legacy_nest="train")
    now = settings(json.loads(json.dumps(asdict(cfg))))
    unknown = sorted(set(saved) - set(now))
    if unknown:
        raise CheckpointError(
            f"{path} has settings this version does not know ({unknown}); it was written by "
            "another version of mlx_spec: resume it with that version, or start a new run"
        )
    diff = settings_diff(saved, now, set(RESUME_FREE))
    if diff:
        raise BadRequest(f"--resume with different settings than the run in {run}: {diff}")
    if legacy:
        path.write_text(json.dumps(asdict(cfg), indent=2))


def run_stream(
    cfg: StreamConfig,
    progress: Callable[[StreamProgress], None] | None = None,
    stop: threading.Event | None = None,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Generate-and-train until the budget is spent (or ``stop`` is set). Returns a summary."""
    say = say or log.info
    if not cfg.tokens and not cfg.minutes:
        raise BadRequest("give a budget: --tokens N and/or --minutes M")
    negative = [
        f"--{n} {v:g}" for n, v in (("tokens", cfg.tokens), ("minutes", cfg.minutes)) if v is not None and v < 0
    ]
    if negative:
        raise BadRequest(
            f"{' and '.join(negative)}: a budget cannot be negative (0 or left out: no budget of that "
            "kind; give at least one of --tokens N, --minutes M above 0)"
        )
    if cfg.batch_size < 1 or cfg.max_tokens < 2 or cfg.steps_per_batch < 0 or cfg.replay_mb <= 0:
        raise BadRequest("--batch-size >= 1, --max-tokens >= 2, --steps-per-batch >= 0 and --replay-mb > 0")
    stop = stop or threading.Event()
    run = Path(cfg.out).expanduser()
    resume = cfg.resume and (run / "ckpt" / "state.json").exists()
    if cfg.resume and not resume:
        raise CheckpointError(f"{run}: no checkpoint to resume (expected {run}/ckpt/state.json)")
    if not cfg.resume and (run / "ckpt").exists():
        raise BadRequest(f"{run} already holds a run; pass --resume to continue it, or choose another --out")
    run.mkdir(parents=True, exist_ok=True)
    if resume:
        _compare_settings(run, cfg)
    recipe = cfg.recipe

    model, tokenizer = load_target_model(cfg.target)
    n_layers = len(getattr(model, "language_model", model).model.layers)
    init = None
    if resume:
        config = json.loads((run / "ckpt" / "config.json").read_text())
    elif cfg.init:
        init, config = load_drafter(cfg.init, dtype=mx.float32)
    else:
        config = None
    if config is not None:
        dc = config.get("dflash_config") or {}
        taps = list(dc.get("target_layer_ids") or build_target_layer_ids(n_layers, config["num_hidden_layers"]))
        mask_id = int(dc.get("mask_token_id", config.get("mask_token_id")))
    else:
        taps = build_target_layer_ids(n_layers, 5)
        mask_id = recipe.mask_token_id if recipe.mask_token_id is not None else pick_mask_token(tokenizer)
    target = Target(model, taps)
    if config is None:
        config = drafter_config(target.args, recipe, taps, mask_id)
    if config.get("block_size") != recipe.block_size:
        config = {
            **config,
            "block_size": recipe.block_size,
            "dflash_config": {**(config.get("dflash_config") or {}), "block_size": recipe.block_size},
        }
    mx.random.seed(cfg.seed)
    drafter = build_drafter(config, target)
    if init is not None:
        drafter.load_weights(tree_flatten(init.parameters()), strict=True)
    freeze_disabled(drafter, recipe)

    # The memory plan: refuse a buffer that does not fit next to the models.
    n_feat = len(taps) * target.args.hidden_size
    target_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    rows = memory_rows(cfg, target_bytes, n_feat, n_params)
    check_plan(rows, *device_budget())
    say("train run: plan " + ", ".join(f"{r.what} {r.bytes / 2**20:.0f} MiB" for r in rows))

    train_prompts, evals = stream_prompts(cfg)
    write_eval_prompts(run / EVAL_FILE, evals)
    opt = optim.AdamW(learning_rate=lr_at(recipe, 0.0), weight_decay=recipe.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    replay = ReplayBuffer(int(cfg.replay_mb * 2**20))
    state = {
        "step": 0,
        "batch": 0,
        "prompt": 0,
        "tokens": 0,
        "seconds": 0.0,
        "pending": 0,
        "skipped": 0,
        "history": [],
        "evals": [],
    }
    if resume:
        state = load_checkpoint(run, drafter, opt)
        rng.bit_generator.state = state["rng"]
        replay.load(run / "ckpt" / REPLAY_FILE)
        say(f"train run: resumed {run} at batch {state['batch']}, step {state['step']}, {state['tokens']} tokens")
    else:
        (run / "run_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    trained = _trained_prompt_ids(run, state["batch"])
    # --draft-vocab: the training softmax's base ids (and the checkpoint's draft_vocab.json): the
    # run's own, the warm start's, or the first batch's most frequent ids.
    vocab = None
    if recipe.draft_vocab and resume and (run / "ckpt" / "draft_vocab.json").exists():
        vocab = np.asarray(json.loads((run / "ckpt" / "draft_vocab.json").read_text())["ids"], np.int32)
    elif recipe.draft_vocab and init is not None and init.shipped_vocab is not None:
        vocab = np.asarray(init.shipped_vocab, np.int32)
    head_w = head_weight(target) if recipe.draft_vocab else None

    eos = sorted(set(tokenizer.eos_token_ids or []) | {tokenizer.eos_token_id} - {None})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    dcfg = DataConfig(
        max_tokens=cfg.max_tokens,
        batch_size=cfg.batch_size,
        temperature=cfg.temperature,
        seed=cfg.seed,
        top_k=cfg.top_k,
    )
    eval_target = Target(model, taps)
    say(
        f"train run: {len(train_prompts)} training prompts ({cfg.prompts}), {len(evals)} held out; "
        f"{config['architectures'][0]}, block {recipe.block_size}, {n_params / 1e6:.1f}M parameters; "
        f"budget {cfg.budget_label}; replay {cfg.replay_mb:g} MiB"
    )

    t_start = time.perf_counter() - state["seconds"]
    rate = {"gen_t": 0.0, "gen_n": 0, "step_t": 0.0, "step_n": 0, "round": 0.0}
    acc = dict.fromkeys(STEP_SUMS, 0.0)

    def seconds() -> float:
        return time.perf_counter() - t_start

    def frac() -> float:
        f = [state["tokens"] / cfg.tokens] if cfg.tokens else []
        f += [state["seconds"] / (60 * cfg.minutes)] if cfg.minutes else []
        return max(f, default=0.0)

    def snapshot(phase: str, message: str = "") -> StreamProgress:
        last = state["history"][-1]["loss"] if state["history"] else None
        tau = state["evals"][-1]["tau"] if state["evals"] else None
        return StreamProgress(
            phase,
            state["tokens"],
            cfg.tokens,
            seconds(),
            60 * cfg.minutes if cfg.minutes else None,
            rate["gen_n"] / rate["gen_t"] if rate["gen_t"] else 0.0,
            state["step"],
            rate["step_n"] / rate["step_t"] if rate["step_t"] else 0.0,
            last,
            tau,
            replay.nbytes,
            len(replay),
            message,
        )

    def report(phase: str, message: str = "") -> None:
        if progress is not None:
            progress(snapshot(phase, message))

    def checkpoint(evaluate: bool) -> None:
        # saved first, evaluated after: a run killed during the eval (at a time limit) keeps its checkpoint
        state["seconds"] = seconds()
        report("checkpoint")
        state["rng"] = rng.bit_generator.state
        state["replay_evicted"] = replay.evicted
        ckpt = save_checkpoint(run, drafter, config, opt, state, vocab, extra=lambda d: replay.save(d / REPLAY_FILE))
        if evaluate and evals and cfg.eval_prompts > 0:
            prompts = [p for p in evals if np.asarray(p.encode(tokenizer), np.int32).tobytes() not in trained]
            if len(prompts) < len(evals):
                say(f"train run: {len(evals) - len(prompts)} held-out prompts were also trained on; not used")
            report("eval")
            drafter.eval()
            ev = evaluate_tau(
                eval_target, drafter, tokenizer, prompts[: cfg.eval_prompts], recipe.block_size, cfg.eval_max_tokens
            )
            ev["step"], ev["tokens"] = state["step"], state["tokens"]
            state["evals"].append(ev)
            say(
                f"train run: eval step {state['step']}: tau {ev['tau']:.3f} by kind {ev['tau_by_kind']} "
                f"({ev['seconds']}s)"
            )
            write_state(ckpt, state)  # the eval joins the saved state
        write_curves(run, state, recipe.block_size)

    def spent() -> bool:
        # a time budget ends early rather than start a round (batch + steps) it cannot half finish
        return bool(
            (cfg.tokens and state["tokens"] >= cfg.tokens)
            or (cfg.minutes and seconds() + 0.5 * rate["round"] >= 60 * cfg.minutes)
        )

    stopped = False
    t_round = time.perf_counter()
    try:
        while True:
            if state["pending"] == 0:
                if spent():
                    break
                todo = train_prompts[state["prompt"] : state["prompt"] + cfg.batch_size]
                if not todo:
                    say(f"train run: all {len(train_prompts)} training prompts used; stopping before the budget")
                    break
                report("generate")
                t0 = t_round = time.perf_counter()
                enc = [p.encode(tokenizer) for p in todo]
                key = mx.random.key(cfg.seed * 1_000_003 + state["batch"])
                live = {"n": 0, "t": time.perf_counter()}

                def on_tokens(n: int) -> None:  # progress inside a long batch
                    live["n"] += n  # noqa: B023
                    if time.perf_counter() - live["t"] > 5:  # noqa: B023
                        live["t"] = time.perf_counter()  # noqa: B023
                        report("generate", f"{live['n']} tokens of this batch")  # noqa: B023

                res = generate_batch(target, enc, dcfg, eos, pad, key, stop=stop.is_set, on_tokens=on_tokens)
                if res is None:
                    raise _Stopped
                seqs, n_new = [], 0
                for p, pids, (resp, f, ti, tl) in zip(todo, enc, res):
                    toks = np.array(pids + resp, np.int32)
                    if (toks == mask_id).any():  # the drafter's MASK id must never be a label
                        state["skipped"] += 1
                        continue
                    P = len(pids)
                    tid = np.zeros((len(toks), cfg.top_k), np.int32)
                    tlp = np.zeros((len(toks), cfg.top_k), np.float16)
                    tid[P:], tlp[P:] = ti, tl
                    replay.add(p.id, toks, P, f, tid, tlp)
                    seqs.append((p.id, toks, P))
                    trained.add(toks[:P].tobytes())
                    n_new += len(resp)
                if seqs:
                    _write_tokens(run, state["batch"], seqs)
                rate["gen_t"] += time.perf_counter() - t0
                rate["gen_n"] += n_new
                if state["batch"] == 0 and init is None and not resume and len(replay):
                    rms = scale_fc_init(drafter, replay)
                    say(
                        f"train run: fc init scaled by feature RMS (median {np.median(rms):.2f}); final norm "
                        f"scaled by {calibrate_head_scale(drafter):.3g}"
                    )
                if recipe.draft_vocab and vocab is None and len(replay):
                    vocab = base_vocab(replay, recipe.draft_vocab)
                state["tokens"] += n_new
                state["prompt"] += len(todo)
                state["batch"] += 1
                state["pending"] = cfg.steps_per_batch if len(replay) else 0
                state["seconds"] = seconds()
            while state["pending"] > 0:
                if stop.is_set():
                    raise _Stopped
                t0 = time.perf_counter()
                nb = make_batch(replay, rng, recipe, mask_id)
                sv = (
                    step_vocab(nb, vocab, target.vocab_size, recipe.vocab_negatives, rng) if vocab is not None else None
                )
                opt.learning_rate = lr_at(recipe, frac())
                drafter.train()
                loss, (ce, sel, wsum, hits), _ = train_step(drafter, opt, to_mx(nb, recipe, sv, head_w), recipe)
                state["step"] += 1
                state["pending"] -= 1
                dt = time.perf_counter() - t0
                rate["step_t"] += dt
                rate["step_n"] += 1
                add_step(acc, (loss, ce, sel, wsum, hits), dt)
                if acc["n"] == 10 or state["pending"] == 0:
                    state["history"].append(
                        {
                            "step": state["step"],
                            "tokens": state["tokens"],
                            **step_means(acc),
                            "lr": round(float(opt.learning_rate), 7),
                        }
                    )
                    acc = dict.fromkeys(acc, 0.0)
                report("train")
            rate["round"] = time.perf_counter() - t_round
            if state["batch"] % cfg.checkpoint_batches == 0 and not spent():
                checkpoint(evaluate=True)
    except _Stopped:  # a second Ctrl+C (KeyboardInterrupt) leaves the last checkpoint as it is
        stopped = True
    if stopped:
        say(f"train run: stopped at batch {state['batch']}, step {state['step']}; resume with --resume")
    checkpoint(evaluate=not stopped)
    summary = {
        "stopped": stopped,
        "step": state["step"],
        "batches": state["batch"],
        "tokens": state["tokens"],
        "seconds": round(state["seconds"], 1),
        "skipped": state["skipped"],
        "gen_tok_s": round(rate["gen_n"] / rate["gen_t"], 2) if rate["gen_t"] else None,
        "steps_s": round(rate["step_n"] / rate["step_t"], 3) if rate["step_t"] else None,
        "replay_bytes": replay.nbytes,
        "replay_seqs": len(replay),
        "replay_evicted": replay.evicted,
        "last": state["history"][-1] if state["history"] else None,
        "evals": state["evals"][-1:],
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    report("stopped" if stopped else "done")
    return summary


__all__ = [
    "StreamConfig",
    "RESUME_FREE",
    "EVAL_FILE",
    "write_eval_prompts",
    "StreamProgress",
    "PlanRow",
    "run_stream",
    "stream_prompts",
    "held_out_by_kind",
    "memory_rows",
    "lr_at",
]
