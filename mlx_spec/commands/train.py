"""`mlx_spec train data|drafter|export|eval`: build a training set from the target's own
responses, train a DFlash 2 (or DFlash 1) drafter on it, export a float16 copy of a checkpoint,
and measure a drafter's held-out tau by block size and prompt kind."""

from __future__ import annotations

import json
import sys


def add_arguments(p) -> None:
    from ..default_target import DEFAULT_TARGET_ID

    sub = p.add_subparsers(dest="train_command", metavar="{data,drafter,export,eval}")
    d = sub.add_parser("data", help="generate training data (target responses + features)")
    d.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model (path, repo id, default id)")
    d.add_argument("--out", required=True, help="data directory (resumable; reruns skip done prompts)")
    d.add_argument("--prompts", default=None, help="JSONL of prompts (default: built-in offline mix)")
    d.add_argument("--num-prompts", type=int, default=2000, help="built-in mix size (training part)")
    d.add_argument("--mix", choices=("wide", "narrow"), default="wide",
                   help="built-in mix: wide = distinct prompts from large pools (default); narrow = the "
                        "first shipped drafter's mix (repeats itself)")
    d.add_argument("--num-eval", type=int, default=16, help="built-in prompts held out for evaluation")
    d.add_argument("--taps", default=None,
                   help="comma-separated target layers to store (default: build_target_layer_ids(L, 5))")
    d.add_argument("--max-tokens", type=int, default=256, help="response length cap")
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--top-k", type=int, default=8, help="target top-K log-probs kept per token (for --loss kl)")
    d.add_argument("--from-tokens", default=None,
                   help="rebuild features from a token-id .npz (from `train export --tokens`) instead of generating")
    d.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke runs)")

    t = sub.add_parser("drafter", help="train a DFlash 2 drafter on a data directory")
    t.add_argument("--target", default=DEFAULT_TARGET_ID)
    t.add_argument("--data", required=True,
                   help="data directory from `train data`; several as a,b (same taps; may grow on --resume)")
    t.add_argument("--out", required=True, help="run directory (checkpoints, log, curve)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t.add_argument("--init", default=None, help="initialise weights from a drafter directory")
    t.add_argument("--init-target-layers", action="store_true",
                   help="warm start: copy the target's last layers and final norm where shapes match")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--intermediate-size", type=int, default=1536)
    t.add_argument("--block-size", type=int, default=8)
    t.add_argument("--no-conv", action="store_true", help="no two-tap convolutions")
    t.add_argument("--no-selector", action="store_true", help="no candidate selector (with --no-conv: DFlash 1)")
    t.add_argument("--selector-rank", type=int, default=64)
    t.add_argument("--selector-top-k", type=int, default=8)
    t.add_argument("--mask-token-id", type=int, default=None, help="default: a never-used special token")
    t.add_argument("--loss", choices=["ce", "kl"], default="ce")
    t.add_argument("--attention", choices=["bidirectional", "causal"], default="bidirectional")
    t.add_argument("--corruption", choices=["full", "uniform"], default="full")
    t.add_argument("--gamma", type=float, default=None, help="loss decay (default 4 for block 8, 7 for 16)")
    t.add_argument("--selector-weight", type=float, default=1.0)
    t.add_argument("--draft-vocab", type=int, default=0,
                   help="train the softmax over the K most frequent data ids (+labels, +negatives); 0 = full vocab")
    t.add_argument("--vocab-negatives", type=int, default=1024, help="random other ids per step with --draft-vocab")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--seqs-per-step", type=int, default=4)
    t.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup", type=float, default=0.04, help="warmup share of the steps")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-every", type=int, default=100, help="steps")
    t.add_argument("--checkpoint-minutes", type=float, default=None, help="also checkpoint after this many minutes")
    t.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts for the real tau eval (0 = off)")
    t.add_argument("--eval-max-tokens", type=int, default=96)
    t.add_argument("--eval-file", default=None,
                   help="JSONL of held-out prompts for the tau eval (default: the first --data dir's "
                        "eval_prompts.jsonl); prompts that are also training prompts are dropped, by name")
    t.add_argument("--export", default=None, help="after each checkpoint, write a float16 copy here")

    e = sub.add_parser("export", help="float16 copy of a run's checkpoint, and/or the data's token ids")
    e.add_argument("--run", default=None, help="run directory (its latest checkpoint)")
    e.add_argument("--out", default=None, help="drafter output directory")
    e.add_argument("--data", default=None, help="data directory, for --tokens")
    e.add_argument("--tokens", default=None, help="write the data's token ids to this .npz")


    v = sub.add_parser("eval", help="held-out tau of a drafter by block size and prompt kind (real decoding)")
    v.add_argument("--target", default=DEFAULT_TARGET_ID)
    v.add_argument("--drafter", required=True, help="drafter directory (or a run's ckpt/)")
    v.add_argument("--prompts", required=True, help="JSONL of held-out prompts (e.g. a data dir's eval_prompts.jsonl)")
    v.add_argument("--blocks", default="2,4,8,16", help="block sizes, e.g. 2,4,8,16")
    v.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    v.add_argument("--limit", type=int, default=None, help="only the first N prompts (interleaved by kind)")
    v.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                   help="auto: the drafter's reduced draft vocabulary when it ships one; full: the whole head")
    v.add_argument("--json", action="store_true")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _data(args) -> int:
    from ..drafter import build_target_layer_ids
    from ..errors import BadRequest
    from ..loading import load_target_model
    from ..target import Target
    from ..train.data import DataConfig, build_dataset, featurize_tokens
    from ..prompts import load_prompts
    from ..train.prompts import builtin_prompts, split_held_out, wide_prompts

    model, tokenizer = load_target_model(args.target)
    n_layers = len(getattr(model, "language_model", model).model.layers)
    taps = ([int(x) for x in args.taps.split(",")] if args.taps else build_target_layer_ids(n_layers, 5))
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
    from pathlib import Path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "eval_prompts.jsonl", "w") as f:
        for p in evals:
            f.write(json.dumps({"id": p.id, "prompt": p.text}) + "\n")
    cfg = DataConfig(max_tokens=args.max_tokens, batch_size=args.batch_size,
                     temperature=args.temperature, seed=args.seed, top_k=args.top_k)
    _log(f"data: {len(prompts)} prompts -> {out} (taps {taps}, batch {cfg.batch_size}, "
         f"max {cfg.max_tokens} tokens, {'greedy' if cfg.temperature == 0 else f'T={cfg.temperature}'})")
    summary = build_dataset(target, tokenizer, prompts, out, cfg, progress=_log)
    print(json.dumps(summary))
    return 0


def _drafter(args) -> int:
    from ..train.trainer import TrainConfig, train

    cfg = TrainConfig.from_args(args)
    result = train(cfg, progress=_log)
    print(json.dumps(result))
    return 0


def _export(args) -> int:
    from ..errors import BadRequest
    from ..train.data import export_tokens
    from ..train.trainer import export_checkpoint

    if not (args.run and args.out) and not (args.data and args.tokens):
        raise BadRequest("give --run and --out (drafter) and/or --data and --tokens (token ids)")
    if args.run and args.out:
        print(json.dumps(export_checkpoint(args.run, args.out)))
    if args.data and args.tokens:
        print(json.dumps(export_tokens(args.data, args.tokens)))
    return 0


def _eval(args) -> int:
    from ..errors import BadRequest
    from ..loading import load_pair
    from ..prompts import interleave, load_prompts
    from ..train.trainer import evaluate_tau

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
        print(json.dumps({"drafter": args.drafter, "prompts": len(prompts), "max_tokens": args.max_tokens,
                          "draft_vocab": vocab or "full", "rows": rows}))
        return 0
    kinds = sorted({k for r in rows for k in r["tau_by_kind"]})
    print(f"held-out tau, {len(prompts)} prompts x {args.max_tokens} tokens, greedy, real speculative decoding, "
          f"draft vocabulary {vocab or 'full'}")
    print("block  tau   " + "  ".join(f"{k:>6}" for k in kinds) + "  acceptance by position")
    for r in rows:
        print(f"{r['block']:>5}  {r['tau']:.2f}  " + "  ".join(f"{r['tau_by_kind'].get(k, 0):6.2f}" for k in kinds)
              + "  " + " ".join(f"{x:.2f}" for x in r["by_position"]))
    return 0


def run(args) -> int:
    from ..errors import BadRequest

    commands = {"data": _data, "drafter": _drafter, "export": _export, "eval": _eval}
    if getattr(args, "train_command", None) not in commands:
        raise BadRequest("choose a train command: data, drafter, export or eval (see `mlx_spec train -h`)")
    return commands[args.train_command](args)
