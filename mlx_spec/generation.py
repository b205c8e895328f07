"""Run one generation on a loaded pair: choose the engine, stream text, collect stats.

This is the library API the CLI, the engine thread, bench and verify share. It must run on the
thread that loaded the pair (MLX streams are thread-local).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

from .decode import Step, plain_steps, spec_steps
from .errors import BadRequest, ContextTooLong, InvalidPrompt
from .loading import Pair
from .policy import MAX_CHAIN_DEPTH, PolicyFactory
from .prefix import PrefixCache
from .sampling import SamplingConfig
from .stats import Stats
from .text import Chunk, encode_prompt, stream_text
from .tuning import load_result, tune_key

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenConfig:
    max_tokens: int = 256
    sampling: SamplingConfig = SamplingConfig()
    stop: tuple[str, ...] = ()
    prefill_step: int = 2048
    prefill_budget_s: float | None = None  # the prefill's time budget, checked between its chunks (None: none)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1 (got {self.max_tokens})")


@dataclass(frozen=True)
class Request:
    """One generation as the engine takes it (the server and the TUI build these)."""

    prompt: str | None = None
    messages: list[dict] | None = None  # chat; goes through the chat template
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int | None = 256  # an upper bound: the reply stops where the context ends (None: there)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: list | None = None
    speculate: bool = True  # False: plain decoding for an A/B (only changes a pair with a drafter)
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    template_kwargs: dict | None = None  # extra chat-template variables, e.g. {"enable_thinking": False}


_ids = itertools.count(1)


def prepare(pair: Pair, req: Request, context_length: int | None) -> tuple[list[int], GenConfig]:
    """Validate a request against the loaded pair and encode its prompt: (prompt ids, config).
    Raises BadRequest / ContextTooLong with the reason."""
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
        vocab = getattr(getattr(pair.model, "args", None), "vocab_size", None)
        if vocab and any(not 0 <= t < vocab for t in ids):
            raise InvalidPrompt(f"prompt token ids must be in [0, {vocab})")
    else:
        try:
            ids = encode_prompt(
                pair.tokenizer, req.prompt, req.messages, tools=req.tools, template_kwargs=req.template_kwargs
            )
        except Exception as e:  # e.g. the chat template rejects these messages
            raise BadRequest(f"could not build the prompt: {type(e).__name__}: {e}") from None
    if not ids:
        raise InvalidPrompt("empty prompt")
    max_tokens = req.max_tokens
    if max_tokens is None:  # OpenAI semantics: until the context is full
        max_tokens = (context_length or len(ids) + 256) - len(ids)
    if context_length and len(ids) >= context_length:
        raise ContextTooLong(
            f"prompt is too long: {len(ids)} tokens > {context_length - 1} maximum (the "
            f"context length is {context_length} tokens, prompt and reply together)"
        )
    if context_length:  # max_tokens is an upper bound: the reply stops where the context ends
        max_tokens = min(max_tokens, context_length - len(ids))
    try:
        cfg = GenConfig(
            max_tokens=max_tokens,
            stop=tuple(req.stop),
            sampling=SamplingConfig(req.temperature, req.top_p, req.top_k, req.seed),
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return ids, cfg


SPECULATIVE, PLAIN, TUNED_OFF = "speculative", "plain", "tuned-off"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """How a pair runs: ``size`` processes, this one ``rank``; ``sharded``: the target is split
    over the group (distributed.py)."""

    size: int = 1
    rank: int = 0
    backend: str = "none"
    sharded: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.size == 1:
            return "one process"
        return f"target sharded over {self.size} processes ({self.backend})"


SINGLE = GroupInfo()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What really runs; shown by every command and in every server response.

    ``mode`` is decided by ``engine_info`` alone: "speculative" (a drafter drafts), "plain" (no
    drafter: --no-draft, or a plain A/B request) or "tuned-off" (a drafter is loaded but the tuner
    found plain decoding faster on this machine). Front ends read ``mode``, never the source text.
    """

    method: str  # "dflash2" | "dflash" | "plain"; without a DFlash drafter the first model source ("mtp", ...)
    target: str
    drafter: str | None
    block_size: int  # 1 for plain decoding
    block_size_source: str  # "flag" | "checkpoint" | "tuned <date>" | "plain (--no-draft)" ...
    mode: str = SPECULATIVE  # see the class docstring
    adaptive_max: int = 0  # > 0: the per-cycle drafting policy (the default), DFlash blocks up to this
    draft_vocab: int = 0  # > 0: drafts come from a reduced vocabulary of this many ids (0: full head)
    group: GroupInfo = SINGLE  # the processes the target is sharded over (distributed.py)
    pinned: bool = False  # the user gave the block size (--block-size): the per-cycle policy keeps it
    drafter_precision: str = ""  # e.g. "float weights, float32 activations" (drafter.Drafter.precision)
    sources: tuple[str, ...] = ()  # the draft sources the per-cycle policy may use ("dflash", "mtp", ...)
    chains: tuple[tuple[str, str], ...] = ()  # (kind, where it loaded from) per chain drafter
    kv_cache: str = ""  # "4-bit K/V (group 64)" with --kv-bits ("": as computed)
    draft_window: int = 0  # > 0: the drafter attends over the last this many positions (--draft-window)
    depths: tuple[tuple[str, int], ...] = ()  # (kind, depth) the tuner measured per chain drafter: its prior's

    @property
    def speculative(self) -> bool:
        return self.mode == SPECULATIVE

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        kv = f", {self.kv_cache}" if self.kv_cache else ""
        if self.mode != SPECULATIVE:
            why = "--no-draft" if self.mode == PLAIN else self.block_size_source
            return f"engine: plain decoding of {self.target} ({why}; no speculation){kv}{self._group()}"
        sources = self.sources or ("dflash", "lookup")
        dflash = "dflash" in sources and self.drafter is not None
        if not self.adaptive_max:
            block = f"block size {self.block_size} ({self.block_size_source}; every cycle, --no-adaptive)"
        else:
            names = {"mtp": "an MTP chain", "eagle": "an EAGLE-3 chain", "lookup": "a lookup draft"}
            depth = dict(self.depths)
            names |= {k: f"{names[k]} (prior depth {d})" for k, d in depth.items() if k in names}
            options = ["plain step"]
            if dflash:
                options.append(
                    f"DFlash block {self.block_size} (--block-size)"
                    if self.pinned
                    else f"DFlash block <= {self.adaptive_max}"
                )
            options += [names[s] for s in sources if s in names]
            block = "per-cycle drafting: " + ", ".join(options[:-1]) + " or " + options[-1]
            if dflash and not self.pinned:
                block += f" (prior block {self.block_size}, {self.block_size_source})"
            elif not dflash and any(s in ("mtp", "eagle") for s in sources):  # where the chains' priors came from
                block += f" (chain priors: {self.block_size_source})"
        vocab = f", draft vocabulary {self.draft_vocab} ids" if self.draft_vocab else ""
        prec = f" ({self.drafter_precision})" if self.drafter_precision else ""
        who = f"drafter {self.drafter}{prec}, " if self.drafter is not None else ""
        heads = "".join(f"{'MTP head' if k == 'mtp' else 'EAGLE-3 drafter'} {p}, " for k, p in self.chains)
        window = f", drafting window {self.draft_window} positions" if self.draft_window else ""
        return (
            f"engine: {self.method} speculative decoding ({'+'.join(sources)}), target {self.target}, "
            f"{who}{heads}{block}{vocab}{window}{kv}{self._group()}"
        )

    def _group(self) -> str:
        return "" if self.group.size == 1 else f", {self.group.describe()}"


def engine_info(
    pair: Pair,
    block_size: int | None = None,
    source: str | None = None,
    adaptive: bool = False,
    *,
    off: bool = False,
    pinned: bool = False,
    depths: tuple[tuple[str, int], ...] = (),
) -> EngineInfo:
    """The one place that decides what runs (``EngineInfo.mode``).

    No drafter: plain. ``off``: the tuner found fixed-block DFlash no faster than plain decoding
    for this pair (``source`` says why): plain decoding with ``--no-adaptive``; with the per-cycle
    policy (``adaptive``) still speculative, the tuner's result its prior. Else speculative at
    ``block_size`` (None: the checkpoint's). ``adaptive``: the online controller picks each
    cycle's block in 1..max(block size, the checkpoint's, 16); the fixed choice stays in
    ``block_size``. ``pinned``: the user chose ``block_size`` (the policy keeps
    it as its DFlash block). ``depths``: the tuner's depth per chain drafter (the prior it measured).
    A pair without a DFlash drafter drafts per cycle only; ``source`` then says where its chain
    priors came from (the tuner's result, "off" included: its chains start resting, or the stated
    default prior)."""
    sources = tuple(
        pair.draft_sources
        if hasattr(pair, "draft_sources")
        else ("dflash", "lookup")
        if pair.drafter is not None
        else ()
    )
    kv = pair.kv.describe() if getattr(pair, "kv", None) is not None else ""
    if pair.drafter is None and not sources:
        return EngineInfo("plain", pair.target_id, None, 1, "plain (--no-draft)", PLAIN, kv_cache=kv)
    chains = tuple((k, str(v)) for k, v in (getattr(pair, "chain_ids", None) or {}).items())
    if pair.drafter is None or "dflash" not in sources:  # chain and lookup drafts: the policy's alone
        if not adaptive:
            raise BadRequest("--no-adaptive drafts a fixed DFlash block every cycle: it needs a DFlash drafter")

        method = next((s for s in sources if s != "lookup"), sources[0])
        if not chains:
            source = "per cycle (lookup length)"
        elif off:  # the tuner's prior says no chain pays here: the policy starts them resting (probes)
            source = f"{source}; chain drafts start resting"
        return EngineInfo(
            method,
            pair.target_id,
            None,
            MAX_CHAIN_DEPTH + 1,
            source or "not tuned: the stated default prior",
            SPECULATIVE,
            MAX_CHAIN_DEPTH + 1,
            sources=sources,
            chains=chains,
            kv_cache=kv,
            depths=tuple(depths),
        )
    ckpt = pair.drafter.args.block_size
    if off and not adaptive:
        return EngineInfo("plain", pair.target_id, pair.drafter_id, 1, source or "tuned: off", TUNED_OFF, kv_cache=kv)
    if off:  # the per-cycle policy takes plain steps itself where drafting does not pay, and a lookup
        # draft may still pay where DFlash does not (a reply copying its prompt): the tuner's "off"
        # is its prior (its stored costs and acceptance start the DFlash source resting), not plain.
        block_size, source = ckpt, f"{source or 'tuned: off'}; DFlash drafts start resting"
    if block_size is None:
        block_size, source = ckpt, "checkpoint"
    if block_size < 2:
        raise BadRequest(
            f"block size must be >= 2 for speculative decoding (got {block_size}); use --no-draft for plain decoding"
        )
    if block_size > ckpt:
        log.warning(
            "block size %d exceeds the checkpoint's trained %d; acceptance past position %d is untrained",
            block_size,
            ckpt,
            ckpt - 1,
        )
    method = "dflash2" if pair.drafter.args.is_v2 else "dflash"
    top = max(block_size, ckpt, 16) if adaptive else 0
    vocab = pair.drafter.vocab_size_drafted
    prec = pair.drafter.precision() if hasattr(pair.drafter, "precision") else ""
    return EngineInfo(
        method,
        pair.target_id,
        pair.drafter_id,
        block_size,
        source or "flag",
        SPECULATIVE,
        top,
        vocab,
        pinned=pinned,
        drafter_precision=prec,
        sources=sources,
        chains=chains,
        kv_cache=kv,
        draft_window=getattr(pair.drafter, "context_limit", None) or 0,
        depths=tuple(depths),
    )


def plain_view(pair: Pair) -> Pair:
    """The same loaded pair seen without its drafters (plain decoding for an A/B)."""
    return replace(pair, drafter=None, target=None, drafter_id=None, chains={}, chain_ids={}, sources=())


def for_request(pair: Pair, info: EngineInfo, speculate: bool = True) -> tuple[Pair, EngineInfo]:
    """The pair and engine a request runs: ``speculate=False`` (an A/B) and a tuned-off engine
    both decode the target plainly, without touching the drafter."""
    if info.speculative and speculate:
        return pair, info
    if info.speculative:  # an A/B request: plain decoding of the same target
        plain = plain_view(pair)
        return plain, replace(engine_info(plain), group=info.group)
    return plain_view(pair), info


def policies(pair: Pair, info: EngineInfo):
    """A factory of fresh drafting policies, one per sequence (``policy.DraftPolicy``: each
    cycle a plain step, a DFlash draft or a lookup draft), from the tuner's stored result for this
    pair (cost curve and acceptance prior), else a cheap estimate from the models' sizes (no
    timing); a ``--block-size`` flag pins the DFlash block. None when the policy is off
    (``--no-adaptive``) or nothing is drafted."""
    if not info.adaptive_max or not info.speculative:
        return None

    pinned = info.block_size if info.pinned else None
    # a pair without a DFlash drafter starts its chains from the tuner's priors exactly when its
    # engine says so (``depths``: tuned; else the stated default prior, e.g. --no-tune)
    tuned = pair.drafter is not None or bool(getattr(pair, "chains", None) and info.depths)
    result = load_result(tune_key(pair)) if tuned else None
    return PolicyFactory(
        pair, result, block_size=pinned, max_block=info.adaptive_max, sources=info.sources or pair.draft_sources
    )


def chain_kinds(pair: Pair, policy) -> tuple[str, ...]:
    """The chain drafters a sequence drafting with ``policy`` keeps caches for."""
    sources = getattr(policy, "sources", ()) if policy is not None else ()
    return tuple(k for k in getattr(pair, "chains", {}) if k in sources)


def token_steps(
    pair: Pair,
    info: EngineInfo,
    prompt: Sequence[int],
    cfg: GenConfig,
    prefix: PrefixCache | None = None,
    lead=None,
    policy=None,
) -> Iterator[Step]:
    """The engine's steps; with ``prefix``, start from its longest reusable prefix of ``prompt``
    and keep the final caches there for the next request. ``policy``: a fresh
    ``policy.DraftPolicy`` (from ``policies``; the default engine; None: every cycle drafts the
    engine's block). ``lead``: rank 0's ``distributed.Leader`` when the target is sharded over a
    group: the other ranks run the same steps (no prefix cache there; the seed, the policy's
    choices and every step are shared)."""
    if lead is not None:
        cfg = lead.seeded(cfg)
        policy = lead.share(policy)
        steps = token_steps(pair, info, prompt, cfg, None, policy=policy)
        return lead.lead(steps, prompt, cfg, info, policy=policy)
    eos = tuple(pair.tokenizer.eos_token_ids)
    plain = not info.speculative
    kinds = () if plain else chain_kinds(pair, policy)
    reuse = (
        dict(
            prefill=prefix.lookup(prompt, drafter=not plain and pair.drafter is not None, chains=kinds),
            on_exit=prefix.store,
        )
        if prefix is not None
        else {}
    )
    if plain:
        return plain_steps(
            pair.model,
            prompt,
            max_tokens=cfg.max_tokens,
            eos_ids=eos,
            sampling=cfg.sampling,
            prefill_step=cfg.prefill_step,
            prefill_budget_s=cfg.prefill_budget_s,
            kv=pair.kv,
            **reuse,
        )
    return spec_steps(
        pair.target,
        pair.drafter,
        prompt,
        block_size=info.block_size,
        max_tokens=cfg.max_tokens,
        eos_ids=eos,
        sampling=cfg.sampling,
        prefill_step=cfg.prefill_step,
        prefill_budget_s=cfg.prefill_budget_s,
        policy=policy,
        chains=getattr(pair, "chains", None),
        **reuse,
    )


@dataclass
class Result:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the text, if one did


def generate(
    pair: Pair,
    info: EngineInfo,
    prompt: Sequence[int],
    cfg: GenConfig,
    result: Result | None = None,
    prefix: PrefixCache | None = None,
    lead=None,
    policy=None,
) -> Iterator[Chunk]:
    """Stream chunks; ``result`` (if given) accumulates text, tokens and stats as they come.
    ``lead``: see ``token_steps``."""
    result = Result() if result is None else result

    def counted(steps):
        for s in steps:
            result.stats.add(s)
            yield s

    eos = tuple(pair.tokenizer.eos_token_ids)
    for chunk in stream_text(
        counted(token_steps(pair, info, prompt, cfg, prefix, lead, policy)), pair.tokenizer, cfg.stop, eos
    ):
        result.text += chunk.text
        result.tokens.extend(chunk.step.tokens)
        if chunk.finish_reason:
            result.finish_reason = chunk.finish_reason
            result.stop_sequence = chunk.stop_sequence
        yield chunk


def run(pair: Pair, info: EngineInfo, prompt: Sequence[int], cfg: GenConfig) -> Result:
    result = Result()
    for _ in generate(pair, info, prompt, cfg, result):
        pass
    return result
