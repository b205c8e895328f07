"""Reasoning and answer, split: a streaming-safe splitter for ``<think> ... </think>`` output.

Thinking models (Qwen3, Qwen3.5/3.6, DeepSeek-R1 distills) write their reasoning between a start
and an end marker before the answer. The tokenizer names the markers (mlx-lm's
``TokenizerWrapper.think_start`` / ``think_end``); ``ThinkFormat`` keeps them as plain strings so
the server and the UI never touch the tokenizer. Some templates open the reasoning block in the
prompt itself (the generation prompt ends with ``<think>``): then the output starts inside it and
only the end marker appears (``prompt_opens_reasoning``).

``ThinkSplitter`` is fed text in any chunking and returns ``("reasoning" | "content", text)``
pieces in order; text that could be the beginning of a marker is held back until it cannot be,
so a marker split across chunks never leaks into either part. Plain Python, no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    start: str = "<think>"
    end: str = "</think>"


def think_format(tokenizer) -> ThinkFormat | None:
    """The tokenizer's reasoning markers, or None when its model does not think."""
    if tokenizer is None or not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if not isinstance(start, str) or not isinstance(end, str) or not start or not end:
        return None
    return ThinkFormat(start, end)


def prompt_opens_reasoning(fmt: ThinkFormat | None, prompt_tail: str) -> bool:
    """True when the prompt (its decoded last tokens) ends inside an open reasoning block, so the
    model's output starts with reasoning and only the end marker will appear."""
    if fmt is None:
        return False
    i = prompt_tail.rfind(fmt.start)
    return i >= 0 and fmt.end not in prompt_tail[i:] and not prompt_tail[i + len(fmt.start) :].strip()


class ThinkSplitter:
    """Feed output text piece by piece; get ``(kind, text)`` pieces, kind "reasoning" or "content".

    ``in_reasoning``: the output starts inside a reasoning block (see ``prompt_opens_reasoning``).
    Every start marker opens reasoning and every end marker closes it; the markers themselves are
    never returned. Whitespace right after an end marker is dropped (templates put a blank line
    there), as is whitespace right after a start marker.
    """

    def __init__(self, fmt: ThinkFormat, in_reasoning: bool = False):
        self.fmt = fmt
        self.in_reasoning = in_reasoning
        self.buf = ""
        self._strip = in_reasoning  # drop leading whitespace of the part that just began
        self.reasoning_chars = 0

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self._strip:
                stripped = self.buf.lstrip()
                if not stripped:
                    self.buf = ""
                    return out
                self.buf, self._strip = stripped, False
            marker = self.fmt.end if self.in_reasoning else self.fmt.start
            i = self.buf.find(marker)
            if i < 0:
                keep = partial_suffix(self.buf, marker)
                self._emit(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return out
            self._emit(out, self.buf[:i])
            self.buf = self.buf[i + len(marker) :]
            self.in_reasoning = not self.in_reasoning
            self._strip = True

    def finish(self) -> list[tuple[str, str]]:
        """Flush held text at the end of the output (an unclosed block stays reasoning)."""
        out: list[tuple[str, str]] = []
        self._emit(out, self.buf)
        self.buf = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if not text:
            return
        kind = REASONING if self.in_reasoning else CONTENT
        if kind == REASONING:
            self.reasoning_chars += len(text)
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def split(fmt: ThinkFormat, text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """A whole output -> (reasoning, content). Same machine as streaming."""
    s = ThinkSplitter(fmt, in_reasoning)
    pieces = s.feed(text) + s.finish()
    return ("".join(t for k, t in pieces if k == REASONING), "".join(t for k, t in pieces if k == CONTENT))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
