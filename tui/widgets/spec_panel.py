"""Live speculation numbers for the current reply: τ, acceptance, drafted and plain cycles and
each draft source's share (dflash, lookup, mtp, eagle), the last cycles by source (``p d3:1 m3:2
e4:3 l8:7``), per-position bars, tok/s, speedup against plain decoding, block size and its
source, and a sparkline of τ per cycle."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Label, Sparkline, Static

BAR = 12
EIGHTHS = " ▏▎▍▌▋▊▉█"


@dataclass(frozen=True)
class SpecView:
    """Everything the panel shows; the chat screen builds one per flush."""

    mode: str = "idle"  # "spec" | "ab-plain" (toggled off) | "plain" (--no-draft) | "tuned-off" | "idle"
    method: str = ""
    block_size: int = 0
    block_source: str = ""
    tau: float = 0.0
    acceptance: float = 0.0
    by_position: tuple[float, ...] = ()
    tps: float = 0.0
    tokens: int = 0
    baseline_tps: float | None = None
    baseline_source: str = ""
    taus: tuple[int, ...] = ()
    cached_tokens: int = 0  # prompt tokens of this reply reused from the prefix cache
    plain_cycles: int = 0  # cycles the drafting policy ran as plain steps
    drafted_cycles: int = 0
    trimmed: int = 0  # drafter passes whose block the policy verified only in part (or not at all)
    sources: tuple[tuple[str, int, int, int], ...] = ()  # (source, cycles, drafted, accepted)
    trace: str = ""  # the last cycles: p (plain), d3:1 (DFlash, 3 rows, 1 accepted), m (MTP), e (EAGLE-3), l (lookup)


def bar(frac: float, width: int = BAR) -> str:
    eighths = round(max(0.0, min(1.0, frac)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width)


def speedup_text(v: SpecView) -> tuple[str, str]:
    """(value, note) of the speedup row; no figure before a reply of this mode has run."""
    if not v.tokens:
        return "–", ""
    if v.mode == "ab-plain":
        return "1.00×", "the plain side"
    if not v.baseline_tps or not v.tps:
        return "n/a", ""
    return f"{v.tps / v.baseline_tps:.2f}×", ""


def render_numbers(v: SpecView) -> Text:
    t = Text()

    def row(name: str, value: str, note: str = "") -> None:
        t.append(f"{name:<11}", style="dim")
        t.append(value, style="bold")
        if note:
            t.append(f"  {note}", style="dim")
        t.append("\n")

    modes = {
        "spec": "SPECULATION ON",
        "ab-plain": "SPECULATION OFF (A/B)",
        "plain": "PLAIN (--no-draft)",
        "tuned-off": "PLAIN (tuner chose off)",
        "idle": "waiting for a prompt",
    }
    t.append(modes[v.mode] + "\n", style="bold reverse" if v.mode != "spec" else "bold")
    if v.mode in ("spec", "idle") and v.method not in ("", "plain"):
        row("method", v.method)
        if v.block_size:
            row("block", str(v.block_size), v.block_source)
        else:  # chain drafters without DFlash: where their depths came from
            row("chains", "per cycle", v.block_source)
    if v.mode == "spec":
        row("τ", f"{v.tau:.2f}", "tokens/cycle")
        row("accept", f"{v.acceptance:.1%}", "of drafts")
        if v.plain_cycles or v.drafted_cycles:
            row("cycles", f"{v.drafted_cycles} drafted", f"{v.plain_cycles} plain steps")
        for name, cycles, drafted, accepted in v.sources:
            row(f" {name}", f"{cycles}×", f"{accepted}/{drafted} accepted")
        if v.trimmed:
            row(" trimmed", f"{v.trimmed}×", "drafter blocks cut to what it was sure of")
        if v.trace:
            row("last", v.trace)
    row("tok/s", f"{v.tps:.1f}" if v.tokens else "–", "this reply")
    if v.cached_tokens:
        row("reused", f"{v.cached_tokens} tok", "of the prompt, from the prefix cache")
    row("speedup", *speedup_text(v))
    if v.baseline_tps:
        t.append(f"  vs plain {v.baseline_tps:.1f} tok/s\n  ({v.baseline_source})\n", style="dim")
    if v.mode == "spec" and v.by_position:
        t.append("acceptance by position\n", style="dim")
        for k, frac in enumerate(v.by_position, start=1):
            t.append(f"{k:>2} ", style="dim")
            t.append(bar(frac), style="green")
            t.append(f" {frac:4.0%}\n")
    return t


class SpecPanel(Vertical):
    view: reactive[SpecView] = reactive(SpecView, always_update=True)
    """What to show; assign a new SpecView to redraw."""

    def compose(self) -> ComposeResult:
        yield Label("Speculation", classes="panel-title")
        yield Static(id="spec-numbers")
        yield Label("τ per cycle", id="tau-label")
        yield Sparkline([], id="tau-spark", summary_function=lambda xs: sum(xs) / len(xs))

    def watch_view(self, v: SpecView) -> None:
        if not self.is_mounted:
            return
        self.query_one("#spec-numbers", Static).update(render_numbers(v))
        spark = self.query_one("#tau-spark", Sparkline)
        spark.data = list(v.taus[-200:])
        show = v.mode == "spec"
        spark.display = show
        self.query_one("#tau-label").display = show

    def on_mount(self) -> None:
        self.watch_view(self.view)
