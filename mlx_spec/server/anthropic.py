"""The Anthropic Messages API over the same engine: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Requests become the same engine ``Request`` as the OpenAI routes (same queue, metrics and
speculation reporting): the system prompt and the messages' blocks are mapped to the chat
template's messages (``tool_use`` -> the assistant's ``tool_calls``, ``tool_result`` -> ``tool``
messages, ``thinking`` -> ``reasoning_content``), custom tools to the template's tool list.
The reply goes through ``output.OutputStream`` (reasoning -> ``thinking`` blocks, tool calls in the
tokenizer's format -> ``tool_use`` blocks). Errors have Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``.

Fields agents send that do not apply to a local model (``cache_control``, ``metadata``,
``service_tier``, ``container``, ...) are accepted and ignored; fields whose meaning cannot be
honoured (images, Anthropic-hosted tools, a forced tool choice) are refused with a 400.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import Request as HTTPRequest
from pydantic import Field
from starlette.responses import JSONResponse

from ..engine import Done, Failed, Request, Started
from ..errors import BadRequest
from ..text import encode_prompt
from ..thinking import REASONING
from . import errors, output, schemas
from .errors import InvalidField

PREFIX = "/v1/messages"
ROUTES = (PREFIX, PREFIX + "/count_tokens")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")
THINKING = {"enabled": True, "disabled": False, "adaptive": None, "between_tools": None}


def is_route(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


# -- errors ------------------------------------------------------------------------------------


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def to_response(exc: BaseException) -> JSONResponse:
    """The OpenAI routes' status for this exception, in Anthropic's body."""
    status, content = errors.to_body(exc)
    headers = {"Retry-After": str(errors.RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(error_body(status, content["error"]["message"]), status_code=status, headers=headers)


def http_error(status: int, detail: str) -> JSONResponse:
    return JSONResponse(error_body(status, detail), status_code=status)


# -- requests ----------------------------------------------------------------------------------


class AnthropicMessage(schemas.RequestBody):
    # "system": Claude Code puts system entries among the messages (the template gets a system
    # message there; before the first turn they join the system prompt)
    role: Literal["user", "assistant", "system"]
    content: str | list[dict]


class _Conversation(schemas.RequestBody):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    chat_template_kwargs: dict | None = None  # extension, as on the OpenAI routes

    def prompt(self, defaults: schemas.RequestDefaults) -> dict:
        """The engine Request's prompt fields: template messages, tools, template variables."""
        tools = self.active_tools()
        messages = [{"role": "system", "content": system_text(self.system)}] if self.system else []
        for i, m in enumerate(self.messages):
            if m.role == "system":
                text = system_text(m.content, f"messages[{i}].content")
                if all(x["role"] == "system" for x in messages) and messages:
                    messages[0]["content"] += "\n" + text
                else:
                    messages.append({"role": "system", "content": text})
                continue
            messages += template_messages(m, i)
        return {"messages": messages, "tools": tools, "template_kwargs": defaults.template(self.template_kwargs())}

    def active_tools(self) -> list[dict] | None:
        choice = (self.tool_choice or {}).get("type", "auto")
        if choice not in ("auto", "none", "any", "tool"):
            raise InvalidField(f"tool_choice.type must be auto, any, tool or none (got {choice!r})", "tool_choice")
        if choice in ("any", "tool"):
            raise InvalidField(
                f"tool_choice '{choice}' is not supported: the reply is the target's own "
                "unconstrained text, so a tool call cannot be forced; send 'auto' or 'none'",
                "tool_choice",
            )
        if choice == "none" or not self.tools:
            return None
        return [openai_tool(t, i) for i, t in enumerate(self.tools)]

    def template_kwargs(self) -> dict | None:
        kw = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind not in THINKING:
                raise InvalidField(
                    f"thinking.type must be one of {', '.join(THINKING)} (got {kind!r})", "thinking.type"
                )
            if THINKING[kind] is not None:
                kw.setdefault("enable_thinking", THINKING[kind])
        return kw or None


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    speculate: bool | None = True  # extension, as on the OpenAI routes

    def to_engine(self, context_length: int | None, defaults: schemas.RequestDefaults) -> Request:
        # max_tokens is an upper bound (Claude Code sends 32000 on any model): the reply stops where
        # the context ends, with stop_reason "max_tokens"; a prompt that fills it is refused.
        stops = [s for s in self.stop_sequences or [] if s]
        if len(stops) > 16:
            raise InvalidField(f"at most 16 stop sequences (got {len(stops)})", "stop_sequences")
        return Request(
            max_tokens=self.max_tokens,
            stop=tuple(stops),
            speculate=self.speculate is not False,
            id=f"req-{uuid.uuid4().hex[:12]}",
            **defaults.sampling(self.temperature, self.top_p, self.top_k),
            **self.prompt(defaults),
        )


class CountTokensRequest(_Conversation):
    pass


BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block, new on every request


def system_text(system: str | list[dict], where: str = "system") -> str:
    """The system prompt's text. Claude Code's billing block (``x-anthropic-billing-header: ...``,
    Anthropic's accounting, not an instruction) is dropped: it changes from request to request and
    would end the shared prefix the prefix cache reuses at the prompt's first tokens."""
    if isinstance(system, str):
        return system
    texts = [_text_block(b, f"{where}[{j}]") for j, b in enumerate(system)]
    return "\n".join(t for t in texts if not t.startswith(BILLING_HEADER))


def _text_block(b, where: str) -> str:
    if not isinstance(b, dict) or b.get("type") != "text":
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        raise InvalidField(f"{where}: expected a text block (got {kind!r})", where)
    if not isinstance(b.get("text"), str):
        raise InvalidField(f"{where}: a text block needs a string 'text'", f"{where}.text")
    return b["text"]


def template_messages(m: AnthropicMessage, i: int) -> list[dict]:
    """One Anthropic message -> the chat template's messages (a user turn with tool results
    becomes ``tool`` messages, in order, around its text)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict] = []
    text: list[str] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    allowed = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        kind = b.get("type")
        if not isinstance(kind, str):
            raise InvalidField(f"{where}: a content block needs a string 'type'", f"{where}.type")
        if kind in UNSUPPORTED_BLOCKS:
            raise InvalidField(
                f"{where}: {kind} blocks are not supported (this server runs a text-only model)", f"{where}.type"
            )
        if kind not in allowed[m.role]:
            known = kind in allowed["user"] + allowed["assistant"]
            raise InvalidField(
                f"{where}: "
                + (
                    f"a {m.role} message cannot hold a {kind} block"
                    if known
                    else f"unknown content block type {kind!r} (expected one of {', '.join(allowed[m.role])})"
                ),
                f"{where}.type",
            )
        if kind == "text":
            text.append(_text_block(b, where))
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise InvalidField(f"{where}: a thinking block needs a string 'thinking'", f"{where}.thinking")
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_call(b, where))
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append(_tool_message(b, where))
        # redacted_thinking: opaque to a local model, dropped
    if m.role == "assistant":
        msg = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        return [msg]
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _tool_call(b: dict, where: str) -> dict:
    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not b["name"]:
        raise InvalidField(f"{where}: a tool_use block needs string 'id' and 'name'", where)
    args = b.get("input", {})
    if not isinstance(args, dict):
        raise InvalidField(f"{where}: tool_use 'input' must be an object", f"{where}.input")
    return {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}}


def _tool_message(b: dict, where: str) -> dict:
    if not isinstance(b.get("tool_use_id"), str):
        raise InvalidField(f"{where}: a tool_result block needs a string 'tool_use_id'", f"{where}.tool_use_id")
    content = b.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(c, f"{where}.content[{k}]") for k, c in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidField(f"{where}: tool_result 'content' must be a string or text blocks", f"{where}.content")
    if b.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": b["tool_use_id"], "content": content}


def openai_tool(t: dict, i: int) -> dict:
    """An Anthropic custom tool -> the template's (OpenAI-shaped) function tool."""
    kind = t.get("type", "custom")
    if kind != "custom":
        raise InvalidField(
            f"tools[{i}]: type {kind!r} is an Anthropic-hosted or Anthropic-defined tool; "
            "only custom tools (name, description, input_schema) run here",
            f"tools[{i}].type",
        )
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise InvalidField(f"tools[{i}]: a tool needs a string 'name'", f"tools[{i}].name")
    schema = t.get("input_schema")
    if not isinstance(schema, dict):
        raise InvalidField(f"tools[{i}]: a tool needs an 'input_schema' object", f"tools[{i}].input_schema")
    fn = {"name": t["name"], "description": t.get("description") or "", "parameters": schema}
    return {"type": "function", "function": fn}


# -- responses ---------------------------------------------------------------------------------


def tool_use(call: dict) -> dict | None:
    """An OpenAI-shaped tool call -> a ``tool_use`` block (None when its arguments are not an object)."""
    try:
        args = json.loads(call["function"]["arguments"])
    except (TypeError, ValueError):
        return None
    if not isinstance(args, dict):
        return None
    cid = call["id"]
    return {
        "type": "tool_use",
        "id": "toolu_" + cid[5:] if cid.startswith("call_") else cid,
        "name": call["function"]["name"],
        "input": args,
    }


def stop_reason(done: Done, called: bool) -> tuple[str, str | None]:
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.stop_sequence:
        return "stop_sequence", done.stop_sequence
    return ("tool_use" if called else "end_turn"), None


def usage(done: Done) -> dict:
    """Anthropic's split: ``input_tokens`` are the prompt tokens that were prefilled,
    ``cache_read_input_tokens`` those reused from the prefix cache (their sum is the prompt)."""
    cached = schemas.usage(done)["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": done.prompt_tokens - cached,
        "output_tokens": done.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def blocks(items: list) -> tuple[list[dict], bool]:
    """OutputStream items -> content blocks (adjacent text merged); and whether a tool was called."""
    out: list[dict] = []
    called = False
    for item in items:
        if isinstance(item, dict):
            block = tool_use(item)
            if block is not None:
                out.append(block)
                called = True
                continue
            item = ("content", _raw_call(item))
        kind, text = item
        if kind == REASONING:
            if out and out[-1]["type"] == "thinking":
                out[-1]["thinking"] += text
            else:
                out.append({"type": "thinking", "thinking": text, "signature": ""})
        elif out and out[-1]["type"] == "text":
            out[-1]["text"] += text
        else:
            out.append({"type": "text", "text": text})
    return out, called


def _raw_call(call: dict) -> str:
    return json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})


def message(mid: str, model: str, done: Done, content: list[dict], called: bool, limits: dict | None = None) -> dict:
    reason, seq = stop_reason(done, called)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(done),
        "timings": done.timings,
        "speculation": schemas.speculation(done.engine),
        "limits": limits,
    }


class _Blocks:
    """Streamed content blocks: opens, extends and closes them as items arrive."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "text" | "thinking" | None
        self.called = False

    def items(self, items: list) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for item in items:
            if isinstance(item, dict):
                block = tool_use(item)
                if block is None:
                    item = ("content", _raw_call(item))
                else:
                    self._close(out)
                    self.called = True
                    self._start(out, {**block, "input": {}})
                    out.append(
                        (
                            "content_block_delta",
                            {
                                "type": "content_block_delta",
                                "index": self.index,
                                "delta": {
                                    "type": "input_json_delta",
                                    "partial_json": json.dumps(block["input"], ensure_ascii=False),
                                },
                            },
                        )
                    )
                    self._close(out)
                    continue
            kind, text = item
            want = "thinking" if kind == REASONING else "text"
            if self.open != want:
                self._close(out)
                self._start(
                    out,
                    {"type": "thinking", "thinking": "", "signature": ""}
                    if want == "thinking"
                    else {"type": "text", "text": ""},
                )
                self.open = want
            delta = (
                {"type": "thinking_delta", "thinking": text}
                if want == "thinking"
                else {"type": "text_delta", "text": text}
            )
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        self._close(out)
        return out

    def _start(self, out: list, block: dict) -> None:
        self.index += 1
        self.open = block["type"]
        out.append(
            ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )

    def _close(self, out: list) -> None:
        if self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None


def sse_event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


# -- routes ------------------------------------------------------------------------------------
# Module-level handlers; ``create_app`` registers ``HANDLERS``. ``request.app.state.served`` is
# server/app.py's ``Served``: the engine, the model check, ``respond`` (submit a request and answer
# it plainly or as a stream, cancelling on disconnect) and the generations in flight.


def _reply_stream(engine, started: Started | None, tools: list | None) -> output.OutputStream:
    tool_fmt = getattr(engine, "tool_format", None) if tools else None
    return output.OutputStream(
        getattr(engine, "think_format", None), bool(started and started.reasoning), tool_fmt, tools
    )


async def messages(request: HTTPRequest):
    s = request.app.state.served
    engine = s.engine
    body = schemas.parse(MessagesRequest, await s.body(request))
    served = s.check_model(body.model)
    req = body.to_engine(engine.context_length, s.defaults)
    mid = f"msg_{uuid.uuid4().hex[:24]}"

    def reply(started: Started | None, done: Done) -> dict:
        out = _reply_stream(engine, started, req.tools)
        content, called = blocks(out.feed(done.text) + out.finish())
        return message(mid, served, done, content, called, s.limits(req, done.prompt_tokens))

    return await s.respond(
        request,
        req,
        body.stream,
        reply,
        lambda handle, first, watcher: stream(s, handle, first, watcher, mid, served, req),
    )


async def stream(s, handle, first, watcher, mid: str, model: str, req) -> AsyncIterator[str]:
    tools = req.tools
    ev, out, built = first, None, _Blocks()
    try:
        while True:
            if ev is None:  # before message_start an SSE comment; after it Anthropic's ping
                yield sse_event("ping", {"type": "ping"}) if out is not None else ": keep-alive\n\n"
            elif isinstance(ev, Started):
                out = _reply_stream(s.engine, ev, tools)
                yield sse_event(
                    "message_start",
                    {
                        "type": "message_start",
                        "message": {
                            "id": mid,
                            "type": "message",
                            "role": "assistant",
                            "model": model,
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": {"input_tokens": ev.prompt_tokens, "output_tokens": 0},
                        },
                    },
                )
                yield sse_event("ping", {"type": "ping"})
            elif isinstance(ev, Failed):
                status, content = errors.to_body(errors.from_failed(ev))
                yield sse_event("error", error_body(status, content["error"]["message"]))
                break
            elif isinstance(ev, Done):
                if ev.finish_reason == "cancelled" or out is None:
                    yield sse_event("error", error_body(503, "generation cancelled: the server is shutting down"))
                    break
                for name, data in built.items(out.finish()) + built.close():
                    yield sse_event(name, data)
                reason, seq = stop_reason(ev, built.called)
                yield sse_event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": usage(ev),
                        "timings": ev.timings,
                        "speculation": schemas.speculation(ev.engine),
                        "limits": s.limits(req, ev.prompt_tokens),
                    },
                )
                yield sse_event("message_stop", {"type": "message_stop"})
                break
            elif ev.text and out is not None:
                for name, data in built.items(out.feed(ev.text)):
                    yield sse_event(name, data)
            ev = await handle.next_event(s.keepalive_s)
    finally:
        handle.cancel()
        s.handles.discard(handle)
        watcher.cancel()


async def count_tokens(request: HTTPRequest):
    s = request.app.state.served
    body = schemas.parse(CountTokensRequest, await s.body(request))
    s.check_model(body.model)
    prompt = body.prompt(s.defaults)

    def count(pair) -> int:
        try:
            return len(
                encode_prompt(
                    pair.tokenizer,
                    None,
                    prompt["messages"],
                    tools=prompt["tools"],
                    template_kwargs=prompt["template_kwargs"],
                )
            )
        except Exception as e:  # e.g. the chat template rejects these messages
            raise BadRequest(f"could not build the prompt: {type(e).__name__}: {e}") from None

    return {"input_tokens": await asyncio.wrap_future(s.engine.call(count))}


HANDLERS = ((PREFIX, messages), (PREFIX + "/count_tokens", count_tokens))
