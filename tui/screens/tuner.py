"""The tuner's screen: progress while it measures block sizes, then the resulting table.

Shown on first launch (the loader tunes when this machine has no stored result for the pair;
the app feeds ``progress``) and for a re-tune from the command palette (``run=True``).
"""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, ProgressBar, Static

from ..backend import TuneView
from ..messages import TuneFinished, TuneProgress


class TunerScreen(Screen):
    BINDINGS = [
        Binding("escape", "close", "Back to chat"),
        Binding("enter", "close", "Back to chat", show=False),
        Binding("s", "skip", "Skip tuning (checkpoint's block size; tuned next launch)"),
    ]

    def __init__(self, run: bool = True):
        super().__init__()
        self.start_tuning = run
        self.running = True
        self.result: TuneView | None = None
        self._shown: tuple[float, str] | None = None  # progress that arrived before mounting

    def compose(self) -> ComposeResult:
        with Vertical(id="tuner"):
            yield Label("Block-size tuner", classes="panel-title")
            yield Static(
                "Measures plain decoding and the most promising block sizes end to end on "
                'built-in prompts, on this machine, and stores the fastest (or "off" when '
                "plain decoding wins) for this machine and pair.",
                id="tuner-about",
            )
            yield ProgressBar(total=1.0, show_eta=False, id="tuner-progress")
            yield Static("", id="tuner-status")
            yield DataTable(id="tuner-table", cursor_type="none", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("block size", "tok/s", "speedup", "τ", "note", "")
        if not self.start_tuning:
            self._status(
                "first launch for this machine and pair: tuning before the chat starts… "
                "(s: skip; the checkpoint's block size until the next launch)"
            )
            if self._shown:
                self.progress(*self._shown)
            if self.result:
                self.finished(self.result)
            return
        reason = self.app.backend.tuner_unavailable()
        if reason:
            self.running = False
            self.query_one("#tuner-progress").display = False
            self._status(
                f"Tuner not available: {reason}. The block size stays as the header shows. Esc: back to the chat.",
                "-error",
            )
            return
        self._status("starting…")
        self._tune()

    def _status(self, text: str, cls: str = "") -> None:
        status = self.query_one("#tuner-status", Static)
        status.update(text)
        status.set_classes(cls)

    @work(thread=True, exclusive=True, group="tune")
    def _tune(self) -> None:
        try:
            view = self.app.backend.retune(lambda f, t: self.post_message(TuneProgress(f, t)))
            self.post_message(TuneFinished(view))
        except Exception as e:
            self.post_message(TuneFinished(None, f"{type(e).__name__}: {e}"))

    @on(TuneProgress)
    def _on_progress(self, m: TuneProgress) -> None:
        m.stop()
        self.progress(m.fraction, m.text)

    @on(TuneFinished)
    def _on_finished(self, m: TuneFinished) -> None:
        m.stop()
        if m.view is None:
            self.running = False
            self._status(f"Tuning failed: {m.error}", "-error")
            return
        self.finished(m.view)
        self.app.tune_finished(m.view)

    def progress(self, fraction: float, text: str) -> None:
        self._shown = (fraction, text)
        if not self.is_mounted or not self.query("#tuner-progress"):  # not composed yet, or leaving
            return
        self.query_one(ProgressBar).update(progress=fraction)
        self._status(text + ("  (s: skip tuning)" if self.running and not self.start_tuning else ""))

    def finished(self, view: TuneView) -> None:
        self.running = False
        self.result = view
        if not self.is_mounted:
            return
        self.query_one(ProgressBar).update(progress=1.0)
        table = self.query_one(DataTable)
        table.clear()
        for r in view.rows:
            table.add_row(
                "off (plain)" if r.block_size == 1 else r.label or str(r.block_size),
                "–" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
                "–" if r.speedup is None else f"{r.speedup:.2f}×",
                "–" if r.tau is None else f"{r.tau:.2f}",
                r.note,
                "◀ chosen" if (r.label == view.chosen if view.chosen else r.block_size == view.best) else "",
            )
        best = (
            f"chain {view.chosen}"
            if view.chosen
            else f"block size {view.best}"
            if view.best > 1
            else "off: plain decoding is faster here"
        )
        base = f"; plain decoding {view.baseline_tps:.1f} tok/s" if view.baseline_tps else ""
        self._status(f"Chosen: {best} ({view.source}){base}. Esc: back to the chat.")

    def check_action(self, action: str, parameters) -> bool | None:
        return self.running and not self.start_tuning if action == "skip" else True

    def action_skip(self) -> None:
        """First launch only: the loader's next progress call stops the tuner; nothing is stored."""
        if self.running and not self.start_tuning:
            self.app.skip_tuning.set()
            self.running = False
            self._status("skipping the tuner: the chat starts with the checkpoint's block size…")
            self.app.pop_screen()

    def action_close(self) -> None:
        if self.running:
            self.notify("the tuner is still running; it stops on its own", severity="warning")
            return
        self.app.pop_screen()
