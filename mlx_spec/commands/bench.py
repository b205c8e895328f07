"""`mlx_spec bench`: plain vs speculative methods side by side, in one process, greedy.

Rows: plain decoding (mlx-lm ``generate_step``, the baseline), prompt lookup, mlx-lm's AR draft
(``--ar-draft``), DFlash at each ``--block-sizes``, the adaptive controller, and optionally the
official ``dflash`` package (``--peer``). See docs/bench.md for every column.
"""

from __future__ import annotations

import json
from pathlib import Path
import math
import sys
from dataclasses import asdict

from ..cli import add_model_args


def _ints(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        out = []
    if not out or min(out) < 2:
        from ..errors import BadRequest

        raise BadRequest(f"--block-sizes wants block sizes >= 2 separated by commas (got '{text}')")
    return out


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--block-sizes", default="2,4,8", help="DFlash block sizes to bench (default 2,4,8)")
    p.add_argument("--prompts", default=None, help="JSONL file of prompts (default: the built-in set)")
    p.add_argument("--kinds", default=None, help="built-in kinds to use, e.g. code,prose (default: all)")
    p.add_argument("--per-kind", type=int, default=None, help="built-in prompts per kind (default: all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median; >= 3 recommended)")
    p.add_argument("--ar-draft", default=None,
                   help="small AR draft model for mlx-lm speculative decoding: a path, or skip:N for the "
                        "target's own first N layers (self-speculation)")
    p.add_argument("--ar-draft-tokens", type=int, default=3, help="draft tokens per round for --ar-draft")
    p.add_argument("--lookup-block", type=int, default=8, help="prompt-lookup block (drafts + 1); 0 = skip")
    p.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-controller row")
    p.add_argument("--peer", action="store_true", help="also run the official dflash==0.1.0 MLX loop")
    p.add_argument("--vocab-compare", action="store_true",
                   help="also run every block size with the full draft head (the drafter must ship a "
                        "reduced draft vocabulary)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON object to FILE")


def _fmt(x, spec=".2f", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows, kinds) -> str:
    head = ["method", "dec tok/s", "e2e tok/s", "spread", "speedup", "e2e x", *[f"{k} x" for k in kinds],
            "tau", "accept", "T1 ms", "Td ms", "Tt ms", "ceiling", "eff"]
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append([r.label, "FAILED — " + r.status.removeprefix("failed: ")])
            continue
        lines.append([r.label, _fmt(r.decode_tps), _fmt(r.e2e_tps), _fmt(r.spread, ".0%"), _fmt(r.speedup),
                      _fmt(r.e2e_speedup), *[_fmt(r.speedup_by_kind.get(k)) for k in kinds], _fmt(r.tau),
                      _fmt(r.acceptance, ".0%"), _fmt(r.t1_ms, ".1f"), _fmt(r.td_ms, ".1f"),
                      _fmt(r.tt_ms, ".1f"), _fmt(r.ceiling), _fmt(r.efficiency, ".0%")])
    widths = [max(len(head[i]), *(len(ln[i]) for ln in lines if len(ln) > 2)) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for ln in lines:
        out.append(ln[0].ljust(widths[0]) + "  " + ln[1] if len(ln) == 2 else
                   "  ".join(c.ljust(w) for c, w in zip(ln, widths)))
    spec = [r for r in rows if r.acceptance_by_position and r.status == "ok"]
    if spec:
        out.append("\nacceptance by draft position (share of cycles reaching it):")
        out += [f"  {r.label:18s} " + " ".join(_fmt(x, ".2f") for x in r.acceptance_by_position) for r in spec]
    div = [r for r in rows if r.diverged]
    if div:
        out.append("\nnot token-identical to plain (greedy near-ties in the target): "
                   + ", ".join(f"{r.label} {r.diverged}/{r.runs} runs" for r in div))
    return "\n".join(out)


def run(args) -> int:
    import mlx_spec

    from ..bench import CostMeter, Method, ProgressBar, Runner, bench, summarize
    from ..errors import BadRequest
    from ..pair import open_pair
    from ..prompts import builtin_prompts, interleave, load_prompts
    from ..tuner import load_result, machine_info, tune_key

    if args.repeats < 1 or args.max_tokens < 1:
        raise BadRequest("--repeats and --max-tokens must be >= 1")
    sizes = _ints(args.block_sizes)
    err = sys.stderr
    print(f"BLAS: {mlx_spec.BLAS.describe()}", file=err)
    pair = open_pair(args, log=lambda m: print(m, file=err))
    if args.prompts:
        prompts = load_prompts(args.prompts)
    else:
        kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else None
        prompts = interleave(builtin_prompts(kinds, args.per_kind))
    encoded = [(p.id, p.kind, p.encode(pair.tokenizer)) for p in prompts]

    ar_model = None
    if args.ar_draft and args.ar_draft.startswith("skip:"):
        from ..lookup import layer_skip_draft

        try:
            ar_model = layer_skip_draft(pair.model, int(args.ar_draft[5:]))
        except ValueError as e:
            raise BadRequest(f"--ar-draft {args.ar_draft}: {e}") from None
    elif args.ar_draft:
        from ..loading import load_target_model

        ar_model, _ = load_target_model(args.ar_draft)
    methods = [Method("plain")]
    if args.lookup_block >= 2:
        methods.append(Method("lookup", args.lookup_block))
    if ar_model is not None:
        methods.append(Method("ar-draft", args.ar_draft_tokens + 1))
    tuned = None
    if pair.drafter is not None:
        kind = "dflash"
        methods += [Method(kind, B) for B in sizes]
        if args.vocab_compare:
            if pair.drafter.vocab is None:
                raise BadRequest("--vocab-compare: the drafter drafts over the full head already "
                                 "(no draft_vocab.json, or --draft-vocab full)")
            methods += [Method(kind, B, full_vocab=True) for B in sizes]
        tuned = load_result(tune_key(pair))
        adaptive_max = max(sizes + [pair.drafter.args.block_size])
        if not args.no_adaptive:
            methods.append(Method("adaptive", adaptive_max))
        if args.peer:
            methods += [Method("peer", B) for B in sizes]
    cost_sizes = sorted({*sizes, args.lookup_block if args.lookup_block >= 2 else 2,
                         args.ar_draft_tokens + 1, *([2, 3, 4, 6, 8, 12, adaptive_max] if pair.drafter else [])})
    context = max((ids for _, _, ids in encoded), key=len)
    bar = ProgressBar(err, "bench")
    meter = CostMeter(pair.model, pair.target, pair.drafter, [s for s in cost_sizes if s <= 64], context,
                      ar_model=ar_model)
    for r in range(3):  # a warm-up round and two more; then one before every repeat
        meter.round(bar, f"measuring pass costs ({r + 1}/3)")
    costs = meter.costs()

    def controller():
        from ..adaptive import AdaptiveController

        # the bench's own cost curve (same machine state as the rows), the tuner's prior if stored
        return AdaptiveController(costs, adaptive_max, tuned.acceptance_by_position if tuned else ())

    runner = Runner(pair, ar_model=ar_model, costs=costs, controller_factory=controller,
                    stop_at_eos=not args.ignore_eos)
    samples, failed = bench(runner, methods, encoded, repeats=args.repeats, max_tokens=args.max_tokens,
                            progress=bar, meter=meter)
    bar.close()
    costs = meter.costs()  # medians over all rounds, interleaved with the runs
    rows = summarize(samples, costs, failed, methods)
    kinds = list(dict.fromkeys(k for _, k, _ in encoded))
    fixed = [r for r in rows if r.kind == "dflash" and r.status == "ok" and r.decode_tps]
    best_fixed = max(fixed, key=lambda r: r.e2e_speedup or 0).label if fixed else None
    report = {
        "blas": mlx_spec.BLAS.describe(), "machine": machine_info(), "target": pair.target_id,
        "drafter": pair.drafter_id, "ar_draft": args.ar_draft,
        "prompts": [pid for pid, _, _ in encoded], "kinds": kinds,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "stop_at_eos": not args.ignore_eos,
        "costs": costs.as_dict(), "rows": [asdict(r) for r in rows], "best_fixed": best_fixed,
        "tuned": None if tuned is None else {"best": "off" if tuned.best == 1 else tuned.best,
                                             "source": tuned.source},
        "failed": [r.label for r in rows if r.status != "ok"],
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"target {pair.target_id} | drafter {pair.drafter_id}"
              + (f" | AR draft {args.ar_draft}" if args.ar_draft else "")
              + f" | {len(encoded)} prompts ({', '.join(kinds)}) "
              f"x {args.repeats} repeats, {args.max_tokens} max tokens, greedy | context for pass costs "
              f"{costs.context} tokens")
        print(table(rows, kinds))
        if best_fixed:
            by = {r.label: r for r in rows}
            ad = next((r for r in rows if r.kind == "adaptive"), None)
            line = f"\nbest fixed block: {best_fixed} (e2e x{_fmt(by[best_fixed].e2e_speedup)})"
            if ad is not None:
                line += f" | adaptive: " + (f"e2e x{_fmt(ad.e2e_speedup)}, mean block {_fmt(ad.mean_block)}"
                                            if ad.status == "ok" else ad.status)
            if tuned:
                line += f" | tuner's choice: B={report['tuned']['best']} ({report['tuned']['source']})"
            print(line)
    return 1 if report["failed"] else 0
