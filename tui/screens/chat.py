"""The main screen: conversation, prompt, speculation and memory panels.

A thread worker iterates the backend's event stream and posts each event as a message; the
screen buffers text and redraws at most every 50 ms (``FLUSH_S``), never once per token.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from mlx_spec.engine import Delta, Done, Failed, Started
from mlx_spec.generation import TUNED_OFF, EngineInfo
from mlx_spec.stats import StatsSnapshot
from mlx_spec.thinking import REASONING, ThinkSplitter, split

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer

from ..backend import TuneView
from ..export import Turn, to_markdown
from ..messages import CheckFinished, MemoryRead, ReplyCrashed, ReplyEvent
from ..widgets.engine_header import EngineHeader
from ..widgets.memory_panel import MemoryPanel
from ..widgets.message_view import MessageView
from ..widgets.prompt_input import PromptInput
from ..widgets.spec_panel import SpecPanel, SpecView

FLUSH_S = 0.05
MEMORY_S = 2.0
MIN_BASELINE_TOKENS = 8  # a plain A/B reply shorter than this is too noisy to be a baseline
CYCLES_SHOWN = 8  # the last cycles the panel names by source (p d3:1 m3:2 e4:3 l8:7)


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel reply", priority=True),
        Binding("f2", "toggle_spec", "Spec on/off"),
        Binding("f3", "check", "Lossless check"),
        Binding("f4", "export", "Export"),
        Binding("f5", "retune", "Re-tune"),
        Binding("f8", "toggle_think", "Think on/off"),  # F6/F7 belong to the prompt (select line / all)
        Binding("ctrl+n", "new_chat", "New chat"),
    ]

    def __init__(self, system: str | None = None):
        super().__init__()
        self.system = system
        self.history: list[dict] = []
        self.turns: list[Turn] = []
        self.ready = False
        self.generating = False
        self.checking = False
        self.stored_tune: TuneView | None = None
        self.session_plain_tps: float | None = None
        self._reply: MessageView | None = None
        self._reply_info: EngineInfo | None = None
        self._reply_baseline: tuple[float | None, str] = (None, "")  # fixed when the reply starts
        self._pending = ""
        self._text = ""
        self._stats = StatsSnapshot()
        self._taus: list[int] = []
        self._cycles: list[tuple[str, int, int]] = []  # the last cycles (source, rows, accepted)
        self._tokens = 0
        self._dirty = False
        self._last_prompt = ""
        self._new_history()

    def compose(self) -> ComposeResult:
        yield EngineHeader(id="header")
        with Horizontal(id="body"):
            with Vertical(id="chat-column"):
                yield VerticalScroll(id="conversation")
                yield PromptInput(
                    id="prompt",
                    placeholder="Ask something. Enter sends, Esc cancels, Ctrl+P commands, F1 help",
                    disabled=True,
                )
            with VerticalScroll(id="sidebar"):
                yield SpecPanel(id="spec")
                yield MemoryPanel(id="memory")
        yield Footer()

    def on_mount(self) -> None:
        self._ticker = self.set_interval(FLUSH_S, self._flush, pause=True)
        self.set_interval(MEMORY_S, self._poll_memory)
        self.query_one("#conversation", VerticalScroll).anchor()

    @property
    def backend(self):
        return self.app.backend

    def _new_history(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []
        self.turns = []

    # -- engine lifecycle ---------------------------------------------------------------------
    def engine_ready(self, info: EngineInfo, stored: TuneView | None) -> None:
        self.ready = True
        self.stored_tune = stored
        self.refresh_engine(info)
        prompt = self.query_one(PromptInput)
        prompt.disabled = False
        prompt.focus()
        self._poll_memory()

    def refresh_engine(self, info: EngineInfo | None = None) -> None:
        """The engine changed (loaded, re-tuned): the header shows it, and the panel leaves the
        last reply (its figures stay in its own line) for the new engine, so both agree."""
        header = self.query_one(EngineHeader)
        header.info = info or self.backend.info
        header.speculate = self.app.settings.speculate
        if not self.generating:
            self._clear_reply_figures()
        self.query_one(SpecPanel).view = self._spec_view()

    def _clear_reply_figures(self) -> None:
        self._reply_info, self._stats, self._taus, self._tokens = None, StatsSnapshot(), [], 0
        self._cycles = []

    # -- sending and streaming ------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _send(self, m: PromptInput.Submitted) -> None:
        if not self.ready:
            self.notify("the engine is still loading", severity="warning")
            return
        if self.generating or self.checking:
            self.notify("a reply is still running: wait, or press Esc to cancel", severity="warning")
            return
        text = m.text.strip()
        m.input.clear()
        self._last_prompt = text
        self.history.append({"role": "user", "content": text})
        self.turns.append(Turn("user", text))
        conv = self.query_one("#conversation", VerticalScroll)
        await conv.mount(MessageView("user", text))
        self._reply = MessageView("assistant")
        await conv.mount(self._reply)
        conv.scroll_end(animate=False)
        self._pending, self._text, self._stats, self._taus, self._tokens = "", "", StatsSnapshot(), [], 0
        self._cycles = []
        self._think, self._pending_reasoning, self._reasoning_tokens, self._opened = None, "", 0, False
        self._reply_info = None
        self.generating = True
        self._ticker.resume()
        self._stream(list(self.history), self.app.settings)

    @work(thread=True, exclusive=True, group="reply")
    def _stream(self, messages: list[dict], settings) -> None:
        try:
            for ev in self.backend.stream(messages, settings):
                self.post_message(ReplyEvent(ev))
        except Exception as e:  # the UI must hear about it and restore the prompt
            self.post_message(ReplyCrashed(f"{type(e).__name__}: {e}"))

    @on(ReplyEvent)
    async def _on_event(self, m: ReplyEvent) -> None:
        ev = m.event
        if isinstance(ev, Started):
            self._reply_info = ev.engine
            fmt = getattr(self.backend, "think_format", None)
            self._think = ThinkSplitter(fmt, ev.reasoning) if fmt is not None else None
            self._opened = ev.reasoning
            self._reply_baseline = self.baseline()  # later re-tunes must not change this reply's speedup
            self._dirty = True
        elif isinstance(ev, Delta):
            if self._think is not None:  # reasoning apart from the answer, counted in tokens
                was = self._think.in_reasoning
                for kind, text in self._think.feed(ev.text):
                    if kind == REASONING:
                        self._pending_reasoning += text
                    else:
                        self._pending += text
                if was or self._think.in_reasoning:
                    self._reasoning_tokens += len(ev.tokens)
            else:
                self._pending += ev.text
            self._text += ev.text
            self._stats = ev.stats
            self._tokens += len(ev.tokens)
            if ev.drafted:
                self._taus.append(len(ev.tokens))
            if ev.source:  # the cycle trace: source, rows, accepted
                self._cycles.append((ev.source, ev.drafted + 1, ev.accepted))
                del self._cycles[:-CYCLES_SHOWN]
            self._dirty = True
        elif isinstance(ev, Done):
            await self._finish(ev)
        elif isinstance(ev, Failed):
            await self._fail(f"{ev.kind}: {ev.error}")

    @on(ReplyCrashed)
    async def _on_crash(self, m: ReplyCrashed) -> None:
        await self._fail(m.error)

    async def _flush(self) -> None:
        if self._pending_reasoning and self._reply is not None:
            fragment, self._pending_reasoning = self._pending_reasoning, ""
            self._reply.append_reasoning(fragment, self._reasoning_tokens)
        if self._pending and self._reply is not None:
            fragment, self._pending = self._pending, ""
            await self._reply.append(fragment)
        if self._dirty:
            self._dirty = False
            self.query_one(SpecPanel).view = self._spec_view()

    async def _finish(self, done: Done) -> None:
        self._ticker.pause()
        self._pending = ""
        self.generating = False
        text = done.text or self._text
        if done.prompt_tokens:  # a request cancelled before it started has no stats
            self._stats = done.stats
        if done.finish_reason == "cancelled" and not text.strip():
            await self._drop_reply()
            self.notify("cancelled")
            return
        meta = self._meta(done)
        self._pending_reasoning = ""
        fmt = getattr(self.backend, "think_format", None)
        reasoning = None
        if fmt is not None:
            reasoning, text = split(fmt, text, self._opened)
        await self._reply.finish(text, meta, reasoning, self._reasoning_tokens)
        # the template decides what to keep of earlier turns' reasoning (Qwen's drop it)
        self.history.append(
            {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}
        )
        self.turns.append(Turn("assistant", text, meta))
        if (
            not done.engine.speculative
            and self.app.settings.speculate is False
            and done.completion_tokens >= MIN_BASELINE_TOKENS
        ):
            self.session_plain_tps = self._stats.decode_tps or None
        self.query_one(SpecPanel).view = self._spec_view()
        self._poll_memory()

    async def _fail(self, error: str) -> None:
        self._ticker.pause()
        self.generating = False
        await self._drop_reply()
        self.notify(error, title="generation failed", severity="error", timeout=10)

    async def _drop_reply(self) -> None:
        """Forget the turn that produced nothing and give the prompt back for editing."""
        if self._reply is not None:
            await self._reply.remove()
            self._reply = None
        views = self.query(MessageView)
        if views and views.last().role == "user":
            await views.last().remove()
        if self.history and self.history[-1]["role"] == "user":
            self.history.pop()
            self.turns.pop()
        self.query_one(PromptInput).text = self._last_prompt

    def _meta(self, done: Done) -> str:
        s = done.stats
        speed = f"{s.decode_tps:.1f} tok/s"
        base = self._reply_baseline[0]
        if done.engine is not None and done.engine.speculative and base and s.decode_tps:
            speed += f" ({s.decode_tps / base:.2f}×)"  # vs plain, fixed now: a re-tune moves the baseline
        parts = [done.engine.method if done.engine else "?", f"{done.completion_tokens} tok", speed]
        if s.drafted:
            parts += [
                f"τ {s.mean_acceptance_length:.2f}",
                f"accept {s.acceptance_rate:.0%}",
                f"block {done.engine.block_size}",
            ]
        if s.cached_tokens:
            parts.append(f"{s.cached_tokens}/{done.prompt_tokens} prompt tok cached")
        parts.append(done.finish_reason)
        return " · ".join(parts)

    def baseline(self) -> tuple[float | None, str]:
        t = self.stored_tune
        if t is not None and t.baseline_tps:
            return t.baseline_tps, f"tuner {t.date}"
        if self.session_plain_tps:
            return self.session_plain_tps, "A/B this session"
        return None, ""

    def _spec_view(self) -> SpecView:
        engine = self.backend.info
        info = self._reply_info or engine
        base, source = self._reply_baseline if self._reply_info else self.baseline()
        if info is None:
            return SpecView()
        if engine is not None and not engine.speculative:
            mode = engine.mode  # "plain" (--no-draft) or "tuned-off"
        elif not info.speculative or not (self._reply_info or self.app.settings.speculate):
            mode = "ab-plain"
        else:
            mode = "spec" if self._reply_info else "idle"
        s = self._stats
        return SpecView(
            mode=mode,
            method=info.method,
            block_size=info.block_size if info.drafter is not None or not info.chains else 0,  # (no DFlash: no block)
            block_source=info.block_size_source,
            tau=s.mean_acceptance_length,
            acceptance=s.acceptance_rate,
            by_position=tuple(s.acceptance_by_position),
            tps=s.decode_tps,
            tokens=self._tokens,
            baseline_tps=base,
            baseline_source=source,
            taus=tuple(self._taus),
            cached_tokens=int(s.cached_tokens),
            plain_cycles=int(s.plain_cycles),
            drafted_cycles=int(s.drafted_cycles),
            trimmed=int(s.trimmed),
            sources=tuple((k, c["cycles"], c["drafted"], c["accepted"]) for k, c in s.sources.items()),
            trace=" ".join("p" if src == "plain" else f"{src[0]}{L}:{a}" for src, L, a in self._cycles),
        )

    # -- memory ---------------------------------------------------------------------------------
    def _poll_memory(self) -> None:
        if self.ready and not self.generating and not self.checking:
            self._read_memory()

    @work(thread=True, exclusive=True, group="memory")
    def _read_memory(self) -> None:
        try:
            self.post_message(MemoryRead(self.backend.memory()))
        except Exception as e:  # a failed reading must not take the chat down
            self.log.warning(f"memory reading failed: {e}")

    @on(MemoryRead)
    def _on_memory(self, m: MemoryRead) -> None:
        if m.memory is not None:
            self.query_one(MemoryPanel).memory = m.memory

    # -- actions (keys and command palette) -------------------------------------------------------
    def action_cancel(self) -> None:
        if self.generating:
            self.backend.cancel()

    def action_toggle_think(self) -> None:
        """Thinking models: turn reasoning on or off for the next turn (the template's switch)."""
        if getattr(self.backend, "think_format", None) is None:
            self.notify("this model writes no reasoning (its tokenizer has no thinking markers)", severity="warning")
            return
        now = self.app.settings.think
        on = not (True if now is None else now)  # None: the template's default, on for such models
        self.app.settings = replace(self.app.settings, think=on)
        self.notify(f"thinking {'on' if on else 'off'} from the next turn")

    def action_toggle_spec(self) -> None:
        info = self.backend.info
        if info is None or not info.speculative:
            why = (
                "no drafter loaded (--no-draft)"
                if info is None or info.mode != TUNED_OFF
                else "the tuner chose plain decoding for this machine (re-tune with F5, or restart with --block-size N)"
            )
            self.notify(f"{why}: speculation cannot be turned on", severity="warning")
            return
        self.app.settings = replace(self.app.settings, speculate=not self.app.settings.speculate)
        self.query_one(EngineHeader).speculate = self.app.settings.speculate
        self._clear_reply_figures()  # the last reply ran the other way: its numbers are not this mode's
        self.query_one(SpecPanel).view = self._spec_view()
        if self.app.settings.speculate:
            self.notify("speculation ON: next replies use the drafter")
        else:
            self.notify(
                "speculation OFF: next replies use plain decoding of the same target "
                "(A/B; their speed becomes this session's baseline)"
            )

    def action_check(self) -> None:
        reason = self.backend.check_unavailable() if self.ready else "the engine is still loading"
        last_user = max((i for i, m in enumerate(self.history) if m["role"] == "user"), default=None)
        if reason is None and last_user is None:
            reason = "send a prompt first: the check replays the last one"
        if reason is None and (self.generating or self.checking):
            reason = "wait for the running reply to finish"
        if reason:
            self.notify(reason, severity="warning")
            return
        self.checking = True
        self.notify("losslessness check: decoding the last prompt speculatively and plainly…")
        self._check(self.history[: last_user + 1], self.app.settings)

    @work(thread=True, exclusive=True, group="check")
    def _check(self, messages: list[dict], settings) -> None:
        try:
            self.post_message(CheckFinished(self.backend.check(messages, settings)))
        except Exception as e:
            self.post_message(CheckFinished(None, f"{type(e).__name__}: {e}"))

    @on(CheckFinished)
    async def _on_check(self, m: CheckFinished) -> None:
        self.checking = False
        if m.result is None:
            self.notify(m.error, title="losslessness check failed", severity="error", timeout=10)
            return
        r = m.result
        verdict = {"identical": "PASS (identical)", "numeric": "PASS (numeric near tie)"}.get(
            r.verdict, "FAIL (mismatch)"
        )
        text = f"**Losslessness check {verdict}**: the last prompt decoded greedily, speculative vs plain. {r.detail}"
        self.turns.append(Turn("note", text))
        await self.query_one("#conversation").mount(MessageView("note", text))
        self.notify(r.detail, title=f"losslessness {verdict}", severity="information" if r.ok else "error", timeout=8)

    def action_export(self) -> Path:
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        path = Path(self.app.export_dir) / f"mlx_spec-chat-{time.strftime('%Y%m%d-%H%M%S')}.md"
        path.write_text(to_markdown(self.turns, self.backend.info, when))
        self.notify(f"exported to {path}")
        return path

    def action_retune(self) -> None:
        if self.generating or self.checking:
            self.notify("wait for the running reply to finish", severity="warning")
            return
        self.app.open_tuner()

    async def action_new_chat(self) -> None:
        if self.generating:
            self.notify("cancel the running reply first (Esc)", severity="warning")
            return
        self._new_history()
        await self.query_one("#conversation").remove_children()
        self._clear_reply_figures()
        self.query_one(SpecPanel).view = self._spec_view()
