"""The engine thread: the one thread that owns every MLX array, model and cache.

MLX streams are thread-local (mlx >= 0.31.2), so the TUI and the server never touch MLX: they
``submit`` a ``Request`` and read plain-value events (``Started``, ``Delta``, ``Done``,
``Failed``) from a ``Handle``, blocking (``for ev in handle``) or async (``async for``).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import BadRequest, MlxSpecError

LOADING, READY, FAILED, CLOSED = "loading", "ready", "failed", "closed"


class EngineBusy(MlxSpecError):
    """The request queue is full; retry later."""


@dataclass(frozen=True)
class Request:
    prompt: str | None = None
    messages: list[dict] | None = None  # chat; goes through the chat template
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int | None = 256  # None: until the context is full (needs a context length)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: list | None = None
    speculate: bool = True  # False: plain decoding for an A/B (only changes a pair with a drafter)
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")


_ids = itertools.count(1)


@dataclass(frozen=True)
class Started:
    request_id: str
    prompt_tokens: int
    engine: dict


@dataclass(frozen=True)
class Delta:
    request_id: str
    text: str
    tokens: tuple[int, ...]
    drafted: int
    accepted: int
    stats: dict  # running Stats.as_dict()


@dataclass(frozen=True)
class Done:
    request_id: str
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    engine: dict
    stats: dict
    timings: dict  # llama.cpp-style counters (see README)


@dataclass(frozen=True)
class Failed:
    request_id: str
    error: str
    kind: str  # exception class name, e.g. "BadRequest", "ContextTooLong"


class Handle:
    """Events of one request. Iterate (blocking) or ``async for``; ``cancel()`` any time."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self._q: queue.Queue = queue.Queue()
        self._loop = loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop else None
        self.cancelled = threading.Event()

    def _put(self, ev) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # the consumer's loop is closed (server shut down): drop
                self.cancelled.set()
        else:
            self._q.put(ev)

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self):
        while True:
            ev = self._q.get()
            yield ev
            if isinstance(ev, (Done, Failed)):
                return

    async def __aiter__(self):
        while True:
            ev = await self._aq.get()
            yield ev
            if isinstance(ev, (Done, Failed)):
                return

    async def next_event(self, timeout: float | None = None):
        """The next event (async handles), or None if none came within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._aq.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def result(self) -> Done:
        """Block until done; raise on failure."""
        last = None
        for ev in self:
            last = ev
        if isinstance(last, Failed):
            raise MlxSpecError(f"{last.kind}: {last.error}")
        return last


def timings(stats, block_size: int) -> dict:
    """llama.cpp-style counters. The prefill step also yields the first token, so prompt_ms
    includes it and predicted_ms / predicted_per_second cover the tokens after it. As in
    llama.cpp, prompt_n counts the prompt tokens actually run and cache_n those reused from the
    prefix cache."""
    return {
        "cache_n": stats.cached_tokens,
        "prompt_n": stats.prompt_tokens - stats.cached_tokens,
        "prompt_ms": round(stats.prefill_ms, 3),
        "prompt_per_second": round(stats.prefill_tps, 3),
        "predicted_n": stats.tokens,
        "predicted_ms": round(stats.decode_ms, 3),
        "predicted_per_second": round(stats.decode_tps, 3),
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "draft_rounds": stats.reached[0] if stats.reached else 0,  # cycles that drafted >= 1 token
        "block_size": block_size,
    }


class Engine:
    """Owns a pair on its own thread. ``loader`` runs on that thread and returns
    ``(pair, info)`` where info is a ``generation.EngineInfo``.

    ``prefix_cache``: bytes of K/V (target + drafter context) kept between requests so a
    conversation's next turn, or a request sharing a system prompt, prefills only its new tokens
    (0 = off). The memory plan counts this budget (``--prefix-cache-mb``)."""

    def __init__(self, loader: Callable[[], Any], *, max_queue: int = 16, context_length: int | None = None,
                 prefix_cache: int = 0):
        self._loader = loader
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.state = LOADING
        self.error: str | None = None
        self.info = None  # EngineInfo once ready
        self.tool_format = None  # server.tools.ToolFormat once ready, if the tokenizer has one
        self.context_length = context_length
        self._ready = threading.Event()
        self._pair = None
        self._prefix_budget = prefix_cache
        self._prefix = None  # PrefixCache, made on the engine thread
        self._controllers = (None, None)  # (EngineInfo, generation.controllers(...)) for --adaptive
        self.counters = {"requests": 0, "errors": 0, "tokens": 0, "prompt_tokens": 0, "drafted": 0,
                         "accepted": 0, "cycles": 0, "cancelled": 0, "cached_tokens": 0,
                         "prefix_cache_bytes": 0}
        self.accepted_by_position: list[int] = []
        self.drafted_by_position: list[int] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="mlx-engine", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("engine still loading")
        if self.state == FAILED:
            raise MlxSpecError(self.error)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            try:
                self._jobs.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
            if not self._thread.is_alive():
                _wait_native_exit(self._thread.native_id, timeout)
        self.state = CLOSED

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    @property
    def queue_depth(self) -> int:
        return self._jobs.qsize()

    # -- API for other threads ---------------------------------------------------------------
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        if self.state not in (LOADING, READY):
            raise MlxSpecError(f"engine is {self.state}" + (f": {self.error}" if self.error else ""))
        handle = Handle(request, loop)
        try:
            self._jobs.put_nowait(("gen", handle))
        except queue.Full:
            raise EngineBusy(f"request queue full ({self._jobs.maxsize} waiting)") from None
        return handle

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run ``fn(pair)`` on the engine thread (tuning, verify, plans). Returns a Future."""
        fut: Future = Future()
        try:
            self._jobs.put_nowait(("call", (fn, fut)))
        except queue.Full:
            raise EngineBusy("request queue full") from None
        return fut

    # -- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            from .prefix import PrefixCache
            from .server.tools import tool_format  # plain Python: markers + parser function

            self._prefix = PrefixCache(self._prefix_budget)
            self._pair, self.info = self._loader()
            self.tool_format = tool_format(getattr(self._pair, "tokenizer", None))
            if self.context_length is None:
                self.context_length = model_context_length(getattr(self._pair, "model", None))
            self.state = READY
        except BaseException as e:  # the UI/server must see why loading failed
            self.state, self.error = FAILED, f"{type(e).__name__}: {e}"
        finally:
            self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                self._release()
                return
            kind, payload = job
            if self.state != READY:
                if kind == "gen":
                    payload._put(Failed(payload.request.id, self.error or "engine not ready", "EngineFailed"))
                else:
                    payload[1].set_exception(MlxSpecError(self.error or "engine not ready"))
                continue
            if kind == "call":
                fn, fut = payload
                try:
                    fut.set_result(fn(self._pair))
                except BaseException as e:
                    fut.set_exception(e)
            else:
                self._generate(payload)

    def _release(self) -> None:
        """Free the pair and this thread's MLX streams before the thread ends: MLX aborts the
        process at exit when a thread-local stream outlives its thread (ml-explore/mlx#3126)."""
        self._pair = None
        if self._prefix is not None:
            self._prefix.clear()
        import mlx.core as mx

        mx.synchronize()
        clear = getattr(mx, "clear_streams", None)
        if clear is not None:
            clear()

    def _generate(self, handle: Handle) -> None:
        from .generation import GenConfig, Result, controllers, engine_info, generate
        from .sampling import SamplingConfig
        from .text import encode_prompt

        req, pair = handle.request, self._pair
        rid = req.id
        with self._lock:
            self.counters["requests"] += 1
        try:
            if handle.cancelled.is_set():
                raise _Cancelled()
            info = self.info
            if not req.speculate and info.method != "plain":
                info = engine_info(_plain_view(pair))
            if req.prompt_ids is not None:
                ids = list(req.prompt_ids)
                vocab = getattr(getattr(pair.model, "args", None), "vocab_size", None)
                if vocab and any(not 0 <= t < vocab for t in ids):
                    raise BadRequest(f"prompt token ids must be in [0, {vocab})")
            else:
                try:
                    ids = encode_prompt(pair.tokenizer, req.prompt, req.messages, tools=req.tools)
                except Exception as e:  # e.g. the chat template rejects these messages
                    raise BadRequest(f"could not build the prompt: {type(e).__name__}: {e}") from None
            if not ids:
                raise BadRequest("empty prompt")
            max_tokens = req.max_tokens
            if max_tokens is None:  # OpenAI semantics: until the context is full
                max_tokens = (self.context_length or len(ids) + 256) - len(ids)
            if self.context_length and len(ids) + max(max_tokens, 1) > self.context_length:
                from .errors import ContextTooLong

                raise ContextTooLong(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                                     f"exceeds the context length {self.context_length}")
            try:
                cfg = GenConfig(max_tokens=max_tokens, stop=tuple(req.stop),
                                sampling=SamplingConfig(req.temperature, req.top_p, req.top_k, req.seed))
            except ValueError as e:
                raise BadRequest(str(e)) from None
            handle._put(Started(rid, len(ids), info.as_dict()))
            result = Result()
            finish = None
            if self._controllers[0] is not info:  # built once per engine (re-tuning changes info)
                self._controllers = (info, controllers(pair, info))
            make = self._controllers[1]
            chunks = generate(_plain_view(pair) if info.method == "plain" else pair, info, ids, cfg, result,
                              prefix=self._prefix, controller=make() if make else None)
            for chunk in chunks:
                s = chunk.step
                handle._put(Delta(rid, chunk.text, s.tokens, s.drafted, s.accepted, result.stats.as_dict()))
                self._count(s)
                if handle.cancelled.is_set():
                    finish = "cancelled"
                    break
            chunks.close()  # hands the caches to the prefix cache now, not at garbage collection
            finish = finish or result.finish_reason or "length"
            if finish == "cancelled":
                with self._lock:
                    self.counters["cancelled"] += 1
            st = result.stats
            handle._put(Done(rid, result.text, finish, len(ids), len(result.tokens), info.as_dict(),
                             st.as_dict(), timings(st, info.block_size)))
            with self._lock:
                self.counters["prompt_tokens"] += len(ids)
                self.counters["cached_tokens"] += st.cached_tokens
                self.counters["prefix_cache_bytes"] = self._prefix.nbytes if self._prefix else 0
        except _Cancelled:
            with self._lock:
                self.counters["cancelled"] += 1
            handle._put(Done(rid, "", "cancelled", 0, 0, self.info.as_dict(), {}, {}))
        except Exception as e:
            with self._lock:
                self.counters["errors"] += 1
            handle._put(Failed(rid, str(e), type(e).__name__))

    def _count(self, step) -> None:
        with self._lock:
            c = self.counters
            c["tokens"] += len(step.tokens)
            if not step.prefill:
                c["cycles"] += 1 if step.drafted else 0
                c["drafted"] += step.drafted
                c["accepted"] += step.accepted
                while len(self.accepted_by_position) < step.drafted:
                    self.accepted_by_position.append(0)
                    self.drafted_by_position.append(0)
                for k in range(step.drafted):
                    self.drafted_by_position[k] += 1
                for k in range(step.accepted):
                    self.accepted_by_position[k] += 1

    def snapshot(self) -> dict:
        """Counters for /metrics and the UI (plain values)."""
        with self._lock:
            return {**self.counters, "accepted_by_position": list(self.accepted_by_position),
                    "drafted_by_position": list(self.drafted_by_position), "queue_depth": self.queue_depth, "state": self.state, "time": time.time()}


def _wait_native_exit(native_id: int | None, timeout: float) -> None:
    """``join`` returns before the OS thread has run its C++ thread-local destructors (MLX's
    thread-local streams); a process that exits meanwhile can abort ("terminate called without
    an active exception", measured ~1 in 3 exits here). Wait until the thread is really gone."""
    task = Path(f"/proc/self/task/{native_id}")
    if native_id is None or not task.parent.is_dir():
        time.sleep(0.05)  # no /proc: a short grace period
        return
    deadline = time.monotonic() + timeout
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.002)


def model_context_length(model) -> int | None:
    """The target's trained context (``max_position_embeddings``), if its config says."""
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


class _Cancelled(Exception):
    pass


def _plain_view(pair):
    """The same loaded pair seen without its drafter (plain decoding for an A/B)."""
    from dataclasses import replace

    return replace(pair, drafter=None, target=None, drafter_id=None)
