"""`mlx_spec status`: the detached servers, found by pid and start time (never by name).

Stale state files (process gone, or the pid reused by another process) are removed and reported.
Exit code 0 whether or not a server runs; non-zero only if the state directory is unreadable.
"""

from __future__ import annotations

import json
import time

from ..server import process


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object: servers and removed stale files")


def run(args) -> int:
    directory = process.state_dir()
    found = process.scan(directory)
    servers = []
    for _, state, proc in found.running:
        status, body = process.health(state.url)
        health = {200: "ready", 503: body.get("status", "unavailable")}.get(status, "not answering")
        spec = body.get("speculation")
        # what the server says it runs, once it answers; else what it was started with
        target, drafter = (spec["target"], spec["drafter"]) if spec else (state.target, state.drafter)
        servers.append(
            {
                "pid": state.pid,
                "url": state.url,
                "health": health,
                "target": target,
                "drafter": drafter,
                "speculation": spec,
                "uptime_s": round(time.time() - state.started_at, 1),
                "log": state.log,
                "auth": state.auth,
                "group": _group(state, body, proc),
            }
        )
    if args.json:
        print(
            json.dumps(
                {
                    "state_dir": str(directory),
                    "servers": servers,
                    "stale_removed": [{"file": str(p), "reason": r} for p, r in found.stale],
                }
            )
        )
        return 0
    for path, reason in found.stale:
        print(f"removed stale state file {path.name}: {reason}")
    if not servers:
        print(f"no mlx_spec server running (state dir {directory})")
        return 0
    for s in servers:
        spec = s["speculation"] or {}
        engine = (
            f"{spec['method']} block {spec['block_size']} ({spec['block_size_source']})"
            if spec.get("enabled")
            else f"plain decoding ({spec['block_size_source']})"
            if spec
            else "engine unknown"
        )
        print(
            f"pid {s['pid']}  {s['url']}  {s['health']}  up {_ago(s['uptime_s'])}  "
            f"target {s['target']}  {engine}  log {s['log']}"
        )
        g = s["group"]
        if g["size"] > 1:
            ranks = ", ".join(
                f"rank {r['rank']} pid {r['pid']}{'' if r['alive'] else ' (gone)'}" for r in g.get("ranks", [])
            )
            print(
                f"  group of {g['size']} ({g['backend']}), "
                f"{'healthy' if g.get('healthy') else 'unhealthy' if g.get('healthy') is False else 'health unknown'}"
                f"; mlx.launch pid {g.get('launcher_pid', '-')}"
                f"{'' if g.get('launcher_alive', True) else ' (gone: `mlx_spec stop` ends the ranks left)'}"
                f"; {ranks or 'no rank on this machine'}"
            )
    return 0


def _group(state, body: dict, proc) -> dict:
    """The server's group: what it says on /health (size, rank, backend, sharded, healthy,
    error) over what it was started with (the launch, mlx.launch's pid, the ranks started on
    this machine, each alive or not; whether mlx.launch, ``proc`` from ``scan``, still runs).
    One process: size 1."""
    said = body.get("group") or {}
    if state.group is None:
        return {"size": 1, "sharded": False, **said}
    alive = process.rank_processes(state.group.get("ranks", []))
    ranks = [{**r, "alive": r["rank"] in alive} for r in state.group.get("ranks", [])]
    return {**state.group, **said, "ranks": ranks, "launcher_alive": process.launcher_of(state, proc) is not None}


def _ago(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
