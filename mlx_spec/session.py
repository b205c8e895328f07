"""One load path: ``LoadConfig`` -> checked names -> memory plan -> loaded pair -> block size ->
``Session``. Every command that loads a pair (generate, chat, serve, bench, tune, verify) calls
``open_session``; ``plan`` calls ``plan_session``, which stops before any weight loads.

The rules live here and nowhere else:

- names first: a target or drafter that does not exist, or a drafter directory whose config is
  not a drafter's, is refused before anything is planned, printed or loaded;
- the bundled drafter goes with the default target; any other target needs a drafter or
  ``no_draft``; nothing falls back to plain decoding on its own;
- the block size: ``block_size`` (the flag) wins; else, with ``tune`` off, the checkpoint's;
  else the tuner's stored result for this machine and pair (tuned once, now, if there is none).
  A tuner result of "off" gives ``mode`` "tuned-off" with ``--no-adaptive``; the per-cycle
  policy (the default) stays speculative with the result as its prior (``generation.engine_info``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import LoadConfig
from .default_target import DEFAULT_TARGET_ID
from .errors import BadRequest, CheckpointError, HubError, IncompatiblePair, MlxSpecError, UnsupportedModel
from .generation import EngineInfo, engine_info

log = logging.getLogger(__name__)

Log = Callable[[str], None]
Progress = Callable[[int, int, str], None]  # (done, total, note), as the tuner reports


@dataclass(frozen=True, slots=True)
class BlockChoice:
    """The block size a pair runs at and where it came from."""

    block_size: int
    source: str  # "flag" | "checkpoint (--no-tune)" | "tuned <date>" | ...
    off: bool = False  # the tuner found plain decoding faster: run plain (mode "tuned-off")
    pinned: bool = False  # the user gave it (--block-size): the per-cycle policy keeps it


@dataclass(frozen=True)
class Planned:
    """What a ``LoadConfig`` names, checked and planned; nothing loaded yet."""

    cfg: LoadConfig
    drafter: str | None  # the drafter to load (the bundled one filled in), None for plain decoding
    quant: Any  # quantize.QuantChoice
    plan: Any  # memory.MemoryPlan, or None when the plan could not read the checkpoint
    block: BlockChoice | None  # the block size loading would use, as far as known before loading
    plan_error: str | None = None  # why there is no plan


@dataclass(frozen=True)
class Session:
    """A loaded pair and what runs on it. ``context_length``: prompt + completion tokens a request
    may use (the configured context, capped at the target's trained context). The tool-call and
    reasoning formats are read from the tokenizer once, here."""

    pair: Any  # loading.Pair (MLX objects: use on the thread that loaded it)
    info: EngineInfo
    context_length: int | None = None
    plan: Any = None
    tool_format: Any = None  # text.ToolFormat | None
    think_format: Any = None  # thinking.ThinkFormat | None
    group: Any = None  # the mx.distributed group the target is sharded over (None: one process)

    @property
    def follower(self) -> bool:
        """A rank other than 0 of a group: it follows rank 0 (distributed.follow_session)."""
        return self.group is not None and self.group.rank() != 0

    @classmethod
    def of(cls, pair, info: EngineInfo, *, context: int | None = None, plan=None, group=None) -> Session:
        from .text import tool_format
        from .thinking import think_format

        trained = model_context_length(getattr(pair, "model", None))
        limits = [x for x in (context, trained) if x]
        tokenizer = getattr(pair, "tokenizer", None)
        return cls(
            pair, info, min(limits) if limits else None, plan, tool_format(tokenizer), think_format(tokenizer), group
        )


def model_context_length(model) -> int | None:
    """The target's trained context (``max_position_embeddings``), if its config says."""
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


# -- names ---------------------------------------------------------------------------------------


def _is_repo_id(ref: str) -> bool:
    return not ref.startswith((".", "/", "~")) and ref.count("/") == 1


def _local_dir(ref: str) -> Path | None:
    from .loading import MODELS_DIR

    p = Path(ref).expanduser()
    if p.exists():
        return p
    bundled = MODELS_DIR / ref
    return bundled if bundled.exists() else None


def check_names(cfg: LoadConfig) -> None:
    """Refuse a target or drafter that does not exist (nothing is downloaded or loaded here)."""
    refs = [("target", cfg.target)] + ([("drafter", cfg.drafter)] if cfg.drafter and not cfg.no_draft else [])
    for what, ref in refs:
        if what == "target" and ref == DEFAULT_TARGET_ID:
            continue
        local = _local_dir(ref)
        if local is None:
            if _is_repo_id(ref):
                continue  # a Hugging Face repo id: fetched (or refused by name) when loading
            raise MlxSpecError(
                f"{what} '{ref}' does not exist (not a directory, not a bundled model, not a Hugging Face repo id)"
            )
        if not local.is_dir():
            raise CheckpointError(f"{what} '{ref}' is a file, not a model directory")
        if not (local / "config.json").is_file():
            raise CheckpointError(f"{what} '{ref}' is not a model directory: no config.json in {local}")
        if what == "drafter":
            _check_drafter_config(ref, local)


def _check_drafter_config(ref: str, path: Path) -> None:
    from .drafter import DrafterArgs

    try:
        DrafterArgs.from_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"drafter '{ref}': {path / 'config.json'} is not a DFlash drafter config ({type(e).__name__}: {e})"
        ) from None


def drafter_for(cfg: LoadConfig) -> str | None:
    """The drafter to load: the flag's, the bundled one with the default target, None for
    ``no_draft``; any other target without a drafter is refused."""
    from .loading import DEFAULT_DRAFTER, MODELS_DIR

    if cfg.no_draft:
        return None
    if cfg.drafter is not None:
        return cfg.drafter
    if cfg.target == DEFAULT_TARGET_ID:
        if not (MODELS_DIR / DEFAULT_DRAFTER).exists():
            raise MlxSpecError(
                f"the bundled drafter models/{DEFAULT_DRAFTER} is missing from this install; "
                "pass --drafter PATH, or --no-draft for plain decoding"
            )
        return str(MODELS_DIR / DEFAULT_DRAFTER)
    raise MlxSpecError(
        f"no drafter for target '{cfg.target}': pass --drafter PATH_OR_REPO, or --no-draft for plain decoding"
    )


def check(cfg: LoadConfig) -> str | None:
    """Everything that can be checked before loading: the names, and the drafter they resolve
    to (returned). Commands that load on another thread (serve, chat) call it first."""
    check_names(cfg)
    return drafter_for(cfg)


# -- the plan ------------------------------------------------------------------------------------


def plan_session(cfg: LoadConfig, log: Log = lambda m: None, *, enforce: bool = True) -> Planned:
    """Check the names, choose the quantization and make the memory plan, from files only.

    ``enforce``: refuse a plan over budget (PlanError) unless ``cfg.force``; the ``plan`` command
    passes False and reports instead."""
    from . import memory

    drafter = check(cfg)
    block = stored_block(cfg, drafter)
    why = None
    try:
        quant, plan = memory.plan_for_config(cfg, drafter, block.block_size if block and not block.off else None)
    except (HubError, UnsupportedModel, IncompatiblePair):  # cannot be fetched, run or paired: say so now
        raise
    except (OSError, ValueError, KeyError, TypeError, MlxSpecError) as e:
        # A config the plan cannot read: loading below names the problem better than the plan can.
        quant, plan, why = memory.quant_for(cfg, drafter, None), None, f"{type(e).__name__}: {e}"
        log(f"memory plan unavailable ({why}); loading without one")
    if plan is not None and enforce:
        log(plan.summary())
        memory.check(plan, force=cfg.force, warn=log)
    return Planned(cfg, drafter, quant, plan, block, why)


def serve_sizing(cfg: LoadConfig, *, context: bool, prefix_cache: bool) -> tuple[LoadConfig, str | None]:
    """``serve``'s defaults, from the memory plan (``memory.serve_sizing``): with ``context`` (no
    --context given) the target's trained context, capped by the plan; with ``prefix_cache`` (no
    --prefix-cache-mb) a prefix cache sized from the plan's headroom. Returns the config to load
    and the sentence that says what was chosen and why (None when both were given). Without a plan
    (a config it cannot read) ``cfg``'s own values stay, and the sentence says so."""
    from dataclasses import replace

    from . import memory

    if not (context or prefix_cache):
        return cfg, None
    drafter = check(cfg)
    block = stored_block(cfg, drafter)
    size = block.block_size if block and not block.off else None
    try:
        sources = memory.config_sources(cfg, drafter)

        def plan_at(n: int, pc: int):
            return memory.plan_for_config(replace(cfg, context=n, prefix_cache=pc), drafter, size, sources)[1]

        s = memory.serve_sizing(
            plan_at,
            memory.target_dims(sources[0][0]).max_position,
            context=None if context else cfg.context,
            prefix_cache=None if prefix_cache else cfg.prefix_cache,
        )
    except (HubError, UnsupportedModel, IncompatiblePair):
        raise
    except (OSError, ValueError, KeyError, TypeError, MlxSpecError) as e:  # as plan_session: loading says more
        return cfg, (
            f"memory plan unavailable ({type(e).__name__}: {e}): context {cfg.context} tokens, "
            f"prefix cache {cfg.prefix_cache >> 20} MiB (the fixed defaults)"
        )
    return replace(cfg, context=s.context, prefix_cache=s.prefix_cache), s.why


def stored_block(cfg: LoadConfig, drafter: str | None) -> BlockChoice | None:
    """The block size loading would use, known before loading: the flag, the checkpoint with
    ``tune`` off, else the tuner's newest stored result for this machine, target and drafter;
    None when no drafter or only loading (or tuning) can tell."""
    if drafter is None:
        return None
    if cfg.block_size is not None:
        return BlockChoice(cfg.block_size, "flag", pinned=True)
    path = _local_dir(drafter)
    ckpt = _checkpoint_block(path) if path else None
    if not cfg.tune:
        return BlockChoice(ckpt, "checkpoint (--no-tune)") if ckpt else None
    result = _stored_result(cfg, drafter)
    if result is not None:
        return from_tuning(result)
    return BlockChoice(ckpt, "checkpoint; not tuned on this machine yet: the first load tunes") if ckpt else None


def _checkpoint_block(path: Path) -> int | None:
    from .drafter import DrafterArgs

    try:
        return DrafterArgs.from_config(json.loads((path / "config.json").read_text())).block_size
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stored_result(cfg: LoadConfig, drafter: str):
    """The newest stored tuning result whose machine, target and drafter match (the weights'
    identity, however the command spells them: ``tuning.same_models``); quantization and draft
    vocabulary are checked where they are known before loading."""
    from . import tuning
    from .default_target import cache_dir

    folder = cache_dir() / "tuning"
    if not folder.is_dir():
        return None
    machine, models = tuning.machine_info(), tuning.models_of(cfg.target, drafter)
    best = None
    for f in sorted(folder.glob("*.json")):
        try:
            result = tuning.TuneResult.from_dict(json.loads(f.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        key = result.key
        if result.format not in tuning.READ_FORMATS or key.get("machine") != machine:
            continue
        if not tuning.same_models(key, models):
            continue
        if cfg.target_bits in ("4", "8") and not key["target"].get("quant", "").startswith(f"q{cfg.target_bits}"):
            continue
        if cfg.draft_vocab == "full" and key["drafter"].get("draft_vocab") != "full":
            continue
        if best is None or result.date > best.date:
            best = result
    return best


def from_tuning(result) -> BlockChoice:
    """The block choice a ``tuning.TuneResult`` makes (``best == 1``: plain decoding, "tuned-off")."""
    return BlockChoice(result.block_size, result.source, off=result.best == 1)


# -- loading ----------------------------------------------------------------------------------------


TUNING = ("tune", "stored", "none")


def choose_block(
    pair,
    cfg: LoadConfig,
    progress: Progress | None = None,
    *,
    tuning: str = "tune",
    root: Path | None = None,
    tune_fn=None,
) -> BlockChoice | None:
    """The block size for a loaded pair (None without a drafter), by one rule: ``cfg.block_size``
    (the flag) wins; else with ``cfg.tune`` off the checkpoint's; else the tuner's stored result for
    this machine and pair. ``tuning``: "tune" tunes first (once) when nothing is stored; "stored"
    never tunes (the checkpoint's when nothing is stored: verify); "none" does not consult the
    tuner at all (bench and tune measure for themselves)."""
    from . import tuning as tuner  # (``tuning`` is this function's parameter)

    if tuning not in TUNING:
        raise ValueError(f"tuning must be one of {TUNING}, not {tuning!r}")
    if pair.drafter is None:
        return None
    ckpt = pair.drafter.args.block_size
    tunes = cfg.block_size is None and cfg.tune and tuning != "none"
    if not tunes or tuning == "stored":
        if tuning != "none":  # a stored choice of threads holds, whatever sets the block size
            result = tuner.load_result(tuner.tune_key(pair), root)
            tuner.apply_threads(result)
        if cfg.block_size is not None:
            return BlockChoice(cfg.block_size, "flag", pinned=True)
        if not tunes:
            return BlockChoice(ckpt, "checkpoint (--no-tune)" if not cfg.tune else "checkpoint")
        return (
            from_tuning(result)
            if result is not None
            else BlockChoice(ckpt, "checkpoint; not tuned on this machine yet")
        )
    kw = {"tune_fn": tune_fn} if tune_fn is not None else {}
    bar = None
    if progress is None:
        import sys

        from .progress import Bar

        progress = bar = Bar(sys.stderr, "tuning block size (first launch; --block-size N or --no-tune skip it)")
    try:
        result = tuner.ensure_tuned(pair, cfg.tune_budget_s, progress, root=root, **kw)
    finally:
        if bar is not None:
            bar.close()
    return from_tuning(result) if result is not None else BlockChoice(ckpt, "checkpoint (tuning skipped)")


def info_for(pair, choice: BlockChoice | None, adaptive: bool = False) -> EngineInfo:
    """The ``EngineInfo`` of a loaded pair at a block choice."""
    if choice is None:
        return engine_info(pair, adaptive=adaptive)
    return engine_info(pair, choice.block_size, choice.source, adaptive, off=choice.off, pinned=choice.pinned)


def load(planned: Planned, log: Log = lambda m: None, *, group=None):
    """Load the planned pair (``loading.Pair``); with ``group``, the target sharded over it."""
    from . import memory
    from .loading import load_pair

    cfg, quant = planned.cfg, planned.quant
    memory.set_wired_limit()
    log(
        f"loading target {cfg.target}"
        + (f" + drafter {planned.drafter}" if planned.drafter else " (no drafter: --no-draft)")
        + f" ({quant.describe()})"
    )
    shard = None
    if group is not None:
        from functools import partial

        from .distributed import shard_target

        shard = partial(shard_target, group=group)
    return load_pair(
        cfg.target,
        planned.drafter,
        no_draft=cfg.no_draft,
        target_bits=quant.target_bits,
        drafter_bits=quant.drafter_bits,
        group_size=quant.group_size,
        draft_vocab=cfg.draft_vocab,
        shard=shard,
        drafter_activations=quant.drafter_activations,
    )


def open_session(
    cfg: LoadConfig,
    progress: Progress | None = None,
    log: Log = lambda m: None,
    *,
    tuning: str = "tune",
    group_aware: bool = False,
) -> Session:
    """Check, plan, load and choose the block size: the ``Session`` every command runs on.

    ``progress(done, total, note)`` hears first-launch tuning (default: a bar on stderr); ``log``
    hears the plan summary and what loads; ``tuning`` as in ``choose_block``.

    Started by ``mlx.launch`` (docs/distributed.md), the process joins its group: the plan is one
    rank's, the target is sharded over the group, and the block size is the flag's or the
    checkpoint's (tuning measures one process; rank 0's choice is what every rank runs)."""
    from dataclasses import replace

    from . import distributed

    if distributed.launched() and not group_aware:  # every rank refuses alike, before joining
        raise BadRequest(
            "this command does not run under mlx.launch: `chat` reads one terminal (serve the "
            "group and use any OpenAI client), `tune` and `verify` measure or check one process "
            "(a group takes --block-size; its greedy output equals one process's). Under "
            "mlx.launch run `mlx_spec serve`, `generate` or `bench` (the group's pass costs), or "
            "let them start the group: `serve --ranks N`, `bench --ranks N` (docs/distributed.md)"
        )
    group = distributed.init_group()  # None unless launched by mlx.launch
    if group is not None:
        cfg = replace(cfg, ranks=group.size(), prefix_cache=0)  # a group prefills every request in full
        tuning = "none"
        log(f"rank {group.rank()} of {group.size()} ({distributed.backend_name()}): the target is sharded")
    planned = plan_session(cfg, log)
    pair = load(planned, log, group=group)
    info = info_for(pair, choose_block(pair, cfg, progress, tuning=tuning), cfg.adaptive)
    if group is not None:
        info = replace(info, group=distributed.group_info(group))
    session = Session.of(pair, info, context=cfg.context, plan=planned.plan, group=group)
    if session.context_length is not None and session.context_length < cfg.context:
        log(f"context limited to the target's trained {session.context_length} tokens (asked {cfg.context})")
    return session


def run_follower(cfg: LoadConfig, log: Log) -> int:
    """A front end's whole job on a rank other than 0 of an ``mlx.launch`` group: load this
    rank's shard of the pair, then follow rank 0 until it shuts the group down (or is lost: the
    process then exits)."""
    from .distributed import follow_session

    session = open_session(cfg, log=log, group_aware=True)
    n = follow_session(session)
    log(f"rank {session.group.rank()}: rank 0 shut the group down after {n} requests")
    return 0
