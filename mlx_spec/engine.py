"""The engine thread: the one thread that owns every MLX array, model and cache.

MLX streams are thread-local (mlx >= 0.31.2), so the TUI and the server never touch MLX: they
``submit`` a ``Request`` and read plain-value events (``Started``, ``Delta``, ``Done``,
``Failed``) from a ``Handle``, blocking (``for ev in handle``) or async (``async for``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .batch import BatchDecoder
from .distributed import HEARTBEAT_S, Leader
from .errors import (
    MlxSpecError,
    PlanError,
    PrefillTimeout,  # noqa: F401  (re-exported for the server)
    UnsupportedModel,
)
from .generation import (
    EngineInfo,
    Request,  # noqa: F401  (re-exported for the front ends)
    Result,
    chain_kinds,
    for_request,
    generate,
    policies,
    prepare,
)
from .memory import MemoryPlan, RssBound, batch_room, release_free_heap, rss, rss_bound
from .prefix import PrefixCache
from .prefix_store import PrefixStore, identity_of
from .stats import Stats, StatsSnapshot
from .target import Target
from .text import stream_text
from .thinking import prompt_opens_reasoning
from .tuning import machine_info, quantization, weights_id

LOADING, READY, FAILED, CLOSED = "loading", "ready", "failed", "closed"
log = logging.getLogger(__name__)
PROC_TASKS = Path("/proc/self/task")  # Linux: one entry per live OS thread of this process


class EngineBusy(MlxSpecError):
    """The request queue is full; retry later."""


PREFILL_TIMEOUT_S = 600.0  # generous: a whole long context on a slow machine


@dataclass(frozen=True)
class Started:
    request_id: str
    prompt_tokens: int
    engine: EngineInfo
    reasoning: bool = False  # the prompt opened a reasoning block: the output starts inside it


@dataclass(frozen=True)
class Delta:
    request_id: str
    text: str
    tokens: tuple[int, ...]
    drafted: int
    accepted: int
    stats: StatsSnapshot  # the request's running stats
    source: str = ""  # the cycle's draft source ("plain", "dflash", "lookup", "mtp", "eagle"; "" for the prefill)


@dataclass(frozen=True)
class Done:
    request_id: str
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    engine: EngineInfo
    stats: StatsSnapshot
    timings: dict  # llama.cpp-style counters (see README)
    stop_sequence: str | None = None  # the stop string that ended the text (finish_reason "stop")


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


def _open_store(config, pair):
    """The disk prefix store for ``pair``, keyed by both models' weights and quantization, the
    drafting window and the machine (what a stored K/V row depends on); None, said, when that
    cannot be worked out."""
    try:
        key = {
            "machine": machine_info(),
            "target": [weights_id(pair.target_id), quantization(pair.model)],
            "drafter": None
            if pair.drafter is None
            else [weights_id(pair.drafter_id), quantization(pair.drafter), pair.drafter.vocab_size_drafted],
        }
        if pair.kv is not None:  # quantized K/V rows are other rows: a store of their own
            key["kv"] = [pair.kv.bits, pair.kv.group_size]
        limit = getattr(pair.drafter, "context_limit", None)
        if limit:  # a drafting window keeps fewer drafter rows: entries of another window differ
            key["draft_window"] = limit
        if key["target"][0] is None or (pair.drafter is not None and key["drafter"][0] is None):
            raise MlxSpecError("the model files were not found to identify them")
        return PrefixStore(config, identity_of(key), {"target": pair.target_id, "drafter": pair.drafter_id})
    except Exception as e:
        log.warning("disk prefix cache off: %s", e)
        return None


class Engine:
    """Owns a loaded session on its own thread: a queue in, frozen events out.

    ``loader`` runs on that thread and returns a ``session.Session`` (pair, ``EngineInfo``,
    context length, tool-call and reasoning formats). ``prefix_cache``: bytes of K/V (target +
    drafter context) kept between requests so a conversation's next turn, or a request sharing a
    system prompt, prefills only its new tokens (0 = off; the memory plan counts it).
    ``release_heap``: once requests end, hand malloc's free pages back to the OS (glibc).

    What a request runs (validation, prompt, steps) is ``generation``'s; the engine only orders
    the work, fans events out and keeps the counters (``snapshot``)."""

    def __init__(
        self,
        loader: Callable[[], Any],
        *,
        max_queue: int = 16,
        prefix_cache: int = 0,
        max_batch: int | None = 1,
        prefix_disk=None,
        prefill_timeout: float = PREFILL_TIMEOUT_S,
        proc_tasks: Path | None = PROC_TASKS,
        release_heap: bool = True,
    ):
        self._loader = loader
        self._prefix_disk = prefix_disk  # prefix_store.DiskConfig: long prefixes kept on disk too
        # seconds a request's prefill may take (0: no limit); checked between batched steps, and
        # on the one-at-a-time path between its prefill chunks (decode.spec_steps / plain_steps)
        self._prefill_timeout = prefill_timeout
        self._memory: dict = {}  # MLX allocator figures, sampled on the engine thread
        self._cache_limit: int | None = None  # mx.set_cache_limit from the memory plan's allowance
        # the process's RSS and MLX's figures once loaded, and the resident memory bound they
        # give with the plan (memory.rss_bound; None without a plan); in snapshot() and /metrics
        self._loaded: dict = {}
        self.rss_bound: RssBound | None = None
        self._reserved = 0  # bytes the plan counts for the sequences in the batch now (admission)
        self._reserved_max = 0  # the most admission counted the batch's sequences at once
        # requests ended since the C heap's free pages were last handed back (_release_heap), and
        # what handing them back freed: releases, bytes of RSS
        self._ended = 0
        self._release_heap_on = release_heap  # False: keep malloc's free pages (benchmarks/heap_release.py)
        self._heap = {"releases": 0, "released": 0}
        # where the OS lists this process's threads (None or missing, as on macOS: not probed;
        # see _wait_native_exit)
        self._proc_tasks = proc_tasks
        self._current: Handle | None = None  # the single-stream request running now
        self._streams_cleared = False  # _release freed this thread's MLX streams (mx.clear_streams)
        # Continuous batching (batch.py): up to max_batch requests decode together; None = as many
        # as the session's memory plan allows (memory.batch_room), 1 = one request after another.
        self._max_batch_asked = max_batch
        self.max_batch = 1
        self._room = None  # memory.BatchRoom: admission by the plan's per-sequence bytes
        self._decoder = None  # batch.BatchDecoder when max_batch > 1
        self._live: dict = {}  # batched requests in flight: sequence id -> _Live
        self._batch = {"sizes": {}, "steps": {"plain": 0, "drafted": 0}, "pipelined": 0}
        # which attention path the batch runs: "shared K/V over N layers" | "per sequence (<reason>)"
        # (None: no batching); in snapshot() and /health
        self.batch_attention: str | None = None
        # the batch's drafter pass: "one pass for all" | "per sequence (<reason>)" | "none" (None: no batching)
        self.batch_drafter: str | None = None
        self.batch_chain: str | None = None  # how a batch runs its chain drafters' passes
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.state = LOADING
        self.error: str | None = None
        self._session = None  # session.Session once ready
        self._info: EngineInfo | None = None  # replaced by use_info (re-tuning)
        self._ready = threading.Event()
        self._prefix_budget = prefix_cache
        self._prefix = None  # PrefixCache, made on the engine thread
        self._policy_factory = (None, None)  # (EngineInfo, generation.policies(...)): the drafting policy
        self._requests = {
            "requests": 0,
            "errors": 0,
            "cancelled": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "prefix_cache_bytes": 0,
            "prefill_timeouts": 0,
        }
        self._done_stats = None  # stats.Stats: cycle counters of finished requests, merged
        self._running = None  # the running request's stats.Stats (updated on the engine thread)
        self._leader = None  # distributed.Leader when the session's target is sharded over a group
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="mlx-engine", daemon=True)

    # -- what is loaded (read-only outside the engine thread) -------------------------------------
    @property
    def info(self) -> EngineInfo | None:
        """What runs: the session's ``EngineInfo`` (after a re-tune, the new one); None while loading."""
        return self._info

    @property
    def context_length(self) -> int | None:
        return self._session.context_length if self._session is not None else None

    @property
    def tool_format(self):
        """``text.ToolFormat`` of the loaded tokenizer, or None."""
        return self._session.tool_format if self._session is not None else None

    @property
    def think_format(self):
        """``thinking.ThinkFormat`` of the loaded tokenizer, or None."""
        return self._session.think_format if self._session is not None else None

    @property
    def group(self) -> dict | None:
        """The distributed group's state (size, rank, backend, healthy, error), None on one process."""
        return self._leader.health() if self._leader is not None else None

    def use_info(self, info: EngineInfo) -> None:
        """Switch what the next request runs (a re-tune). Call it from a job on the engine thread
        (``call``), so it lands between requests."""
        if threading.current_thread() is not self._thread:
            raise MlxSpecError("Engine.use_info must run on the engine thread (inside Engine.call)")
        self._info = info

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("engine still loading")
        if self.state == FAILED:
            raise MlxSpecError(self.error)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine: the request in flight is cancelled (it ends at its next step with
        finish "cancelled"), queued requests are answered cancelled and queued calls fail, then the
        engine thread frees its MLX streams and is joined, within ``timeout`` seconds."""
        if self._thread.is_alive():
            self._cancel_all()
            try:
                self._jobs.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "the engine thread did not stop within %.0f s (a step still running); exiting without it", timeout
                )
            else:
                _wait_native_exit(self._thread.native_id, timeout, self._proc_tasks, self._streams_cleared)
        self.state = CLOSED

    def _cancel_all(self) -> None:
        """Cancel the running request and everything still queued (close)."""
        with self._jobs.mutex:
            jobs = list(self._jobs.queue)
            self._jobs.queue.clear()
            self._jobs.not_full.notify_all()
        for job in jobs:
            if job is None:
                continue
            kind, payload = job
            if kind == "gen":
                payload.cancel()
                payload._put(Done(payload.request.id, "", "cancelled", 0, 0, self._info, StatsSnapshot(), {}))
            else:
                payload[1].set_exception(MlxSpecError("the engine closed before this call ran"))
        current = self._current
        if current is not None:
            current.cancel()
        with self._lock:
            live = list(self._live.values())
        for lv in live:
            lv.handle.cancel()

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
        if self._leader is not None:
            self._leader.ensure_healthy()  # GroupFailed: a rank died or hangs
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
            self._prefix = PrefixCache(self._prefix_budget)
            session = self._loader()
            if getattr(session, "group", None) is not None:
                if session.group.rank() != 0:
                    raise MlxSpecError("an engine runs on rank 0 only; other ranks follow (distributed.follow_session)")
                self._leader = Leader(session.group)
            self._session, self._info = session, session.info
            if self._prefix_disk is not None and self._leader is None:
                self._prefix.attach(_open_store(self._prefix_disk, session.pair))
            self._bound_cache(session)
            self._decoder = self._make_decoder(session)
            self._measure_loaded(session)
            self.state = READY
        except BaseException as e:  # the UI/server must see why loading failed
            self.state, self.error = FAILED, f"{type(e).__name__}: {e}"
        finally:
            self._ready.set()
        if self._decoder is not None:
            return self._batched()
        while True:
            job = self._next_job()
            if job is None:
                if self._leader is not None:
                    self._leader.shutdown()  # the other ranks exit
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
                self._call(*payload)
            else:
                self._generate(payload)

    def _call(self, fn, fut: Future) -> None:
        try:
            fut.set_result(fn(self._session.pair))
        except BaseException as e:
            fut.set_exception(e)

    def _next_job(self):
        """The next job; in a group, heartbeats to the other ranks while waiting for it."""
        if self._leader is None:
            return self._jobs.get()

        while True:
            try:
                return self._jobs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                self._leader.heartbeat()

    def _release(self) -> None:
        """Free the pair and this thread's MLX streams before the thread ends: MLX aborts the
        process at exit when a thread-local stream outlives its thread (ml-explore/mlx#3126)."""
        self._session = None
        if self._prefix is not None:
            self._prefix.clear()

        mx.synchronize()
        mx.synchronize(generation_stream)  # (a batched step may still be queued there)
        clear = getattr(mx, "clear_streams", None)
        if clear is not None:
            clear()
            self._streams_cleared = True

    def _generate(self, handle: Handle) -> None:
        req = handle.request
        rid = req.id
        self._add("requests")
        self._current = handle
        try:
            if handle.cancelled.is_set():
                raise _Cancelled()
            pair, info = for_request(self._session.pair, self._info, req.speculate)
            ids, cfg = prepare(pair, req, self.context_length)
            if self._prefill_timeout and self._leader is None:  # checked between the prefill's chunks
                cfg = replace(cfg, prefill_budget_s=self._prefill_timeout)
            make = self._begin(handle, pair, info, ids)
            result = Result()
            finish = None
            with self._lock:
                self._running = result.stats
            lead = self._leader
            if lead is not None:  # a rank stuck in a collective: fail this request from the watchdog
                unwatch = lead.on_failure(
                    lambda why: (
                        handle._put(Failed(rid, why, "GroupFailed"))
                        if threading.current_thread() is not self._thread
                        else None
                    )
                )
            began = time.monotonic()
            chunks = generate(
                pair,
                info,
                ids,
                cfg,
                result,
                prefix=self._prefix if lead is None else None,
                policy=make() if make else None,
                lead=lead,
            )
            try:
                for chunk in chunks:
                    if began is not None:  # the first chunk comes when the prefill is done
                        self._check_prefill(time.monotonic() - began, len(ids), chunks)
                        began = None
                    s = chunk.step
                    handle._put(
                        Delta(rid, chunk.text, s.tokens, s.drafted, s.accepted, result.stats.snapshot(), s.source)
                    )
                    if handle.cancelled.is_set():
                        finish = "cancelled"
                        break
                chunks.close()  # hands the caches to the prefix cache now, not at garbage collection
            finally:
                if lead is not None:
                    unwatch()
                    lead.finish()
            finish = finish or result.finish_reason or "length"
            self._sample_memory()
            st = result.stats
            self._finish(st, len(ids), cancelled=finish == "cancelled")
            handle._put(
                Done(
                    rid,
                    result.text,
                    finish,
                    len(ids),
                    len(result.tokens),
                    info,
                    st.snapshot(trace=True),
                    timings(st, info.block_size),
                    result.stop_sequence,
                )
            )
        except _Cancelled:
            self._add("cancelled")
            handle._put(Done(rid, "", "cancelled", 0, 0, self._info, StatsSnapshot(), {}))
        except Exception as e:
            self._finish(None, 0)
            self._add("errors")
            if isinstance(e, PrefillTimeout):
                self._add("prefill_timeouts")
            handle._put(Failed(rid, str(e), type(e).__name__))
        finally:
            self._current = None
            self._release_heap()

    def _begin(self, handle: Handle, pair, info, ids) -> Callable | None:
        """A prepared request starts: Started goes out; returns the drafting policy's factory
        (built once per engine: re-tuning changes ``info``)."""
        handle._put(Started(handle.request.id, len(ids), info, reasoning=self._opens_reasoning(pair, ids)))
        if self._policy_factory[0] is not info:
            self._policy_factory = (info, policies(pair, info))
        return self._policy_factory[1]

    # -- continuous batching ---------------------------------------------------------------------
    def _make_decoder(self, session):
        """The ``batch.BatchDecoder`` when requests may run together (None: one at a time)."""
        asked = self._max_batch_asked
        if asked == 1 or getattr(session, "group", None) is not None:
            return None  # (a sharded target runs the group's single-stream protocol)

        if session.plan is not None:
            self._room = batch_room(session.plan)
        if asked is None:
            if self._room is None:
                return None
            context = self.context_length or session.plan.context
            asked = self._room.max_batch(context)
            if asked == 1:
                return None
        pair = session.pair
        try:
            target = pair.target if pair.target is not None else Target(pair.model)
            dec = BatchDecoder(
                target,
                pair.drafter,
                block_size=max(1, self._info.block_size),
                max_batch=asked,
                chains=getattr(pair, "chains", None),
            )
        except UnsupportedModel as e:
            if self._max_batch_asked is not None:
                raise UnsupportedModel(f"--max-batch {asked}: {e}; use --max-batch 1") from None
            log.warning("continuous batching is off for this target (%s); requests run one at a time", e)
            return None
        self.max_batch = asked
        self.batch_attention = dec.attention
        self.batch_drafter = dec.drafter_path
        self.batch_chain = dec.chain_path
        log.info("continuous batching of up to %d requests (the decoder logs its attention path)", asked)
        return dec

    def _batched(self) -> None:
        """The engine loop with continuous batching: requests join the batch at the next step
        (their prefill chunked between the others' steps) and leave the moment they finish or
        are cancelled; beyond ``max_batch`` (or the plan's memory) they wait in the queue, which
        answers EngineBusy (HTTP 503) when full. Calls (tuning, plans) run between steps."""
        dec = self._decoder
        waiting: list[Handle] = []  # taken from the queue; admitted when memory allows
        reserved = 0
        while True:
            self._release_heap()  # (after the requests that ended in the last round, before waiting)
            while True:  # take jobs: block only when there is nothing to do
                if len(self._live) + len(waiting) >= self.max_batch:
                    break
                try:
                    job = self._jobs.get(block=not (self._live or waiting))
                except queue.Empty:
                    break
                if job is None:
                    for sid in list(self._live):
                        self._leave(sid, "cancelled")
                    for h in waiting:
                        self._add("cancelled")  # (counted as a request when taken)
                        h._put(Done(h.request.id, "", "cancelled", 0, 0, self._info, StatsSnapshot(), {}))
                    dec.close()
                    self._release()
                    return
                kind, payload = job
                if kind == "call":
                    self._call(*payload)
                else:
                    self._add("requests")  # once: a request that waits for memory is not counted again
                    waiting.append(payload)
            while waiting:  # admit in arrival order while the plan's memory allows
                h = waiting[0]
                got = self._join(h, reserved)
                if got is None:
                    break  # the oldest waits for memory (the others wait behind it: fairness)
                waiting.pop(0)
                reserved += got
            for sid, lv in list(self._live.items()):
                if lv.handle.cancelled.is_set():
                    reserved -= self._leave(sid, "cancelled")
            self._reserved = reserved
            if not self._live:
                continue
            try:
                steps = dec.step()
            except Exception as e:  # a bug or a device error: fail every request in the batch
                log.exception("batched step failed")
                for sid in list(self._live):
                    lv = self._live.pop(sid)
                    try:
                        dec.cancel(sid, keep=False)  # its caches may be half-written: dropped, not cached
                    except Exception:  # fail the request all the same
                        log.exception("could not release a failed sequence's caches")
                    self._finish(None, 0)
                    self._add("errors")
                    lv.handle._put(Failed(lv.rid, str(e), type(e).__name__))
                reserved = 0
                continue
            self._sample_memory()
            with self._lock:
                self._batch["sizes"] = dict(dec.batch_sizes)
                self._batch["steps"] = dict(dec.steps)
                self._batch["pipelined"] = dec.pipelined
            for sid, st in steps:
                lv = self._live.get(sid)
                if lv is None:
                    continue
                chunk = lv.push(st)
                lv.handle._put(
                    Delta(lv.rid, chunk.text, st.tokens, st.drafted, st.accepted, lv.result.stats.snapshot(), st.source)
                )
                if chunk.finish_reason:
                    reserved -= self._leave(sid, chunk.finish_reason)
            reserved -= self._expire_prefills()
            self._reserved = reserved

    def _join(self, handle: Handle, reserved: int) -> int | None:
        """Admit one request into the batch: the bytes it reserves, 0 if it ended at once (bad
        request, cancelled), None if the plan's memory cannot hold it next to the batch now."""
        req = handle.request
        rid = req.id
        if handle.cancelled.is_set():
            self._add("cancelled")
            handle._put(Done(rid, "", "cancelled", 0, 0, self._info, StatsSnapshot(), {}))
            return 0
        try:
            pair, info = for_request(self._session.pair, self._info, req.speculate)
            ids, cfg = prepare(pair, req, self.context_length)
            need = self._room.need(len(ids) + cfg.max_tokens) if self._room is not None else 0
            if self._room is not None and need > self._room.room:
                raise PlanError(
                    f"this request (prompt {len(ids)} + max_tokens {cfg.max_tokens} tokens) needs "
                    f"{need / 2**20:.0f} MiB of caches; the memory plan leaves "
                    f"{max(0, self._room.room) / 2**20:.0f} MiB for sequences"
                )
            # what the plan counts the batch's sequences at once with this one in it
            batched = self._room is not None and bool(self._live)
            held = self._batch_need(len(ids) + cfg.max_tokens, reserved, need) if batched else need
            if batched and held > self._room.room:
                return None
        except Exception as e:
            self._finish(None, 0)
            self._add("errors")
            handle._put(Failed(rid, str(e), type(e).__name__))
            return 0
        make = self._begin(handle, pair, info, ids)
        dec = self._decoder
        if info.speculative:
            dec.block_size = max(1, info.block_size)
        prefix = self._prefix
        try:
            policy = make() if make and info.speculative else None
            kw = (
                dict(
                    prefill=prefix.lookup(
                        ids,
                        drafter=info.speculative and pair.drafter is not None,
                        chains=chain_kinds(pair, policy) if info.speculative else (),
                    ),
                    on_exit=prefix.store,
                )
                if prefix is not None
                else {}
            )
            sid = dec.add(
                ids,
                max_tokens=cfg.max_tokens,
                eos_ids=tuple(pair.tokenizer.eos_token_ids),
                sampling=cfg.sampling,
                policy=policy,
                speculate=info.speculative,
                **kw,
            )
        except Exception as e:  # a bug: this request fails, the batch goes on
            log.exception("could not add a request to the batch")
            self._finish(None, 0)
            self._add("errors")
            handle._put(Failed(rid, str(e), type(e).__name__))
            return 0
        with self._lock:
            self._live[sid] = _Live(handle, rid, info, ids, cfg, pair.tokenizer, need)
        self._reserved_max = max(self._reserved_max, held)
        return need

    # -- bounds: prefill time, the allocator's cache --------------------------------------------
    def _check_prefill(self, took: float, prompt: int, chunks) -> None:
        """One-at-a-time path: fail a request whose prefill took longer than the budget (the
        decode loops check it between prefill chunks; this catches a last chunk that overran it,
        and a sharded group's prefill, which has no check inside)."""
        budget = self._prefill_timeout
        if budget and took > budget:
            chunks.close()
            raise PrefillTimeout(
                f"the prefill of this {prompt}-token prompt took {took:.0f} s, past the server's "
                f"--prefill-timeout of {budget:g} s; send a shorter prompt"
            )

    def _expire_prefills(self) -> int:
        """Batched path: a sequence still prefilling past the budget fails and leaves the batch.
        Returns the bytes those had reserved."""
        budget, freed = self._prefill_timeout, 0
        if not budget:
            return 0
        now = time.monotonic()
        for sid, lv in list(self._live.items()):
            if lv.result.tokens or now - lv.joined <= budget:
                continue
            self._decoder.cancel(sid, keep=False)  # a half-prefilled cache is not worth keeping
            with self._lock:
                del self._live[sid]
            self._finish(None, 0)
            self._add("errors")
            self._add("prefill_timeouts")
            freed += lv.need
            lv.handle._put(
                Failed(
                    lv.rid,
                    f"the prefill of this {len(lv.ids)}-token prompt ran past the server's "
                    f"--prefill-timeout of {budget:g} s; send a shorter prompt",
                    "PrefillTimeout",
                )
            )
        return freed

    def _bound_cache(self, session) -> None:
        """Bound MLX's buffer cache by the memory plan's allowance for it (on this thread)."""
        plan = getattr(session, "plan", None)
        allowance = next((i.bytes for i in getattr(plan, "items", ()) if i.name == "MLX cache allowance"), None)
        if allowance is not None:
            mx.set_cache_limit(int(allowance))
        self._cache_limit = allowance
        self._sample_memory()

    def _measure_loaded(self, session) -> None:
        """The measured terms of the resident memory bound, once the pair (and the batch decoder)
        have loaded: the process's RSS and MLX's active and cached bytes, after a garbage
        collection and with MLX's cache emptied, so that what loading left behind is not counted
        as the runtime. With the session's plan they give ``rss_bound`` for this engine's batch."""
        gc.collect()
        mx.clear_cache()
        active, cache, now = mx.get_active_memory(), mx.get_cache_memory(), rss()
        self._loaded = {"rss": now, "active": active, "cache": cache}
        plan = getattr(session, "plan", None)
        if isinstance(plan, MemoryPlan):
            self.rss_bound = rss_bound(plan, rss=now, mlx_active=active, mlx_cache=cache, batch=self.max_batch)
            log.info("%s", self.rss_bound.describe())
        self._sample_memory()

    def _release_heap(self) -> None:
        """Once requests have ended: hand the C heap's free pages back to the OS
        (``memory.release_free_heap``), counting what that took off the RSS."""
        if not self._ended or not self._release_heap_on:
            return
        self._ended = 0
        before = rss()
        if release_free_heap():
            freed = max(0, before - rss())
            with self._lock:
                self._heap["releases"] += 1
                self._heap["released"] += freed

    def _sample_memory(self) -> None:
        """MLX's allocator figures for /metrics, read on the engine thread."""
        mem = {"active": mx.get_active_memory(), "cache": mx.get_cache_memory(), "peak": mx.get_peak_memory()}
        if self._cache_limit is not None:
            mem["cache_limit"] = self._cache_limit
        with self._lock:
            self._memory = mem

    def _batch_need(self, positions: int, reserved: int, need: int) -> int:
        """Bytes the batch's sequences may hold once this one (``positions``, ``need`` bytes)
        joins. Where attention runs over the batch's shared K/V (``batch.BatchKV``) every row is
        as long as the longest, so that is what each sequence counts: the longest live request's
        positions, or the buffers' length now if longer (``BatchKV`` shrinks to its rows when a
        long one leaves; ``reserved`` and ``need`` do not enter there)."""
        kv = self._decoder.kv
        if kv is None:
            return reserved + need
        longest = max(
            [positions, kv.length - self._room.block]  # (need() adds the verify rows back)
            + [len(lv.ids) + lv.cfg.max_tokens for lv in self._live.values()]
        )
        return max(len(self._live) + 1, kv.slots) * self._room.need(longest)

    def _leave(self, sid: int, finish: str) -> int:
        """End a batched request (finished, stopped by a stop string, or cancelled): Done, and
        its sequence leaves the batch now. Returns the bytes it had reserved."""
        lv = self._live[sid]
        self._decoder.cancel(sid)  # no-op when the decoder already let it go
        with self._lock:
            del self._live[sid]
        st, res = lv.result.stats, lv.result
        self._finish(st, len(lv.ids), cancelled=finish == "cancelled")
        lv.handle._put(
            Done(
                lv.rid,
                res.text,
                finish,
                len(lv.ids),
                len(res.tokens),
                lv.info,
                st.snapshot(trace=True),
                timings(st, lv.info.block_size),
                res.stop_sequence,
            )
        )
        return lv.need

    def _opens_reasoning(self, pair, ids) -> bool:
        if self.think_format is None:
            return False

        return prompt_opens_reasoning(self.think_format, pair.tokenizer.decode(list(ids[-8:])))

    def _add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._requests[name] += n

    def _finish(self, stats, prompt_tokens: int, cancelled: bool = False) -> None:
        """Fold a finished request's stats into the engine's totals."""
        self._ended += 1  # (its buffers are freed: _release_heap hands the pages back)
        drafter = getattr(getattr(self._session, "pair", None), "drafter", None)
        if hasattr(drafter, "settle"):  # the request's last drafter passes: their tokens were read
            drafter.settle()
        with self._lock:
            self._running = None
            if stats is not None:
                self._done_stats = Stats.merged([s for s in (self._done_stats, stats) if s is not None])
                self._requests["prompt_tokens"] += prompt_tokens
                self._requests["cached_tokens"] += stats.cached_tokens
                self._requests["cancelled"] += int(cancelled)
            self._requests["prefix_cache_bytes"] = self._prefix.nbytes if self._prefix is not None else 0
            if self._prefix is not None:
                if stats is not None:
                    self._prefix.note_prefill(stats.prompt_tokens - stats.cached_tokens, stats.prefill_ms)
                self._requests["prefix_cache"] = self._prefix.stats()

    def snapshot(self) -> dict:
        """Counters for /metrics and the UI (plain values): request counts, and cycle counters
        from the requests' ``Stats`` (finished ones plus the one running now)."""
        with self._lock:
            live = [lv.result.stats for lv in self._live.values()]
            parts = [s for s in (self._done_stats, self._running, *live) if s is not None]
            st = Stats.merged(parts) if parts else None
            c = dict(self._requests)
            batch = {
                "batch_sizes": dict(self._batch["sizes"]),
                "batch_steps": dict(self._batch["steps"]),
                "batch_pipelined": self._batch["pipelined"],
                "batch_active": len(self._live),
                "max_batch": self.max_batch,
                "batch_attention": self.batch_attention,
                "batch_drafter": self.batch_drafter,
                "batch_chain": self.batch_chain,
            }
        cycles = {
            "tokens": 0,
            "drafted": 0,
            "accepted": 0,
            "cycles": 0,
            "accepted_by_position": [],
            "drafted_by_position": [],
            "plain_cycles": 0,
            "drafter_passes": 0,
            "head_passes": 0,
            "trimmed": 0,
            "block_sizes": {},
            "sources": {},
        }
        if st is not None:
            cycles = {
                "tokens": st.tokens,
                "drafted": st.drafted,
                "accepted": st.accepted,
                "cycles": st.reached[0] if st.reached else 0,  # cycles that drafted >= 1 token
                "accepted_by_position": list(st.hits),
                "drafted_by_position": list(st.reached),
                # the drafting policy: plain steps it took, cycles by verify rows, per draft source
                "plain_cycles": st.plain_cycles,
                "drafter_passes": st.drafter_passes,
                "head_passes": st.head_passes,
                "trimmed": st.trimmed,
                "block_sizes": dict(st.block_sizes),
                "sources": {k: dict(v) for k, v in st.sources.items()},
            }
        with self._lock:
            memory = dict(self._memory)
        memory["rss"] = rss()  # (the process's: any thread may read it)
        memory["reserved"], memory["reserved_max"] = self._reserved, self._reserved_max
        with self._lock:
            memory["heap_releases"], memory["heap_released"] = self._heap["releases"], self._heap["released"]
        if self._loaded:
            memory["loaded"] = dict(self._loaded)
        if self.rss_bound is not None:
            memory["bound"] = {**self.rss_bound.terms(), "total": self.rss_bound.total}
        return {
            **c,
            **cycles,
            **batch,
            **self._drafter_health(),
            "memory": memory,
            "queue_depth": self.queue_depth,
            "state": self.state,
            "time": time.time(),
        }

    def _drafter_health(self) -> dict:
        """The drafter's pass finiteness (plain ints and strings it keeps: no MLX work)."""
        drafter = getattr(getattr(self._session, "pair", None), "drafter", None)
        h = drafter.health() if hasattr(drafter, "health") else None
        return {
            "drafter_passes": h.passes if h else 0,
            "drafter_nonfinite": h.nonfinite if h else 0,
            "drafter_activations": h.activations if h else None,
            "drafter_fallback": h.fallback if h else None,
        }


class _Live:
    """A request in the batch: its handle and its own text stream over the steps it gets."""

    def __init__(self, handle: Handle, rid: str, info: EngineInfo, ids, cfg, tokenizer, need: int):
        self.handle, self.rid, self.info, self.ids, self.cfg, self.need = handle, rid, info, ids, cfg, need
        self.joined = time.monotonic()  # for the prefill budget
        self.result = Result()
        self._q: list = []
        self._chunks = stream_text(self._feed(), tokenizer, cfg.stop, tuple(tokenizer.eos_token_ids))

    def _feed(self):
        while True:  # stream_text pulls exactly one step per chunk it yields
            s = self._q.pop()
            self.result.stats.add(s)
            yield s

    def push(self, step):
        """Text for one more step (a ``text.Chunk``), accumulated into ``result``."""
        self._q.append(step)
        chunk = next(self._chunks)
        r = self.result
        r.text += chunk.text
        r.tokens.extend(chunk.step.tokens)
        if chunk.finish_reason:
            r.finish_reason = chunk.finish_reason
            r.stop_sequence = getattr(chunk, "stop_sequence", None)
            self._chunks.close()
        return chunk


def _wait_native_exit(
    native_id: int | None, timeout: float, tasks: Path | None = PROC_TASKS, streams_cleared: bool = False
) -> bool:
    """``join`` returns before the OS thread has run its C++ thread-local destructors (MLX's
    thread-local streams); a process that exits meanwhile can abort ("terminate called without
    an active exception", measured ~1 in 3 exits here without the streams cleared).

    Where the OS lists threads (``tasks``, Linux's /proc/self/task), wait, within ``timeout``,
    until the thread's entry is gone. Without it (macOS): when the thread freed its streams
    itself (``mx.clear_streams`` in ``Engine._release``) its destructors have nothing of MLX's
    left to free, so there is nothing to wait for; only an MLX without ``clear_streams`` gets a
    bounded grace period, said in the log. Returns True when the exit was observed or not needed."""
    task = None if tasks is None or native_id is None else Path(tasks) / str(native_id)
    if task is None or not task.parent.is_dir():
        if streams_cleared:
            return True
        log.info(
            "no thread list to watch and this MLX cannot clear its streams: waiting 0.2 s for the engine thread's exit"
        )
        time.sleep(0.2)
        return False
    deadline = time.monotonic() + timeout
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    return not task.exists()


class _Cancelled(Exception):
    pass
