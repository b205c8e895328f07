"""Tool calls in generated text -> OpenAI ``tool_calls``: one state machine, stream and non-stream.

The tokenizer says how its model writes a call (mlx-lm's ``TokenizerWrapper``: a start marker,
an end marker, and a parser ``parse(text, tools) -> {"name", "arguments"}`` or a list of them).
The session reads that once at load time into a ``text.ToolFormat``; this module is plain Python and
never touches MLX. Text between the markers is held back and handed to the parser; a call the
parser cannot read goes back into the content exactly as the model wrote it.
"""

from __future__ import annotations

import json
import logging
import uuid

from ..text import ToolFormat, tool_format  # noqa: F401  (the format is read in the text layer)
from ..thinking import partial_suffix  # held-back text that may start a marker: one rule for both

log = logging.getLogger(__name__)


def parse_call(fmt: ToolFormat, text: str, tools: list | None) -> list[dict] | None:
    """OpenAI tool calls (without ``index``) for the text inside one pair of markers, or None
    when the parser cannot read it (then the caller keeps the text)."""
    try:
        parsed = fmt.parser(text, tools)
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            name, args = item["name"], item.get("arguments", {})
            if not isinstance(name, str) or not name:
                raise ValueError(f"tool name is {name!r}")
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            cid = item.get("id")
            calls.append(
                {
                    "id": cid if isinstance(cid, str) and cid else new_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
    except Exception as e:  # any parser failure: the model's text is returned as content
        log.warning("tool call not parsed (%s: %s); returned as text", type(e).__name__, e)
        return None
    return calls or None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Feed generated text piece by piece; get back, in order, content strings and tool calls.

    Outside a call, text that could be the beginning of a start marker is held until it cannot
    be; inside a call everything is held until the end marker (or ``finish`` for an unterminated
    call or an end marker of ""). Each tool call carries its ``index`` (0, 1, ...).
    """

    def __init__(self, fmt: ToolFormat, tools: list | None):
        self.fmt, self.tools = fmt, tools
        self.buf = ""
        self.in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[str | dict]:
        self.buf += text
        out: list[str | dict] = []
        start, end = self.fmt.start, self.fmt.end
        while True:
            if not self.in_call:
                i = self.buf.find(start)
                if i < 0:
                    keep = partial_suffix(self.buf, start)
                    _add_text(out, self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                _add_text(out, self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(start) :], True
            j = self.buf.find(end) if end else -1
            if j < 0:
                return out  # inside a call: hold everything until its end marker
            self._close(self.buf[:j], start + self.buf[: j + len(end)], out)
            self.buf, self.in_call = self.buf[j + len(end) :], False

    def finish(self) -> list[str | dict]:
        """Flush at the end of the output: held text, or a call the end marker never closed."""
        out: list[str | dict] = []
        if self.in_call:
            self._close(self.buf, self.fmt.start + self.buf, out)
        else:
            _add_text(out, self.buf)
        self.buf, self.in_call = "", False
        return out

    def _close(self, inner: str, raw: str, out: list) -> None:
        calls = parse_call(self.fmt, inner, self.tools)
        if calls is None:
            _add_text(out, raw)
            return
        for c in calls:
            out.append({"index": self.calls, **c})
            self.calls += 1


def split(fmt: ToolFormat, text: str, tools: list | None) -> tuple[str, list[dict]]:
    """A whole output -> (content outside the calls, tool calls). Same machine as streaming."""
    s = ToolCallStream(fmt, tools)
    items = s.feed(text) + s.finish()
    content = "".join(x for x in items if isinstance(x, str))
    calls = [{k: v for k, v in x.items() if k != "index"} for x in items if isinstance(x, dict)]
    return content, calls


def finish_reason(base: str, called: bool) -> str:
    """ "tool_calls" when the model made a call and stopped by itself; "length" stays "length"."""
    return "tool_calls" if called and base == "stop" else base


def _add_text(out: list, text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], str):
        out[-1] += text
    else:
        out.append(text)
