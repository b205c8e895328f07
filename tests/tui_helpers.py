"""Helpers for the TUI tests: the screen as text (from App.export_screenshot()'s SVG), waiting,
sending a prompt, running a palette command."""

from __future__ import annotations

import html
import re
import time
from collections import defaultdict

from textual.command import CommandInput, CommandList, CommandPalette

from tui.widgets.prompt_input import PromptInput

_TEXT = re.compile(r'<text[^>]*\bx="([\d.]+)"[^>]*clip-path="url\(#[^)]*-line-(\d+)\)"[^>]*>(.*?)</text>', re.S)
CHAR_W = 12.2  # Rich's SVG export: 0.61 x font size 20


def screen_text(app) -> str:
    """Every line of the current screen as text, segments placed at their columns."""
    rows: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for x, line, content in _TEXT.findall(app.export_screenshot()):
        rows[int(line)].append((round(float(x) / CHAR_W), html.unescape(content).replace("\xa0", " ")))
    out = []
    for i in range(max(rows, default=-1) + 1):
        line = ""
        for col, text in sorted(rows[i]):
            line = line.ljust(col) + text
        out.append(line.rstrip())
    return "\n".join(out)


async def wait_for(pilot, cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


async def send(pilot, text: str) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.chat.ready)
    prompt = app.screen.query_one(PromptInput)
    prompt.focus()
    prompt.text = text  # typing is covered once, in test_help_memory_warning_and_growing_prompt
    await pilot.press("enter")
    await pilot.pause()


async def reply(pilot, text: str) -> None:
    await send(pilot, text)
    await wait_for(pilot, lambda: not pilot.app.chat.generating)
    await pilot.pause(0.1)


async def palette(pilot, command: str) -> None:
    """Run a command-palette entry the way a user does: Ctrl+P, search, Enter."""
    app = pilot.app
    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
    app.screen.query_one(CommandInput).value = command
    commands = app.screen.query_one(CommandList)

    def found() -> bool:
        i = commands.highlighted
        return i is not None and command in str(commands.get_option_at_index(i).prompt)

    await wait_for(pilot, found)
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, CommandPalette))
