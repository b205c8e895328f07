"""`mlx_spec train run|data|drafter|export|eval`: generate the target's responses and train a
drafter on them in one process (run), or in two steps: build a training set from the target's own
responses (data) and train a DFlash 2 (or DFlash 1) drafter on it (drafter); export a float16 copy
of a checkpoint, and measure a drafter's held-out tau by block size and prompt kind."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path

from .. import catalog
from ..default_target import DEFAULT_TARGET_ID
from ..drafter import build_target_layer_ids
from ..errors import BadRequest
from ..loading import load_pair, load_target_model
from ..progress import clock
from ..prompts import interleave, load_prompts
from ..target import Target
from ..train.chain import ChainTrainConfig, build_features, eagle_taps, split_paths, train_chain
from ..train.data import DataConfig, build_dataset, export_tokens, featurize_tokens
from ..train.prompts import builtin_prompts, split_held_out, wide_prompts
from ..train.stream import StreamConfig, run_stream
from ..train.trainer import EVAL_MAX_TOKENS, EVAL_PROMPTS, Recipe, TrainConfig, evaluate_tau, export_checkpoint, train


def _add_recipe(t) -> None:
    """The drafter recipe flags shared by `train drafter` and `train run` (``trainer.Recipe`` fields)."""
    t.add_argument("--layers", type=int, default=2, help="drafter transformer layers")
    t.add_argument("--intermediate-size", type=int, default=1536, help="drafter MLP width")
    t.add_argument("--block-size", type=int, default=8, help="training block size incl. the anchor")
    t.add_argument("--no-conv", action="store_true", help="no two-tap convolutions")
    t.add_argument("--no-selector", action="store_true", help="no candidate selector (with --no-conv: DFlash 1)")
    t.add_argument("--selector-rank", type=int, default=64, help="rank of the candidate selector")
    t.add_argument("--selector-top-k", type=int, default=8, help="candidates the selector reranks")
    t.add_argument("--mask-token-id", type=int, default=None, help="default: a never-used special token")
    t.add_argument(
        "--loss", choices=["ce", "kl"], default="ce", help="ce: the target's tokens; kl: its top-K distribution"
    )
    t.add_argument(
        "--attention",
        choices=["bidirectional", "causal"],
        default="bidirectional",
        help="attention inside a draft block",
    )
    t.add_argument(
        "--corruption",
        choices=["full", "uniform"],
        default="full",
        help="full: every position after the anchor masked; uniform: a random share masked, the rest kept",
    )
    t.add_argument("--gamma", type=float, default=None, help="loss decay (default 4 for block 8, 7 for 16)")
    t.add_argument("--selector-weight", type=float, default=1.0, help="weight of the selector loss")
    t.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="train the softmax over the K most frequent data ids (+labels, +negatives); 0 = full vocab",
    )
    t.add_argument("--vocab-negatives", type=int, default=1024, help="random other ids per step with --draft-vocab")
    t.add_argument("--seqs-per-step", type=int, default=4, help="sequences per optimizer step")
    t.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW, cosine decay)")
    t.add_argument("--warmup", type=float, default=0.04, help="warm-up share of the steps (train run: of the budget)")
    t.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")


def _add_generation(p, batch_size: int) -> None:
    """How the target's responses are generated (`train data` and `train run`)."""
    p.add_argument("--max-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--batch-size", type=int, default=batch_size, help="prompts generated together")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=8, help="target top-K log-probs kept per token (for --loss kl)")


def _add_eval(p) -> None:
    """The held-out tau evaluation at each checkpoint (`train drafter` and `train run`)."""
    p.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS, help="held-out prompts in each tau eval (0 = off)")
    p.add_argument("--eval-max-tokens", type=int, default=EVAL_MAX_TOKENS, help="tokens per prompt in the tau eval")


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="train_command", metavar="{run,data,drafter,mtp,eagle,features,export,eval}")
    r = sub.add_parser(
        "run",
        formatter_class=p.formatter_class,
        help="generate the target's responses and train a drafter on them in one process "
        "(no stored features; bounded replay buffer; resumable)",
    )
    r.add_argument(
        "--target",
        default=DEFAULT_TARGET_ID,
        help="target model: path, repo id, default id, or a catalog name (`mlx_spec models`)",
    )
    r.add_argument("--out", required=True, help="run directory (checkpoint, token ids, curves)")
    r.add_argument(
        "--prompts",
        default="broad",
        help="broad | wide | narrow (built-in mixes), a JSONL of prompts, or a directory of chat-data "
        '*.jsonl files ({"messages": [...]} per line; trailing assistant turns are dropped)',
    )
    r.add_argument("--tokens", type=int, default=None, help="budget: generated response tokens (whole run)")
    r.add_argument("--minutes", type=float, default=None, help="budget: wall minutes (whole run, resumes included)")
    r.add_argument("--init", default=None, help="warm start from a drafter directory (its architecture and weights)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    _add_generation(r, batch_size=16)
    r.add_argument(
        "--replay-mb",
        type=float,
        default=256.0,
        help="replay buffer of features (MiB, in memory and in the checkpoint); counted in the memory plan",
    )
    r.add_argument("--steps-per-batch", type=int, default=8, help="optimizer steps after each generated batch")
    r.add_argument(
        "--checkpoint-batches", type=int, default=8, help="generated batches between checkpoints (each with a tau eval)"
    )
    r.add_argument("--num-prompts", type=int, default=20000, help="size of a built-in mix")
    r.add_argument("--eval-per-kind", type=int, default=4, help="prompts of each kind held out of training")
    _add_eval(r)
    r.add_argument("--seed", type=int, default=0, help="random seed (prompts, init, anchors, generation)")
    _add_recipe(r)
    r.set_defaults(anchors=16)
    d = sub.add_parser(
        "data", formatter_class=p.formatter_class, help="generate training data (target responses + features)"
    )
    d.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model (path, repo id, default id)")
    d.add_argument("--out", required=True, help="data directory (resumable; reruns skip done prompts)")
    d.add_argument("--prompts", default=None, help="JSONL of prompts (default: built-in offline mix)")
    d.add_argument("--num-prompts", type=int, default=2000, help="built-in mix size (training part)")
    d.add_argument(
        "--mix",
        choices=("wide", "narrow"),
        default="wide",
        help="built-in mix: wide = distinct prompts from large pools (default); narrow = the "
        "first shipped drafter's mix (repeats itself)",
    )
    d.add_argument("--num-eval", type=int, default=16, help="built-in prompts held out for evaluation")
    d.add_argument(
        "--taps", default=None, help="comma-separated target layers to store (default: build_target_layer_ids(L, 5))"
    )
    _add_generation(d, batch_size=32)
    d.add_argument("--seed", type=int, default=0, help="random seed (prompt mix, sampling)")
    d.add_argument(
        "--from-tokens",
        default=None,
        help="rebuild features from a token-id .npz (from `train export --tokens`) instead of generating",
    )
    d.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke runs)")

    t = sub.add_parser(
        "drafter", formatter_class=p.formatter_class, help="train a DFlash 2 drafter on a data directory"
    )
    t.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model the data came from")
    t.add_argument(
        "--data",
        required=True,
        help="data directory from `train data`; several as a,b (same taps; may grow on --resume)",
    )
    t.add_argument("--out", required=True, help="run directory (checkpoints, log, curve)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t.add_argument("--init", default=None, help="initialise weights from a drafter directory")
    t.add_argument(
        "--init-target-layers",
        action="store_true",
        help="warm start: copy the target's last layers and final norm where shapes match",
    )
    _add_recipe(t)
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    t.add_argument("--seed", type=int, default=0, help="random seed (init, anchors, batches)")
    t.add_argument("--checkpoint-every", type=int, default=100, help="optimizer steps between checkpoints")
    t.add_argument("--checkpoint-minutes", type=float, default=None, help="also checkpoint after this many minutes")
    _add_eval(t)
    t.add_argument(
        "--eval-file",
        default=None,
        help="JSONL of held-out prompts for the tau eval (default: the first --data dir's "
        "eval_prompts.jsonl); prompts that are also training prompts are dropped, by name",
    )
    t.add_argument("--export", default=None, help="after each checkpoint, write a float16 copy here")

    for kind, what in (
        ("mtp", "an MTP-style head (fc + one decoder layer + norm, sharing the target's embedding and head)"),
        ("eagle", "an EAGLE-3 layer (three fused target layers, training-time test)"),
    ):
        c = sub.add_parser(kind, formatter_class=p.formatter_class, help=f"train {what} on a token file")
        c.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model the tokens came from")
        c.add_argument(
            "--tokens",
            required=True,
            help="token-id .npz files, comma-separated (`train export --tokens`; e.g. "
            "models/smollm2-135m-dflash2/data/tokens.npz,models/smollm2-135m-dflash2/data/tokens-v2.npz)",
        )
        c.add_argument(
            "--features",
            default=None,
            help="feature store from `train features` over the same token files (default: the target "
            "recomputes each batch's features)",
        )
        c.add_argument(
            "--grow",
            action="store_true",
            help="with --features: a store `train features` is still writing (or stopped part-way): "
            "sequences it holds are read, the target recomputes the rest (the log's 'stored' says how many)",
        )
        c.add_argument(
            "--eval-tokens",
            default=None,
            help="token file of held-out sequences (e.g. the target's responses to held-out prompts); "
            "training sequences with one of its prompts are dropped, by name",
        )
        c.add_argument("--out", required=True, help="run directory (checkpoint, log; the head in OUT/head)")
        c.add_argument("--steps", type=int, default=6000, help="optimizer steps")
        c.add_argument("--batch-size", type=int, default=8, help="sequences per step")
        c.add_argument("--seq-len", type=int, default=256, help="tokens per sequence window")
        c.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (linear warm-up, cosine decay)")
        c.add_argument("--warmup", type=float, default=0.04, help="warm-up share of the steps")
        c.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
        c.add_argument("--ttt", type=int, default=3, help="training-time-test steps (the head on its own outputs)")
        c.add_argument("--decay", type=float, default=0.8, help="loss weight decay per training-time-test step")
        c.add_argument(
            "--held-out",
            type=int,
            default=None,
            help="sequences held out of training, the files' last (default 64; not with --eval-tokens)",
        )
        c.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
        c.add_argument("--checkpoint-every", type=int, default=100, help="optimizer steps between checkpoints")
        c.add_argument("--eval-every", type=int, default=100, help="optimizer steps between held-out evals")
        c.add_argument("--seed", type=int, default=0, help="random seed (init, batches)")
        c.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
        if kind == "eagle":
            c.add_argument(
                "--layout",
                choices=("eagle", "speculators"),
                default="eagle",
                help="output layout: the EAGLE authors' (midlayer.*) or speculators' (layers.0.*)",
            )
            c.add_argument(
                "--draft-vocab",
                type=int,
                default=0,
                help="draft over the N most frequent response tokens (written as d2t/t2d); 0: the full vocabulary",
            )
        else:
            c.add_argument(
                "--softmax-vocab",
                type=int,
                default=0,
                help="train the softmax over the N most frequent response ids + labels + negatives "
                "(the head drafts over the full vocabulary); 0: the full head",
            )
            c.add_argument(
                "--vocab-negatives", type=int, default=1024, help="random other ids per step with --softmax-vocab"
            )

    f = sub.add_parser(
        "features",
        formatter_class=p.formatter_class,
        help="store the target's features of token files for `train mtp|eagle --features` (float16, resumable)",
    )
    f.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model the tokens came from")
    f.add_argument("--tokens", required=True, help="token-id .npz files, comma-separated")
    f.add_argument("--out", required=True, help="feature store directory (one folder per token file)")
    f.add_argument("--batch-size", type=int, default=8, help="sequences per target pass (similar lengths)")
    f.add_argument(
        "--taps",
        default=None,
        help="comma-separated target layers stored for EAGLE-3 (default: the layers `train eagle` reads, "
        "EAGLE layer ids 2, N/2, N-3)",
    )

    e = sub.add_parser(
        "export",
        formatter_class=p.formatter_class,
        help="float16 copy of a run's checkpoint, and/or the data's token ids",
    )
    e.add_argument("--run", default=None, help="run directory (its latest checkpoint)")
    e.add_argument("--out", default=None, help="drafter output directory")
    e.add_argument("--data", default=None, help="data directory, for --tokens")
    e.add_argument("--tokens", default=None, help="write the data's token ids to this .npz")

    v = sub.add_parser(
        "eval",
        formatter_class=p.formatter_class,
        help="held-out tau of a drafter by block size and prompt kind (real decoding)",
    )
    v.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model (path, repo id, default id)")
    v.add_argument("--drafter", required=True, help="drafter directory (or a run's ckpt/)")
    v.add_argument("--prompts", required=True, help="JSONL of held-out prompts (e.g. a data dir's eval_prompts.jsonl)")
    v.add_argument("--blocks", default="2,4,8,16", help="block sizes, e.g. 2,4,8,16")
    v.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    v.add_argument("--limit", type=int, default=None, help="only the first N prompts (interleaved by kind)")
    v.add_argument(
        "--draft-vocab",
        choices=("auto", "full"),
        default="auto",
        help="auto: the drafter's reduced draft vocabulary when it ships one; full: the whole head",
    )
    v.add_argument("--json", action="store_true", help="print the result as JSON")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _data(args) -> int:
    model, tokenizer = load_target_model(args.target)
    n_layers = len(getattr(model, "language_model", model).model.layers)
    taps = [int(x) for x in args.taps.split(",")] if args.taps else build_target_layer_ids(n_layers, 5)
    target = Target(model, taps)
    if args.from_tokens:
        pad = tokenizer.pad_token_id or 0
        summary = featurize_tokens(target, args.from_tokens, args.out, args.top_k, pad_id=pad, progress=_log)
        print(json.dumps(summary))
        return 0
    if args.prompts:
        prompts = load_prompts(args.prompts)
        evals = []
    else:
        make = wide_prompts if args.mix == "wide" else builtin_prompts
        allp = make(args.num_prompts + args.num_eval, seed=args.seed)
        prompts, evals = split_held_out(allp, args.num_prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    if not prompts:
        raise BadRequest("no prompts")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "eval_prompts.jsonl", "w") as f:
        for p in evals:
            f.write(json.dumps({"id": p.id, "prompt": p.text}) + "\n")
    cfg = DataConfig(
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        seed=args.seed,
        top_k=args.top_k,
    )
    _log(
        f"data: {len(prompts)} prompts -> {out} (taps {taps}, batch {cfg.batch_size}, "
        f"max {cfg.max_tokens} tokens, {'greedy' if cfg.temperature == 0 else f'T={cfg.temperature}'})"
    )
    summary = build_dataset(target, tokenizer, prompts, out, cfg, progress=_log)
    print(json.dumps(summary))
    return 0


def _drafter(args) -> int:
    cfg = train_config(TrainConfig, args, recipe=train_config(Recipe, args))
    result = train(cfg, progress=_log)
    print(json.dumps(result))
    return 0


def _export(args) -> int:
    if not (args.run and args.out) and not (args.data and args.tokens):
        raise BadRequest("give --run and --out (drafter) and/or --data and --tokens (token ids)")
    if args.run and args.out:
        print(json.dumps(export_checkpoint(args.run, args.out)))
    if args.data and args.tokens:
        print(json.dumps(export_tokens(args.data, args.tokens)))
    return 0


def _eval(args) -> int:
    try:
        blocks = [int(b) for b in args.blocks.split(",") if b]
    except ValueError:
        raise BadRequest(f"--blocks must be comma-separated integers (got {args.blocks!r})") from None
    if not blocks or min(blocks) < 2 or args.max_tokens < 1:
        raise BadRequest("--blocks must be >= 2 and --max-tokens >= 1")
    prompts = interleave(load_prompts(args.prompts))[: args.limit]
    pair = load_pair(args.target, args.drafter, draft_vocab=args.draft_vocab)
    vocab = pair.drafter.vocab_size_drafted
    rows = []
    for B in blocks:
        ev = evaluate_tau(pair.target, pair.drafter, pair.tokenizer, prompts, B, args.max_tokens)
        rows.append({"block": B, **ev})
        _log(f"block {B}: tau {ev['tau']:.2f} by kind {ev['tau_by_kind']} ({ev['seconds']} s)")
    if args.json:
        print(
            json.dumps(
                {
                    "drafter": args.drafter,
                    "prompts": len(prompts),
                    "max_tokens": args.max_tokens,
                    "draft_vocab": vocab or "full",
                    "rows": rows,
                }
            )
        )
        return 0
    kinds = sorted({k for r in rows for k in r["tau_by_kind"]})
    print(
        f"held-out tau, {len(prompts)} prompts x {args.max_tokens} tokens, greedy, real speculative decoding, "
        f"draft vocabulary {vocab or 'full'}"
    )
    print("block  tau   " + "  ".join(f"{k:>6}" for k in kinds) + "  acceptance by position")
    for r in rows:
        print(
            f"{r['block']:>5}  {r['tau']:.2f}  "
            + "  ".join(f"{r['tau_by_kind'].get(k, 0):6.2f}" for k in kinds)
            + "  "
            + " ".join(f"{x:.2f}" for x in r["by_position"])
        )
    return 0


def _bar(p) -> str:
    """One progress line: budget share, generated tokens/s, steps/s, ETA, loss, latest tau."""
    width = 24
    fill = int(round(p.fraction * width))
    eta_s = "?" if p.eta_s is None else clock(p.eta_s)
    loss = "-" if p.loss is None else f"{p.loss:.3f}"
    tau = "-" if p.tau is None else f"{p.tau:.2f}"
    return (
        f"[{'#' * fill}{'.' * (width - fill)}] {100 * p.fraction:5.1f}% {p.phase:<10} {p.tokens} tok "
        f"{p.gen_tok_s:6.1f} tok/s  step {p.steps} {p.steps_s:5.2f}/s  loss {loss}  tau {tau}  "
        f"replay {p.replay_bytes / 2**20:.0f} MiB  ETA {eta_s}" + (f"  ({p.message})" if p.message else "")
    )


def _run(args) -> int:
    cfg = train_config(StreamConfig, args, target=_catalog_target(args.target), recipe=train_config(Recipe, args))
    stop = threading.Event()
    tty = sys.stderr.isatty()

    def on_sigint(signum, frame):
        if stop.is_set():  # a second Ctrl+C: leave now (the last checkpoint stays)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        _log("\ntrain run: stopping after the current step (Ctrl+C again to leave without a checkpoint)")
        stop.set()

    last = [0.0]

    def progress(p) -> None:
        now = time.monotonic()
        if tty:
            print("\r" + _bar(p), end="", file=sys.stderr, flush=True)
        elif now - last[0] > 10 or p.phase in ("eval", "done", "stopped"):
            _log(_bar(p))
            last[0] = now

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        summary = run_stream(cfg, progress=progress, stop=stop, say=lambda m: _log(("\n" if tty else "") + m))
    finally:
        signal.signal(signal.SIGINT, previous)
    if tty:
        print(file=sys.stderr)
    print(json.dumps(summary))
    return 130 if summary["stopped"] else 0


def _features(args) -> int:
    target_id = _catalog_target(args.target)
    model, _ = load_target_model(target_id)
    n_layers = len(getattr(model, "language_model", model).model.layers)
    taps = [int(x) for x in args.taps.split(",")] if args.taps else eagle_taps(n_layers)
    target = Target(model, taps, final_hidden=True)
    summary = build_features(
        target, split_paths(args.tokens), args.out, target_id=target_id, batch_size=args.batch_size, log=_log
    )
    print(json.dumps(summary))
    return 0


def _chain(args) -> int:
    cfg = train_config(ChainTrainConfig, args, kind=args.train_command)
    target_id = _catalog_target(args.target)
    model, _ = load_target_model(target_id)
    tcfg = _target_config(model)
    target = Target(model, (), final_hidden=args.train_command == "mtp")
    summary = train_chain(cfg, target, tcfg, log=_log)
    print(json.dumps(summary))
    return 0


def _target_config(model) -> dict:
    """The text model's config as a dict (the fields a head's config copies)."""
    lm = getattr(model, "language_model", model)
    args = lm.args
    return asdict(args) if is_dataclass(args) else dict(vars(args))


def _catalog_target(name: str) -> str:
    """A catalog name (`mlx_spec models`) stands for its target; paths and repo ids pass through."""
    if Path(name).expanduser().exists() or name.lower() not in {k.lower() for k in catalog.load()}:
        return name
    entry = catalog.get(name)
    catalog.check_supported(entry)
    return entry.target


def train_config(cls, args, **changes):
    """The flags that name ``cls``'s fields (a Recipe, TrainConfig or StreamConfig), with ``changes``
    on top: the one place training flags become a config (nothing below commands/ reads an
    argparse Namespace)."""
    given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{**given, **changes})


def run(args) -> int:
    commands = {
        "run": _run,
        "data": _data,
        "drafter": _drafter,
        "mtp": _chain,
        "eagle": _chain,
        "features": _features,
        "export": _export,
        "eval": _eval,
    }
    if getattr(args, "train_command", None) not in commands:
        raise BadRequest(
            "choose a train command: run, data, drafter, mtp, eagle, features, export or eval (see `mlx_spec train -h`)"
        )
    return commands[args.train_command](args)
