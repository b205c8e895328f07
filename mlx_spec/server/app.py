"""Routes of ``mlx_spec serve``: parse -> engine handle -> OpenAI JSON or SSE. Nothing else.

Every route is a module-level handler; what it needs (the engine, the server's settings, its
live counters) it reaches as ``request.app.state.served``, one frozen ``Served`` that
``create_app`` builds. Handlers never touch MLX: they ``engine.submit(request, loop=...)`` and
read plain-value events. A client that disconnects cancels its generation; a full queue answers
503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..engine import FAILED, READY, Done, Failed, Started
from . import anthropic, errors, guard, output, schemas, tools
from .errors import ModelNotFound, NotReady, PayloadTooLarge, Unauthorized, UnsupportedMediaType

MAX_BODY_BYTES = 4 << 20
KEEPALIVE_S = 5.0
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics") + anthropic.ROUTES


@dataclass(frozen=True)
class Served:
    """What the routes share: the engine, the server's settings, and its live counters
    (``http_counts`` by route and status, ``live`` in-flight / rejected counts, ``handles``: the
    generations in flight, so a shutdown can end them cleanly)."""

    engine: Any
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    keepalive_s: float = KEEPALIVE_S
    defaults: schemas.RequestDefaults = schemas.NO_DEFAULTS
    created: int = 0
    names: schemas.ModelNames = schemas.ANY_NAME
    refused: guard.Counters = field(default_factory=guard.Counters)  # the guard's 403s and 429s
    http_counts: dict = field(default_factory=dict)
    live: dict = field(default_factory=lambda: {"in_flight": 0, "rejected": 0})
    handles: set = field(default_factory=set)

    def cancel_all(self) -> None:
        """End every generation (server shutdown): streams finish with an error event."""
        for h in list(self.handles):
            h.cancel()

    async def body(self, request: HTTPRequest) -> bytes:
        return await read_body(request, self.max_body_bytes)

    def not_ready(self) -> NotReady:
        failed = self.engine.state == FAILED
        return NotReady(f"engine failed: {self.engine.error}" if failed else "model is loading")

    def ready_info(self):
        if self.engine.state != READY:
            raise self.not_ready()
        return self.engine.info

    def check_model(self, name: str | None) -> str:
        """The id of the model that answers a request naming ``name``: the target, under any name
        unless ``names.strict`` (then only its id, folder name and aliases; others 404)."""
        served = self.ready_info().target
        if name is not None and not self.names.accepts(name, served):
            also = f" (also as {', '.join(repr(a) for a in self.names.aliases)})" if self.names.aliases else ""
            raise ModelNotFound(
                f"model '{name}' is not served here; this server serves '{served}'{also} (--strict-model-name is on)"
            )
        return served

    def max_tokens_header(self, req, prompt_tokens: int) -> dict:
        """The response header that says how many completion tokens the context allowed."""
        n = schemas.max_tokens_allowed(self.engine.context_length, req.max_tokens, prompt_tokens)
        return {} if n is None else {schemas.MAX_TOKENS_HEADER: str(n)}

    def limits(self, req, prompt_tokens: int) -> dict:
        return schemas.limits(self.engine.context_length, req.max_tokens, prompt_tokens)

    async def respond(self, request: HTTPRequest, req, stream: bool, reply, events):
        """Queue ``req`` and answer it: for a plain request ``reply(started, done)``, for a streamed
        one an SSE response over ``events(handle, first, watcher)`` (which must release the handle
        and the watcher when it ends). Shared by the OpenAI and Anthropic routes."""
        handle = self.engine.submit(req, loop=asyncio.get_running_loop())
        self.handles.add(handle)
        watcher = asyncio.create_task(cancel_on_disconnect(request, handle))
        try:
            if not stream:
                started, done = await self.collect(handle)
                watcher.cancel()
                return JSONResponse(reply(started, done), headers=self.max_tokens_header(req, done.prompt_tokens))
            # Wait briefly for the first event so early failures get a real HTTP status.
            first = await handle.next_event(self.keepalive_s)
            if isinstance(first, Failed):
                raise errors.from_failed(first)
        except BaseException:
            watcher.cancel()
            handle.cancel()
            self.handles.discard(handle)
            raise
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if isinstance(first, Started):  # (a request still queued, or prefilling, learns it from the body)
            headers.update(self.max_tokens_header(req, first.prompt_tokens))
        return StreamingResponse(events(handle, first, watcher), media_type="text/event-stream", headers=headers)

    async def collect(self, handle) -> tuple[Started | None, Done]:
        started = None
        try:
            async for ev in handle:
                if isinstance(ev, Started):
                    started = ev
                if isinstance(ev, Failed):
                    raise errors.from_failed(ev)
                if isinstance(ev, Done):
                    if ev.finish_reason == "cancelled":
                        raise errors.Cancelled("generation cancelled (client gone or server stopping)")
                    return started, ev
        finally:
            handle.cancel()  # no-op once done; stops the engine if this task is cancelled
            self.handles.discard(handle)
        raise errors.MlxSpecError("engine ended the request without a result")


def served(request: HTTPRequest) -> Served:
    return request.app.state.served


def create_app(
    engine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    keepalive_s: float = KEEPALIVE_S,
    defaults: schemas.RequestDefaults = schemas.NO_DEFAULTS,
    names: schemas.ModelNames = schemas.ANY_NAME,
    policy: guard.Policy | None = None,
) -> FastAPI:
    """An OpenAI-compatible app (and Anthropic's Messages API, server/anthropic.py) over a started
    ``Engine`` (or anything with its interface). ``defaults`` fill fields a request omits;
    ``names``: which model names requests may give (default: any). ``policy``: Host/Origin checks
    and client bounds on every route (server/guard.py; ``serve`` always passes one, None = none)."""
    app = FastAPI(title="mlx_spec", docs_url=None, redoc_url=None, openapi_url=None)
    state = Served(engine, api_key, max_body_bytes, keepalive_s, defaults, schemas.now(), names)
    app.state.served = state
    app.state.cancel_all = state.cancel_all
    if policy is not None:  # inside _Counter: its 403s and 429s are counted too
        app.add_middleware(guard.Guard, policy=policy, counters=state.refused)
    app.add_middleware(_Counter, counts=state.http_counts, live=state.live)
    app.add_exception_handler(errors.MlxSpecError, on_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_crash)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/health", health, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/models", models, methods=["GET"], dependencies=AUTH)
    app.add_api_route("/v1/models/{name:path}", model, methods=["GET"], dependencies=AUTH)
    app.add_api_route("/metrics", metrics, methods=["GET"], dependencies=AUTH)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], dependencies=AUTH)
    app.add_api_route("/v1/completions", completions, methods=["POST"], dependencies=AUTH)
    for path, handler in anthropic.HANDLERS:
        app.add_api_route(path, handler, methods=["POST"], dependencies=AUTH)
    return app


# -- handlers ---------------------------------------------------------------------------------


async def check_key(request: HTTPRequest) -> None:
    api_key = served(request).api_key
    if api_key is None:
        return
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer":  # Anthropic clients send the key as 'x-api-key'
        token = request.headers.get("x-api-key", "")
    if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise Unauthorized("missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')")


AUTH = [Depends(check_key)]


def api(request):  # the error shape of the API the request was for
    return anthropic if anthropic.is_route(request.url.path) else errors


async def on_error(request, exc):
    return api(request).to_response(exc)


async def on_http_error(request, exc: HTTPException):
    return api(request).http_error(exc.status_code, str(exc.detail))


async def on_crash(request, exc):  # a bug: answer in the API's shape; uvicorn logs the traceback
    return api(request).to_response(exc)


async def health(request: HTTPRequest):
    s = served(request)
    engine = s.engine
    group = getattr(engine, "group", None)  # the distributed group's state, None on one process
    if engine.state == READY and group is not None and not group["healthy"]:
        _, content = errors.to_body(errors.GroupFailed(f"the distributed group is unhealthy: {group['error']}"))
        content.update(status="group_failed", group=group, speculation=schemas.speculation(engine.info))
        return JSONResponse(content, status_code=503)
    if engine.state == READY:
        info = engine.info
        return {
            "status": "ok",
            "model": engine.info.target,
            "context_length": engine.context_length,
            "speculation": schemas.speculation(info),
            "queue_depth": engine.queue_depth,
            "group": group or info.group.as_dict(),
            # continuous batching's attention path ("shared K/V over N layers" | "per sequence
            # (<reason>)"); None when requests run one at a time
            "batch_attention": getattr(engine, "batch_attention", None),
            # the batch's drafter pass ("one pass for all" | "per sequence (<reason>)"): a failed
            # self-check is said here, not only in the log
            "batch_drafter": getattr(engine, "batch_drafter", None),
            # the batch's chain drafters (MTP / EAGLE-3): k passes per drafting sequence, not packed
            "batch_chain": getattr(engine, "batch_chain", None),
            # drafter passes with a NaN/inf hidden state or logit, and the float32 fallback they caused
            "drafter": {k: v for k, v in engine.snapshot().items() if k.startswith("drafter_")},
        }
    _, content = errors.to_body(s.not_ready())  # the 503 a completion request gets now
    content["status"] = "failed" if engine.state == FAILED else "loading"
    content["speculation"] = None
    return JSONResponse(content, status_code=503, headers={"Retry-After": str(errors.RETRY_AFTER_S)})


async def models(request: HTTPRequest):
    s = served(request)
    info = s.ready_info()
    return {
        "object": "list",
        "data": [schemas.model_card(n, s.created, s.engine.context_length, info) for n in s.names.listed(info.target)],
    }


async def model(request: HTTPRequest, name: str):
    """The card of ``name``: an alias's own, else (any name reaching the target) the target's."""
    s = served(request)
    info = s.ready_info()
    target = s.check_model(name)
    shown = name if name in s.names.aliases else target
    return schemas.model_card(shown, s.created, s.engine.context_length, info)


async def metrics(request: HTTPRequest):
    s = served(request)
    text = prometheus(s.engine, s.http_counts, s.live) + guard.metrics_text(s.refused, s.engine.snapshot())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def chat_completions(request: HTTPRequest):
    return await complete(request, schemas.ChatCompletionRequest, "chat")


async def completions(request: HTTPRequest):
    return await complete(request, schemas.CompletionRequest, "text")


async def complete(request: HTTPRequest, model_cls, kind: str):
    s = served(request)
    engine = s.engine
    body = schemas.parse(model_cls, await s.body(request))
    model_name = s.check_model(body.model)
    req = body.to_engine(engine.context_length, s.defaults)
    rid = schemas.new_id("chatcmpl" if kind == "chat" else "cmpl")
    created_at = schemas.now()
    # Tool calls are parsed only for a chat request with tools and a tokenizer that has a
    # tool-call format; reasoning is split off for a chat request to a model that writes
    # it; otherwise the model's text is returned as it is.
    fmt = getattr(engine, "tool_format", None) if kind == "chat" and body.active_tools else None
    think = getattr(engine, "think_format", None) if kind == "chat" else None

    def reply_stream(started: Started | None) -> output.OutputStream | None:
        if fmt is None and think is None:
            return None
        return output.OutputStream(think, bool(started and started.reasoning), fmt, body.active_tools)

    def reply(started: Started | None, done: Done):
        limits = s.limits(req, done.prompt_tokens)
        if fmt is None and think is None:
            return schemas.completion(kind, rid, created_at, model_name, done, limits=limits)
        reasoning, content, calls = output.split(
            done.text, think, bool(started and started.reasoning), fmt, body.active_tools
        )
        return schemas.completion(
            kind,
            rid,
            created_at,
            model_name,
            done,
            content=content,
            tool_calls=calls,
            reasoning=reasoning,
            limits=limits,
        )

    return await s.respond(
        request,
        req,
        body.stream,
        reply,
        lambda handle, first, watcher: sse(
            s, handle, first, watcher, kind, rid, created_at, model_name, body.include_usage, reply_stream, req
        ),
    )


async def sse(
    s: Served, handle, first, watcher, kind, rid, created_at, model, include_usage, reply_stream, req
) -> AsyncIterator[str]:
    def data(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    def chunk(**kw):
        return schemas.chunk(kind, rid, created_at, model, include_usage=include_usage, **kw)

    def pieces(items):  # reasoning, content text and tool calls, in the order the model wrote them
        for item in items:
            if isinstance(item, dict):
                yield data(chunk(tool_calls=[item]))
            elif item[0] == "reasoning":
                yield data(chunk(reasoning=item[1]))
            else:
                yield data(chunk(text=item[1]))

    ev, out = first, None
    try:
        while True:
            if ev is None:
                yield ": keep-alive\n\n"
            elif isinstance(ev, Started):
                out = reply_stream(ev)
                if kind == "chat":
                    yield data(chunk(role=True))
            elif isinstance(ev, Failed):
                _, content = errors.to_body(errors.from_failed(ev))
                yield data(content)
                break
            elif isinstance(ev, Done):
                if ev.finish_reason == "cancelled":
                    yield data(
                        errors.body(
                            "generation cancelled: the server is shutting down", "server_error", None, "cancelled"
                        )
                    )
                    break
                extra = {
                    "timings": ev.timings,
                    "speculation": schemas.speculation(ev.engine, ev.stats),
                    "limits": s.limits(req, ev.prompt_tokens),
                }
                finish = schemas.finish_reason(ev)
                if out is not None:
                    for piece in pieces(out.finish()):
                        yield piece
                    finish = tools.finish_reason(finish, out.called)
                yield data(chunk(finish=finish, **extra))
                if include_usage:
                    yield data({**chunk(), "choices": [], "usage": schemas.usage(ev), **extra})
                break
            elif ev.text and out is not None:
                for piece in pieces(out.feed(ev.text)):
                    yield piece
            elif ev.text:
                yield data(chunk(text=ev.text))
            ev = await handle.next_event(s.keepalive_s)
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()
        s.handles.discard(handle)
        watcher.cancel()


class _Counter:
    """Pure ASGI middleware: counts responses by (route, status) and requests in flight."""

    def __init__(self, app, counts: dict, live: dict):
        self.app, self.counts, self.live = app, counts, live

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        self.live["in_flight"] += 1
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.live["in_flight"] -= 1
            key = (route, status[0])
            self.counts[key] = self.counts.get(key, 0) + 1
            if status[0] == 503 and route.startswith("/v1/"):
                self.live["rejected"] += 1


def check_json_content_type(request: HTTPRequest) -> None:
    """A body must be JSON: ``application/json`` (or ``application/*+json``); no header is
    taken as JSON. Anything else (``text/plain``, a form) is refused with 415."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedMediaType(
            f"Content-Type '{declared}' is not supported: send the body as JSON with 'Content-Type: application/json'"
        )


async def read_body(request: HTTPRequest, limit: int) -> bytes:
    check_json_content_type(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the {limit}-byte limit")
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
    return bytes(buf)


async def cancel_on_disconnect(request: HTTPRequest, handle) -> None:
    """After the body is read, the next ASGI message is http.disconnect: cancel then."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


def prometheus(engine, http_counts: dict, live: dict) -> str:
    """Prometheus text exposition (names follow llama.cpp's ``spec_decode`` counters)."""
    snap = engine.snapshot()
    out: list[str] = []

    def metric(name, kind, help_, samples):
        out.append(f"# HELP mlx_spec:{name} {help_}")
        out.append(f"# TYPE mlx_spec:{name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            out.append(f"mlx_spec:{name}{{{lab}}} {value}" if lab else f"mlx_spec:{name} {value}")

    metric("requests_total", "counter", "Generation requests the engine took from its queue.", [({}, snap["requests"])])
    metric(
        "requests_cancelled_total", "counter", "Generations cancelled (client disconnected).", [({}, snap["cancelled"])]
    )
    metric(
        "request_errors_total",
        "counter",
        "Generation requests that failed in the engine (bad prompt, too long, bug).",
        [({}, snap["errors"])],
    )
    metric(
        "requests_rejected_total",
        "counter",
        "Completion requests answered 503 (queue full or not ready).",
        [({}, live["rejected"])],
    )
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished generations.", [({}, snap["prompt_tokens"])])
    metric(
        "prompt_tokens_cached_total",
        "counter",
        "Prompt tokens reused from the prefix cache (not prefilled).",
        [({}, snap["cached_tokens"])],
    )
    metric(
        "prefix_cache_bytes",
        "gauge",
        "Bytes of K/V the prefix cache holds for reuse.",
        [({}, snap["prefix_cache_bytes"])],
    )
    pc = snap.get("prefix_cache") or {}  # prefix.PrefixCache.stats(): memory and disk tiers
    metric(
        "prefix_cache_hits_total",
        "counter",
        "Requests that started from a cached prefix, by where it was found.",
        [
            ({"tier": "memory"}, pc.get("hits", 0) - pc.get("disk", {}).get("hits", 0)),
            ({"tier": "disk"}, pc.get("disk", {}).get("hits", 0)),
        ],
    )
    metric(
        "prefix_cache_disk_bytes_read_total",
        "counter",
        "Bytes of cached prefixes loaded from disk.",
        [({}, pc.get("disk", {}).get("bytes_read", 0))],
    )
    metric(
        "prefix_cache_disk_bytes",
        "gauge",
        "Bytes of this model's prefixes stored on disk.",
        [({}, pc.get("disk", {}).get("bytes", 0))],
    )
    metric(
        "prefix_cache_saved_seconds_total",
        "counter",
        "Prefill time the reused prefixes saved (estimated at the measured prefill rate, less the disk loads).",
        [({}, round(pc.get("saved_ms", 0.0) / 1e3, 3))],
    )
    metric("tokens_predicted_total", "counter", "Tokens generated (committed), all requests.", [({}, snap["tokens"])])
    metric(
        "spec_decode_num_drafts_total",
        "counter",
        "Draft blocks proposed (verify cycles that drafted).",
        [({}, snap["cycles"])],
    )
    metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [({}, snap["drafted"])])
    metric(
        "spec_decode_num_accepted_tokens_total",
        "counter",
        "Draft tokens accepted by the target.",
        [({}, snap["accepted"])],
    )
    metric(
        "spec_decode_num_draft_tokens_per_pos_total",
        "counter",
        "Draft tokens proposed at block position N (1 = first token after the anchor).",
        [({"position": str(k + 1)}, v) for k, v in enumerate(snap.get("drafted_by_position", []))],
    )
    metric(
        "spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Draft tokens accepted at block position N (1 = first token after the anchor).",
        [({"position": str(k + 1)}, v) for k, v in enumerate(snap["accepted_by_position"])],
    )
    if snap.get("batch_drafter"):
        metric(
            "batch_drafter_packed",
            "gauge",
            "1 when the batch runs one drafter pass for all drafting sequences, 0 when its self-check "
            "failed and it drafts per sequence (the path label says why).",
            [({"path": snap["batch_drafter"]}, int(snap["batch_drafter"] == "one pass for all"))],
        )
    metric(
        "drafter_nonfinite_passes_total",
        "counter",
        "Drafter passes with a non-finite hidden state or logit (their drafts are rejected; the first "
        "switches the drafter to float32 activations).",
        [({}, snap.get("drafter_nonfinite", 0))],
    )
    metric(
        "drafter_float32_fallback",
        "gauge",
        "1 once non-finite passes switched the drafter to float32.",
        [({}, int(bool(snap.get("drafter_fallback"))))],
    )
    metric(
        "spec_decode_plain_cycles_total",
        "counter",
        "Plain target steps the drafting policy took instead of a draft (cycles without drafts).",
        [({}, snap.get("plain_cycles", 0))],
    )
    metric(
        "spec_decode_drafter_passes_total",
        "counter",
        "Cycles the DFlash drafter ran in (its block then verified whole, in part, or not at all).",
        [({}, snap.get("drafter_passes", 0))],
    )
    metric(
        "spec_decode_head_passes_total",
        "counter",
        "Chain drafter passes (MTP heads, EAGLE-3 layers: a chain of depth k runs k).",
        [({}, snap.get("head_passes", 0))],
    )
    if snap.get("batch_chain") and snap["batch_chain"] != "none":
        metric(
            "batch_chain_drafters",
            "gauge",
            "1 when the batch has chain drafters; the path label says how their passes run.",
            [({"path": snap["batch_chain"]}, 1)],
        )
    metric(
        "spec_decode_trimmed_total",
        "counter",
        "Drafter passes whose block the policy verified only in part (or not at all: a plain cycle).",
        [({}, snap.get("trimmed", 0))],
    )
    metric(
        "spec_decode_cycles_by_block_total",
        "counter",
        "Verify cycles by block size (rows verified, anchor included; 1 = a plain step).",
        [({"block": str(L)}, n) for L, n in sorted(snap.get("block_sizes", {}).items())],
    )
    for name, key, help_ in (
        ("spec_decode_source_drafts_total", "cycles", "Drafted cycles by draft source."),
        ("spec_decode_source_draft_tokens_total", "drafted", "Draft tokens by draft source."),
        ("spec_decode_source_accepted_tokens_total", "accepted", "Accepted draft tokens by draft source."),
    ):
        metric(
            name,
            "counter",
            help_ + " (dflash: the DFlash drafter; mtp: the target's MTP head; eagle: an EAGLE-3 drafter; "
            "lookup: copies of earlier text)",
            [({"source": src}, c[key]) for src, c in sorted(snap.get("sources", {}).items())],
        )
    metric(
        "http_requests_total",
        "counter",
        "HTTP responses by route and status.",
        [({"route": r, "status": str(s)}, n) for (r, s), n in sorted(http_counts.items())],
    )
    metric("queue_depth", "gauge", "Requests waiting for the engine thread.", [({}, snap["queue_depth"])])
    if "batch_sizes" in snap:  # continuous batching (batch.py)
        metric(
            "batch_max",
            "gauge",
            "Requests the engine decodes together at most (--max-batch).",
            [({}, snap["max_batch"])],
        )
        metric("batch_active", "gauge", "Requests in the running batch now.", [({}, snap["batch_active"])])
        sizes = snap["batch_sizes"]
        hist, run = [], 0
        for le in sorted(set(sizes) | {1, 2, 4, 8, 16}):
            run += sizes.get(le, 0)
            hist.append(({"le": str(le)}, run))
        hist.append(({"le": "+Inf"}, sum(sizes.values())))
        out.append("# HELP mlx_spec:batch_size Decoding sequences in each batched step.")
        out.append("# TYPE mlx_spec:batch_size histogram")
        out += [f'mlx_spec:batch_size_bucket{{le="{lab["le"]}"}} {v}' for lab, v in hist]
        out.append(f"mlx_spec:batch_size_sum {sum(k * v for k, v in sizes.items())}")
        out.append(f"mlx_spec:batch_size_count {sum(sizes.values())}")
        metric(
            "batch_steps_total",
            "counter",
            "Batched steps by kind: plain (no sequence drafted) or drafted (at least one sequence verified a draft).",
            [({"kind": k}, v) for k, v in sorted(snap["batch_steps"].items())],
        )
        metric(
            "batch_pipelined_steps_total",
            "counter",
            "Plain batched steps queued before the step ahead "
            "of them was read (pipelined; counted among the plain steps).",
            [({}, snap.get("batch_pipelined", 0))],
        )
    metric("http_requests_in_flight", "gauge", "HTTP requests being handled now.", [({}, live["in_flight"])])
    metric("engine_ready", "gauge", "1 when the engine is loaded and serving.", [({}, int(snap["state"] == READY))])
    info = getattr(engine, "info", None)
    if info is not None:
        labels = {k: str(v) for k, v in info.as_dict().items() if v is not None}
        metric("engine_info", "gauge", "The engine that runs (method, target, drafter, block size).", [(labels, 1)])
    return "\n".join(out) + "\n"


def _escape(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
