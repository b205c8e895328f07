"""`mlx_spec plan`: the memory plan of a pair, computed from its files before anything loads."""

from __future__ import annotations

import json

from ..cli import add_model_args


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="plan for a prompt of N tokens (default: the whole context arrives as one prompt)")
    p.add_argument("--prefix-cache-mb", type=float, default=0, help="budget for reused prompt caches, MiB")
    p.add_argument("--budget-gb", type=float, default=None,
                   help="plan against this budget (GiB) instead of this machine's")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args) -> int:
    """Print the plan; exit 1 when it does not fit the budget."""
    from .. import memory
    from ..pair import drafter_for

    drafter = drafter_for(args.target, args.drafter, args.no_draft)
    quant, plan = memory.plan_from_args(args, drafter)
    if args.json:
        print(json.dumps({"target": args.target, "drafter": drafter, "quantization": quant.as_dict(),
                          **plan.as_dict()}, indent=2))
    else:
        print(f"target {args.target}" + (f", drafter {drafter}" if drafter else " (no drafter)"))
        print(plan.table())
        if not plan.fits:
            print(f"\ndoes not fit: lower --context (max {plan.max_context}) or quantize (--target-bits 4)")
    return 0 if plan.fits else 1
