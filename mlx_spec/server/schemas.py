"""OpenAI request bodies (pydantic, strict JSON types) and the response shapes we send back.

Requests are validated with ``parse(Model, body)``; anything wrong becomes ``InvalidField``
(400, with ``param`` naming the field). Unknown fields are accepted and ignored, as OpenAI
clients send many; fields we cannot honour exactly (``n > 1``, penalties, logprobs, images)
are refused with a message rather than silently ignored.

Responses are plain dicts: the OpenAI shapes plus llama.cpp-style ``timings`` and a
``speculation`` object naming the engine that produced the text (see docs/server.md).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import Done, Request
from ..generation import EngineInfo
from . import tools
from .errors import InvalidField

MIN_TEMPERATURE = 1e-5  # below this sampling is the argmax anyway; greedy avoids inf in logits / T


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that omits a field gets (``serve --temp/--top-p/--top-k/--max-tokens/--think``).
    None: the API's own default (temperature 1, top_p 1, no top-k; OpenAI: no token limit but the
    context)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    template_kwargs: dict | None = None  # e.g. {"enable_thinking": False} (serve --no-think)

    def sampling(self, temperature, top_p, top_k) -> dict:
        """The engine Request's sampling fields: the request's values, else these defaults."""
        t = temperature if temperature is not None else (1.0 if self.temperature is None else self.temperature)
        return {
            "temperature": 0.0 if t < MIN_TEMPERATURE else t,
            "top_p": top_p if top_p is not None else (self.top_p or 1.0),
            "top_k": top_k if top_k is not None else (self.top_k or 0),
        }

    def template(self, request_kwargs: dict | None) -> dict | None:
        """Chat-template variables: the server's, overridden by the request's."""
        merged = {**(self.template_kwargs or {}), **(request_kwargs or {})}
        return merged or None


NO_DEFAULTS = RequestDefaults()


@dataclass(frozen=True)
class ModelNames:
    """The names a request's ``model`` may give (``serve --served-model-name/--strict-model-name``).

    One pair is served: by default any name reaches it (agents send their own defaults,
    ``claude-sonnet-...``, ``gpt-...``), and responses name the model that really answered.
    ``strict``: only the target's id, its folder name and the ``aliases`` are accepted, others 404."""

    aliases: tuple[str, ...] = ()
    strict: bool = False

    def accepts(self, name: str, target: str) -> bool:
        return not self.strict or name in (target, Path(target).name, *self.aliases)

    def listed(self, target: str) -> tuple[str, ...]:
        """The ids /v1/models lists: the target's, then each alias."""
        return (target,) + tuple(a for a in self.aliases if a != target)


ANY_NAME = ModelNames()


class RequestBody(BaseModel):
    # allow_inf_nan=False: a NaN / Infinity literal is refused as "not a finite number", not as
    # out of range.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(RequestBody):
    include_usage: bool = False


class ContentPart(RequestBody):
    type: str
    text: str | None = None


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class _Generation(RequestBody):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension (llama.cpp, mlx-lm)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    speculate: bool | None = True  # extension: false = plain decoding of the same target (A/B)

    def _check_common(self) -> None:
        if (self.n or 1) != 1:
            raise InvalidField("n > 1 is not supported (one choice per request)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidField(
                    f"{name} is not supported (it would change the target's distribution); send 0 or omit it", name
                )
        if self.logit_bias:
            raise InvalidField("logit_bias is not supported", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise InvalidField(f"at most 16 stop sequences (got {len(stops)})", "stop")

    def engine_request(
        self, max_tokens: int | None, context_length: int | None, defaults: RequestDefaults = NO_DEFAULTS, **prompt
    ) -> Request:
        # An upper bound, as agents send it (32000 on any model): the engine stops the reply where
        # the context ends; only a prompt that fills the context alone is refused (ContextTooLong).
        max_tokens = max_tokens if max_tokens is not None else defaults.max_tokens
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Request(
            max_tokens=max_tokens,
            **defaults.sampling(self.temperature, self.top_p, self.top_k),
            seed=None if self.seed is None else self.seed % (1 << 64),  # OpenAI seeds may be < 0
            stop=tuple(s for s in stops if s),
            speculate=self.speculate is not False,
            id=f"req-{uuid.uuid4().hex[:12]}",
            **prompt,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    logprobs: bool | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None  # extension (vLLM, llama.cpp): e.g. {"enable_thinking": false}

    @property
    def active_tools(self) -> list[dict] | None:
        """The tools the model is shown and whose calls are parsed: none with tool_choice "none"."""
        return None if self.tool_choice == "none" else (self.tools or None)

    def _check_tool_choice(self) -> None:
        c = self.tool_choice
        if c is None or c in ("auto", "none"):
            return
        if c == "required" or isinstance(c, dict):
            raise InvalidField(
                "tool_choice 'required' or a named function is not supported: the reply is "
                "the target's own unconstrained text, so a call cannot be forced; send "
                "'auto' (the model decides) or 'none'",
                "tool_choice",
            )
        raise InvalidField(f"tool_choice must be 'auto' or 'none' (got {c!r})", "tool_choice")

    def to_engine(self, context_length: int | None, defaults: RequestDefaults = NO_DEFAULTS) -> Request:
        self._check_common()
        self._check_tool_choice()
        if self.logprobs:
            raise InvalidField("logprobs are not supported", "logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidField("only response_format {'type': 'text'} is supported", "response_format")
        max_tokens = self.max_completion_tokens or self.max_tokens
        messages = [_template_message(m, i) for i, m in enumerate(self.messages)]
        return self.engine_request(
            max_tokens,
            context_length,
            defaults,
            messages=messages,
            tools=self.active_tools,
            template_kwargs=defaults.template(self.chat_template_kwargs),
        )


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def to_engine(self, context_length: int | None, defaults: RequestDefaults = NO_DEFAULTS) -> Request:
        self._check_common()
        for name in ("echo", "suffix", "logprobs"):
            if getattr(self, name):
                raise InvalidField(f"{name} is not supported", name)
        if (self.best_of or 1) != 1:
            raise InvalidField("best_of > 1 is not supported", "best_of")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            if any(t < 0 for t in p):
                raise InvalidField("token ids must be >= 0", "prompt")
            prompt = {"prompt_ids": tuple(p)}
        elif isinstance(p, list):
            if len(p) != 1:
                raise InvalidField(f"exactly one prompt per request (got {len(p)})", "prompt")
            prompt = {"prompt": p[0]}
        else:
            prompt = {"prompt": p}
        if prompt.get("prompt") == "" or prompt.get("prompt_ids") == ():
            raise InvalidField("prompt is empty", "prompt")
        return self.engine_request(self.max_tokens, context_length, defaults, **prompt)


def _template_message(m: ChatMessage, i: int) -> dict:
    """The message as the chat template sees it: text parts joined, extra keys kept."""
    d = m.model_dump(exclude_none=True)
    d["role"] = "system" if m.role == "developer" else m.role
    if isinstance(m.content, list):
        kinds = {part.type for part in m.content} - {"text"}
        if kinds:
            raise InvalidField(
                f"messages[{i}]: only text content is supported (got {sorted(kinds)})", f"messages[{i}].content"
            )
        d["content"] = "".join(part.text or "" for part in m.content)
    elif m.content is None:
        if m.role in NEEDS_CONTENT:  # only an assistant turn (e.g. one that called tools) may omit it
            missing = "content is null" if "content" in m.model_fields_set else "no content"
            raise InvalidField(
                f"messages[{i}]: a {m.role} message needs content ({missing}); send a string or a list of text parts",
                f"messages[{i}].content",
            )
        d["content"] = ""
    return d


NEEDS_CONTENT = ("system", "developer", "user", "tool")


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    if not body.strip():
        raise InvalidField("request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        if errs[0]["type"] == "json_invalid":
            raise InvalidField(f"malformed JSON: {_json_problem(body, errs[0]['msg'])}") from None
        path, tag = _split_loc(errs[0]["loc"])
        if not path:
            raise InvalidField(f"request body must be a JSON object ({errs[0]['msg']})") from None
        tags = [t for p, t in map(lambda x: _split_loc(x["loc"]), errs) if p == path and t]
        msg = f"expected one of {', '.join(dict.fromkeys(tags))}" if len(tags) > 1 else errs[0]["msg"]
        raise InvalidField(f"'{path}': {msg}", path) from None


def _split_loc(loc) -> tuple[str, str | None]:
    """("stop", "list[str]", 0) -> ("stop", "list[str]"): the field path, then the union member
    pydantic tried (a type name, not a field: fields are snake_case)."""
    for i, p in enumerate(loc):
        if isinstance(p, str) and ("[" in p or p[:1].isupper() or p in ("str", "int", "float", "bool")):
            return _path(loc[:i]), p
    return _path(loc), None


def _path(loc) -> str:
    """("messages", 0, "role") -> "messages[0].role", OpenAI's spelling of a field path."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if out else str(p)
    return out


_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"  # high, no low after
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)  # low, no high before


def _json_problem(body: bytes, msg: str) -> str:
    """The JSON parser's message, except a lone UTF-16 surrogate escape, named as such (the
    parser reports it as the end of a hex escape)."""
    if "escape" in msg or "surrogate" in msg:
        if found := _LONE_SURROGATE.search(body):
            return (
                f"a string holds the lone UTF-16 surrogate {found.group().decode()} (a high "
                "surrogate \\ud800-\\udbff must be followed by a low one \\udc00-\\udfff): "
                "not valid Unicode"
            )
    return msg


# -- responses -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def speculation(engine: EngineInfo | None, stats=None) -> dict | None:
    """Which engine ran: the same block in /v1/models, /health and every response. ``stats`` (a
    response's ``StatsSnapshot``) adds what the drafting policy did for that response."""
    if engine is None:
        return None
    out = {
        "enabled": engine.speculative,
        "method": engine.method,
        "target": engine.target,
        "drafter": engine.drafter,
        "block_size": engine.block_size,
        "block_size_source": engine.block_size_source,
        "draft_vocab": engine.draft_vocab or None,
        "policy": "per-cycle" if engine.adaptive_max and engine.speculative else "fixed",
        # the draft sources the per-cycle policy may use (a fixed block every cycle: DFlash alone)
        "sources": (list(engine.sources or ("dflash", "lookup")) if engine.adaptive_max else ["dflash"])
        if engine.speculative
        else [],
        "chains": {k: p for k, p in engine.chains} if engine.speculative else {},
        # the depth the tuner measured per chain drafter, the prior its policy starts from (none: not tuned)
        "chain_depths": dict(engine.depths) if engine.speculative else {},
        "group": engine.group.as_dict(),
    }
    if stats is not None and engine.speculative:
        d = stats.as_dict()
        out["cycles"] = {
            k: d[k]
            for k in (
                "cycles",
                "plain_cycles",
                "drafted_cycles",
                "drafter_passes",
                "head_passes",
                "trimmed",
                "block_sizes",
                "sources",
            )
            if k in d
        }
        if d.get("cycle_trace") is not None:
            out["cycles"]["trace"] = d["cycle_trace"]
    return out


MAX_TOKENS_HEADER = "x-mlx-spec-max-tokens-allowed"


def max_tokens_allowed(context_length: int | None, max_tokens: int | None, prompt_tokens: int) -> int | None:
    """The completion tokens a request may really use: its ``max_tokens`` (None: no limit but the
    context), capped where the context ends. None when neither bounds it."""
    room = context_length - prompt_tokens if context_length else None
    if max_tokens is None or room is None:
        return room if max_tokens is None else max_tokens
    return max(0, min(max_tokens, room))


def limits(context_length: int | None, max_tokens: int | None, prompt_tokens: int) -> dict:
    """The ``limits`` extension block of every response (both APIs; clients ignore unknown
    fields): the context length, the prompt, the max_tokens asked and what the context allowed."""
    return {
        "context_length": context_length,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "max_tokens_allowed": max_tokens_allowed(context_length, max_tokens, prompt_tokens),
    }


def usage(done: Done) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": int(done.stats.cached_tokens)},
    }


def finish_reason(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def completion(
    kind: str,
    rid: str,
    created: int,
    model: str,
    done: Done,
    *,
    content: str | None = None,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
    limits: dict | None = None,
) -> dict:
    """A whole (non-stream) response. ``kind`` is "chat" or "text". With ``tool_calls`` (parsed
    by server.tools), ``content`` is the text outside them (null when empty); ``content`` given
    alone replaces the text (reasoning split off into ``reasoning_content``)."""
    if kind == "chat":
        message = {"role": "assistant", "content": done.text if content is None else content}
        finish = finish_reason(done)
        if tool_calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
            finish = tools.finish_reason(finish, called=True)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish_reason(done)}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(done),
        "timings": done.timings,
        "speculation": speculation(done.engine, done.stats),
        "limits": limits,
    }


def chunk(
    kind: str,
    rid: str,
    created: int,
    model: str,
    *,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    include_usage: bool = False,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
    **extra,
) -> dict:
    """One streamed chunk with one choice; ``extra`` keys (timings, ...) are added at the top."""
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    out.update(extra)
    return out


def model_card(model_id: str, created: int, context_length: int | None, engine: EngineInfo) -> dict:
    """``root``: the model that answers under this id (the target; an alias's card names it)."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "mlx_spec",
        "root": engine.target,
        "context_length": context_length,
        "speculation": speculation(engine),
    }


def now() -> int:
    return int(time.time())
