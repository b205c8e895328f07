"""`mlx_spec` command line. Each subcommand lives in mlx_spec/commands/<name>.py and exposes
``add_arguments(parser)`` and ``run(args) -> int``; they are imported lazily so ``--help`` is
fast and a broken optional command cannot break the others."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__
from .backend import unsupported_platform
from .errors import BadRequest, MlxSpecError

COMMANDS = {
    "generate": "generate text with speculative decoding (or --no-draft)",
    "chat": "terminal chat UI with live speculation stats",
    "serve": "OpenAI-compatible local server",
    "status": "show a detached server",
    "stop": "stop a detached server",
    "bench": "side-by-side speed benchmark",
    "tune": "tune the block size for this machine",
    "plan": "memory plan for a pair",
    "models": "known target + drafter pairs: --model NAME, fits, downloaded",
    "verify": "losslessness check: speculative vs plain greedy output",
    "convert": "convert a GGUF file to an MLX model directory",
    "train": "build data for and train a DFlash 2 drafter",
    "cache": "the disk prefix cache: list or clear the stored prefixes",
    "doctor": "a report of this machine to send us: backend, precision, costs, acceptance",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the text already names it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_model_args(
    p: argparse.ArgumentParser, *, tuning: bool = True, context: bool = True, sized_context: str | None = None
) -> None:
    """Flags shared by every command that loads a pair. ``tuning=False`` (the tune command
    itself) leaves out the flags that skip or budget first-launch tuning; ``context=False``
    (bench, whose --context lists lengths to pad prompts to) leaves out --context;
    ``sized_context``: the help of a --context the command sizes itself when it is not given
    (serve: from the memory plan), whose default is then None."""
    from .default_target import DEFAULT_TARGET_ID  # (startup: --help loads no MLX)
    from .loading import DEFAULT_DRAFTER  # (startup: --help loads no MLX)

    p.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="a known pair by name (`mlx_spec models` lists them): fills --target and --drafter",
    )
    p.add_argument("--target", default=DEFAULT_TARGET_ID, help="target model: path, HF repo id, or the default id")
    p.add_argument(
        "--drafter",
        default=None,
        help=f"DFlash / DFlash 2 drafter: path or HF repo id (default: bundled {DEFAULT_DRAFTER} with the default target)",  # noqa: E501
    )
    p.add_argument("--no-draft", action="store_true", help="plain decoding of the target (no speculation)")
    from .config import DEFAULT_DRAFT  # (startup: --help loads no MLX)

    p.add_argument(
        "--draft",
        default=None,
        metavar="SOURCES",
        help="draft sources the per-cycle policy may use, comma-separated: dflash, mtp (the "
        "target's multi-token-prediction head), eagle (an EAGLE-3 drafter), lookup; or auto = "
        f"every source the pair has (default: {DEFAULT_DRAFT}; docs/drafters.md)",
    )
    p.add_argument(
        "--mtp",
        default=None,
        metavar="PATH",
        help="a folder with the MTP head's mtp.* tensors (default: the target's own checkpoint folder)",
    )
    p.add_argument(
        "--eagle",
        default=None,
        metavar="PATH",
        help="an EAGLE-3 drafter: a checkpoint folder or a catalog name (`mlx_spec models`)",
    )
    if tuning:
        p.add_argument("--block-size", type=int, default=None, help="block size incl. the anchor (skips tuning)")
    bits = ("4", "8", "none")
    p.add_argument(
        "--target-bits",
        choices=bits,
        default=None,
        help="quantize the target at load (default: as the checkpoint is; float32 on CPU)",
    )
    p.add_argument(
        "--drafter-bits",
        choices=bits,
        default=None,
        help="quantize the drafter at load (default: the target's bits on Apple Silicon, float32 on CPU)",
    )
    p.add_argument("--group-size", type=int, default=None, help="quantization group size (default 64)")
    p.add_argument(
        "--draft-vocab",
        choices=("auto", "full"),
        default="auto",
        help="auto: draft over the drafter's reduced vocabulary when it ships one "
        "(draft_vocab.json; a cheaper draft head, same output); full: the whole head",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        default=None,
        help="quantize the target's K/V cache to 4 or 8 bits (mlx-lm's QuantizedKVCache; counted in the "
        "memory plan; output identical to plain decoding with the same setting; not for hybrid targets)",
    )
    p.add_argument(
        "--kv-group-size", type=int, choices=(32, 64, 128), default=64, help="K/V quantization group size (default 64)"
    )
    p.add_argument(
        "--draft-window",
        type=int,
        default=None,
        metavar="N",
        help="the DFlash drafter attends over the last N target positions only (its context cache "
        "bounded: memory and draft cost at long context); output unchanged; 0: every position "
        "(default: the bundled drafter 512, others every position; docs/context.md)",
    )
    if context and sized_context is not None:
        p.add_argument("--context", type=int, default=None, help=sized_context)
    elif context:
        p.add_argument(
            "--context", type=int, default=4096, help="context length the memory plan must fit (default 4096)"
        )
    p.add_argument("--force", action="store_true", help="start even when the memory plan exceeds the budget")
    if tuning:
        p.add_argument(
            "--no-tune",
            action="store_true",
            help="no first-launch tuning: use the checkpoint's block size unless --block-size",
        )
        p.add_argument(
            "--tune-budget", type=float, default=None, help="first-launch tuning time budget, s (default 90)"
        )
    p.add_argument(
        "--no-adaptive",
        action="store_true",
        help="turn the per-cycle drafting policy off: every cycle drafts the fixed block with the "
        "DFlash drafter (by default each cycle is a plain step, a DFlash draft or a lookup "
        "draft, whichever pays; docs/tuner.md)",
    )
    p.add_argument("--adaptive", action="store_true", help=argparse.SUPPRESS)  # the default now; accepted, no-op
    p.add_argument(
        "--think",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="thinking models: turn reasoning on or off through the chat template's switch "
        "(enable_thinking) (default: the catalog entry's, else the template's own)",
    )


def apply_model_name(args: argparse.Namespace) -> None:
    """``--model NAME``: fill --target and --drafter (and --think's default) from the catalog, before
    anything reads the flags; a chain entry fills --target and --mtp / --eagle (``_apply_chain``).
    An unknown name, a name given with a different --target/--drafter, or an architecture this
    build cannot run is refused here, before any download."""
    name = getattr(args, "model", None)
    if not name:
        return
    from . import catalog  # (startup: --help loads no MLX)
    from .default_target import DEFAULT_TARGET_ID  # (startup: --help loads no MLX)

    entry = catalog.find(name)
    if isinstance(entry, catalog.ChainEntry):
        return _apply_chain(args, entry)
    catalog.check_supported(entry)
    if args.target not in (DEFAULT_TARGET_ID, entry.target):
        raise BadRequest(f"--model {name} is target {entry.target}; drop --target {args.target} (or --model)")
    if getattr(args, "drafter", None) not in (None, entry.drafter):
        raise BadRequest(
            f"--model {name} comes with drafter {entry.drafter}; drop --drafter {args.drafter} "
            "(or pass --target and --drafter without --model)"
        )
    # the embedded pair: the default target's own drafter path (so stored tuning results match)
    args.target, args.drafter = entry.target, None if entry.bundled else entry.drafter
    if getattr(args, "think", None) is None and entry.think_switch == "enable_thinking":
        args.think = entry.thinks


def _apply_chain(args: argparse.Namespace, entry) -> None:
    """``--model NAME`` of a chain entry: --target is the entry's target, and the head it names
    drafts: an MTP head from the target's own checkpoint (--mtp stays unset), an EAGLE-3 drafter
    from its repo (--eagle). --draft defaults to that source and lookup (dflash first when a
    --drafter is given); one given must draft with it. Refused by name before any download: an
    entry the loader cannot run (``catalog.check_chain``), a different --target, --mtp or --eagle."""
    from . import catalog  # (startup: --help loads no MLX)
    from .config import parse_draft  # (startup: --help loads no MLX)
    from .default_target import DEFAULT_TARGET_ID  # (startup: --help loads no MLX)

    catalog.check_chain(entry)
    name, kind = entry.name, entry.kind
    if args.target not in (DEFAULT_TARGET_ID, entry.target):
        raise BadRequest(f"--model {name} is target {entry.target}; drop --target {args.target} (or --model)")
    what = "its MTP head in the target's own checkpoint" if kind == "mtp" else f"EAGLE-3 drafter {entry.drafter}"
    for flag in ("mtp", "eagle"):
        given = getattr(args, flag, None)
        if given is not None and not (flag == kind == "eagle" and given in (entry.drafter, name)):
            raise BadRequest(f"--model {name} drafts with {what}; drop --{flag} {given} (or --model)")
    draft = getattr(args, "draft", None)
    if getattr(args, "no_draft", False):  # plain decoding of the entry's target: nothing drafts
        pass
    elif draft is None:
        args.draft = ("dflash," if getattr(args, "drafter", None) else "") + f"{kind},lookup"
    elif parse_draft(draft) != ("auto",) and kind not in parse_draft(draft):
        raise BadRequest(
            f"--model {name} drafts with {kind}: --draft {draft} leaves it out (add {kind}, or drop --draft)"
        )
    args.target = entry.target
    if kind == "eagle" and not getattr(args, "no_draft", False):
        args.eagle = entry.drafter


def think_kwargs(args: argparse.Namespace) -> dict | None:
    """The chat-template variables for --think / --no-think (None: the template's default)."""
    think = getattr(args, "think", None)
    return None if think is None else {"enable_thinking": bool(think)}


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, what: str = "the reply") -> None:
    """--max-tokens and the sampling flags of generate and chat."""
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens in {what}")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probabilities sum to P (1 = all)",
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: a fresh one)")


DEFAULT_PREFIX_CACHE_MB = 256


def add_prefix_cache_arg(
    p: argparse.ArgumentParser, default: float | None = DEFAULT_PREFIX_CACHE_MB, help: str | None = None
) -> None:
    """For long-lived engines (chat, serve): K/V kept between turns and requests. ``default``
    None with its ``help``: the command sizes it when it is not given (serve)."""
    if default is None and help is None:
        raise ValueError("a --prefix-cache-mb without a default needs a help that says how it is sized")
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=default,
        help=help
        or f"K/V kept between turns/requests so a shared prefix is not prefilled again; "
        f"counted in the memory plan (MiB, default {default:g}; 0 = off)",
    )


DEFAULT_PREFIX_DISK_MB = 4096
DEFAULT_PREFIX_DISK_MIN_TOKENS = 1024


def add_prefix_disk_args(p: argparse.ArgumentParser) -> None:
    """For servers: long prefixes also kept on disk, so they survive a restart (docs/context.md)."""
    p.add_argument(
        "--prefix-disk-mb",
        type=float,
        default=DEFAULT_PREFIX_DISK_MB,
        help="disk space for prompt prefixes kept across restarts, least recently used deleted "
        "first (MiB, all models together; 0 = off; `mlx_spec cache list|clear`)",
    )
    p.add_argument(
        "--prefix-disk-min-tokens",
        type=int,
        default=DEFAULT_PREFIX_DISK_MIN_TOKENS,
        help="shortest prompt prefix written to disk (tokens)",
    )


def prefix_disk_of(args: argparse.Namespace):
    """The ``prefix_store.DiskConfig`` of --prefix-disk-mb / --prefix-disk-min-tokens (None: off)."""

    mb, least = getattr(args, "prefix_disk_mb", 0) or 0, getattr(args, "prefix_disk_min_tokens", 1)
    if mb < 0:
        raise BadRequest(f"--prefix-disk-mb must be >= 0 (got {mb:g})")
    if least < 1:
        raise BadRequest(f"--prefix-disk-min-tokens must be >= 1 (got {least})")
    if not mb:
        return None
    from .prefix_store import DiskConfig, default_root  # (startup: --help loads no MLX)

    return DiskConfig(default_root(), int(mb * 2**20), least)


LAUNCH_DESTS = ("ranks", "hosts", "hostfile", "backend", "ring_port")


def add_launch_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--ranks/--hosts/--hostfile/--backend/--ring-port``: run ``what`` on a group that
    mlx_spec starts with mlx.launch itself (docs/distributed.md)."""
    g = p.add_argument_group(f"a target sharded over a group (mlx_spec runs mlx.launch: {what})")
    g.add_argument(
        "--ranks",
        type=int,
        default=None,
        metavar="N",
        help="processes in the group: N on this machine (127.0.0.1), or checked against "
        "--hosts/--hostfile (default: one process, no group)",
    )
    g.add_argument(
        "--hosts",
        default=None,
        metavar="H1,H2",
        help="one rank per host, in rank order (mlx.launch --hosts; the ring wants IPs)",
    )
    g.add_argument("--hostfile", default=None, metavar="FILE", help="mlx.launch hostfile (JSON), one rank per host")
    g.add_argument(
        "--backend",
        default=None,
        help="mlx.launch backend: ring (TCP) or jaccl (RDMA over Thunderbolt) (default: the hostfile's, else ring)",
    )
    g.add_argument(
        "--ring-port",
        type=int,
        default=None,
        metavar="P",
        help="the ring's first port, one more per rank (default: free ports on 127.0.0.1, else mlx.launch's 32323)",
    )


def launch_of(args: argparse.Namespace):
    """The group ``add_launch_args`` flags ask for (``distributed.Launch``), None for one process."""
    from .distributed import launch_plan  # (startup: --help loads no MLX)

    return launch_plan(
        getattr(args, "ranks", None),
        getattr(args, "hosts", None),
        getattr(args, "hostfile", None),
        getattr(args, "backend", None),
        getattr(args, "ring_port", None),
    )


def flags_of(args: argparse.Namespace, parser: argparse.ArgumentParser, skip=()) -> list[str]:
    """The command line for the same settings: every non-default option of ``parser`` (its dest
    not in ``skip``), as a child process (``serve --detach``, a launched group) is given them."""
    skip = {"help", *skip}
    out, seen = [], set()
    for action in parser._actions:
        dest = action.dest
        if dest in skip or dest in seen or not action.option_strings or not hasattr(args, dest):
            continue
        seen.add(dest)
        value = getattr(args, dest)
        if value is None or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):  # --think / --no-think
            out.append(action.option_strings[0] if value else action.option_strings[1])
        elif action.nargs == 0:
            out.append(flag)
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def load_config(args: argparse.Namespace):
    """The command's model flags as a ``config.LoadConfig``: the one place flags become the
    loading configuration (it checks its values, so bad flags fail before anything loads).
    Flags a command does not have take LoadConfig's defaults."""
    from .config import DEFAULT_CONTEXT, DEFAULT_DRAFT, LoadConfig  # (startup: --help loads no MLX)

    def flag(name, default=None):
        return getattr(args, name, default)

    mb = flag("prefix_cache_mb", 0) or 0
    if mb < 0:
        raise BadRequest(f"--prefix-cache-mb must be >= 0 (got {mb:g})")
    gb = flag("budget_gb")
    if gb is not None and not gb > 0:
        raise BadRequest(f"--budget-gb must be > 0 (got {gb:g})")
    if flag("draft") and flag("no_draft", False):
        raise BadRequest(f"--no-draft and --draft {flag('draft')} ask for opposite things: give one")
    return LoadConfig(
        target=args.target,
        drafter=flag("drafter"),
        no_draft=bool(flag("no_draft", False)),
        block_size=flag("block_size"),
        target_bits=flag("target_bits"),
        drafter_bits=flag("drafter_bits"),
        group_size=flag("group_size"),
        draft_vocab=flag("draft_vocab") or "auto",
        context=flag("context") or DEFAULT_CONTEXT,
        prompt_tokens=flag("prompt_tokens"),
        budget=int(gb * 2**30) if gb else None,
        force=bool(flag("force", False)),
        tune=not flag("no_tune", False),
        tune_budget_s=flag("tune_budget"),
        adaptive=not flag("no_adaptive", False),
        draft=flag("draft") or DEFAULT_DRAFT,
        mtp=flag("mtp"),
        eagle=flag("eagle"),
        prefix_cache=int(mb * 2**20),
        ranks=flag("ranks") or 1,
        kv_bits=flag("kv_bits"),
        kv_group_size=flag("kv_group_size") or 64,
        draft_window=flag("draft_window"),
    )


def main(argv: list[str] | None = None) -> int:
    if (why := unsupported_platform()) is not None:  # an Intel Mac: no MLX was installed
        print(f"mlx_spec: {why}", file=sys.stderr)
        return 1

    parser = argparse.ArgumentParser(prog="mlx_spec", description="Lossless speculative decoding on MLX")
    parser.add_argument("--version", action="version", version=f"mlx_spec {__version__}")
    parser.add_argument("--verbose", action="store_true", help="log details (BLAS, plan, loading)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    # Only the chosen command's module is imported.
    wanted = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, help_ in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
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
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        apply_model_name(args)
        return modules[args.command].run(args) or 0
    except MlxSpecError as e:
        print(f"mlx_spec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
