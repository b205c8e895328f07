"""The header: the engine that actually runs, and whether speculation is on for this chat."""

from __future__ import annotations

from pathlib import Path

from mlx_spec.generation import PLAIN, TUNED_OFF, EngineInfo

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static


def short(model: str | None) -> str | None:
    """A local path by its folder name (the full path is in the logs); a repo id as it is."""
    if model and model.startswith(("/", ".", "~")):
        return Path(model).name or model
    return model


def describe(info: EngineInfo | None, speculate: bool) -> tuple[str, str]:
    """(engine line, mode badge) for the loaded engine (its ``mode`` says what runs)."""
    if info is None:
        return "loading the engine…", "LOADING"
    target, drafter = short(info.target), short(info.drafter)
    if info.mode == PLAIN:
        return f"plain decoding · target {target} (--no-draft: no drafter loaded)", "PLAIN"
    if info.mode == TUNED_OFF:  # the tuner chose "off" for this machine
        return (f"plain decoding · target {target} · drafter {drafter} unused: {info.block_size_source}"), "PLAIN"
    if info.drafter is None and info.chains:  # chain drafters without DFlash: their depths and where they came from
        depths = dict(info.depths)
        heads = " · ".join(
            f"{'MTP head' if k == 'mtp' else 'EAGLE-3'}" + (f" depth {depths[k]}" if k in depths else "")
            for k, _ in info.chains
        )
        line = f"{info.method} · target {target} · {heads} ({info.block_size_source})"
    else:
        line = (
            f"{info.method} · target {target} · drafter {drafter} · block {info.block_size} ({info.block_size_source})"
        )
    if info.draft_vocab:
        line += f" · draft vocab {info.draft_vocab}"
    if info.group.size > 1:  # the target sharded over an mlx.launch group (docs/distributed.md)
        line += f" · {info.group.size} ranks ({info.group.backend})"
    return line, ("SPECULATION ON" if speculate else "SPECULATION OFF · plain A/B")


TITLE = "mlx_spec chat"


def fit(line: str, badge: str, width: int) -> Text:
    """The header on one line of ``width`` columns: the whole line when it fits; else without
    the title, then with shorter words, then without the target; an ellipsis only as a last
    resort. The block size, its source and the draft vocabulary are the last to go."""
    shorter = line.replace("draft vocab ", "vocab ").replace("plain decoding", "plain")
    no_target = " · ".join(part for part in shorter.split(" · ") if not part.startswith("target "))
    tries = [(TITLE, line), (None, line), (None, shorter), (None, no_target)]
    for title, text in tries:
        parts = [(f" {badge} ", "reverse bold"), "  "] + ([(title, "bold"), "  "] if title else []) + [text]
        out = Text.assemble(*parts, no_wrap=True, overflow="ellipsis")
        if width <= 0 or out.cell_len <= width:
            return out
    out.truncate(width, overflow="ellipsis")
    return out


class EngineHeader(Static):
    info: reactive[EngineInfo | None] = reactive(None)
    """The loaded engine's EngineInfo (None while loading)."""
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
        return fit(line, badge, self.size.width)
