"""A clean exit: a process that closes its engine mid-request exits with code 0, every time,
with and without a /proc thread list to watch (macOS has none)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import save_tiny_pair

ROOT = Path(__file__).resolve().parent.parent

# Starts a long request, waits for its first tokens, closes the engine and exits. Prints the
# request's last event so the test can see it was cancelled by close (not finished).
WORKER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from mlx_spec.engine import Delta, Done, Engine, Request
    from mlx_spec.generation import engine_info
    from mlx_spec.loading import load_pair
    from mlx_spec.session import Session

    target, drafter, proc = sys.argv[1], sys.argv[2], sys.argv[3]

    def loader():
        pair = load_pair(target, drafter)
        return Session.of(pair, engine_info(pair, 4, "flag"))

    e = Engine(loader, proc_tasks=None if proc == "none" else Path(proc)).start()
    e.wait_ready(120)
    h = e.submit(Request(prompt="hello", max_tokens=3000))
    events = iter(h)
    first = next(ev for ev in events if isinstance(ev, Delta))
    e.close(timeout=30)
    last = [ev for ev in events][-1]
    print("LAST", type(last).__name__, getattr(last, "finish_reason", None), getattr(last, "completion_tokens", None))
""")


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("exit"))


def _run(pair_dirs, proc: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t, d = pair_dirs
    return subprocess.run(
        [sys.executable, "-c", WORKER, str(t), str(d), proc],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


def _check(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"exit code {r.returncode}: {r.stderr[-2000:]}"
    last = [ln for ln in r.stdout.splitlines() if ln.startswith("LAST")]
    assert last, r.stdout + r.stderr[-2000:]
    _, kind, finish, n = last[0].split()
    assert (kind, finish) == ("Done", "cancelled"), last[0]  # close cancelled the request in flight
    assert int(n) < 3000


@pytest.mark.parametrize("proc", ["/proc/self/task", "/no/such/proc"], ids=["proc", "no-proc"])
def test_closing_mid_request_exits_cleanly(pair_dirs, proc):
    """One run per thread-list setting in the default suite; twenty in a row under -m slow."""
    _check(_run(pair_dirs, proc))


@pytest.mark.slow
@pytest.mark.parametrize("proc", ["/proc/self/task", "none"], ids=["proc", "no-proc"])
def test_closing_mid_request_exits_cleanly_twenty_times_in_a_row(pair_dirs, proc):
    for _ in range(20):
        _check(_run(pair_dirs, proc))


def test_close_cancels_the_request_in_flight_and_answers_the_queued_ones(pair_dirs):
    from mlx_spec.engine import Delta, Done, Engine, Request
    from mlx_spec.generation import engine_info
    from mlx_spec.loading import load_pair
    from mlx_spec.session import Session

    t, d = pair_dirs

    def loader():
        pair = load_pair(str(t), str(d))
        return Session.of(pair, engine_info(pair, 4, "flag"))

    e = Engine(loader).start()
    e.wait_ready(120)
    running = e.submit(Request(prompt="hello", max_tokens=3000))
    queued = e.submit(Request(prompt="again", max_tokens=3000))
    call = e.call(lambda pair: "ran")
    events = iter(running)
    next(ev for ev in events if isinstance(ev, Delta))
    e.close(timeout=30)
    assert not e._thread.is_alive()
    last = list(events)[-1]
    assert isinstance(last, Done) and last.finish_reason == "cancelled" and last.completion_tokens < 3000
    q = list(queued)
    assert isinstance(q[-1], Done) and q[-1].finish_reason == "cancelled"
    with pytest.raises(Exception, match="closed"):
        call.result(timeout=5)
