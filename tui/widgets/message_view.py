"""One turn of the conversation: a role label and streamed markdown."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Markdown
from textual.widgets.markdown import MarkdownStream


class MessageView(Vertical):
    """A user, assistant or note turn. Assistant text arrives through a ``MarkdownStream``,
    which coalesces fragments when the widget cannot keep up."""

    ROLE_LABELS = {"user": "you", "assistant": "assistant", "note": "note", "system": "system"}

    def __init__(self, role: str, text: str = "", **kwargs):
        super().__init__(classes=f"message -{role}", **kwargs)
        self.role = role
        self.text = text
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Label(self.ROLE_LABELS.get(self.role, self.role), classes="role")
        yield Markdown(self.text)
        meta = Label("", classes="meta")
        meta.display = False
        yield meta

    async def append(self, fragment: str) -> None:
        if not fragment:
            return
        self.text += fragment
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(fragment)

    async def finish(self, text: str, meta: str = "") -> None:
        """Stop streaming and render the final text once (fixes stale fences after a stream)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.text = text
        await self.query_one(Markdown).update(text)
        self.set_meta(meta)

    def set_meta(self, meta: str) -> None:
        label = self.query_one(".meta", Label)
        label.update(meta)
        label.display = bool(meta)
