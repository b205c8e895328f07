"""OpenAI request bodies (pydantic, strict JSON types) and the response shapes we send back.

Requests are validated with ``parse(Model, body)``; anything wrong becomes ``InvalidField``
(400, with ``param`` naming the field). Unknown fields are accepted and ignored, as OpenAI
clients send many; fields we cannot honour exactly (``n > 1``, penalties, logprobs, images)
are refused with a message rather than silently ignored.

Responses are plain dicts: the OpenAI shapes plus llama.cpp-style ``timings`` and a
``speculation`` object naming the engine that produced the text (see docs/server.md).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import Done, Request
from . import tools
from .errors import InvalidField


MIN_TEMPERATURE = 1e-5  # below this sampling is the argmax anyway; greedy avoids inf in logits / T


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class _Generation(_Body):
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
                raise InvalidField(f"{name} is not supported (it would change the target's "
                                   "distribution); send 0 or omit it", name)
        if self.logit_bias:
            raise InvalidField("logit_bias is not supported", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise InvalidField(f"at most 16 stop sequences (got {len(stops)})", "stop")

    def engine_request(self, max_tokens: int | None, context_length: int | None, **prompt) -> Request:
        if max_tokens is not None and context_length and max_tokens >= context_length:
            raise InvalidField(f"max_tokens ({max_tokens}) must be below the context length "
                               f"({context_length})", "max_tokens")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 1.0 if self.temperature is None else self.temperature
        return Request(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
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

    @property
    def active_tools(self) -> list[dict] | None:
        """The tools the model is shown and whose calls are parsed: none with tool_choice "none"."""
        return None if self.tool_choice == "none" else (self.tools or None)

    def _check_tool_choice(self) -> None:
        c = self.tool_choice
        if c is None or c in ("auto", "none"):
            return
        if c == "required" or isinstance(c, dict):
            raise InvalidField("tool_choice 'required' or a named function is not supported: the reply is "
                               "the target's own unconstrained text, so a call cannot be forced; send "
                               "'auto' (the model decides) or 'none'", "tool_choice")
        raise InvalidField(f"tool_choice must be 'auto' or 'none' (got {c!r})", "tool_choice")

    def to_engine(self, context_length: int | None) -> Request:
        self._check_common()
        self._check_tool_choice()
        if self.logprobs:
            raise InvalidField("logprobs are not supported", "logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidField("only response_format {'type': 'text'} is supported", "response_format")
        max_tokens = self.max_completion_tokens or self.max_tokens
        messages = [_template_message(m, i) for i, m in enumerate(self.messages)]
        return self.engine_request(max_tokens, context_length, messages=messages,
                                   tools=self.active_tools)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def to_engine(self, context_length: int | None) -> Request:
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
        return self.engine_request(self.max_tokens, context_length, **prompt)


def _template_message(m: ChatMessage, i: int) -> dict:
    """The message as the chat template sees it: text parts joined, extra keys kept."""
    d = m.model_dump(exclude_none=True)
    d["role"] = "system" if m.role == "developer" else m.role
    if isinstance(m.content, list):
        kinds = {part.type for part in m.content} - {"text"}
        if kinds:
            raise InvalidField(f"messages[{i}]: only text content is supported (got {sorted(kinds)})",
                               f"messages[{i}].content")
        d["content"] = "".join(part.text or "" for part in m.content)
    elif m.content is None:
        d["content"] = ""
    return d


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    if not body.strip():
        raise InvalidField("request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        if errs[0]["type"] == "json_invalid":
            raise InvalidField(f"malformed JSON: {errs[0]['msg']}") from None
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
            return ".".join(map(str, loc[:i])), p
    return ".".join(map(str, loc)), None


# -- responses -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def speculation(engine: dict | None) -> dict | None:
    """Which engine ran: the same block in /v1/models, /health and every response."""
    if not engine:
        return None
    on = engine["method"] != "plain"
    return {"enabled": on, "method": engine["method"], "target": engine["target"],
            "drafter": engine["drafter"], "block_size": engine["block_size"],
            "block_size_source": engine["block_size_source"],
            "draft_vocab": engine.get("draft_vocab") or None}


def usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int((done.stats or {}).get("cached_tokens", 0))}}


def finish_reason(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def completion(kind: str, rid: str, created: int, model: str, done: Done, *,
               content: str | None = None, tool_calls: list[dict] | None = None) -> dict:
    """A whole (non-stream) response. ``kind`` is "chat" or "text". With ``tool_calls`` (parsed
    by server.tools), ``content`` is the text outside them (null when empty)."""
    if kind == "chat":
        message = {"role": "assistant", "content": done.text}
        finish = finish_reason(done)
        if tool_calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
            finish = tools.finish_reason(finish, called=True)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish_reason(done)}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(done), "timings": done.timings, "speculation": speculation(done.engine)}


def chunk(kind: str, rid: str, created: int, model: str, *, text: str | None = None,
          role: bool = False, finish: str | None = None, include_usage: bool = False,
          tool_calls: list[dict] | None = None, **extra) -> dict:
    """One streamed chunk with one choice; ``extra`` keys (timings, ...) are added at the top."""
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
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


def model_card(model_id: str, created: int, context_length: int | None, engine: dict) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mlx_spec",
            "context_length": context_length, "speculation": speculation(engine)}


def now() -> int:
    return int(time.time())
