"""`mlx_spec models`: the known target + drafter pairs (``--model NAME``), whether each fits this
machine and whether it is already downloaded. Nothing is fetched: downloads are found in the
local Hugging Face cache; a pair on disk gets its real memory plan, one not downloaded an estimate
from its parameter count (marked ``~``); ``mlx_spec plan --model NAME`` plans one from the hub's
metadata without downloading it."""

from __future__ import annotations

import json

from .. import catalog, hub, memory
from ..config import LoadConfig
from ..default_target import cache_dir
from ..errors import BadRequest, MlxSpecError
from ..loading import MODELS_DIR

GiB = 2**30


def add_arguments(p) -> None:
    p.add_argument(
        "--target-bits",
        choices=("4", "8", "none"),
        default="4",
        help="target precision the fit is judged at (4-bit is the usual choice on a Mac)",
    )
    p.add_argument("--context", type=int, default=4096, help="context the memory plan must fit")
    p.add_argument(
        "--budget-gb", type=float, default=None, help="judge against this budget (GiB) instead of this machine's"
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")


def run(args) -> int:
    if args.context < 2:
        raise BadRequest(f"--context must be >= 2 (got {args.context})")
    if args.budget_gb is not None and not args.budget_gb > 0:
        raise BadRequest(f"--budget-gb must be > 0 (got {args.budget_gb:g})")
    budget = (int(args.budget_gb * GiB), "--budget-gb") if args.budget_gb else memory.device_budget()
    rows = [row(e, args, budget) for e in catalog.load().values()]
    chain = [chain_row(e, args, budget) for e in catalog.load_chain().values()]
    if args.json:
        print(
            json.dumps(
                {
                    "budget": budget[0],
                    "budget_source": budget[1],
                    "context": args.context,
                    "target_bits": args.target_bits,
                    "models": rows,
                    "chain": chain,
                },
                indent=2,
            )
        )
        return 0
    cols = [
        ("name", "NAME"),
        ("architecture", "ARCH"),
        ("dflash", "DFLASH"),
        ("block_size", "BLOCK"),
        ("thinks", "THINKS"),
        ("size", "SIZE"),
        ("fits", "FITS"),
        ("downloaded", "DOWNLOADED"),
        ("license", "LICENSE"),
    ]
    table = [[h for _, h in cols]] + [[cell(r, k) for k, _ in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print(
        f"\nfits: at --target-bits {args.target_bits}, context {args.context}, against "
        f"{budget[0] / GiB:.1f} GiB ({budget[1]}); '~' = estimated from the parameter count (not downloaded: "
        "`mlx_spec plan --model NAME` plans from the hub's metadata, no weights fetched). "
        "Use a pair with `--model NAME` on any command."
    )
    if chain:
        print_chain(chain)
    return 0


def print_chain(chain: list[dict]) -> None:
    """The chain drafters' table (MTP heads inside their targets, published EAGLE-3 drafters)."""
    cols = [
        ("name", "CHAIN DRAFTER"),
        ("kind", "KIND"),
        ("architecture", "ARCH"),
        ("target", "TARGET"),
        ("drafter", "DRAFTER"),
        ("layout", "LAYOUT"),
        ("size", "SIZE"),
        ("fits", "FITS"),
        ("license", "LICENSE"),
    ]
    table = [[h for _, h in cols]] + [[chain_cell(r, k) for k, _ in cols] for r in chain]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    print()
    for line in table:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print(
        "\nchain drafters: MTP heads ship inside the target's original repo (conversions that strip mtp.* are "
        "refused); SIZE is the target's, estimated from its parameter count; '~' marks what is as published, "
        "unchecked (no repo here was opened); the head's own weights and K/V are counted in the plan from its "
        "config. Run one by name: --model NAME (the target and its head; `mlx_spec plan --model NAME` first). "
        "See docs/chain-drafters.md."
    )


def chain_cell(r: dict, key: str) -> str:
    v = r[key]
    if key == "drafter":
        return v or "(in the target)"
    if key == "size":
        return f"~{v / GiB:.1f} GiB"
    if key in ("layout", "architecture", "license") and key in r["approximate"]:
        return f"~{v}"
    return str(v)


def chain_row(e, args, budget) -> dict:
    """One chain entry as plain values, with the target's size estimated from its parameter count."""
    bits = None if args.target_bits == "none" else int(args.target_bits)
    need = int(e.params_b * 1e9 * (16 if not bits else bits + 0.5) / 8 * 1.1)
    fits = ("~yes" if need <= budget[0] else "~no") if e.supported else f"unsupported ({e.architecture})"
    return {
        "name": e.name,
        "kind": e.kind,
        "target": e.target,
        "drafter": e.drafter,
        "architecture": e.architecture,
        "layout": e.layout,
        "license": e.license,
        "params_b": e.params_b,
        "approximate": list(e.approximate),
        "size": need,
        "size_approximate": True,
        "fits": fits,
        "source": e.source,
        "notes": e.notes,
    }


def cell(r: dict, key: str) -> str:
    v = r[key]
    if key in ("dflash", "block_size") and key in r["approximate"]:
        return f"~{v}"
    if key == "thinks":
        return "yes" if v else "no"
    if key == "size":
        return f"~{v / GiB:.1f} GiB" if r["size_approximate"] else f"{v / GiB:.1f} GiB"
    return str(v)


def row(e, args, budget) -> dict:
    """One entry as plain values: what the catalog says, where it is, whether it fits."""
    where = downloaded(e)
    out = {
        "name": e.name,
        "target": e.target,
        "drafter": e.drafter,
        "architecture": e.architecture,
        "dflash": e.dflash,
        "block_size": e.block_size,
        "thinks": e.thinks,
        "think_switch": e.think_switch,
        "license": e.license,
        "params_b": e.params_b,
        "approximate": list(e.approximate),
        "downloaded": where["status"],
        "notes": e.notes,
    }
    bits = None if args.target_bits == "none" else int(args.target_bits)
    plan = None
    if e.supported and where["target"] and where["drafter"]:
        plan = planned(where["target"], where["drafter"], args)
    if plan is not None:
        out.update(
            size=plan.total, size_approximate=False, fits="yes" if plan.fits else "no", max_context=plan.max_context
        )
    else:
        need = int(e.weight_bytes(bits) * 1.1)  # weights + ~10% for caches and scratch at short context
        out.update(size=need, size_approximate=True, fits="~yes" if need <= budget[0] else "~no", max_context=None)
    if not e.supported:
        out["fits"] = f"unsupported ({e.architecture})"
    return out


def downloaded(e) -> dict:
    """{"status": "yes" | "no" | "target only" | "drafter only" | "bundled", "target", "drafter"}: local
    folders of a complete download (huggingface-hub's cache; no network)."""
    if e.bundled:
        targets = sorted((cache_dir() / "models").glob(f"{e.target}-*/config.json"))
        drafter = MODELS_DIR / e.drafter
        t = targets[0].parent if targets else None
        return {
            "status": "bundled" + ("" if t else " (target converted on first use)"),
            "target": t,
            "drafter": drafter if drafter.exists() else None,
        }
    t, d = hub.local_snapshot(e.target), hub.local_snapshot(e.drafter)
    status = {(True, True): "yes", (True, False): "target only", (False, True): "drafter only", (False, False): "no"}[
        (t is not None, d is not None)
    ]
    return {"status": status, "target": t, "drafter": d}


def planned(target, drafter, args):
    """The memory plan of a pair on disk at the listing's bits, context and budget (None if its
    files cannot be read: then the estimate stands)."""
    cfg = LoadConfig(
        target=str(target),
        drafter=str(drafter),
        target_bits=args.target_bits,
        context=args.context,
        budget=int(args.budget_gb * GiB) if args.budget_gb else None,
    )
    try:
        return memory.plan_for_config(cfg, str(drafter))[1]
    except (OSError, ValueError, KeyError, TypeError, MlxSpecError):
        return None
