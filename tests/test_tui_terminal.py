"""`mlx_spec chat` in a real terminal (tmux): keystroke-to-screen latency while it generates.

Slow and machine-dependent: run with ``pytest -m slow tests/test_tui_terminal.py -s``. Needs
tmux and the default target's converted copy in the user cache.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow
SESSION = "mlx-spec-tui-latency"


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True).stdout


def _prompt_line() -> str:
    lines = _tmux("capture-pane", "-p", "-t", SESSION).splitlines()
    return next((line for line in reversed(lines) if line.startswith("│")), "")


def _latencies(n: int = 8) -> list[float]:
    out = []
    for i in range(n):
        t = time.monotonic()
        _tmux("send-keys", "-t", SESSION, "abcdefgh"[i])
        while "abcdefgh"[: i + 1] not in _prompt_line():
            if time.monotonic() - t > 10:
                break
            time.sleep(0.005)
        out.append(time.monotonic() - t)
        time.sleep(0.3)
    for _ in range(n):
        _tmux("send-keys", "-t", SESSION, "BSpace")
    time.sleep(0.5)
    return out


@pytest.mark.parametrize("flags", [["--no-draft"]], ids=["no-draft"])
def test_keystroke_latency_while_generating(flags):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    from mlx_spec.default_target import cache_dir

    if not any((cache_dir() / "models").glob("smollm2-135m-instruct-*")):
        pytest.skip("the default target is not converted yet")
    exe = f"{sys.executable} -m mlx_spec chat --no-tune --max-tokens 150 " + " ".join(flags)
    _tmux("kill-session", "-t", SESSION)
    _tmux("new-session", "-d", "-s", SESSION, "-x", "120", "-y", "40", f"TERM=xterm-256color {exe}; sleep 60")
    try:
        end = time.monotonic() + 120
        while not _tmux("capture-pane", "-p", "-t", SESSION).startswith((" PLAIN", " SPECULATION")):
            assert time.monotonic() < end, "the chat did not come up"
            time.sleep(0.5)
        idle = _latencies()
        _tmux("send-keys", "-t", SESSION, "Write a long story about a lighthouse keeper.")
        time.sleep(0.5)
        _tmux("send-keys", "-t", SESSION, "Enter")
        time.sleep(4)
        busy = _latencies()
        print(
            f"\n{' '.join(flags)}: keystroke-to-screen idle median {statistics.median(idle) * 1e3:.0f} ms "
            f"max {max(idle) * 1e3:.0f} ms; generating median {statistics.median(busy) * 1e3:.0f} ms "
            f"max {max(busy) * 1e3:.0f} ms"
        )
        assert statistics.median(busy) < 0.5
        _tmux("send-keys", "-t", SESSION, "Escape")
        time.sleep(1)
        _tmux("send-keys", "-t", SESSION, "C-q")
        time.sleep(3)
    finally:
        _tmux("kill-session", "-t", SESSION)
