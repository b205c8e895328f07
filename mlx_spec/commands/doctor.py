"""`mlx_spec doctor`: what we need to know about a machine we have never seen, in under a minute.

Backend and device, the precision chosen for the target and the drafter (and why), the memory
budget, the pass costs T1 / Td(B) / Tt(B) for B up to 16 (few repeats: a shape, not a benchmark),
tau on three built-in prompts with the drafter's finiteness, the tuner's stored choice, and the
decode loop's host synchronisations per cycle where the loop counts them. Text, or ``--json``
to paste into a report (docs/mac.md).
"""

from __future__ import annotations

import json
import platform
import sys
import time

import mlx.core as mx
import mlx_lm

from .. import backend, costs, decode, prompts
from ..cli import add_model_args, load_config
from ..session import load, plan_session, stored_block

SIZES = (2, 4, 8, 12, 16)
PROMPT_IDS = ("code-1", "math-1", "prose-1")


def add_arguments(p) -> None:
    add_model_args(p, tuning=False)
    p.add_argument("--reps", type=int, default=2, help="timed rounds of each pass (after one warm-up)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt for tau")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _host_syncs(steps) -> float | None:
    """Host synchronisations per drafted cycle, if the decode loop reports them per step
    (``Step.host_syncs``); None where it does not."""
    counts = [getattr(s, "host_syncs", None) for s in steps if not s.prefill and s.drafted]
    counts = [c for c in counts if c is not None]
    return round(sum(counts) / len(counts), 2) if counts else None


def report(args) -> dict:
    t0 = time.perf_counter()
    b = backend.current()
    cfg = load_config(args)
    planned = plan_session(cfg, enforce=False)
    quant = planned.quant
    pair = load(planned)
    loaded_s = time.perf_counter() - t0
    out = {
        "mlx_spec_doctor": 1,
        "backend": b.as_dict(),
        "machine": {
            "os": f"{platform.system()} {platform.release()}",
            "arch": platform.machine(),
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
        },
        "target": cfg.target,
        "drafter": planned.drafter,
        "precision": {"chosen": quant.describe(), "why": quant.reason, **quant.as_dict()},
        "plan": None
        if planned.plan is None
        else {
            "total": planned.plan.total,
            "budget": planned.plan.budget,
            "budget_source": planned.plan.budget_source,
            "fits": planned.plan.fits,
        },
        "load_s": round(loaded_s, 1),
    }
    stored = stored_block(cfg, planned.drafter) if planned.drafter else None
    out["tuning"] = (
        None if stored is None else {"block_size": None if stored.off else stored.block_size, "source": stored.source}
    )
    if pair.drafter is None:
        out["elapsed_s"] = round(time.perf_counter() - t0, 1)
        return out
    ctx = prompts.builtin_prompts()[0].encode(pair.tokenizer)
    t = time.perf_counter()
    c = costs.measure_costs(pair.model, pair.target, pair.drafter, SIZES, ctx, reps=max(1, args.reps))
    out["costs"] = {
        "context": c.context,
        "t1_ms": c.t1_ms,
        "td_ms": {str(k): v for k, v in sorted(c.td_ms.items())},
        "tt_ms": {str(k): v for k, v in sorted(c.tt_ms.items())},
        "seconds": round(time.perf_counter() - t, 1),
    }
    block = stored.block_size if stored is not None and not stored.off else pair.drafter.args.block_size
    eos = tuple(pair.tokenizer.eos_token_ids)
    taus, steps_all = {}, []
    t = time.perf_counter()
    for p in (q for q in prompts.BUILTIN if q.id in PROMPT_IDS):
        steps = list(
            decode.spec_steps(
                pair.target,
                pair.drafter,
                p.encode(pair.tokenizer),
                block_size=block,
                max_tokens=args.max_tokens,
                eos_ids=eos,
            )
        )
        cyc = [s for s in steps if not s.prefill and s.drafted]
        taus[p.id] = round(sum(s.accepted + 1 for s in cyc) / len(cyc), 2) if cyc else None
        steps_all += steps
    pair.drafter.settle()
    out["acceptance"] = {
        "block_size": block,
        "max_tokens": args.max_tokens,
        "tau": taus,
        "drafter": pair.drafter.health().as_dict(),
        "seconds": round(time.perf_counter() - t, 1),
    }
    out["host_syncs_per_cycle"] = _host_syncs(steps_all)
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return out


def text(r: dict) -> str:
    b = r["backend"]
    lines = [
        f"backend      {b['kind']} on {b['device']}" + (" (faked: MLX_SPEC_BACKEND_AS)" if b["faked"] else ""),
        (
            f"budget       {b['budget'] / 2**30:.1f} GiB ({b['budget_source']}); wired limit "
            + (f"{b['wired_limit'] / 2**30:.1f} GiB" if b["wired_limit"] else "none")
        ),
        (
            f"machine      {r['machine']['os']} {r['machine']['arch']}, Python {r['machine']['python']}, "
            f"mlx {r['machine']['mlx']}, mlx-lm {r['machine']['mlx_lm']}"
        ),
        f"pair         {r['target']} + {r['drafter']}",
        f"precision    {r['precision']['chosen']}" + (f" ({r['precision']['why']})" if r["precision"]["why"] else ""),
    ]
    if r.get("plan"):
        p = r["plan"]
        lines.append(
            f"memory plan  {p['total'] / 2**30:.2f} of {p['budget'] / 2**30:.1f} GiB"
            + ("" if p["fits"] else " (does not fit)")
        )
    t = r.get("tuning")
    lines.append(
        "tuning       "
        + (
            "nothing stored for this pair and machine"
            if t is None
            else f"block {t['block_size'] or 'off'} ({t['source']})"
        )
    )
    if "costs" in r:
        c = r["costs"]
        lines.append(f"costs        at {c['context']} tokens of context: T1 {c['t1_ms']:.1f} ms")
        lines.append("             B      " + " ".join(f"{k:>7}" for k in c["tt_ms"]))
        lines.append("             Tt(B)  " + " ".join(f"{v:7.1f}" for v in c["tt_ms"].values()))
        lines.append("             Td(B)  " + " ".join(f"{c['td_ms'].get(k, 0):7.1f}" for k in c["tt_ms"]))
    if "acceptance" in r:
        a = r["acceptance"]
        d = a["drafter"]
        lines.append(
            f"tau          block {a['block_size']}, {a['max_tokens']} tokens: "
            + ", ".join(f"{k} {v}" for k, v in a["tau"].items())
        )
        lines.append(
            f"drafter      {d['passes']} passes, {d['nonfinite']} non-finite, activations {d['activations']}"
            + (f"; {d['fallback']}" if d["fallback"] else "")
        )
        hs = r.get("host_syncs_per_cycle")
        lines.append(
            "host syncs   " + ("not counted by this version's decode loop" if hs is None else f"{hs} per cycle")
        )
    lines.append(f"elapsed      {r['elapsed_s']} s (loading {r['load_s']} s)")
    return "\n".join(lines)


def run(args) -> int:
    r = report(args)
    print(json.dumps(r, indent=2) if args.json else text(r))
    sys.stdout.flush()
    return 0
