"""SpecChatApp: loads the engine, shows the chat; exits non-zero if loading fails."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from mlx_spec.errors import MlxSpecError
from mlx_spec.tuning import TuneSkipped

from textual import on, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from .backend import Backend, Settings, TuneView
from .messages import EngineFailed, EngineReady, TuneProgress
from .screens.chat import ChatScreen
from .screens.help import HelpScreen
from .screens.tuner import TunerScreen


class SpecChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "mlx_spec chat"
    BINDINGS = [Binding("f1", "help", "Help")]

    def __init__(
        self,
        backend: Backend,
        settings: Settings = Settings(),
        *,
        system: str | None = None,
        export_dir: str | Path = ".",
    ):
        super().__init__()
        self.backend = backend
        self.settings = settings
        self.system = system
        self.export_dir = Path(export_dir).resolve()
        self.error: str | None = None
        self.skip_tuning = threading.Event()  # set by the tuner screen's skip key (first launch)

    @property
    def chat(self) -> ChatScreen:
        return self.get_screen("chat")

    def on_mount(self) -> None:
        self.install_screen(ChatScreen(self.system), "chat")
        self.push_screen("chat")
        self._load_engine()

    @work(thread=True, exclusive=True, group="load")
    def _load_engine(self) -> None:
        try:
            info = self.backend.start(self._tuning_progress)
            stored = None if self.backend.tuner_unavailable() else self.backend.stored_tune()
        except Exception as e:  # shown and turned into a non-zero exit: never a degraded mode
            msg = str(e) if isinstance(e, MlxSpecError) else f"{type(e).__name__}: {e}"
            self.post_message(EngineFailed(msg))
            return
        self.post_message(EngineReady(info, stored))

    def _tuning_progress(self, fraction: float, text: str) -> None:
        """First-launch tuning progress (engine thread); stops the tuner once the user skipped it."""
        if self.skip_tuning.is_set():
            raise TuneSkipped("tuning skipped from the TUI")
        self.post_message(TuneProgress(fraction, text))

    @on(TuneProgress)
    def _on_first_launch_tuning(self, m: TuneProgress) -> None:
        """The loader is tuning (no stored result for this machine and pair): show it."""
        if self.skip_tuning.is_set():
            return
        if not isinstance(self.screen, TunerScreen):
            self.push_screen(TunerScreen(run=False))
        self.screen.progress(m.fraction, m.text)

    @on(EngineFailed)
    def _on_engine_failed(self, m: EngineFailed) -> None:
        self.error = m.error
        self.exit(return_code=1, message=f"mlx_spec chat: error: could not load the engine: {m.error}")

    @on(EngineReady)
    def _on_engine_ready(self, m: EngineReady) -> None:
        self.chat.engine_ready(m.info, m.stored_tune)
        if isinstance(self.screen, TunerScreen) and m.stored_tune is not None:
            self.screen.finished(m.stored_tune)

    def open_tuner(self) -> None:
        self.push_screen(TunerScreen(run=True))

    def tune_finished(self, view: TuneView) -> None:
        self.chat.stored_tune = view
        self.chat.refresh_engine()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat
        spec = "off (A/B: plain decoding)" if self.settings.speculate else "back on"
        yield SystemCommand(
            f"Speculation {spec}", "Toggle the drafter for the next replies (F2)", chat.action_toggle_spec
        )
        yield SystemCommand("Re-tune block size", "Measure block sizes on this machine (F5)", chat.action_retune)
        reason = self.backend.check_unavailable() if self.backend.info else "engine still loading"
        yield SystemCommand(
            "Losslessness check",
            reason or "Replay the last prompt greedily, speculative vs plain, and compare tokens (F3)",
            chat.action_check,
        )
        yield SystemCommand(
            "Export chat as markdown", f"Write the conversation to {self.export_dir}/ (F4)", chat.action_export
        )
        yield SystemCommand("New conversation", "Clear the history (Ctrl+N)", chat.action_new_chat)
        yield SystemCommand("Help", "What each number means (F1)", self.action_help)
