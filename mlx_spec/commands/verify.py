"""`mlx_spec verify`: greedy speculative output must equal greedy plain output, token for token.

Exit status: 0 when every prompt is identical or a numeric near tie, 1 on any mismatch.
"""

from __future__ import annotations

import json
import sys

from ..cli import add_model_args, load_config
from ..errors import BadRequest
from ..prompts import BUILTIN, load_prompts
from ..session import open_session
from ..verify import check


def add_arguments(p) -> None:
    add_model_args(p)
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="JSONL prompts, one object per line with 'prompt' or 'messages' (default: built-in set)",
    )
    p.add_argument(
        "--block-sizes",
        default=None,
        metavar="B,B,...",
        help="block sizes to check, e.g. 2,4,8 (default: the block size the engine would run: "
        "--block-size, else the stored tuning result, else the checkpoint's; never tunes)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="near-tie tolerance in logits (default: derived from the logits' dtype and size)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON report at the end")


def _sizes(args) -> tuple[int, ...] | None:
    if args.block_sizes is None:
        return None
    try:
        return tuple(int(x) for x in args.block_sizes.split(",") if x.strip())
    except ValueError:
        raise BadRequest(f"--block-sizes expects comma-separated integers (got {args.block_sizes!r})") from None


def run(args) -> int:
    load = load_config(args)
    if load.no_draft:
        raise BadRequest("verify compares speculative with plain decoding; it cannot run with --no-draft")
    sizes = _sizes(args)
    if sizes is not None and (not sizes or min(sizes) < 2):
        raise BadRequest(f"--block-sizes wants block sizes >= 2 (got {args.block_sizes!r})")
    prompts = load_prompts(args.prompts) if args.prompts else list(BUILTIN)
    # The block size the engine would run (the flag, else the stored tuning result, else the
    # checkpoint's); verify never tunes.
    session = open_session(load, log=lambda m: print(m, file=sys.stderr), tuning="stored")
    pair, info = session.pair, session.info
    if sizes is None:
        if pair.drafter is None:  # chain drafters alone: no DFlash block to take
            sizes, why = (4,), "chains of depth 3 (no DFlash drafter loaded; --block-sizes sets the depths + 1)"
        elif info.speculative:
            sizes, why = (info.block_size,), f"the engine's block size ({info.block_size_source})"
        else:  # the tuner chose plain decoding: check the checkpoint's block, and say so
            sizes = (pair.drafter.args.block_size,)
            why = f"the checkpoint's block size (the engine runs plain decoding: {info.block_size_source})"
        print(f"verify: block size {sizes[0]}: {why}", file=sys.stderr)
    n = len(prompts) * len(sizes) * ((pair.drafter is not None) + len(getattr(pair, "chains", None) or ()))
    print(f"verify: {n} runs, greedy, up to {args.max_tokens} tokens each", file=sys.stderr)
    report = check(
        pair,
        prompts,
        sizes,
        args.max_tokens,
        tol=args.tolerance,
        progress=None if args.json else (lambda r: print(r.describe(), flush=True)),
    )
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(report.summary())
    if not report.ok:
        print("verify: speculative decoding changed the output (see 'mismatch' above)", file=sys.stderr)
    return 0 if report.ok else 1
