"""One turn of the conversation: a role label and streamed markdown."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream


class MessageView(Vertical):
    """A user, assistant or note turn. Assistant text arrives through a ``MarkdownStream``,
    which coalesces fragments when the widget cannot keep up."""

    ROLE_LABELS = {"user": "you", "assistant": "assistant", "note": "note", "system": "system"}
    DEFAULT_CSS = """
    MessageView .reasoning-box { display: none; height: auto; border: none; padding: 0; margin: 0; }
    MessageView .reasoning-box.-shown { display: block; }
    MessageView .reasoning { color: $text-muted; text-style: italic; }
    """

    def __init__(self, role: str, text: str = "", **kwargs):
        super().__init__(classes=f"message -{role}", **kwargs)
        self.role = role
        self.text = text
        self.reasoning = ""  # a thinking model's reasoning, shown dimmed and collapsible
        self.reasoning_tokens = 0
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Label(self.ROLE_LABELS.get(self.role, self.role), classes="role")
        with Collapsible(title="reasoning", collapsed=False, classes="reasoning-box"):
            yield Static("", classes="reasoning", markup=False)
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

    def append_reasoning(self, fragment: str, tokens: int) -> None:
        """Streamed reasoning: shown (open) while it arrives, with its token count."""
        if not fragment and tokens == self.reasoning_tokens:
            return
        self.reasoning += fragment
        self.show_reasoning(self.reasoning, tokens, collapsed=False)

    def show_reasoning(self, reasoning: str, tokens: int, collapsed: bool) -> None:
        self.reasoning, self.reasoning_tokens = reasoning, tokens
        box = self.query_one(".reasoning-box", Collapsible)
        box.set_class(bool(reasoning), "-shown")
        box.title = f"reasoning ({tokens} tok)"
        box.collapsed = collapsed
        self.query_one(".reasoning", Static).update(reasoning.strip())

    async def finish(self, text: str, meta: str = "", reasoning: str | None = None, reasoning_tokens: int = 0) -> None:
        """Stop streaming and render the final text once (fixes stale fences after a stream);
        the reasoning, if any, folds away under its token count (click or Enter to open)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.text = text
        await self.query_one(Markdown).update(text)
        if reasoning:
            self.show_reasoning(reasoning, reasoning_tokens, collapsed=True)
        self.set_meta(meta)

    def set_meta(self, meta: str) -> None:
        label = self.query_one(".meta", Label)
        label.update(meta)
        label.display = bool(meta)
