"""Open the pair a command asked for: defaults, refusals, and the block size's provenance.

Shared by generate, chat, serve, bench, tune and verify, so every command resolves the same
way: the bundled drafter goes with the default target; any other target needs ``--drafter``
or ``--no-draft``; nothing falls back to plain decoding on its own.
"""

from __future__ import annotations

from typing import Callable

from .default_target import DEFAULT_TARGET_ID
from .errors import MlxSpecError
from .loading import DEFAULT_DRAFTER, MODELS_DIR, Pair, load_pair


def drafter_for(target: str, drafter: str | None, no_draft: bool) -> str | None:
    if no_draft:
        return None
    if drafter is not None:
        return drafter
    if target == DEFAULT_TARGET_ID:
        if not (MODELS_DIR / DEFAULT_DRAFTER).exists():
            raise MlxSpecError(
                f"the bundled drafter models/{DEFAULT_DRAFTER} is missing from this install; "
                "pass --drafter PATH, or --no-draft for plain decoding")
        return str(MODELS_DIR / DEFAULT_DRAFTER)
    raise MlxSpecError(f"no drafter for target '{target}': pass --drafter PATH_OR_REPO, "
                       "or --no-draft for plain decoding")


def open_pair(args, log: Callable[[str], None] = lambda m: None) -> Pair:
    """Plan memory (print the one-line summary; PlanError over budget unless --force), then load."""
    from . import memory

    drafter = drafter_for(args.target, args.drafter, args.no_draft)
    try:
        quant, plan = memory.plan_from_args(args, drafter)
    except (OSError, ValueError, KeyError, TypeError, MlxSpecError) as e:
        # A malformed checkpoint: loading below names the problem better than the plan can.
        quant, plan = memory.quant_from_args(args, drafter, None), None
        log(f"memory plan unavailable ({type(e).__name__}: {e}); loading without one")
    if plan is not None:
        log(plan.summary())
        memory.check(plan, force=getattr(args, "force", False), warn=log)
    memory.set_wired_limit()
    log(f"loading target {args.target}" + (f" + drafter {drafter}" if drafter else " (no drafter: --no-draft)")
        + f" ({quant.describe()})")
    return load_pair(args.target, drafter, no_draft=args.no_draft, target_bits=quant.target_bits,
                     drafter_bits=quant.drafter_bits, group_size=quant.group_size,
                     draft_vocab=getattr(args, "draft_vocab", None) or "auto")


def resolve_block_size(pair: Pair, args, progress=None) -> tuple[int | None, str | None]:
    """(block size, source): --block-size flag, else the tuner's stored result for this machine
    and pair (tuning it first, once, if there is none), else with --no-tune the checkpoint's.

    A block size of 1 means the tuner chose "off": plain decoding (the source says why).
    ``progress(done, total, note)`` shows the first-launch tuning; default: a bar on stderr.
    """
    if pair.drafter is None:
        return None, None
    if getattr(args, "block_size", None) is not None:
        return args.block_size, "flag"
    from .tuner import ensure_tuned

    if progress is None:
        import sys

        from .bench import ProgressBar

        bar = ProgressBar(sys.stderr, "tuning block size (first launch; --block-size N or --no-tune skip it)")
        try:
            return ensure_tuned(pair, args, bar)
        finally:
            bar.close()
    return ensure_tuned(pair, args, progress)
