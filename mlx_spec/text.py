"""From token steps to text: chat template, streaming detokenization, stop strings.

Stop strings are matched on the decoded text; nothing at or past a stop string is emitted, and
text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .decode import Step


@dataclass(frozen=True, slots=True)
class Chunk:
    text: str  # new text since the previous chunk
    step: Step
    finish_reason: str | None = None  # "stop" | "length" | None
    stop_sequence: str | None = None  # the stop string that cut the text, if one did


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes a tool call (read once from the tokenizer at load time)."""

    start: str  # e.g. "<tool_call>"
    end: str  # e.g. "</tool_call>"; "" means a call runs to the end of the output (Mistral)
    parser: Callable[[str, Any], Any]  # parse(text between the markers, tools) -> dict | list[dict]


def tool_format(tokenizer) -> ToolFormat | None:
    """The tokenizer's tool-call format (mlx-lm's ``TokenizerWrapper``: a start marker, an end
    marker and a parser), or None if it has none (then calls stay text)."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    start, parser = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_parser", None)
    if not start or parser is None:
        return None
    return ToolFormat(start, getattr(tokenizer, "tool_call_end", None) or "", parser)


def encode_prompt(
    tokenizer,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    chat: bool = False,
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids for a raw prompt or a conversation (through the tokenizer's chat template).
    ``template_kwargs`` are extra template variables, e.g. ``{"enable_thinking": False}``."""
    if messages is None and chat:
        messages = [{"role": "user", "content": prompt or ""}]
    if messages is not None:
        kw = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw)
        return list(ids)
    ids = tokenizer.encode(prompt or "")
    return list(ids)


def stream_text(
    steps: Iterable[Step], tokenizer, stop: Sequence[str] = (), eos_ids: Iterable[int] = ()
) -> Iterator[Chunk]:
    """Detokenize steps; stop at a stop string (excluded from the output)."""
    eos = set(eos_ids)
    stop = [s for s in stop if s]
    hold = max((len(s) for s in stop), default=1) - 1
    detok = tokenizer.detokenizer
    detok.reset()
    emitted = 0
    it = iter(steps)
    try:
        for step in it:
            for t in step.tokens:
                if t not in eos:
                    detok.add_token(t)
            if step.finish_reason:
                detok.finalize()
            text = detok.text
            if stop:
                start = max(0, emitted - hold)
                hits = [(text.find(s, start), s) for s in stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    cut, hit = min(hits)
                    yield Chunk(text[emitted:cut], step, "stop", hit)
                    return
            end = len(text) if step.finish_reason else max(emitted, len(text) - hold)
            yield Chunk(text[emitted:end], step, step.finish_reason)
            emitted = end
            if step.finish_reason:
                return
    finally:
        close = getattr(it, "close", None)
        if close:
            close()
