"""Concurrency benchmark: `mlx_spec serve` against `mlx_lm.server`, same target, same prompts.

``mlx_spec bench --concurrency 1,2,4,8`` starts both servers itself on 127.0.0.1 (free ports,
child processes), and for each server and each level c runs c clients at once, each sending
``requests`` chat completions (greedy, ``max_tokens`` each, prompts cycled over the built-in
set) through plain HTTP. Per level it reports the aggregate completion tok/s (all tokens / wall
time of the level), the p50 / p95 request latency and the requests that failed. Everything is
bounded: request counts, a per-request timeout and an overall deadline; the servers are stopped
at the end (also on errors or Ctrl-C).
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from .errors import MlxSpecError

OURS, MLX_LM = "mlx_spec serve", "mlx_lm.server"


@dataclass(frozen=True)
class Level:
    server: str
    clients: int
    requests: int
    failed: int
    tokens: int
    wall_s: float
    p50_s: float
    p95_s: float

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tok_per_s": round(self.tps, 2)}


@dataclass
class Server:
    """A server child process on 127.0.0.1."""

    name: str
    argv: list[str]
    port: int
    env: dict = field(default_factory=dict)  # added to this process's environment
    proc: subprocess.Popen | None = None
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            start_new_session=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            del self.log[:-40]

    def wait_ready(self, deadline: float) -> None:
        import httpx  # (optional: httpx, a test extra)

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MlxSpecError(f"{self.name} exited ({self.proc.returncode}): " + " | ".join(self.log[-5:]))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise MlxSpecError(f"{self.name} not ready in time: " + " | ".join(self.log[-5:]))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and its children
            self.proc.wait(15)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(target: str, drafter: str | None, max_batch: int, extra: Sequence[str] = ()) -> Server:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "mlx_spec",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--target",
        target,
        "--max-batch",
        str(max_batch),
        "--max-queue",
        str(4 * max_batch),
        *extra,
    ]
    if drafter:
        argv += ["--drafter", drafter]
    return Server(OURS, argv, port)


def mlx_lm_server(model_dir: str, blas: str | None = None) -> Server:
    """``blas``: the BLAS library our process loaded (Linux: MKL or OpenBLAS), preloaded into mlx-lm's
    server too, so both sides multiply with the same library (mlx's CPU wheel alone links a
    reference BLAS many times slower on many rows). A preload of the user's own stays, after it."""
    port = free_port()
    env = {"LD_PRELOAD": ":".join(x for x in (blas, os.environ.get("LD_PRELOAD")) if x)} if blas else {}
    return Server(
        MLX_LM,
        [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port)],
        port,
        env,
    )


def _ask(url: str, messages: list[dict], max_tokens: int, timeout: float) -> int:
    import httpx  # (optional: httpx, a test extra)

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def run_level(
    server: Server,
    clients: int,
    requests: int,
    prompts: Sequence[list[dict]],
    max_tokens: int,
    timeout: float,
    deadline: float,
) -> Level:
    """``clients`` threads at once, each sending ``requests`` requests one after another."""
    lat: list[float] = []
    toks, failed = [0], [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(requests):
            if time.monotonic() > deadline:
                with lock:
                    failed[0] += requests - i
                return
            msgs = prompts[(c * requests + i) % len(prompts)]
            t = time.perf_counter()
            try:
                n = _ask(server.url, msgs, max_tokens, timeout)
            except Exception:
                with lock:
                    failed[0] += 1
                continue
            with lock:
                lat.append(time.perf_counter() - t)
                toks[0] += n

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(1.0, deadline - time.monotonic() + timeout))
    wall = time.perf_counter() - t0
    lat.sort()
    p50 = statistics.median(lat) if lat else float("nan")
    p95 = lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))] if lat else float("nan")
    return Level(server.name, clients, clients * requests, failed[0], toks[0], wall, p50, p95)


def run(
    servers: Sequence[Server],
    levels: Sequence[int],
    prompts: Sequence[list[dict]],
    *,
    max_tokens: int,
    requests: int,
    timeout: float = 300.0,
    budget_s: float = 1800.0,
    log: Callable[[str], None] = lambda m: None,
) -> list[Level]:
    """Start every server, warm each with one request, run every level on each in turn
    (interleaved by level, so a drift of the machine hits both alike), stop them all."""
    if not levels or min(levels) < 1:
        raise MlxSpecError("concurrency levels must be >= 1")
    deadline = time.monotonic() + budget_s
    out: list[Level] = []
    try:
        for s in servers:
            log(f"starting {s.name} on {s.url}")
            s.start()
        for s in servers:
            s.wait_ready(min(deadline, time.monotonic() + 600))
            _ask(s.url, prompts[0], 8, timeout)  # warm-up (lazy loads, first-call compilation)
        for c in levels:
            for s in servers:
                log(f"{s.name}: {c} client(s) x {requests} request(s)")
                out.append(run_level(s, c, requests, prompts, max_tokens, timeout, deadline))
    finally:
        for s in servers:
            s.stop()
    return out


def table(rows: Sequence[Level]) -> str:
    head = f"{'server':16s} {'clients':>7s} {'requests':>8s} {'failed':>6s} {'tok/s':>8s} {'p50 s':>7s} {'p95 s':>7s}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.server:16s} {r.clients:7d} {r.requests:8d} {r.failed:6d} {r.tps:8.2f} {r.p50_s:7.2f} {r.p95_s:7.2f}"
        )
    base = {r.clients: r for r in rows if r.server == MLX_LM}
    ratio = [
        f"{r.clients}: x{r.tps / base[r.clients].tps:.2f}"
        for r in rows
        if r.server == OURS and r.clients in base and base[r.clients].tps > 0
    ]
    if ratio:
        lines.append("aggregate tok/s of mlx_spec serve / mlx_lm.server by clients: " + ", ".join(ratio))
    return "\n".join(lines)


__all__ = ["Level", "Server", "ours", "mlx_lm_server", "run", "run_level", "table", "free_port", "OURS", "MLX_LM"]
