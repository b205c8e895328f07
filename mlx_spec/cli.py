"""`mlx_spec` command line. Each subcommand lives in mlx_spec/commands/<name>.py and exposes
``add_arguments(parser)`` and ``run(args) -> int``; they are imported lazily so ``--help`` is
fast and a broken optional command cannot break the others."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import MlxSpecError

COMMANDS = {
    "generate": "generate text with speculative decoding (or --no-draft)",
    "chat": "terminal chat UI with live speculation stats",
    "serve": "OpenAI-compatible local server",
    "status": "show a detached server",
    "stop": "stop a detached server",
    "bench": "side-by-side speed benchmark",
    "tune": "tune the block size for this machine",
    "plan": "memory plan for a pair",
    "verify": "losslessness check: speculative vs plain greedy output",
    "convert": "convert a GGUF file to an MLX model directory",
    "train": "build data for and train a DFlash 2 drafter",
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a pair."""
    from .loading import DEFAULT_DRAFTER
    from .default_target import DEFAULT_TARGET_ID

    p.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model: path, HF repo id, or the default id")
    p.add_argument("--drafter", default=None,
                   help=f"DFlash / DFlash 2 drafter: path or HF repo id (default: bundled {DEFAULT_DRAFTER} with the default target)")
    p.add_argument("--no-draft", action="store_true", help="plain decoding of the target (no speculation)")
    p.add_argument("--block-size", type=int, default=None, help="block size incl. the anchor (skips tuning)")
    bits = ("4", "8", "none")
    p.add_argument("--target-bits", choices=bits, default=None,
                   help="quantize the target at load (default: as the checkpoint is; float32 on CPU)")
    p.add_argument("--drafter-bits", choices=bits, default=None,
                   help="quantize the drafter at load (default: the target's bits on Apple Silicon, float32 on CPU)")
    p.add_argument("--group-size", type=int, default=None, help="quantization group size (default 64)")
    p.add_argument("--draft-vocab", choices=("auto", "full"), default="auto",
                   help="auto: draft over the drafter's reduced vocabulary when it ships one "
                        "(draft_vocab.json; a cheaper draft head, same output); full: the whole head")
    p.add_argument("--context", type=int, default=4096, help="context length the memory plan must fit (default 4096)")
    p.add_argument("--force", action="store_true", help="start even when the memory plan exceeds the budget")
    p.add_argument("--no-tune", action="store_true",
                   help="no first-launch tuning: use the checkpoint's block size unless --block-size")
    p.add_argument("--tune-budget", type=float, default=None, help="first-launch tuning time budget, s (default 90)")
    p.add_argument("--adaptive", action="store_true",
                   help="choose the block size every cycle (online controller over the tuned cost curve; "
                        "falls back to plain steps while drafting does not pay; docs/tuner.md)")


DEFAULT_PREFIX_CACHE_MB = 256


def add_prefix_cache_arg(p: argparse.ArgumentParser, default: float = DEFAULT_PREFIX_CACHE_MB) -> None:
    """For long-lived engines (chat, serve): K/V kept between turns and requests."""
    p.add_argument("--prefix-cache-mb", type=float, default=default,
                   help=f"K/V kept between turns/requests so a shared prefix is not prefilled again; "
                        f"counted in the memory plan (MiB, default {default:g}; 0 = off)")


def prefix_cache_bytes(args) -> int:
    from .errors import BadRequest

    mb = getattr(args, "prefix_cache_mb", 0) or 0
    if mb < 0:
        raise BadRequest(f"--prefix-cache-mb must be >= 0 (got {mb:g})")
    return int(mb * 2**20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx_spec", description="Lossless speculative decoding on MLX")
    parser.add_argument("--verbose", action="store_true", help="log details (BLAS, plan, loading)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    # Only the chosen command's module is imported.
    wanted = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, help_ in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == wanted:
            try:
                modules[name] = importlib.import_module(f"mlx_spec.commands.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"mlx_spec.commands.{name}":
                    raise
                print(f"mlx_spec {name}: not available in this version", file=sys.stderr)
                return 2
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    import logging

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return modules[args.command].run(args) or 0
    except MlxSpecError as e:
        print(f"mlx_spec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
