"""Generated text -> the parts an API returns: reasoning, content and tool calls, in order.

One machine for both APIs, streaming and not: the reasoning splitter (``thinking.ThinkSplitter``)
runs first, then the content goes through the tool-call machine (``tools.ToolCallStream``).
Reasoning is never parsed for tool calls. Items are ``("reasoning", text)``, ``("content", text)``
or a tool-call dict (OpenAI shape with ``index``).
"""

from __future__ import annotations

from ..thinking import CONTENT, REASONING, ThinkFormat, ThinkSplitter
from . import tools


class OutputStream:
    """Feed text pieces, get items; ``finish()`` flushes what is held at the end of the output."""

    def __init__(
        self,
        think: ThinkFormat | None = None,
        in_reasoning: bool = False,
        tool_format: tools.ToolFormat | None = None,
        tool_list: list | None = None,
    ):
        self.think = ThinkSplitter(think, in_reasoning) if think is not None else None
        self.calls = tools.ToolCallStream(tool_format, tool_list) if tool_format is not None else None

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.calls > 0

    def feed(self, text: str) -> list:
        pieces = self.think.feed(text) if self.think is not None else [(CONTENT, text)]
        return self._content(pieces, final=False)

    def finish(self) -> list:
        pieces = self.think.finish() if self.think is not None else []
        return self._content(pieces, final=True)

    def _content(self, pieces, final: bool) -> list:
        out: list = []
        for kind, text in pieces:
            if kind == REASONING or self.calls is None:
                _add(out, kind, text)
            else:
                _extend(out, self.calls.feed(text))
        if final and self.calls is not None:
            _extend(out, self.calls.finish())
        return out


def split(
    text: str,
    think: ThinkFormat | None = None,
    in_reasoning: bool = False,
    tool_format: tools.ToolFormat | None = None,
    tool_list: list | None = None,
):
    """A whole output -> (reasoning or None, content, tool calls without ``index``)."""
    s = OutputStream(think, in_reasoning, tool_format, tool_list)
    items = s.feed(text) + s.finish()
    reasoning = "".join(t for k, t in (i for i in items if isinstance(i, tuple)) if k == REASONING)
    content = "".join(t for k, t in (i for i in items if isinstance(i, tuple)) if k == CONTENT)
    calls = [{k: v for k, v in i.items() if k != "index"} for i in items if isinstance(i, dict)]
    return (reasoning or None), content, calls


def _extend(out: list, items: list) -> None:
    """The tool machine's output (strings are content, dicts are calls) onto ``out``."""
    for item in items:
        if isinstance(item, str):
            _add(out, CONTENT, item)
        else:
            out.append(item)


def _add(out: list, kind: str, text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], tuple) and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))
