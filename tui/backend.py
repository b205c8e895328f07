"""What the chat UI talks to: a ``Backend`` that streams plain-value events.

``LocalBackend`` wraps ``mlx_spec.engine.Engine``: the engine thread does all MLX work, the UI's
worker threads only iterate a ``Handle``. ``FakeBackend`` (tui/fake_backend.py) plays scripted
events without MLX, for the UI tests. The events are the engine's own ``Started``, ``Delta``,
``Done`` and ``Failed`` dataclasses, carrying frozen ``EngineInfo`` and ``StatsSnapshot`` values
(importing ``mlx_spec.engine`` does not import MLX).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_spec import session, tuning
from mlx_spec.engine import Delta, Done, Engine, Failed, Request, Started
from mlx_spec.errors import MlxSpecError
from mlx_spec.generation import EngineInfo
from mlx_spec.memory import live, loaded_sizes
from mlx_spec.session import open_session
from mlx_spec.text import encode_prompt
from mlx_spec.tuning import DEFAULT_BUDGET_S
from mlx_spec.verify import IDENTICAL, check

import mlx.core as mx
import psutil

log = logging.getLogger(__name__)

Event = Started | Delta | Done | Failed
Progress = Callable[[float, str], None]  # (fraction done 0..1, what is happening)


@dataclass(frozen=True)
class Settings:
    """Per-request knobs the UI sends with every turn."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    speculate: bool = True
    """False: plain decoding of the same target, for an A/B against speculation."""
    think: bool | None = None
    """Thinking models: the chat template's switch (enable_thinking); None: the template's default."""


@dataclass(frozen=True)
class Memory:
    """Working-set numbers in bytes. ``kv`` is estimated for ``context_tokens`` of context."""

    used: int  # MLX active + allocator cache, now
    peak: int  # MLX peak since the last reply started
    budget: int
    budget_source: str
    target: int
    drafter: int
    kv: int
    context_tokens: int
    prefix: int  # K/V held by the prefix cache for reuse across turns
    swap_used: int
    swap_total: int
    rss: int

    @property
    def other(self) -> int:
        return max(0, self.used - self.target - self.drafter - self.kv - self.prefix)

    @property
    def fraction(self) -> float:
        """Share of the budget taken by the larger of now and the last reply's peak."""
        return max(self.used, self.peak) / self.budget if self.budget else 0.0


@dataclass(frozen=True)
class TuneRow:
    block_size: int  # 1 = plain decoding
    tokens_per_s: float | None  # None: not raced (the model's figure only)
    speedup: float | None  # against plain decoding: the race's median, else the model's (note says "model")
    tau: float | None = None
    note: str = ""
    label: str = ""  # how the row is named where it is not a DFlash block: a chain, "mtp k=3"


@dataclass(frozen=True)
class TuneView:
    """A tuner result as the UI shows it."""

    best: int  # 1: "off", plain decoding is faster on this machine
    baseline_tps: float | None  # plain decoding tok/s of this target, same prompts
    rows: tuple[TuneRow, ...]
    date: str  # YYYY-MM-DD
    source: str  # the block size's source, as the header shows it
    chosen: str = ""  # the chosen chain's label ("mtp k=3") in a pair without a DFlash drafter


@dataclass(frozen=True)
class CheckResult:
    ok: bool  # no mismatch (a numeric near tie is ok)
    verdict: str  # "identical" | "numeric" | "mismatch"
    tokens: int
    detail: str


class Backend(Protocol):
    def start(self, progress: Progress | None = None) -> EngineInfo: ...

    """Block until loaded (``progress`` hears first-launch tuning); raise on failure."""

    @property
    def info(self) -> EngineInfo | None: ...  # None while loading
    def stream(self, messages: list[dict], settings: Settings) -> Iterator[Event]: ...
    def cancel(self) -> None: ...
    def memory(self) -> Memory | None: ...
    def tuner_unavailable(self) -> str | None: ...  # None when the tuner can run
    def stored_tune(self) -> TuneView | None: ...
    def retune(self, progress: Progress) -> TuneView: ...
    def check_unavailable(self) -> str | None: ...
    def check(self, messages: list[dict], settings: Settings) -> CheckResult: ...
    def close(self) -> None: ...


def request_for(messages: list[dict], settings: Settings) -> Request:
    think = None if settings.think is None else {"enable_thinking": settings.think}
    return Request(
        messages=[dict(m) for m in messages],
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        seed=settings.seed,
        speculate=settings.speculate,
        template_kwargs=think,
    )


# -- MLX-side probes: each runs on the engine thread via Engine.call ---------------------------
def _live_memory(pair) -> dict:
    return live()


def _reset_peak(pair) -> None:
    mx.reset_peak_memory()


def read_memory(engine: Engine, sizes, context_tokens: int, timeout: float = 5.0) -> Memory:
    """The one place the UI's memory numbers come from: ``mlx_spec.memory`` (``live`` read on the
    engine thread; ``sizes`` is its ``LoadedSizes`` of the pair)."""
    m = engine.call(_live_memory).result(timeout)
    kv = (sizes.target_kv_per_token + sizes.drafter_kv_per_token) * context_tokens
    return Memory(
        used=m["used"],
        peak=m["peak"],
        budget=m["budget"],
        budget_source=m["budget_source"],
        target=sizes.target,
        drafter=sizes.drafter,
        kv=kv,
        prefix=engine.snapshot()["prefix_cache_bytes"],
        context_tokens=context_tokens,
        swap_used=m["swap_used"],
        swap_total=m["swap_total"],
        rss=psutil.Process().memory_info().rss,
    )


# -- the tuner (mlx_spec/tuning/) and the losslessness check (mlx_spec/verify.py) -------------
def tune_view(result) -> TuneView:
    """A ``tuning.TuneResult`` as the UI shows it: the rows at the chosen thread count; a raced
    row's speedup is the race's measured median (the model's figure, which decided, in its
    note), a row the race did not time shows the model's figure, marked "model"."""
    shown = [c for c in result.candidates if result.threads is None or c.threads == result.threads]
    rows = []
    for c in shown:
        raced = c.measured and c.speedup is not None
        model = "" if c.predicted is None else f"model x{c.predicted:.2f}" if raced else "model"
        rows.append(
            TuneRow(
                c.block,
                c.median_tps,
                c.speedup if raced else c.predicted,
                c.tau,
                "; ".join(x for x in (c.note, model) if x),
                c.label if c.source != "dflash" else "",
            )
        )
    rows = tuple(rows)
    plain = next((c.median_tps for c in shown if c.block == 1 and c.measured), None)  # at the chosen threads
    chain = result.best_source != "dflash" and result.best > 1
    chosen = next((c.label for c in shown if c.block == result.best and c.source == result.best_source), "")
    return TuneView(result.best, plain, rows, result.date[:10], result.source, chosen if chain else "")


def _stored_tune(pair) -> TuneView | None:
    result = tuning.load_result(tuning.tune_key(pair))
    return tune_view(result) if result is not None else None


def _retune(engine: Engine, budget_s: float, progress: Progress):
    """An engine-thread job: tune, store, and switch the engine to the new block size."""

    def job(pair) -> TuneView:
        # tune() keys its result by tuning.tune_key(pair) itself.
        result = tuning.tune(pair, budget_s=budget_s, progress=lambda d, t, m: progress(d / t if t else 0.0, m))
        tuning.save_result(result)
        # Between requests, on the engine thread: the next turn runs the tuned engine.
        engine.use_info(
            session.info_for(pair, session.from_tuning(result), adaptive=bool(engine.info and engine.info.adaptive_max))
        )
        progress(1.0, "done")
        return tune_view(result)

    return job


def _verify_last(engine: Engine, messages: list[dict], max_tokens: int):
    """An engine-thread job: mlx_spec.verify on the conversation so far, at the block size in use."""

    def job(pair) -> CheckResult:
        info = engine.info
        block = info.block_size if info.speculative else pair.drafter.args.block_size
        ids = encode_prompt(pair.tokenizer, messages=messages)
        r = check(pair, [ids], (block,), max_tokens).results[0]
        if r.verdict == IDENTICAL:
            detail = (
                f"{r.plain_tokens} tokens at block size {block}, same token ids and text "
                f"(sha256 {r.plain_sha256[:12]}), τ {r.tau:.2f}"
            )
        else:
            d = r.divergence
            detail = (
                f"first divergence at token {d.index}: plain {d.plain_text!r} vs speculative "
                f"{d.spec_text!r}; {d.reason}" + (f"; block size 2: {r.block2}" if r.block2 else "")
            )
        return CheckResult(r.verdict != "mismatch", r.verdict, r.plain_tokens, detail)

    return job


class LocalBackend:
    """The engine in this process. ``loader(progress)`` runs on the engine thread and returns a
    ``session.Session``; ``progress`` hears first-launch tuning."""

    CHECK_TOKENS = 64  # the losslessness check replays at most this many tokens (both ways)

    def __init__(self, loader: Callable[[Progress], Any], *, tune_budget_s: float | None = None, prefix_cache: int = 0):
        self._loader = loader
        self._progress: Progress = lambda f, m: None
        self.engine = Engine(lambda: self._loader(lambda f, m: self._progress(f, m)), prefix_cache=prefix_cache)
        self.tune_budget_s = tune_budget_s
        self._handle = None
        self._sizes = None  # memory.LoadedSizes once loaded
        self._context = 0  # tokens of the last turn (prompt + reply), for the KV estimate

    @classmethod
    def from_config(cls, cfg) -> LocalBackend:
        """Load what a ``config.LoadConfig`` names, as generate and serve do (``session.open_session``)."""

        def loader(progress: Progress):
            # First launch tunes here, as generate and serve do; progress goes to the UI.
            return open_session(cfg, lambda d, t, m: progress(d / t if t else 0.0, m), log=log.info)

        return cls(loader, tune_budget_s=cfg.tune_budget_s, prefix_cache=cfg.prefix_cache)

    def start(self, progress: Progress | None = None) -> EngineInfo:
        if progress is not None:
            self._progress = progress
        self.engine.start()
        self.engine.wait_ready()  # raises MlxSpecError with the loader's error

        self._sizes = self.engine.call(loaded_sizes).result()
        return self.info

    @property
    def info(self) -> EngineInfo | None:
        return self.engine.info

    @property
    def think_format(self):
        """The model's reasoning markers (thinking.ThinkFormat), or None; known once loaded."""
        return self.engine.think_format

    def stream(self, messages: list[dict], settings: Settings) -> Iterator[Event]:
        self.engine.call(_reset_peak)  # ordered before the request: peak = this reply's
        handle = self.engine.submit(request_for(messages, settings))
        self._handle = handle
        try:
            for ev in handle:
                if isinstance(ev, Done) and ev.prompt_tokens:
                    self._context = ev.prompt_tokens + ev.completion_tokens
                yield ev
        finally:
            handle.cancel()  # a consumer that stops early must not leave the engine generating
            self._handle = None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def memory(self) -> Memory | None:
        if self._sizes is None:
            return None
        return read_memory(self.engine, self._sizes, self._context)

    def _has_drafter(self) -> bool:
        return self.info is not None and self.info.drafter is not None

    def tuner_unavailable(self) -> str | None:
        if not self._has_drafter():
            return "no drafter loaded (--no-draft): there is no block size to tune"
        return None

    def stored_tune(self) -> TuneView | None:
        if self.tuner_unavailable():
            return None
        return self.engine.call(_stored_tune).result()

    def retune(self, progress: Progress) -> TuneView:
        reason = self.tuner_unavailable()
        if reason:
            raise MlxSpecError(reason)

        job = _retune(self.engine, self.tune_budget_s or DEFAULT_BUDGET_S, progress)
        return self.engine.call(job).result()

    def check_unavailable(self) -> str | None:
        if not self._has_drafter():
            return "no drafter loaded (--no-draft): nothing to compare against plain decoding"
        return None

    def check(self, messages: list[dict], settings: Settings) -> CheckResult:
        """Greedy speculative vs greedy plain decoding of the conversation so far (``mlx_spec.verify``)."""
        reason = self.check_unavailable()
        if reason:
            raise MlxSpecError(reason)
        n = min(settings.max_tokens, self.CHECK_TOKENS)
        return self.engine.call(_verify_last(self.engine, messages, n)).result()

    def close(self) -> None:
        self.cancel()
        self.engine.close()  # the engine clears its thread's MLX streams as its last job
