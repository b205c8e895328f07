"""`mlx_spec bench`: plain vs speculative methods side by side, in one process, greedy.

Rows: mlx-lm's own plain decoding (``stream_generate``, the BLAS at its default threads: what a
user runs instead of us), our plain path, prompt lookup at a fixed block, mlx-lm's AR draft
(``--ar-draft``), DFlash at each ``--block-sizes``, the per-cycle policy over DFlash only, lookup
only and both (the default engine), and optionally the official ``dflash`` package (``--peer``).
Every speedup is shown against our plain path and against mlx-lm's; per prompt kind and the worst
single prompt; for agent prompts also how much of the reply repeats the prompt. See docs/bench.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import mlx_spec

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from .. import contextbench, distributed, loadtest, policy
from ..analysis import COPY_SUBSET, reach_table
from ..baselines import layer_skip_draft
from ..bench import (
    METHOD_KINDS,
    POLICY_SOURCES,
    CostMeter,
    Method,
    Runner,
    bench,
    pooled_ceiling,
    prompt_report,
    subset_speedups,
    summarize,
)
from ..blas import default_threads, set_threads
from ..cli import LAUNCH_DESTS, add_launch_args, add_model_args, flags_of, launch_of, load_config
from ..contextbench import padded, parse_contexts
from ..costs import measure_costs
from ..default_target import resolve_target_id
from ..distributed import group_info, link_costs
from ..errors import BadRequest, MlxSpecError
from ..loading import load_target_model, resolve
from ..policy import PolicyFactory
from ..progress import Bar as ProgressBar
from ..prompts import BUILTIN, WORKLOADS, builtin_prompts, interleave, load_prompts
from ..server import process
from ..session import open_session
from ..text import encode_prompt
from ..tuning import apply_threads, load_result, machine_info, tune_key
from ..verify import MISMATCH


def _ints(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        out = []
    if not out or min(out) < 2:
        raise BadRequest(f"--block-sizes wants block sizes >= 2 separated by commas (got '{text}')")
    return out


def add_arguments(p) -> None:
    add_model_args(p, context=False)  # bench's own --context (below): the memory plan is sized from it
    p.add_argument("--block-sizes", default="2,4,8", help="DFlash block sizes to bench (default 2,4,8)")
    p.add_argument(
        "--methods",
        default=None,
        metavar="NAMES",
        help="instead of the default rows: one per-cycle policy row per draft source set, e.g. "
        "lookup,mtp,eagle,dflash,auto (each the policy restricted to that source; auto: every "
        "source the pair has), beside mlx-lm's and our plain decoding; loads what they need "
        "(--draft defaults to their sources)",
    )
    p.add_argument("--prompts", default=None, help="JSONL file of prompts (default: the built-in set)")
    p.add_argument(
        "--workload",
        choices=("all", "chat", "agent"),
        default="all",
        help="built-in set: chat (code, math, prose), agent (multi-turn file edits) or all (default)",
    )
    p.add_argument("--kinds", default=None, help="built-in kinds to use, e.g. code,agent (default: the workload's)")
    p.add_argument("--per-kind", type=int, default=None, help="built-in prompts per kind (default: all)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens generated per prompt and method")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median; >= 3 recommended)")
    p.add_argument(
        "--ar-draft",
        default=None,
        help="small AR draft model for mlx-lm speculative decoding: a path, or skip:N for the "
        "target's own first N layers (self-speculation)",
    )
    p.add_argument("--ar-draft-tokens", type=int, default=3, help="draft tokens per round for --ar-draft")
    p.add_argument("--lookup-block", type=int, default=8, help="prompt-lookup block (drafts + 1); 0 = skip")
    # --no-adaptive comes from add_model_args: here it also skips the per-cycle rows (dflash
    # per-cycle, lookup per-cycle, the default engine)
    p.add_argument(
        "--no-mlx-lm",
        action="store_true",
        help="skip the mlx-lm plain row (the baseline a user would run instead of us)",
    )
    p.add_argument("--peer", action="store_true", help="also run the official dflash==0.1.0 MLX loop")
    p.add_argument(
        "--vocab-compare",
        action="store_true",
        help="also run every block size with the full draft head (the drafter must ship a reduced draft vocabulary)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON object to FILE")
    p.add_argument(
        "--costs-only",
        action="store_true",
        help="only the pass costs T1, Td(B), Tt(B) (at the longest prompt's context, median of "
        "--repeats rounds), no generation rows; what bench measures on a group (a group "
        "started with --ranks must finish within --time-budget)",
    )

    add_launch_args(p, "the group's pass costs beside one process's; under mlx.launch bench measures the group's alone")
    p.set_defaults(bench_parser=p)  # --ranks rebuilds the ranks' flags from it
    p.add_argument(
        "--context",
        default=None,
        metavar="SIZES",
        help="e.g. 1k,4k,8k: pad each prompt to these context lengths (a long file for agent "
        "prompts, a long conversation for chat ones) and report prefill, time to first token "
        "cold / warm / from disk after a restart, decode speed and tau per context (default "
        "kinds agent,prose; docs/context.md); with --concurrency, the padded prompts go to "
        "both servers; the memory plan is sized for the longest",
    )
    g = p.add_argument_group("many clients at once (mlx_spec serve vs mlx_lm.server; mlx_spec/loadtest.py)")
    g.add_argument(
        "--concurrency",
        default=None,
        metavar="LEVELS",
        help="e.g. 1,2,4,8: start both servers on 127.0.0.1 and report aggregate tok/s and p50/p95 "
        "latency at each number of concurrent clients (instead of the single-stream rows)",
    )
    g.add_argument("--requests", type=int, default=4, help="requests per client at each level (default 4)")
    g.add_argument(
        "--max-batch", type=int, default=None, help="mlx_spec serve --max-batch (default: the largest level)"
    )
    g.add_argument(
        "--time-budget",
        type=float,
        default=1800.0,
        metavar="S",
        help="stop sending requests after S seconds in all (default 1800)",
    )


def _fmt(x, spec=".2f", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _grid(head: list[str], lines: list[list[str]]) -> list[str]:
    """Columns padded to width; a line of two cells is a label and a note spanning the rest."""
    widths = [max([len(head[i])] + [len(ln[i]) for ln in lines if len(ln) > 2]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for ln in lines:
        out.append(
            ln[0].ljust(widths[0]) + "  " + ln[1] if len(ln) == 2 else "  ".join(c.ljust(w) for c, w in zip(ln, widths))
        )
    return out


def _worst(w) -> str:
    return "-" if not w else f"{_fmt(w[1])} {w[0]}"


def table(rows, kinds) -> str:
    head = [
        "method",
        "dec tok/s",
        "e2e tok/s",
        "spread",
        "tau",
        "accept",
        "mean L",
        "T1 ms",
        "Td ms",
        "Tt ms",
        "ceiling",
        "eff",
    ]
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append([r.label, "FAILED — " + r.status.removeprefix("failed: ")])
            continue
        lines.append(
            [
                r.label,
                _fmt(r.decode_tps),
                _fmt(r.e2e_tps),
                _fmt(r.spread, ".0%"),
                _fmt(r.tau),
                _fmt(r.acceptance, ".0%"),
                _fmt(r.mean_block),
                _fmt(r.t1_ms, ".1f"),
                _fmt(r.td_ms, ".1f"),
                _fmt(r.tt_ms, ".1f"),
                _fmt(r.ceiling),
                _fmt(r.efficiency, ".0%"),
            ]
        )
    out = _grid(head, lines)
    ok = [r for r in rows if r.status == "ok"]
    for suffix, title in (("", "plain (ours)"), ("_mlx", "mlx-lm plain")):
        if not any(getattr(r, "speedup" + suffix) is not None for r in ok):
            continue
        out.append(f"\nspeedup vs {title} (decode tok/s; median over repeats; worst = lowest single prompt):")
        head = ["method", "all", "e2e", *kinds, "worst prompt"]
        out += _grid(
            head,
            [
                [
                    r.label,
                    _fmt(getattr(r, "speedup" + suffix)),
                    _fmt(getattr(r, "e2e_speedup" + suffix)),
                    *[_fmt(getattr(r, "speedup_by_kind" + suffix).get(k)) for k in kinds],
                    _worst(getattr(r, "worst" + suffix)),
                ]
                for r in ok
            ],
        )
    spec = [r for r in ok if r.acceptance_by_position]
    if spec:
        out.append("\nacceptance by draft position (share of cycles reaching it):")
        out += [f"  {r.label:18s} " + " ".join(_fmt(x, ".2f") for x in r.acceptance_by_position) for r in spec]
    src = [r for r in ok if r.sources and r.kind in POLICY_SOURCES]  # fixed rows have one source
    if src:
        out.append("\ndraft sources (drafted cycles, accepted/drafted tokens, tau):")
        out += [
            f"  {r.label:18s} "
            + ", ".join(
                f"{k} {v.get('cycles', 0)} ({v.get('accepted', 0)}/{v.get('drafted', 0)}, "
                f"tau {_fmt(v.get('mean_acceptance_length'))})"
                for k, v in r.sources.items()
            )
            for r in src
        ]
    if any(r.kind in ("mtp-policy", "eagle-policy") for r in ok):
        out.append("\n(mtp / eagle rows: Td is one head pass, Tc; a chain of depth k costs k of them)")
    div = [r for r in rows if r.diverged]
    if div:
        out.append(
            "\nnot token-identical to plain (greedy near-ties in the target): "
            + ", ".join(f"{r.label} {r.diverged}/{r.runs} runs" for r in div)
        )
    return "\n".join(out)


def copy_table(prompt_rows, rows, subset, ceilings=None) -> str:
    """Agent prompts: the share of each reply that repeats its prompt and the speedup that allows
    (the copy ceiling), next to every drafting method's tau and speedups (vs our plain / vs
    mlx-lm) and its share of the ceiling; then the speedups over the replies that do repeat their
    prompt. ``ceilings``: {"agent": pooled ceiling of all agent prompts, "copying": of those}."""
    ceilings = ceilings or {}
    labels = [r.label for r in rows if r.status == "ok" and r.tau is not None]
    head = ["prompt", "prompt tok", "reply tok", "copy share", "ceiling", *[f"{m} tau x/x-mlx %ceil" for m in labels]]
    lines = [
        [
            p.prompt_id,
            str(p.prompt_tokens),
            str(p.reply_tokens),
            _fmt(p.copy_share, ".0%"),
            _fmt(p.ceiling),
            *[
                f"{_fmt(p.tau.get(m))} {_fmt(p.speedup.get(m))}/{_fmt(p.speedup_mlx.get(m))} "
                f"{_fmt(p.of_ceiling.get(m), '.0%')}"
                for m in labels
            ],
        ]
        for p in prompt_rows
    ]
    out = [
        "agent prompts: copy share = reply tokens covered by spans of >= 4 tokens that occur in the prompt; "
        "ceiling = the speedup an oracle reaches that drafts every such token right (blocks up to 32 at the "
        "measured Tt(L), plain steps elsewhere); per method: tau, speedup vs our plain / vs mlx-lm plain, "
        "share of the ceiling"
    ]
    out += _grid(head, lines)
    ids = [p.prompt_id for p in prompt_rows if p.copy_share >= COPY_SUBSET]
    if subset:
        c = ceilings.get("copying")
        out.append(
            f"\nreplies that repeat their prompt (copy share >= {COPY_SUBSET:.0%}: {', '.join(ids)}; "
            f"ceiling x{_fmt(c)}): "
            + "; ".join(
                f"{m} x{_fmt(a)} / x{_fmt(b)} mlx-lm" + (f" ({_fmt(a / c, '.0%')} of the ceiling)" if a and c else "")
                for m, (a, b) in subset.items()
                if m in labels
            )
        )
    else:
        out.append(f"\nno reply repeats its prompt (copy share >= {COPY_SUBSET:.0%})")
    if ceilings.get("agent"):
        out.append(f"all agent prompts: ceiling x{_fmt(ceilings['agent'])}")
    return "\n".join(out)


def reach_lines(reach, rows, kinds) -> str:
    """What drafting can reach on this run's pass costs (``analysis.reach_table``): per block, the
    tau at which a cycle breaks even and the speedup of a perfect drafter, DFlash (its pass paid)
    and lookup (free proposals); then each fixed DFlash row's tau by prompt kind and what that tau
    gives at its block."""
    by = {(r.block, r.source): r for r in reach}

    def cells(r) -> list[str]:
        return ["-", "-"] if r is None else [_fmt(r.break_even), "x" + _fmt(r.perfect)]

    lines = [
        [str(B), *cells(by.get((B, "dflash"))), *cells(by.get((B, "lookup")))] for B in sorted({r.block for r in reach})
    ]
    out = [
        "what drafting can reach here (this run's pass costs, one sequence, no host overhead; tau = tokens a "
        "cycle commits; a cycle committing tau runs tau / break-even times as fast as plain steps; perfect = "
        "every draft accepted):"
    ]
    out += _grid(["block", "dflash break-even tau", "dflash perfect", "lookup break-even tau", "lookup perfect"], lines)
    # (a full-vocab row's draft pass is not the curve's: its td_ms is None)
    fixed = [
        r
        for r in rows
        if r.status == "ok"
        and r.kind == "dflash"
        and r.tau_by_kind
        and r.td_ms is not None
        and (r.block_size, "dflash") in by
    ]
    for r in fixed:
        R = by[(r.block_size, "dflash")]
        out.append(
            f"  {r.label}: measured tau "
            + ", ".join(
                f"{k} {_fmt(r.tau_by_kind[k])} (x{_fmt(R.speedup(r.tau_by_kind[k]))})"
                for k in kinds
                if k in r.tau_by_kind
            )
        )
    return "\n".join(out)


def concurrency(args) -> int:
    """``--concurrency``: mlx_spec serve and mlx_lm.server under 1..N concurrent clients."""
    try:
        levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or args.requests < 1:
        raise BadRequest(
            f"--concurrency wants client counts >= 1 separated by commas (got '{args.concurrency}'), --requests >= 1"
        )
    if args.prompts:
        prompts = load_prompts(args.prompts)
    else:
        kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else WORKLOADS["chat"]
        prompts = interleave(builtin_prompts(kinds, args.per_kind))
    messages = [list(p.messages) if p.messages else [{"role": "user", "content": p.text}] for p in prompts]
    target = str(resolve_target_id(args.target) or resolve(args.target, "target"))
    extra = ["--no-draft"] if args.no_draft else []
    if args.context:
        messages = context_messages(args, prompts, target)
        extra += ["--context", str(_plan_context(args))]
    if getattr(args, "block_size", None):
        extra += ["--block-size", str(args.block_size)]
    if getattr(args, "kv_bits", None):  # (mlx_lm.server keeps its own float K/V: it has no such flag)
        extra += ["--kv-bits", str(args.kv_bits), "--kv-group-size", str(args.kv_group_size)]
    if getattr(args, "draft_window", None):
        extra += ["--draft-window", str(args.draft_window)]
    servers = [loadtest.ours(args.target, args.drafter, args.max_batch or max(levels), extra)]

    if not args.no_mlx_lm:
        servers.append(loadtest.mlx_lm_server(target, mlx_spec.BLAS.path))
    rows = loadtest.run(
        servers,
        levels,
        messages,
        max_tokens=args.max_tokens,
        requests=args.requests,
        budget_s=args.time_budget,
        log=lambda m: print(m, file=sys.stderr),
    )
    report = {
        "target": args.target,
        "blas": mlx_spec.BLAS.describe(),
        "levels": levels,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "prompts": [p.id for p in prompts],
        "rows": [r.as_dict() for r in rows],
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if args.json else loadtest.table(rows))
    return 0 if all(r.failed == 0 for r in rows) else 1


def _method_names(args) -> list[str]:
    """``--methods``' names (checked), and ``--draft`` set to the sources they need when not
    given (auto: every source the pair has)."""
    if not args.methods:
        return []
    names = [x.strip() for x in args.methods.split(",") if x.strip()]
    bad = [n for n in names if n not in METHOD_KINDS]
    if not names or bad:
        raise BadRequest(
            f"--methods: unknown {', '.join(repr(b) for b in bad) or 'empty list'} (known: {', '.join(METHOD_KINDS)})"
        )
    if len(set(names)) != len(names):
        raise BadRequest(f"--methods names a method twice: {args.methods}")
    if getattr(args, "draft", None) is None and not getattr(args, "no_draft", False):
        if "auto" in names:
            args.draft = "auto"
        else:
            need = dict.fromkeys(s for n in names for s in POLICY_SOURCES[METHOD_KINDS[n]])
            args.draft = ",".join(need)
    return names


def run(args) -> int:
    if args.time_budget <= 0:
        raise BadRequest(f"--time-budget must be > 0 seconds (got {args.time_budget:g})")
    if args.concurrency:
        return concurrency(args)
    if args.context:
        return context_run(args)

    if distributed.launched() or args.costs_only or launch_of(args) is not None:
        return costs_run(args)

    if args.repeats < 1 or args.max_tokens < 1:
        raise BadRequest("--repeats and --max-tokens must be >= 1")
    sizes = _ints(args.block_sizes)
    names = _method_names(args)
    err = sys.stderr
    print(f"BLAS: {mlx_spec.BLAS.describe()}", file=err)
    pair = open_session(load_config(args), log=lambda m: print(m, file=err), tuning="none").pair
    if args.prompts:
        prompts = load_prompts(args.prompts)
    else:
        kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else WORKLOADS[args.workload]
        prompts = interleave(builtin_prompts(kinds, args.per_kind))
    encoded = [(p.id, p.kind, p.encode(pair.tokenizer)) for p in prompts]

    ar_model = None
    if args.ar_draft and args.ar_draft.startswith("skip:"):
        try:
            ar_model = layer_skip_draft(pair.model, int(args.ar_draft[5:]))
        except ValueError as e:
            raise BadRequest(f"--ar-draft {args.ar_draft}: {e}") from None
    elif args.ar_draft:
        ar_model, _ = load_target_model(args.ar_draft)
    methods = ([] if args.no_mlx_lm else [Method("mlx-lm")]) + [Method("plain")]
    if args.lookup_block >= 2:
        methods.append(Method("lookup", args.lookup_block))
    if ar_model is not None:
        methods.append(Method("ar-draft", args.ar_draft_tokens + 1))
    tuned = None
    adaptive_max = policy.MAX_CHAIN_DEPTH + 1
    if names:  # `--methods`: mlx-lm, our plain path and one policy row per named source set
        methods = [m for m in methods if m.kind in ("mlx-lm", "plain", "ar-draft")]
        if pair.drafter is not None or pair.chains:  # (the policy rows start from the tuner's priors)
            tuned = load_result(tune_key(pair))
        if pair.drafter is not None:
            adaptive_max = max(sizes + [pair.drafter.args.block_size])
        have = set(pair.draft_sources)
        for n in names:
            missing = set(POLICY_SOURCES[METHOD_KINDS[n]]) - have if n != "auto" else set()
            if missing:
                raise BadRequest(
                    f"--methods {n}: the loaded pair cannot draft with {', '.join(sorted(missing))} "
                    f"(it has {', '.join(sorted(have)) or 'no draft source'}; see --draft, --mtp, --eagle)"
                )
            methods.append(Method(METHOD_KINDS[n], adaptive_max))
    elif pair.drafter is not None:
        kind = "dflash"
        methods += [Method(kind, B) for B in sizes]
        if args.vocab_compare:
            if pair.drafter.vocab is None:
                raise BadRequest(
                    "--vocab-compare: the drafter drafts over the full head already "
                    "(no draft_vocab.json, or --draft-vocab full)"
                )
            methods += [Method(kind, B, full_vocab=True) for B in sizes]
        tuned = load_result(tune_key(pair))
        adaptive_max = max(sizes + [pair.drafter.args.block_size])
        if not args.no_adaptive:
            methods += [
                Method("adaptive", adaptive_max),
                Method("lookup-policy", adaptive_max),
                Method("default", adaptive_max),
            ]
        if args.peer:
            methods += [Method("peer", B) for B in sizes]
    cost_sizes = sorted(
        {
            *sizes,
            args.lookup_block if args.lookup_block >= 2 else 2,
            args.ar_draft_tokens + 1,
            *([2, 3, 4, 6, 8, 12, adaptive_max] if pair.drafter else []),
            *(range(2, policy.MAX_CHAIN_DEPTH + 2) if pair.chains else []),  # a chain's verify rows
            # the copy ceiling's blocks (agent prompts): Tt(L) up to a full lookup draft
            *([16, 24, policy.MAX_LOOKUP + 1] if any(k == "agent" for _, k, _ in encoded) else []),
        }
    )
    context = max((ids for _, _, ids in encoded), key=len)
    bar = ProgressBar(err, "bench")
    meter = CostMeter(
        pair.model,
        pair.target,
        pair.drafter,
        [s for s in cost_sizes if s <= 64],
        context,
        ar_model=ar_model,
        chains=pair.chains or None,
    )
    for r in range(3):  # a warm-up round and two more; then one before every repeat
        meter.round(bar, f"measuring pass costs ({r + 1}/3)")
    costs = meter.costs()

    # Our rows at the engine's thread count (the tuner's stored choice, else all cores); the
    # mlx-lm row at the BLAS's own default. Either way a user's pinned count wins.
    ours = apply_threads(tuned)
    runner = Runner(
        pair,
        ar_model=ar_model,
        costs=costs,
        stop_at_eos=not args.ignore_eos,
        tuned=tuned,
        threads=ours,
        blas=mlx_spec.BLAS,
    )
    threads = {"ours": ours, "mlx-lm": mlx_spec.BLAS.pinned or (default_threads() if ours else None)}
    samples, failed = bench(
        runner, methods, encoded, repeats=args.repeats, max_tokens=args.max_tokens, progress=bar, meter=meter
    )
    bar.close()
    costs = meter.costs()  # medians over all rounds, interleaved with the runs
    rows = summarize(samples, costs, failed, methods)
    apply_threads(tuned)
    kinds = list(dict.fromkeys(k for _, k, _ in encoded))
    per_prompt = prompt_report(samples, encoded, pair.tokenizer.eos_token_ids, costs)
    agent = [p for p in per_prompt if p.kind == "agent"]
    copying = {p.prompt_id for p in agent if p.copy_share >= COPY_SUBSET}
    subset = subset_speedups(samples, copying) if copying else {}
    ceilings = {
        "agent": pooled_ceiling(agent, costs.t1_ms),
        "copying": pooled_ceiling([p for p in agent if p.prompt_id in copying], costs.t1_ms),
    }
    reach = reach_table(costs, adaptive_max if pair.drafter is not None else 0)
    fixed = [r for r in rows if r.kind == "dflash" and r.status == "ok" and r.decode_tps]
    best_fixed = max(fixed, key=lambda r: r.e2e_speedup or 0).label if fixed else None
    report = {
        "blas": mlx_spec.BLAS.describe(),
        "machine": machine_info(),
        "target": pair.target_id,
        "drafter": pair.drafter_id,
        "ar_draft": args.ar_draft,
        "prompts": [pid for pid, _, _ in encoded],
        "kinds": kinds,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "stop_at_eos": not args.ignore_eos,
        "costs": costs.as_dict(),
        "rows": [asdict(r) for r in rows],
        "best_fixed": best_fixed,
        "tuned": None
        if tuned is None
        else {"best": "off" if tuned.best == 1 else tuned.best, "threads": tuned.threads, "source": tuned.source},
        "failed": [r.label for r in rows if r.status != "ok"],
        "blas_threads": threads,
        "per_prompt": [asdict(p) for p in per_prompt],
        "copy_subset": {
            "min_share": COPY_SUBSET,
            "prompts": sorted(copying),
            "ceiling": ceilings["copying"],
            "speedup": {m: {"plain": a, "mlx-lm": b} for m, (a, b) in subset.items()},
        },
        "agent_ceiling": ceilings["agent"],
        "reach": [{**asdict(r), "break_even": round(r.break_even, 3), "perfect": round(r.perfect, 3)} for r in reach],
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"target {pair.target_id} | drafter {pair.drafter_id}"
            + (f" | AR draft {args.ar_draft}" if args.ar_draft else "")
            + f" | {len(encoded)} prompts ({', '.join(kinds)}) "
            f"x {args.repeats} repeats, {args.max_tokens} max tokens, greedy | context for pass costs "
            f"{costs.context} tokens | BLAS threads: ours {threads['ours'] or '-'}, "
            f"mlx-lm {threads['mlx-lm'] or '-'}"
        )
        print(table(rows, kinds))
        if agent:
            print()
            print(copy_table(agent, rows, subset, ceilings))
        if reach:
            print()
            print(reach_lines(reach, rows, kinds))
        if best_fixed:
            by = {r.label: r for r in rows}
            line = f"\nbest fixed block: {best_fixed} (e2e x{_fmt(by[best_fixed].e2e_speedup)})"
            for ad in (r for r in rows if r.kind in ("default", "adaptive")):
                line += f" | {ad.label}: " + (
                    f"e2e x{_fmt(ad.e2e_speedup)}, mean L {_fmt(ad.mean_block)}" if ad.status == "ok" else ad.status
                )
            if tuned:
                line += f" | tuner's choice: B={report['tuned']['best']} ({report['tuned']['source']})"
            print(line)
    return 1 if report["failed"] else 0


# -- by context length (contextbench.py, docs/context.md) -------------------------------------------

CONTEXT_KINDS = ("agent", "prose")
# Without --prompts / --kinds / --per-kind: an agent edit whose reply re-emits a whole file (the
# copying reply the engine is judged on at every context) and a chat prompt
CONTEXT_PROMPTS = ("agent-7", "prose-1")


def _plan_context(args) -> int:
    """The memory plan's context for ``--context SIZES``: the longest padded prompt and its reply."""
    return max(parse_contexts(args.context)) + args.max_tokens + 64


def context_prompts(args):
    if args.prompts:
        return load_prompts(args.prompts)
    if not args.kinds and not args.per_kind:
        return [p for i in CONTEXT_PROMPTS for p in BUILTIN if p.id == i]
    kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else CONTEXT_KINDS
    return interleave(builtin_prompts(kinds, args.per_kind or 1))


def context_messages(args, prompts, target: str) -> list[list[dict]]:
    """``--concurrency`` with ``--context``: every prompt padded to each size (the target's tokenizer counts)."""
    tok = load_tokenizer(Path(target))
    sizes = parse_contexts(args.context)
    out = []
    for c in sizes:
        for p in prompts:
            msgs, n = padded(p, c, lambda m: len(encode_prompt(tok, messages=m)))
            print(f"context {c}: {p.id} padded to {n} tokens", file=sys.stderr)
            out.append(msgs)
    return out


def context_run(args) -> int:
    """``--context``: prefill, first token cold / warm / from disk, decode speed by context length."""
    if args.repeats < 1 or args.max_tokens < 1:
        raise BadRequest("--repeats and --max-tokens must be >= 1")
    if args.costs_only or launch_of(args) is not None:
        raise BadRequest("bench --context runs in one process: drop --costs-only / --ranks / --hosts")
    sizes = contextbench.parse_contexts(args.context)
    err = sys.stderr
    cfg = load_config(argparse.Namespace(**{**vars(args), "context": _plan_context(args)}))
    pair = open_session(cfg, log=lambda m: print(m, file=err), tuning="none").pair
    if pair.drafter is None:
        raise BadRequest("bench --context compares the default engine with plain decoding: it needs a drafter")
    tuned = load_result(tune_key(pair))
    policies = PolicyFactory(pair, tuned)
    ours = apply_threads(tuned)
    blas = mlx_spec.BLAS

    def threads(who: str) -> None:  # as the main bench: mlx-lm at the BLAS's own default
        if blas.settable:
            set_threads(blas, blas.pinned if who == "mlx-lm" else ours)

    prompts = context_prompts(args)
    rows = contextbench.run(
        pair,
        prompts,
        sizes,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        policies=policies,
        threads=threads,
        log=lambda m: print(m, file=err),
    )
    term = contextbench.context_term(rows)
    report = {
        "target": pair.target_id,
        "drafter": pair.drafter_id,
        "blas": blas.describe(),
        "contexts": sizes,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "rows": contextbench.as_dicts(rows),
        "copying": {str(c): None if v is None else round(v, 3) for c, v in contextbench.copying(rows).items()},
        "context_term": None if term is None else term.as_dict(),
        "kv_cache": pair.kv.describe() if pair.kv is not None else "float K/V (as computed)",
        "draft_window": pair.drafter.context_limit,
        "engine_curve": _curve_source(tuned),
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"target {pair.target_id} | drafter {pair.drafter_id} | {args.max_tokens} max tokens, greedy, "
            f"{args.repeats} repeats (cold prefill once) | BLAS {blas.describe()} | "
            f"{report['kv_cache']} on every row | drafting window "
            f"{pair.drafter.context_limit or 'all positions'}\n"
            f"the default engine's cost curve: {report['engine_curve']}"
        )
        print(contextbench.table(rows))
        print(contextbench.copying_line(rows))
        for r in rows:
            if r.divergence:
                print(f"not token-identical at context {r.context}, {r.prompt_id}: {r.divergence}")
        print(
            "disk/(warm+load): time to first token after a restart over a warm in-memory hit plus the "
            "disk load (<= 1.10: within 10 %)"
        )
        if term is not None:
            print(
                "context term (ms a pass gains per 1000 tokens of context; costs.Costs.ctx_ms): "
                + ", ".join(f"{'T1' if B == 1 else f'Tt({B})'} +{v:.2f}" for B, v in sorted(term.ctx_ms.items()))
            )
    return 0 if all(r.verdict != MISMATCH for r in rows) else 1


def _curve_source(tuned) -> str:
    """What the default engine's policy prices its choices with (docs/context.md)."""
    if tuned is None or tuned.costs is None:
        return "estimated from the models' sizes (no tuning result for this pair here: `mlx_spec tune` measures one)"
    term = "with its measured context term" if tuned.costs.ctx_ms else "without a context term"
    return f"tuned {tuned.date[:10]}, {term}"


# -- pass costs alone, and on a group (docs/distributed.md) ---------------------------------------

GROUP_SKIP = {"json", "json_out", "costs_only", "concurrency", *LAUNCH_DESTS}


def _costs_prompts(args, tokenizer) -> list[int]:
    """The context the passes are timed at: the longest prompt of the set bench would run."""
    if args.prompts:
        prompts = load_prompts(args.prompts)
    else:
        kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else WORKLOADS[args.workload]
        prompts = builtin_prompts(kinds, args.per_kind)
    return max((p.encode(tokenizer) for p in prompts), key=len)


def _pass_costs(pair, sizes: list[int], context: list[int], reps: int, group=None) -> dict:
    """The pass costs alone (``bench --costs-only``; what `bench` reports for a group): T1, Td(B),
    Tt(B) at ``context`` tokens, medians of ``reps`` rounds. With ``group`` (every rank calls
    this at the same point, the target sharded over it) also what the link adds on its own:
    the all-reduce chain of one verify pass and the per-step message (``distributed.link_costs``)."""
    costs = measure_costs(pair.model, pair.target, pair.drafter, sizes, context, reps=reps)
    out = {
        "group": group_info(group).as_dict(),
        "target": pair.target_id,
        "drafter": pair.drafter_id,
        "context": len(context),
        "reps": reps,
        "costs": costs.as_dict(),
    }
    if group is not None:
        out.update(link_costs(group, pair.target.num_layers, pair.target.hidden_size, sizes, reps))
    return out


def _measure(args, cfg, sizes, group_aware: bool = False) -> dict:
    session = open_session(cfg, log=lambda m: print(m, file=sys.stderr), tuning="none", group_aware=group_aware)
    pair = session.pair
    return _pass_costs(pair, sizes, _costs_prompts(args, pair.tokenizer), max(args.repeats, 1), session.group)


def costs_run(args) -> int:
    """``--costs-only``, under mlx.launch (every rank measures its sharded passes; rank 0
    reports), or ``--ranks/--hosts/--hostfile`` (one process here, then the group through
    mlx.launch, side by side)."""
    if args.repeats < 1:
        raise BadRequest("--repeats must be >= 1")
    sizes = _ints(args.block_sizes)
    launch = launch_of(args)
    if distributed.launched():
        if not args.costs_only:
            print("bench under mlx.launch measures the group's pass costs only (--costs-only)", file=sys.stderr)
        report = _measure(args, load_config(args), sizes, group_aware=True)
        if report["group"]["rank"] == 0:
            _report(args, report)
        return 0
    try:
        single = _measure(args, replace(load_config(args), ranks=1), sizes)
    except MlxSpecError as e:  # a target bigger than one machine: the group's column alone
        if launch is None:
            raise
        single = {"error": f"{type(e).__name__}: {e}"}
    if launch is None:
        _report(args, single)
        return 0

    gc.collect()
    mx.clear_cache()
    group = _launch_costs(args, launch)
    report = {"single": single, "ranks": group, "launch": launch.as_dict()}
    _report(args, report)
    return 0 if "error" not in group else 1


def _launch_costs(args, launch) -> dict:
    """Run ``bench --costs-only --json`` on the group with mlx.launch; rank 0's JSON (or why not)."""
    child = [sys.executable, "-m", "mlx_spec", "bench", "--costs-only", "--json"]
    child += flags_of(args, args.bench_parser, GROUP_SKIP)
    cmd = launch.command(child)
    print(f"measuring on {launch.describe()}: {launch.shown(cmd)}", file=sys.stderr, flush=True)
    # its own session, stdin a pipe that never ends (mlx.launch's stdin loop spins on /dev/null)
    proc = process.spawn(cmd, None, quiet_stdin=True, stdout=subprocess.PIPE)
    try:
        out, _ = proc.communicate(timeout=args.time_budget)
    except subprocess.TimeoutExpired:
        process.stop_launched(proc)  # rank 0 first, then mlx.launch and the ranks it started here
        proc.communicate()
        return {"error": f"the group did not finish within --time-budget {args.time_budget:g} s"}
    except BaseException:  # Ctrl-C (the group, in its own session, does not get it) or an error
        process.stop_launched(proc)
        raise
    for line in reversed(out.decode(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {"error": f"mlx.launch exited with code {proc.returncode} without rank 0's report (see stderr above)"}


def _report(args, report: dict) -> None:
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
        return
    cols = [("single", report)] if "ranks" not in report else [("single", report["single"]), ("ranks", report["ranks"])]
    print(costs_table(cols))


def costs_table(cols: list[tuple[str, dict]]) -> str:
    """Pass costs side by side: one column per report (one process, a group), and the ratio of
    the last to the first when both ran."""

    def name(rep):
        g = rep.get("group") or {}
        return "1 process" if g.get("size", 1) == 1 else f"{g['size']} ranks ({g.get('backend')})"

    ok = [(k, r) for k, r in cols if "error" not in r]
    head = ["pass (ms, median)"] + [name(r) if "error" not in r else k for k, r in cols]
    ratio = len(ok) == 2 and len(cols) == 2
    if ratio:
        head.append("ratio")
    rows: list[tuple[str, list]] = []

    def get(rep, path):
        x = rep
        for p in path:
            x = (x or {}).get(p) if isinstance(x, dict) else None
        return x

    first = next((r for _, r in ok), {})
    keys = sorted({int(k) for _, r in ok for k in (get(r, ["costs", "tt_ms"]) or {})})
    rows.append(("T1 (plain step)", [get(r, ["costs", "t1_ms"]) for _, r in cols]))
    for B in keys:
        if B > 1:
            rows.append((f"Td({B}) (draft)", [get(r, ["costs", "td_ms", str(B)]) for _, r in cols]))
    for B in keys:
        rows.append((f"Tt({B}) (verify)", [get(r, ["costs", "tt_ms", str(B)]) for _, r in cols]))
    link = [r for _, r in cols if "allreduce_ms" in r]
    if link:
        for B in sorted(int(k) for k in link[0]["allreduce_ms"]):
            rows.append(
                (
                    f"all-reduces of one Tt({B})",
                    [(r.get("allreduce_ms") or {}).get(str(B), (r.get("allreduce_ms") or {}).get(B)) for _, r in cols],
                )
            )
        rows.append(("one-int message", [r.get("message_ms") for _, r in cols]))
    lines = []
    for label, vals in rows:
        cells = [label] + [_fmt(v, ".1f") if isinstance(v, (int, float)) else "-" for v in vals]
        if ratio:
            a, b = vals[0], vals[1]
            cells.append(
                f"x{b / a:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 else "-"
            )
        lines.append(cells)
    out = [
        f"target {first.get('target')} | drafter {first.get('drafter')} | context {first.get('context')} "
        f"tokens | median of {first.get('reps')} rounds"
    ]
    out += _grid(head, lines)
    for k, r in cols:
        if "error" in r:
            out.append(f"{k}: {r['error']}")
    return "\n".join(out)
