"""The conversation as a markdown document (pure function; the chat screen writes the file)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant" | "note"
    text: str
    meta: str = ""  # engine + stats line for assistant turns


def to_markdown(turns: list[Turn], info, when: str) -> str:
    """``info``: the engine's ``generation.EngineInfo`` (None: not loaded)."""
    lines = ["# mlx_spec chat", "", f"_exported {when}_", ""]
    if info is not None:
        lines += [f"- engine: {info.method}", f"- target: {info.target}"]
        if info.drafter:
            lines += [f"- drafter: {info.drafter}", f"- block size: {info.block_size} ({info.block_size_source})"]
        lines.append("")
    titles = {"user": "You", "assistant": "Assistant", "note": "Note"}
    for t in turns:
        lines += [f"## {titles.get(t.role, t.role)}", "", t.text.rstrip(), ""]
        if t.meta:
            lines += [f"> {t.meta}", ""]
    return "\n".join(lines)
