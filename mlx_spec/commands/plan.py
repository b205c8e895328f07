"""`mlx_spec plan`: the memory plan of a pair, computed from its files before anything loads."""

from __future__ import annotations

import json

from ..cli import add_model_args, load_config
from ..errors import MlxSpecError
from ..session import plan_session


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="plan for a prompt of N tokens (default: the whole context arrives as one prompt)",
    )
    p.add_argument("--prefix-cache-mb", type=float, default=0, help="budget for reused prompt caches, MiB")
    p.add_argument(
        "--budget-gb", type=float, default=None, help="plan against this budget (GiB) instead of this machine's"
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="plan one machine of a group of N the target is sharded over (mlx.launch; "
        "docs/distributed.md); the notes say how many machines of this budget the pair needs",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args) -> int:
    """Print the plan; exit 1 when it does not fit the budget."""
    planned = plan_session(load_config(args), enforce=False)
    plan, drafter, block = planned.plan, planned.drafter, planned.block
    if plan is None:
        raise MlxSpecError(f"no memory plan for target {args.target}: {planned.plan_error}")
    engine = None
    if drafter is not None:  # the block size loading would run, and where it comes from
        engine = {
            "block_size": None if block is None or block.off else block.block_size,
            "block_size_source": block.source if block else "known after loading (a hub drafter)",
            "plain": bool(block and block.off),
        }
    if args.json:
        print(
            json.dumps(
                {
                    "target": args.target,
                    "drafter": drafter,
                    "quantization": planned.quant.as_dict(),
                    "engine": engine,
                    "chains": {k: v or "in the target" for k, v in (planned.chains or {}).items()},
                    **plan.as_dict(),
                },
                indent=2,
            )
        )
    else:
        heads = "".join(
            f", {'MTP head ' + (v or 'in the target') if k == 'mtp' else 'EAGLE-3 drafter ' + str(v)}"
            for k, v in (planned.chains or {}).items()
        )
        print(
            f"target {args.target}" + (f", drafter {drafter}" if drafter else "" if heads else " (no drafter)") + heads
        )
        if engine is not None:
            print(
                "engine: "
                + (
                    f"plain decoding ({engine['block_size_source']}); planned at the "
                    f"checkpoint's block {plan.block_size}"
                    if engine["plain"]
                    else f"block size {plan.block_size} ({engine['block_size_source']})"
                )
            )
        print(plan.table())
        if not plan.fits:
            print(f"\ndoes not fit: lower --context (max {plan.max_context}) or quantize (--target-bits 4)")
    return 0 if plan.fits else 1
