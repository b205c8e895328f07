"""`mlx_spec stop`: stop detached servers (SIGTERM, wait, SIGKILL if needed; children too).
A detached group (``serve --ranks/--hosts --detach``): rank 0 first, so it shuts the group
down, then mlx.launch and every rank it started here (process.terminate_group); ranks whose
mlx.launch has died are still found (by their recorded pid and start time) and stopped.

Servers are identified by pid and process start time, never by command line. Stopping when
nothing runs says so and exits 0; the exit code is non-zero only if a server could not be stopped.
"""

from __future__ import annotations

import sys

import psutil

from ..server import process


def add_arguments(p) -> None:
    p.add_argument("--port", type=int, default=None, help="only the server on this port")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait after SIGTERM before SIGKILL (default 10)"
    )


def run(args) -> int:
    found = process.scan(process.state_dir())
    for path, reason in found.stale:
        print(f"removed stale state file {path.name}: {reason}")
    targets = [r for r in found.running if args.port is None or r[1].port == args.port]
    if not targets:
        where = f" on port {args.port}" if args.port is not None else ""
        print(f"no mlx_spec server running{where}; nothing to stop")
        return 0
    failed = 0
    for path, state, proc in targets:
        launcher = process.launcher_of(state, proc) if state.group is not None else None
        try:
            if state.group is not None:  # rank 0 first (it shuts the group down), then the rest
                left = process.terminate_group(state.group.get("ranks", []), launcher, timeout=args.timeout)
            else:
                left = process.terminate(proc, timeout=args.timeout)
        except psutil.AccessDenied:
            print(f"cannot stop pid {state.pid}: permission denied", file=sys.stderr)
            failed += 1
            continue
        if left:
            print(f"pid {state.pid} did not exit (still running: {[p.pid for p in left]})", file=sys.stderr)
            failed += 1
            continue
        path.unlink(missing_ok=True)
        if state.group is not None:
            ranks = ", ".join(f"rank {r['rank']} pid {r['pid']}" for r in state.group.get("ranks", []))
            gone = "" if launcher else " (already gone)"
            print(
                f"stopped group server: mlx.launch pid {state.pid}{gone} and {ranks or 'no rank on this machine'} "
                f"({state.url})"
            )
        else:
            print(f"stopped server pid {state.pid} ({state.url})")
    return 1 if failed else 0
