"""The header: the engine that actually runs, and whether speculation is on for this chat."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static


def describe(info: dict | None, speculate: bool) -> tuple[str, str]:
    """(engine line, mode badge) for an EngineInfo dict."""
    if info is None:
        return "loading the engine…", "LOADING"
    if info["method"] == "plain" and not info.get("drafter"):
        return f"plain decoding · target {info['target']} (--no-draft: no drafter loaded)", "PLAIN"
    if info["method"] == "plain":  # the tuner chose "off" for this machine
        return (f"plain decoding · target {info['target']} · drafter {info['drafter']} unused: "
                f"{info['block_size_source']}"), "PLAIN"
    line = (f"{info['method']} · target {info['target']} · drafter {info['drafter']} · "
            f"block {info['block_size']} ({info['block_size_source']})")
    if info.get("draft_vocab"):
        line += f" · draft vocab {info['draft_vocab']}"
    return line, ("SPECULATION ON" if speculate else "SPECULATION OFF · plain A/B")


class EngineHeader(Static):
    info: reactive[dict | None] = reactive(None)
    """EngineInfo.as_dict() of the loaded engine (None while loading)."""
    speculate: reactive[bool] = reactive(True)
    """False while the user runs the plain-decoding side of an A/B."""

    def watch_info(self) -> None:
        self._restyle()

    def watch_speculate(self) -> None:
        self._restyle()

    def _restyle(self) -> None:
        _, badge = describe(self.info, self.speculate)
        self.set_class(badge.startswith("SPECULATION OFF") or badge == "PLAIN", "-plain")

    def render(self) -> Text:
        line, badge = describe(self.info, self.speculate)
        return Text.assemble((f" {badge} ", "reverse bold"), "  ", ("mlx_spec chat", "bold"), "  ", line)
