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
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from . import catalog, distributed, memory, tuning
from . import tuning as tuner  # (in _chain_choice, whose parameter is named ``tuning``)
from .config import LoadConfig
from .default_target import DEFAULT_TARGET_ID, cache_dir
from .distributed import follow_session, shard_target
from .drafter import DrafterArgs
from .errors import BadRequest, CheckpointError, HubError, IncompatiblePair, MlxSpecError, UnsupportedModel
from .generation import EngineInfo, engine_info
from .loading import DEFAULT_DRAFTER, DEFAULT_EAGLE, DEFAULT_MTP, MODELS_DIR, draft_window, has_mtp_tensors, load_pair
from .mtp import PREFIX, STRIPPED
from .policy import MAX_CHAIN_DEPTH
from .progress import Bar
from .target import KVQuant
from .text import tool_format
from .thinking import think_format

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
    depths: tuple[tuple[str, int], ...] = ()  # the tuner's depth per chain drafter (its prior's), none untuned


@dataclass(frozen=True)
class Planned:
    """What a ``LoadConfig`` names, checked and planned; nothing loaded yet."""

    cfg: LoadConfig
    drafter: str | None  # the drafter to load (the bundled one filled in), None for plain decoding
    quant: Any  # quantize.QuantChoice
    plan: Any  # memory.MemoryPlan, or None when the plan could not read the checkpoint
    block: BlockChoice | None  # the block size loading would use, as far as known before loading
    plan_error: str | None = None  # why there is no plan
    chains: dict | None = None  # chain drafters to load: kind -> folder (None: the target's own, MTP)


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
    try:
        DrafterArgs.from_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"drafter '{ref}': {path / 'config.json'} is not a DFlash drafter config ({type(e).__name__}: {e})"
        ) from None


def drafter_for(cfg: LoadConfig) -> str | None:
    """The DFlash drafter to load: the flag's, the bundled one with the default target, None for
    ``no_draft`` or a ``--draft`` without dflash; any other target without a drafter is refused
    (``--draft auto``: no DFlash drafter then)."""
    if cfg.no_draft:
        return None
    sources = cfg.draft_sources
    auto = sources == ("auto",)
    if not auto and "dflash" not in sources:
        if cfg.drafter is not None:
            raise BadRequest(
                f"--drafter {cfg.drafter} is a DFlash drafter, but --draft {cfg.draft} does not draft "
                "with dflash: add dflash to --draft, or drop --drafter"
            )
        return None
    if cfg.drafter is not None:
        return cfg.drafter
    if cfg.target == DEFAULT_TARGET_ID:
        if not (MODELS_DIR / DEFAULT_DRAFTER).exists():
            if auto:
                return None
            raise MlxSpecError(
                f"the bundled drafter models/{DEFAULT_DRAFTER} is missing from this install; "
                "pass --drafter PATH, or --no-draft for plain decoding"
            )
        return str(MODELS_DIR / DEFAULT_DRAFTER)
    if auto:
        return None
    raise MlxSpecError(
        f"no drafter for target '{cfg.target}': pass --drafter PATH_OR_REPO, or --no-draft for plain decoding"
    )


def chain_refs(cfg: LoadConfig) -> dict[str, str | None]:
    """The chain drafters ``cfg`` asks for, checked before anything loads: kind -> where it
    loads from (an MTP head: ``--mtp``, the embedded pair's head, else None = the target's own
    checkpoint folder; EAGLE-3: ``--eagle``, else the embedded pair's). Refused by name: eagle
    without a checkpoint, mtp on a local folder without ``mtp.*`` tensors (the stripped-conversion
    message), ``--mtp`` / ``--eagle`` given without their source in ``--draft``. With ``auto``
    only what exists is returned (an MTP head in a target folder is looked for at load)."""
    if cfg.no_draft:
        return {}
    sources = cfg.draft_sources
    auto = sources == ("auto",)
    default = cfg.target == DEFAULT_TARGET_ID
    for kind, flag in (("mtp", cfg.mtp), ("eagle", cfg.eagle)):
        if flag is not None and not auto and kind not in sources:
            raise BadRequest(
                f"--{kind} {flag} loads a{'n MTP head' if kind == 'mtp' else 'n EAGLE-3 drafter'}, but --draft "
                f"{cfg.draft} does not draft with {kind}: add {kind} to --draft, or drop --{kind}"
            )
    out: dict[str, str | None] = {}
    if auto or "eagle" in sources:
        ref = cfg.eagle
        if ref is None and default and (MODELS_DIR / DEFAULT_EAGLE).is_dir():
            ref = str(MODELS_DIR / DEFAULT_EAGLE)
        if ref is None and not auto:
            raise BadRequest(
                "--draft eagle needs an EAGLE-3 drafter: --eagle PATH (a checkpoint folder or a catalog "
                "name; `mlx_spec models` lists the published ones)"
                + (f" (the embedded pair's models/{DEFAULT_EAGLE} is not in this install)" if default else "")
            )
        if ref is not None:
            entry = catalog.load_chain().get(ref)
            if entry is not None and entry.kind != "eagle":
                raise BadRequest(f"--eagle {ref}: that catalog entry is an {entry.kind} head, not an EAGLE-3 drafter")
            local = _local_dir(entry.drafter if entry is not None else ref)
            if local is None and not _is_repo_id(entry.drafter if entry is not None else ref):
                raise MlxSpecError(f"--eagle {ref}: no such folder, catalog name or Hugging Face repo id")
            out["eagle"] = entry.drafter if entry is not None else ref
    if auto or "mtp" in sources:
        ref = cfg.mtp
        if ref is None and default and (MODELS_DIR / DEFAULT_MTP).is_dir():
            ref = str(MODELS_DIR / DEFAULT_MTP)
        folder = _local_dir(ref) if ref is not None else (None if default else _local_dir(cfg.target))
        if ref is None and default:
            if not auto:
                raise BadRequest(
                    f"--draft mtp: the embedded default target carries no MTP head (models/{DEFAULT_MTP} is "
                    "not in this install); pass --mtp PATH (a folder with mtp.* tensors, e.g. from "
                    "`mlx_spec train mtp`)"
                )
        elif folder is None:  # a hub repo: its tensors are looked at once it is downloaded
            if ref is not None:
                raise MlxSpecError(f"--mtp {ref}: no such folder (a folder with mtp.* tensors)")
            if not auto:
                out["mtp"] = None
        elif has_mtp_tensors(folder):
            out["mtp"] = str(folder) if ref is not None else None
        elif not auto:
            hint = next((e.target for e in catalog.load_chain().values() if e.target == cfg.target), None)
            raise CheckpointError(
                "--draft mtp: " + STRIPPED.format(path=folder, hint=hint or "the model's original repo")
            )
    return out


def check(cfg: LoadConfig) -> str | None:
    """Everything that can be checked before loading: the names, the chain drafters asked for,
    and the drafter they resolve to (returned). Commands that load on another thread (serve,
    chat) call it first."""
    check_names(cfg)
    chain_refs(cfg)
    drafter = drafter_for(cfg)
    if drafter is None and cfg.block_size is not None and not cfg.no_draft:
        raise BadRequest(
            f"--block-size {cfg.block_size} pins the DFlash block, but --draft {cfg.draft} loads no DFlash "
            "drafter (the policy chooses each chain's depth and lookup length itself; --no-tune skips tuning)"
        )
    return drafter


# -- the plan ------------------------------------------------------------------------------------


def plan_session(cfg: LoadConfig, log: Log = lambda m: None, *, enforce: bool = True) -> Planned:
    """Check the names, choose the quantization and make the memory plan, from files only.

    ``enforce``: refuse a plan over budget (PlanError) unless ``cfg.force``; the ``plan`` command
    passes False and reports instead."""
    drafter = check(cfg)
    chains = chain_refs(cfg)
    block = stored_block(cfg, drafter)
    why, sources = None, None
    try:
        sources = memory.config_sources(cfg, drafter)
        quant, plan = memory.plan_for_config(
            cfg, drafter, block.block_size if block and not block.off else None, sources, chains=chains
        )
    except (HubError, UnsupportedModel, IncompatiblePair):  # cannot be fetched, run or paired: say so now
        raise
    except (OSError, ValueError, KeyError, TypeError, MlxSpecError) as e:
        # A config the plan cannot read: loading below names the problem better than the plan can.
        quant, plan, why = memory.quant_for(cfg, drafter, None), None, f"{type(e).__name__}: {e}"
        log(f"memory plan unavailable ({why}); loading without one")
    if "mtp" in chains and chains["mtp"] is None and sources is not None:
        _check_mtp_tensors(cfg.target, sources[0][1])
    if plan is not None and enforce:
        log(plan.summary())
        memory.check(plan, force=cfg.force, warn=log)
    return Planned(cfg, drafter, quant, plan, block, why, chains)


def _check_mtp_tensors(target: str, tensors) -> None:
    """A target whose own checkpoint must carry the MTP head (a hub repo: from the safetensors
    headers the plan read, before any weight is downloaded) but has no ``mtp.*`` tensors is
    refused by name (a local folder is checked by ``chain_refs``)."""
    if any(t.name.startswith(PREFIX) for t in tensors):
        return
    hint = next((e.target for e in catalog.load_chain().values() if e.target == target), None)
    hint = None if hint == target else hint  # (this repo is the catalog's: no other to point at)
    raise CheckpointError(
        "--draft mtp: "
        + STRIPPED.format(path=target, hint=hint or "the model's original repo")
        + "; nothing was downloaded"
    )


def serve_sizing(cfg: LoadConfig, *, context: bool, prefix_cache: bool) -> tuple[LoadConfig, str | None]:
    """``serve``'s defaults, from the memory plan (``memory.serve_sizing``): with ``context`` (no
    --context given) the target's trained context, capped by the plan; with ``prefix_cache`` (no
    --prefix-cache-mb) a prefix cache sized from the plan's headroom. Returns the config to load
    and the sentence that says what was chosen and why (None when both were given). Without a plan
    (a config it cannot read) ``cfg``'s own values stay, and the sentence says so."""
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
    try:
        return DrafterArgs.from_config(json.loads((path / "config.json").read_text())).block_size
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stored_result(cfg: LoadConfig, drafter: str):
    """The newest stored tuning result whose machine, target and drafter match (the weights'
    identity, however the command spells them: ``tuning.same_models``); quantization and draft
    vocabulary are checked where they are known before loading."""
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
    """The block choice a ``tuning.TuneResult`` makes (``best == 1``: plain decoding, "tuned-off"),
    with the depth it measured for each chain drafter."""
    depths = tuple((k, int(c["depth"])) for k, c in result.chains.items() if c.get("depth"))
    return BlockChoice(result.block_size, result.source, off=result.best == 1, depths=depths)


STATED_PRIOR = "the stated default prior"  # (policy.CHAIN_PRIOR, a head pass priced from its size)


def _chain_choice(pair, cfg: LoadConfig, progress, *, tuning: str, root, kw) -> BlockChoice:
    """``choose_block`` for a pair without a DFlash drafter that drafts with chain drafters: the
    tuner's stored result for this machine and pair (tuned once, now, if there is none, as a
    DFlash pair is), else the stated default prior; ``block_size`` is the chosen chain's rows."""
    rows = MAX_CHAIN_DEPTH + 1
    if not cfg.tune or tuning == "none":
        if tuning != "none":
            tuner.apply_threads(tuner.load_result(tuner.tune_key(pair), root))
        why = "not tuned (--no-tune)" if not cfg.tune else "not tuned"
        return BlockChoice(rows, f"{why}: {STATED_PRIOR}")
    if tuning == "stored":
        result = tuner.load_result(tuner.tune_key(pair), root)
        tuner.apply_threads(result)
        if result is None:
            return BlockChoice(rows, f"not tuned on this machine yet: {STATED_PRIOR}")
        return from_tuning(result)
    bar = None
    if progress is None:
        progress = bar = Bar(sys.stderr, "tuning the chain drafters (first launch; --no-tune skips it)")
    try:
        result = tuner.ensure_tuned(pair, cfg.tune_budget_s, progress, root=root, **kw)
    finally:
        if bar is not None:
            bar.close()
    return from_tuning(result) if result is not None else BlockChoice(rows, f"tuning skipped: {STATED_PRIOR}")


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
    tuner at all (bench and tune measure for themselves). A pair without a DFlash drafter that
    drafts with chain drafters is tuned the same way (``_chain_choice``: the chain depths and
    their priors)."""
    if tuning not in TUNING:
        raise ValueError(f"tuning must be one of {TUNING}, not {tuning!r}")
    kw = {"tune_fn": tune_fn} if tune_fn is not None else {}
    if pair.drafter is None:
        if not getattr(pair, "chains", None):
            return None
        return _chain_choice(pair, cfg, progress, tuning=tuning, root=root, kw=kw)
    ckpt = pair.drafter.args.block_size
    tunes = cfg.block_size is None and cfg.tune and tuning != "none"
    if not tunes or tuning == "stored":
        result = None
        if tuning != "none":  # a stored choice of threads holds, whatever sets the block size
            result = tuner.load_result(tuner.tune_key(pair), root)
            tuner.apply_threads(result)
        depths = from_tuning(result).depths if result is not None else ()  # (the policy's chain priors)
        if cfg.block_size is not None:
            return BlockChoice(cfg.block_size, "flag", pinned=True, depths=depths)
        if not tunes:
            return BlockChoice(ckpt, "checkpoint (--no-tune)" if not cfg.tune else "checkpoint", depths=depths)
        return (
            from_tuning(result)
            if result is not None
            else BlockChoice(ckpt, "checkpoint; not tuned on this machine yet")
        )
    bar = None
    if progress is None:
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
    return engine_info(
        pair, choice.block_size, choice.source, adaptive, off=choice.off, pinned=choice.pinned, depths=choice.depths
    )


def load(planned: Planned, log: Log = lambda m: None, *, group=None):
    """Load the planned pair (``loading.Pair``); with ``group``, the target sharded over it."""
    cfg, quant = planned.cfg, planned.quant
    memory.set_wired_limit()
    chains = planned.chains or {}
    log(
        f"loading target {cfg.target}"
        + (f" + drafter {planned.drafter}" if planned.drafter else " (no drafter: --no-draft)" if cfg.no_draft else "")
        + "".join(f" + {k} {v or 'head in the target'}" for k, v in chains.items())
        + f" ({quant.describe()})"
    )
    shard = None
    if group is not None:
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
        sources=cfg.draft_sources,
        mtp=chains.get("mtp"),
        eagle=chains.get("eagle"),
        kv=KVQuant(cfg.kv_bits, cfg.kv_group_size) if cfg.kv_bits else None,
        draft_window=draft_window(cfg.draft_window, planned.drafter),
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
    session = open_session(cfg, log=log, group_aware=True)
    n = follow_session(session)
    log(f"rank {session.group.rank()}: rank 0 shut the group down after {n} requests")
    return 0
