"""Progress for slow steps a person waits on (first-launch fetch, hash check, conversion).

``Bar(stream, label)`` is called as ``bar(done, total, note)``. On a terminal it redraws one
line: label, bar, percent, elapsed and ETA. Off a terminal (a log file, a pipe, a test) it
writes the label once when the step starts and one line with the elapsed time when it ends, so
logs stay short. No MLX, no other mlx_spec imports: every layer may use it.
"""

from __future__ import annotations

import time
from typing import TextIO


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}" if s < 3600 else f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Bar:
    """A one-line progress bar with ETA on a terminal; two plain lines elsewhere."""

    def __init__(self, stream: TextIO, label: str, width: int = 24):
        self.stream, self.label, self.width = stream, label, width
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.started = self.closed = False

    def line(self, done: float, total: float, note: str = "") -> str:
        """The terminal line for this state (without the carriage return)."""
        f = min(max(done / total, 0.0), 1.0) if total else 1.0
        fill = int(f * self.width)
        el = time.perf_counter() - self.t0
        eta = f"eta {clock(el * (1 - f) / f)}" if 0.02 <= f < 1 else "eta -:--" if f < 1 else "done"
        text = f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {100 * f:3.0f}% {clock(el)} {eta}"
        return f"{text}  {note}" if note else text

    def __call__(self, done: float, total: float, note: str = "") -> None:
        if not self.started:
            self.started = True
            if not self.tty:
                self.stream.write(f"{self.label} ...\n")
                self.stream.flush()
        if self.tty:
            self.stream.write(f"\r\x1b[2K{self.line(done, total, note)[:160]}")
            self.stream.flush()

    def close(self, summary: str = "") -> None:
        """End the step: on a terminal the bar's line is replaced by ``label: summary (time)``.
        A step that never reported progress and is closed without a summary (nothing to do: a
        stored result found at once) ends silently, as it started; a summary is always shown."""
        if self.closed:
            return
        self.closed = True
        if not self.started and not summary:
            return
        el = clock(time.perf_counter() - self.t0)
        end = f"{self.label}: {summary or 'done'} ({el})\n"
        self.stream.write(f"\r\x1b[2K{end}" if self.tty else end)
        self.stream.flush()

    def __enter__(self) -> Bar:
        self(0, 1)
        return self

    def __exit__(self, kind, *_) -> None:
        self.close("failed" if kind else "")
