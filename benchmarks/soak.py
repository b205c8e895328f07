"""Soak `mlx_spec serve`: does its memory level off within the memory plan?

Starts `mlx_spec serve` on 127.0.0.1 (the embedded default pair unless --target/--drafter are
given), sends ``--requests`` requests from ``--clients`` concurrent clients (mixed prompt lengths
and max_tokens, every ``--cancel-every``-th streamed and dropped after a few chunks), samples the
server's RSS and MLX's allocator figures from /metrics once a second, and prints whether RSS
levelled off within the plan's total plus a stated allocator allowance.

    python benchmarks/soak.py --requests 300 --clients 8 --out benchmarks/results/soak.json

The verdict has two parts: **bounded** (the largest RSS sample <= RSS when the server started
listening, before loading, + the plan's total + ``--allowance-mb``) and **level** (the last
third of the samples grows less than ``--level-mb`` over the middle third's maximum).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "engineers",
    "write",
    "tests",
    "on",
    "a",
    "shared",
    "machine",
    "and",
    "the",
    "server",
    "keeps",
    "serving",
    "every",
    "request",
    "it",
    "can",
]


def plan_total(args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mlx_spec",
        "plan",
        "--json",
        "--prefix-cache-mb",
        str(args.prefix_cache_mb),
        "--context",
        str(args.context),
        *args.pair,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"plan failed: {out.stderr}")
    plan = json.loads(out.stdout)
    found = plan.get("plan", plan)
    items = {i["name"]: i["bytes"] for i in found.get("items", [])}
    return {"total": found["total"], "cache_allowance": items.get("MLX cache allowance", 0), "items": items}


def start_server(args):
    cmd = [
        sys.executable,
        "-m",
        "mlx_spec",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--context",
        str(args.context),
        "--prefix-cache-mb",
        str(args.prefix_cache_mb),
        *args.pair,
        *(["--no-tune"] if args.no_tune else []),
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    url, rss_listen, deadline = None, None, time.monotonic() + 900
    log: list[str] = []
    while url is None:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit("serve exited:\n" + "".join(log))
        log.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
            rss_listen = psutil.Process(proc.pid).memory_info().rss
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("serve did not become ready:\n" + "".join(log))
        time.sleep(0.5)
    return proc, url, rss_listen


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^mlx_spec:{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def client(url: str, jobs: list, lock: threading.Lock, done: dict, cancel_every: int, seed: int) -> None:
    rnd = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as c:
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop()
            words = rnd.choice((4, 40, 200, 600))
            body = {
                "messages": [{"role": "user", "content": " ".join(rnd.choice(WORDS) for _ in range(words))}],
                "max_tokens": rnd.choice((8, 32, 128)),
                "temperature": 0,
            }
            try:
                if cancel_every and i % cancel_every == 0:
                    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
                        for n, _ in enumerate(s.iter_lines()):
                            if n >= 3:
                                break  # drop the stream: the server cancels the generation
                    kind = "cancelled"
                else:
                    r = c.post("/v1/chat/completions", json=body)
                    kind = "ok" if r.status_code == 200 else f"http {r.status_code}"
            except httpx.HTTPError as e:
                kind = type(e).__name__
            with lock:
                done[kind] = done.get(kind, 0) + 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--cancel-every", type=int, default=10, help="every N-th request is streamed and dropped")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefix-cache-mb", type=float, default=256)
    p.add_argument(
        "--allowance-mb",
        type=float,
        default=256,
        help="allocator allowance over the plan: Python heaps, tokenizer, fragmentation",
    )
    p.add_argument("--level-mb", type=float, default=32, help="growth of the last third that still counts as level")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument(
        "--no-tune", action="store_true", help="serve with the checkpoint's block size (no first-launch tuning)"
    )
    p.add_argument("--out", type=Path, default=None, help="write samples and verdict as JSON")
    args = p.parse_args()
    args.pair = [x for k in ("target", "drafter") if getattr(args, k) for x in (f"--{k}", getattr(args, k))]
    plan = plan_total(args)
    proc, url, rss_listen = start_server(args)
    samples: list[dict] = []
    stop = threading.Event()
    me = psutil.Process(proc.pid)

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            text = httpx.get(f"{url}/metrics", timeout=30).text
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 2),
                    "rss": me.memory_info().rss,
                    "requests": metric(text, "requests_total"),
                    **{k: metric(text, f"mlx_memory_{k}_bytes") for k in ("active", "cache", "peak")},
                }
            )
            stop.wait(1.0)

    try:
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        jobs, lock, done = list(range(args.requests)), threading.Lock(), {}
        started = time.monotonic()
        threads = [
            threading.Thread(target=client, args=(url, jobs, lock, done, args.cancel_every, s))
            for s in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - started
        time.sleep(2)
        stop.set()
        sampler.join(40)
    finally:
        proc.terminate()
        proc.wait(60)
    rss = [s["rss"] for s in samples]
    third = max(1, len(rss) // 3)
    middle, last = rss[third : 2 * third] or rss, rss[2 * third :] or rss
    bound = rss_listen + plan["total"] + args.allowance_mb * 2**20
    growth = max(last) - max(middle)
    verdict = {"bounded": max(rss) <= bound, "level": growth < args.level_mb * 2**20}
    MiB = 2**20
    summary = {
        "requests": args.requests,
        "clients": args.clients,
        "outcomes": done,
        "seconds": round(took, 1),
        "rss_listen_mib": round(rss_listen / MiB, 1),
        "rss_first_mib": round(rss[0] / MiB, 1),
        "rss_max_mib": round(max(rss) / MiB, 1),
        "rss_last_mib": round(rss[-1] / MiB, 1),
        "last_third_growth_mib": round(growth / MiB, 1),
        "plan_total_mib": round(plan["total"] / MiB, 1),
        "plan_cache_allowance_mib": round(plan["cache_allowance"] / MiB, 1),
        "allowance_mib": args.allowance_mb,
        "bound_mib": round(bound / MiB, 1),
        "mlx_active_max_mib": round(max(s["active"] or 0 for s in samples) / MiB, 1),
        "mlx_cache_max_mib": round(max(s["cache"] or 0 for s in samples) / MiB, 1),
        "mlx_peak_mib": round(max(s["peak"] or 0 for s in samples) / MiB, 1),
        **verdict,
    }
    print(json.dumps(summary, indent=2))
    print(
        f"RSS {summary['rss_first_mib']} -> max {summary['rss_max_mib']} MiB (bound {summary['bound_mib']} = listen "
        f"{summary['rss_listen_mib']} + plan {summary['plan_total_mib']} + allowance {args.allowance_mb:g}); "
        f"last third grew {summary['last_third_growth_mib']} MiB: "
        f"{'levelled off within the plan' if all(verdict.values()) else 'NOT within the plan'}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "plan": plan, "samples": samples}, indent=1))
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
