"""Working-set headroom: used / budget with a breakdown, swap, and a warning above 90 %."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from ..backend import Memory
from .spec_panel import bar

WARN = 0.9
GiB = float(1 << 30)


def gib(n: int) -> str:
    return f"{n / GiB:.2f}" if n < 10 * GiB else f"{n / GiB:.1f}"


def size(n: int) -> str:
    """Bytes as MiB below 1 GiB, else GiB."""
    return f"{n / (1 << 20):.0f} MiB" if n < GiB else f"{gib(n)} GiB"


def render_memory(m: Memory | None) -> Text:
    t = Text()
    t.append("Working set\n", style="bold")
    if m is None:
        t.append("reading…", style="dim")
        return t
    frac = m.fraction
    style = "bold red" if frac > WARN else "green"
    t.append(f"{gib(max(m.used, m.peak))} / {gib(m.budget)} GiB ", style="bold")
    t.append(f"{frac:.0%}\n", style=style)
    t.append(bar(frac, 24) + "\n", style=style)
    t.append(f"budget: {m.budget_source}\n", style="dim")
    for name, value, note in (
        ("target", m.target, "weights"),
        ("drafter", m.drafter, "weights"),
        ("KV", m.kv, f"est. {m.context_tokens} tok"),
        ("prefix", m.prefix, "kept across turns"),  # fits the 40-column sidebar
        ("other", m.other, "scratch, cache"),
    ):
        t.append(f"{name:<8}", style="dim")
        t.append(f"{size(value):>9}")
        t.append(f"  {note}\n", style="dim")
    t.append(f"{'now':<8}", style="dim")
    t.append(f"{size(m.used):>9}  peak {size(m.peak)}\n")
    t.append(f"{'swap':<8}", style="dim")
    t.append(f"{size(m.swap_used):>9} of {size(m.swap_total)}" if m.swap_total else f"{'inactive':>9}")
    t.append(f"\n{'RSS':<8}", style="dim")
    t.append(f"{size(m.rss):>9}  process")
    if frac > WARN:
        t.append("\nabove 90 % of the budget", style="bold red")
    return t


class MemoryPanel(Static):
    memory: reactive[Memory | None] = reactive(None, always_update=True)
    """Latest reading (refreshed between replies; the engine thread is busy during one)."""

    def watch_memory(self, m: Memory | None) -> None:
        self.set_class(m is not None and m.fraction > WARN, "-warn")
        self.update(render_memory(m))

    def on_mount(self) -> None:
        self.update(render_memory(self.memory))
