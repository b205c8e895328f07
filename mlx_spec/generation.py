"""Run one generation on a loaded pair: choose the engine, stream text, collect stats.

This is the library API the CLI, the engine thread, bench and verify share. It must run on the
thread that loaded the pair (MLX streams are thread-local).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

from .decode import Step, plain_steps, spec_steps
from .errors import BadRequest
from .loading import Pair
from .prefix import PrefixCache
from .sampling import SamplingConfig
from .stats import Stats
from .text import Chunk, stream_text

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenConfig:
    max_tokens: int = 256
    sampling: SamplingConfig = SamplingConfig()
    stop: tuple[str, ...] = ()
    prefill_step: int = 2048

    def __post_init__(self):
        if self.max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1 (got {self.max_tokens})")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What really runs; shown by every command and in every server response."""

    method: str  # "dflash2" | "dflash" | "plain"
    target: str
    drafter: str | None
    block_size: int  # 1 for plain decoding
    block_size_source: str  # "flag" | "checkpoint" | "tuned <date>" | "plain (--no-draft)" ...
    adaptive_max: int = 0  # > 0: --adaptive, the block size is chosen each cycle in 1..adaptive_max
    draft_vocab: int = 0  # > 0: drafts come from a reduced vocabulary of this many ids (0: full head)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.method == "plain":
            why = "--no-draft" if self.drafter is None else self.block_size_source
            return f"engine: plain decoding of {self.target} ({why}; no speculation)"
        block = (f"adaptive block size <= {self.adaptive_max} (online controller; fixed would be "
                 f"{self.block_size}, {self.block_size_source})" if self.adaptive_max else
                 f"block size {self.block_size} ({self.block_size_source})")
        vocab = f", draft vocabulary {self.draft_vocab} ids" if self.draft_vocab else ""
        return (f"engine: {self.method} speculative decoding, target {self.target}, drafter "
                f"{self.drafter}, {block}{vocab}")


def engine_info(pair: Pair, block_size: int | None = None, source: str | None = None,
                adaptive: bool = False) -> EngineInfo:
    """Resolve the block size: explicit flag, else the given source (tuner), else checkpoint.

    ``adaptive``: the online controller picks each cycle's block in 1..max(block size, the
    checkpoint's, the tuner's candidates); the fixed choice stays in ``block_size``."""
    if pair.drafter is None:
        return EngineInfo("plain", pair.target_id, None, 1, "plain (--no-draft)")
    ckpt = pair.drafter.args.block_size
    if block_size == 1 and (source or "").startswith("tuned"):  # the tuner chose "off"
        return EngineInfo("plain", pair.target_id, pair.drafter_id, 1, source)
    if block_size is None:
        block_size, source = ckpt, "checkpoint"
    if block_size < 2:
        raise BadRequest(f"block size must be >= 2 for speculative decoding (got {block_size});"
                         " use --no-draft for plain decoding")
    if block_size > ckpt:
        log.warning("block size %d exceeds the checkpoint's trained %d; acceptance past "
                    "position %d is untrained", block_size, ckpt, ckpt - 1)
    method = "dflash2" if pair.drafter.args.is_v2 else "dflash"
    top = max(block_size, ckpt, 16) if adaptive else 0
    vocab = pair.drafter.vocab_size_drafted
    return EngineInfo(method, pair.target_id, pair.drafter_id, block_size, source or "flag", top, vocab)


def controllers(pair: Pair, info: EngineInfo):
    """For ``--adaptive``: a factory of fresh controllers (one per generation) from the tuner's
    stored cost curve for this pair, else costs measured once now; None when not adaptive."""
    if not info.adaptive_max or info.method == "plain":
        return None
    from .adaptive import Controllers
    from .tuner import load_result, tune_key

    return Controllers(pair, load_result(tune_key(pair)), info.adaptive_max)


def token_steps(pair: Pair, info: EngineInfo, prompt: Sequence[int], cfg: GenConfig,
                prefix: PrefixCache | None = None, controller=None) -> Iterator[Step]:
    """The engine's steps; with ``prefix``, start from its longest reusable prefix of ``prompt``
    and keep the final caches there for the next request. ``controller``: a fresh
    ``adaptive.AdaptiveController`` for this generation (``--adaptive``)."""
    eos = tuple(pair.tokenizer.eos_token_ids)
    plain = info.method == "plain"
    reuse = dict(prefill=prefix.lookup(prompt, drafter=not plain), on_exit=prefix.store) if prefix is not None else {}
    if plain:
        return plain_steps(pair.model, prompt, max_tokens=cfg.max_tokens, eos_ids=eos,
                           sampling=cfg.sampling, prefill_step=cfg.prefill_step, **reuse)
    return spec_steps(pair.target, pair.drafter, prompt, block_size=info.block_size,
                      max_tokens=cfg.max_tokens, eos_ids=eos, sampling=cfg.sampling,
                      prefill_step=cfg.prefill_step, controller=controller, **reuse)


@dataclass
class Result:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None


def generate(pair: Pair, info: EngineInfo, prompt: Sequence[int], cfg: GenConfig,
             result: Result | None = None, prefix: PrefixCache | None = None,
             controller=None) -> Iterator[Chunk]:
    """Stream chunks; ``result`` (if given) accumulates text, tokens and stats as they come."""
    result = Result() if result is None else result

    def counted(steps):
        for s in steps:
            result.stats.add(s)
            yield s

    eos = tuple(pair.tokenizer.eos_token_ids)
    for chunk in stream_text(counted(token_steps(pair, info, prompt, cfg, prefix, controller)), pair.tokenizer,
                             cfg.stop, eos):
        result.text += chunk.text
        result.tokens.extend(chunk.step.tokens)
        if chunk.finish_reason:
            result.finish_reason = chunk.finish_reason
        yield chunk


def run(pair: Pair, info: EngineInfo, prompt: Sequence[int], cfg: GenConfig) -> Result:
    result = Result()
    for _ in generate(pair, info, prompt, cfg, result):
        pass
    return result
