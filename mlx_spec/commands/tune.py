"""`mlx_spec tune`: (re-)measure the best block size (or, for a pair without a DFlash drafter, each
chain drafter's depth) for this machine and pair, store it, show it."""

from __future__ import annotations

import json
import sys

import mlx_spec

from ..cli import add_model_args, load_config
from ..errors import BadRequest
from ..progress import Bar
from ..session import open_session
from ..tuning import DEFAULT_BUDGET_S, save_result, tune
from ..tuning.store import SOURCE_NAMES


def add_arguments(p) -> None:
    add_model_args(p, tuning=False)  # tuning is the point here: no --no-tune / --block-size / --tune-budget
    p.add_argument("--budget", type=float, default=None, help="time budget in seconds (default 90)")
    p.add_argument(
        "--candidates",
        default=None,
        help="block sizes to consider, e.g. 2,3,4,8 (default 2..max(ckpt,16)); without a DFlash drafter, "
        "chain rows = depth + 1 (default 2..9)",
    )
    p.add_argument("--tokens", type=int, default=24, help="tokens per timed run (the probe's and the race's)")
    p.add_argument("--json", action="store_true", help="print the stored result as JSON")


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def table(result) -> str:
    """One row per candidate: the model's speedup (what decides) and its noise first, then what
    the race measured (what calibrates and checks it)."""
    chain = result.best_source != "dflash"  # (a pair without a DFlash drafter: its rows are chains)
    width = max([5] + [len(c.label) + 1 for c in result.candidates])
    lines = [
        f"{'chain' if chain else 'block':>{width}}  {'threads':>7}  {'tau':>5}  {'model':>6}  {'noise':>5}  "
        f"{'raced':>5}  {'tok/s':>6}  {'speedup':>7}  {'spread':>6}  {'rounds':>6}  note"
    ]
    chosen = (result.best, result.threads) + ((result.best_source,) if chain else ())
    for c in result.candidates:
        mark = "*" if c.key == (chosen if result.best > 1 else chosen[:2]) else " "
        lines.append(
            f"{mark}{c.label:>{width - 1}}  {_f(c.threads, 'd'):>7}  {_f(c.tau, '.2f'):>5}  "
            f"{_f(c.predicted, '.3f'):>6}  {_f(c.noise, '.1%'):>5}  {'yes' if c.measured else 'no':>5}  "
            f"{_f(c.median_tps, '.2f'):>6}  {_f(c.speedup, '.3f'):>7}  {_f(c.spread, '.0%'):>6}  "
            f"{c.rounds:>6}  {c.note}"
        )
    return "\n".join(lines)


def run(args) -> int:
    err = sys.stderr
    print(f"BLAS: {mlx_spec.BLAS.describe()}", file=err)
    load = load_config(args)
    if load.no_draft:
        raise BadRequest("nothing to tune with --no-draft: the block size is a drafter setting")
    cands = None
    if args.candidates:
        try:
            cands = sorted({int(x) for x in args.candidates.split(",") if x.strip()})
        except ValueError:
            cands = []
        if not cands or min(cands) < 2:
            raise BadRequest(f"--candidates wants block sizes >= 2 (got '{args.candidates}')")
    if args.budget is not None and not args.budget > 0:
        raise BadRequest(f"--budget must be a positive number of seconds (got {args.budget:g})")
    budget = args.budget or DEFAULT_BUDGET_S
    pair = open_session(load, log=lambda m: print(m, file=err), tuning="none").pair
    if pair.drafter is None and not pair.chains:
        raise BadRequest(
            f"nothing to tune: --draft {load.draft} loads no DFlash drafter and no chain drafter (lookup "
            "drafts have no pass to time; the policy prices them from the models' sizes)"
        )
    bar = Bar(err, "tuning")
    result = tune(pair, budget_s=budget, progress=bar, tokens=args.tokens, candidates=cands)
    bar.close()
    path = save_result(result)
    if args.json:
        print(json.dumps(result.as_dict() | {"path": str(path)}))
        return 0
    heads = "".join(f" | {SOURCE_NAMES[k]} {v}" for k, v in pair.chain_ids.items())
    print(
        f"target {pair.target_id}"
        + (f" | drafter {pair.drafter_id}" if pair.drafter is not None else "")
        + heads
        + f" | prompts {', '.join(result.prompt_kinds)} | {result.tokens_per_run} tokens per run | {result.timing}"
    )
    print(table(result))
    if pair.drafter is not None:
        best = (
            "off: fixed-block DFlash does not pay (--no-adaptive runs plain; the default per-cycle engine "
            "starts DFlash resting and keeps its lookup drafts)"
            if result.best == 1
            else f"block size {result.best}"
        )
    else:
        best = (
            "off: no chain drafter beats plain decoding here (the per-cycle engine starts its chains "
            "resting, probing them now and then, and keeps its lookup drafts)"
            if result.best == 1
            else f"{result.chosen} first (the per-cycle policy starts from each drafter's line below)"
        )
    best += f", {result.threads} BLAS thread{'s' if result.threads != 1 else ''}" if result.threads else ""
    for kind, c in result.chains.items():
        print(chain_line(kind, c))
    print(f"\nchoice: {best} — {result.source}\nwhy: {result.why}")
    print(context_line(result))
    print(f"stored: {path}")
    return 0


def chain_line(kind: str, c: dict) -> str:
    """What the tuner chose for one chain drafter: its head pass, acceptance, depth, the model's
    speedup and, where it raced, the race's against plain decoding."""
    acc = ", ".join(f"{a:.2f}" for a in c["acceptance_by_position"][: c["depth"] + 2])
    raced = (
        f", raced x{c['speedup']:.2f} over plain ({c['rounds']} rounds)"
        if c.get("speedup") is not None
        else ", not raced"
        if "speedup" in c
        else ""
    )
    return (
        f"{SOURCE_NAMES[kind]}: one pass {c['pass_ms']:.2f} ms, acceptance by position {acc}, ...; "
        f"depth {c['depth']} (model x{c['predicted']:.2f}{raced})"
    )


def context_line(result) -> str:
    """What the per-cycle policy prices long contexts with: the stored curve's context term."""
    c = result.costs
    if c is None or not c.ctx_ms:
        why = (result.phases or {}).get("context_term")
        return "context term: not measured" + (
            " (the budget could not afford a long prefill)" if why == "budget" else ""
        )
    terms = ", ".join(f"{'T1' if B == 1 else f'Tt({B})'} +{v:.1f}" for B, v in sorted(c.ctx_ms.items()))
    drafts = ", ".join(f"Td({B}) +{v:.1f}" for B, v in sorted(c.ctx_draft_ms.items()))
    n = (result.phases or {}).get("context_tokens")
    return f"context term (ms a pass gains per 1000 tokens, timed at {c.context} and {n} tokens): {terms}" + (
        f"; {drafts}" if drafts else ""
    )
