"""Detached servers: state files, finding them again, stopping them.

A detached server is identified by its pid *and* its process start time (psutil), never by
its command line: a reused pid or a renamed process cannot fool ``status`` or ``stop``. State
files whose process is gone (or whose pid now belongs to another process) are stale and are
removed by whoever finds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

START_TIME_TOLERANCE_S = 0.5


def state_dir() -> Path:
    """``MLX_SPEC_STATE_DIR``, else the platform's user state directory."""
    env = os.environ.get("MLX_SPEC_STATE_DIR")
    if env:
        return Path(env).expanduser()
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "mlx_spec"
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else home / ".local" / "state") / "mlx_spec"


@dataclass(frozen=True)
class ServerState:
    pid: int
    create_time: float  # psutil.Process(pid).create_time() when the server was spawned
    host: str
    port: int
    target: str
    drafter: str | None
    log: str
    started_at: float
    auth: bool = False  # an API key is required (the key itself is never written)
    # a group (``serve --ranks/--hosts --detach``): ``pid`` is mlx.launch's; this holds the
    # launch (size, backend, hosts) and "ranks": [{"rank", "pid", "create_time"}] of the ranks
    # started on this machine (remote ranks run under mlx.launch's ssh sessions)
    group: dict | None = None

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"


def state_path(port: int, directory: Path | None = None) -> Path:
    return (directory or state_dir()) / f"server-{port}.json"


def write_state(state: ServerState, directory: Path | None = None) -> Path:
    path = state_path(state.port, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    os.replace(tmp, path)
    return path


def process_for(state: ServerState) -> psutil.Process | None:
    """The live process this state describes, or None (gone, zombie, or pid reused)."""
    return alive(state.pid, state.create_time)


def alive(pid: int, create_time: float) -> psutil.Process | None:
    """The live process with this pid and start time, or None (gone, zombie, or pid reused)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > START_TIME_TOLERANCE_S:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


@dataclass(frozen=True)
class Found:
    running: list[tuple[Path, ServerState, psutil.Process]]
    stale: list[tuple[Path, str]]  # removed files and why


def scan(directory: Path | None = None, clean: bool = True) -> Found:
    """Every state file: running servers, and stale files (removed when ``clean``)."""
    directory = directory or state_dir()
    running, stale = [], []
    for path in sorted(directory.glob("server-*.json")) if directory.is_dir() else []:
        try:
            state = ServerState(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            stale.append((path, f"unreadable state file ({type(e).__name__})"))
        else:
            proc = process_for(state) or group_survivor(state)
            if proc is not None:
                running.append((path, state, proc))
                continue
            if _zombie(state.pid):
                why = f"pid {state.pid} has exited (a zombie not yet reaped)"
            elif psutil.pid_exists(state.pid):
                why = f"pid {state.pid} now belongs to another process (start time differs)"
            else:
                why = f"pid {state.pid} is no longer running"
            stale.append((path, why))
        if clean:
            path.unlink(missing_ok=True)
    return Found(running, stale)


def group_survivor(state: ServerState) -> psutil.Process | None:
    """A group whose mlx.launch is gone (killed, OOM) but whose ranks here still run: rank 0
    if it lives, else any live rank; None when none does (or it is no group). Its state file
    stays, so ``stop`` can end the orphaned ranks."""
    if state.group is None:
        return None
    ranks = rank_processes(state.group.get("ranks", []))
    return ranks.get(0) or next(iter(ranks.values()), None)


def launcher_of(state: ServerState, proc: psutil.Process) -> psutil.Process | None:
    """mlx.launch's process when ``proc`` (from ``scan``) is it; None when only ranks are left."""
    return proc if proc.pid == state.pid else None


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if not _gone(p)]
    return alive


def terminate(proc: psutil.Process, timeout: float = 10.0) -> list[psutil.Process]:
    """SIGTERM the server and its children, wait, then SIGKILL what is left.

    Returns the processes still alive afterwards (empty on success). Raises
    ``psutil.AccessDenied`` if the process belongs to someone else.
    """
    try:
        family = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return _end(family, timeout)


def _end(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """SIGTERM each, wait up to ``timeout``, SIGKILL the rest; the ones still alive after 5 s."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    alive = _wait(procs, timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return _wait(alive, 5.0)


def spawn(cmd: list[str], log_path: Path | None, env: dict | None = None, *, quiet_stdin: bool = False, stdout=None):
    """Start ``cmd`` in its own session (it survives the terminal), output to ``log_path``
    (None: to ``stdout``, e.g. ``subprocess.PIPE``, else this process's stdout; stderr to this
    process's).

    ``quiet_stdin``: stdin is a pipe that never ends (the child holds its write end) instead of
    /dev/null: mlx.launch forwards stdin to its ranks in a select() loop that would spin on an
    always-readable /dev/null."""
    r = w = None
    if quiet_stdin:
        r, w = os.pipe()
    try:
        with contextlib.ExitStack() as stack:
            log = None
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log = stack.enter_context(open(log_path, "ab"))
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL if r is None else r,
                stdout=stdout if log is None else log,
                stderr=None if log is None else subprocess.STDOUT,
                start_new_session=True,
                env=env,
                close_fds=True,
                pass_fds=() if w is None else (w,),
            )
    finally:
        for fd in (r, w):
            if fd is not None:
                os.close(fd)


def group_ranks(launcher: psutil.Process) -> list[dict]:
    """The ranks mlx.launch started on this machine: its descendants that carry ``MLX_RANK``
    (each rank's launch script execs the command, so the rank is the script's process)."""
    out = []
    try:
        procs = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            rank = p.environ().get("MLX_RANK")
            if rank is not None and p.name() != "ssh":
                out.append({"rank": int(rank), "pid": p.pid, "create_time": p.create_time(), "ppid": p.ppid()})
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
            continue
    # a rank's own subprocesses (a pip download, a helper) inherit MLX_RANK: keep the topmost
    pids = {r["pid"] for r in out}
    top = [{k: v for k, v in r.items() if k != "ppid"} for r in out if r["ppid"] not in pids]
    return sorted(top, key=lambda r: r["rank"])


def rank_processes(ranks: list[dict]) -> dict[int, psutil.Process]:
    """The recorded ranks (``group_ranks``) still alive (same pid and start time), by rank."""
    out = {}
    for r in ranks:
        proc = alive(r["pid"], r["create_time"])
        if proc is not None:
            out[r["rank"]] = proc
    return out


def terminate_group(ranks: list[dict], launcher: psutil.Process | None, timeout: float = 10.0) -> list[psutil.Process]:
    """Stop a group mlx.launch runs: SIGTERM rank 0 first (it tells the other ranks to exit,
    and mlx.launch ends with them), wait up to ``timeout``; then SIGTERM what is left
    (mlx.launch, its children, every rank in ``ranks``, as ``group_ranks`` recorded them), wait,
    SIGKILL. Returns the processes still alive."""
    ranks = rank_processes(ranks)
    family: list[psutil.Process] = list(ranks.values())
    if launcher is not None:
        known = {q.pid for q in family}
        try:
            family = [launcher] + [p for p in launcher.children(recursive=True) if p.pid not in known] + family
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout
    if 0 in ranks:
        try:
            ranks[0].terminate()
        except psutil.NoSuchProcess:
            pass
        _wait(family, timeout)
    return _end([p for p in family if not _gone(p)], max(1.0, deadline - time.monotonic()))


def stop_launched(child, timeout: float = 10.0) -> list[psutil.Process]:
    """Stop the group of an mlx.launch this process spawned (a ``Popen``): ``terminate_group``
    over the ranks it has started here. Returns the processes still alive."""
    if child.poll() is not None:  # mlx.launch exits after its ranks (and its pid may be reused)
        return []
    try:
        me = psutil.Process(child.pid)
    except psutil.NoSuchProcess:
        return []
    return terminate_group(group_ranks(me), me, timeout=timeout)


def health(url: str, timeout: float = 2.0) -> tuple[int | None, dict]:
    """(HTTP status, JSON body) of ``url``/health; (None, {}) if nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return None, {}


def tail(path: Path | str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
