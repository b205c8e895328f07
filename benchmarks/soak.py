"""Soak `mlx_spec serve`: does its resident memory level off within the bound it states?

Starts `mlx_spec serve` on 127.0.0.1 (the embedded default pair unless --target/--drafter are
given) and sends up to ``--requests`` requests from ``--clients`` concurrent clients, issuing none
after ``--duration`` seconds. The requests mix short chats with ~1 K and ~3 K token agent-like
prompts (a few fixed system prompts, so they hit the prefix cache), ``max_tokens`` from 8 to 128,
both API families (OpenAI chat and text completions, Anthropic messages), streamed and not, and
a share (``--cancel-share``) streamed and dropped after a few chunks. Every ``--every`` seconds it
samples the server's RSS (psutil) and, from /metrics, MLX's active / cache / peak bytes, the
prefix cache's bytes and the bytes the plan reserved for the batch's sequences.

    nice -n 19 python benchmarks/soak.py --requests 300 --clients 8 --no-tune --out soak.json

The verdict has two parts: **bounded** (the largest RSS sample is at most the server's
``memory_bound_bytes``: its RSS once loaded + the plan's sequences, prefix cache and MLX cache +
a stated heap allowance, docs/memory.md) and **level** (a least-squares line through the last
third of the RSS samples rises less than ``--level-mb`` over that third).
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

MiB = 2**20
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven engineers write tests on a shared machine "
    "and the server keeps serving every request it can read file call tool search result line code "
    "function return value error test build run check list open close edit patch diff commit branch"
).split()
# (kind, share of requests, words of system prompt): about a token a word with SmolLM2's tokenizer
KINDS = (("chat", 0.4, 0), ("agent-1k", 0.35, 1000), ("agent-3k", 0.25, 3000))
AGENTS_PER_KIND = 2  # distinct system prompts of each agent length (prefix cache entries compete)
MAX_TOKENS = (8, 32, 64, 128)
# (API, streamed, share of requests); a cancelled request is always streamed
APIS = (
    ("openai-chat", False, 0.3),
    ("openai-chat", True, 0.25),
    ("anthropic", False, 0.15),
    ("anthropic", True, 0.15),
    ("openai-text", False, 0.15),
)


def words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def system_prompt(kind: str, n_words: int, agent: int) -> str:
    rnd = random.Random(f"{kind}-{agent}")
    return f"You are agent {agent} ({kind}). Tools and rules follow. " + words(rnd, n_words)


def make_job(i: int, rnd: random.Random, cancel_share: float) -> dict:
    """Request ``i``: its kind, API, streaming, cancellation and body parts."""
    kind, _, n_words = rnd.choices(KINDS, weights=[k[1] for k in KINDS])[0]
    system = system_prompt(kind, n_words, rnd.randrange(AGENTS_PER_KIND)) if n_words else None
    user = words(rnd, rnd.choice((4, 12, 40, 60)))
    cancel = rnd.random() < cancel_share
    api, stream, _ = rnd.choices(APIS, weights=[a[2] for a in APIS])[0]
    if cancel:  # dropped mid-stream (text completions are not streamed here: a chat stream instead)
        api, stream = ("openai-chat" if api == "openai-text" else api), True
    return {
        "i": i,
        "kind": kind,
        "api": api,
        "stream": stream,
        "cancel": cancel,
        "system": system,
        "user": user,
        "max_tokens": rnd.choice(MAX_TOKENS),
    }


def request_of(job: dict) -> tuple[str, dict]:
    """(path, JSON body) of a job."""
    sys_, user, n = job["system"], job["user"], job["max_tokens"]
    if job["api"] == "anthropic":
        body = {"model": "local", "max_tokens": n, "messages": [{"role": "user", "content": user}], "temperature": 0}
        if sys_:
            body["system"] = sys_
        return "/v1/messages", {**body, "stream": job["stream"]}
    if job["api"] == "openai-text":
        return "/v1/completions", {"prompt": (sys_ + "\n\n" if sys_ else "") + user, "max_tokens": n, "temperature": 0}
    messages = ([{"role": "system", "content": sys_}] if sys_ else []) + [{"role": "user", "content": user}]
    return "/v1/chat/completions", {"messages": messages, "max_tokens": n, "temperature": 0, "stream": job["stream"]}


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
    url, deadline = None, time.monotonic() + 900
    log: list[str] = []
    while url is None:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit("serve exited:\n" + "".join(log))
        log.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("serve did not become ready:\n" + "".join(log))
        time.sleep(0.5)
    return proc, url, log


def metric(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^mlx_spec:{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def run_job(c: httpx.Client, job: dict) -> str:
    path, body = request_of(job)
    if job["cancel"]:
        with c.stream("POST", path, json=body) as s:
            if s.status_code != 200:
                return f"http {s.status_code}"
            seen = 0
            for line in s.iter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    return "cancelled"  # the stream is dropped here: the server cancels the generation
        return "ended before cancel"
    if job["stream"]:
        with c.stream("POST", path, json=body) as s:
            if s.status_code != 200:
                return f"http {s.status_code}"
            for _ in s.iter_lines():
                pass
        return "ok"
    r = c.post(path, json=body)
    return "ok" if r.status_code == 200 else f"http {r.status_code}"


def client(url: str, jobs: list, lock: threading.Lock, done: dict, stop_at: float) -> None:
    with httpx.Client(base_url=url, timeout=900) as c:
        while time.monotonic() < stop_at:
            with lock:
                if not jobs:
                    return
                job = jobs.pop(0)
            try:
                outcome = run_job(c, job)
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            with lock:
                key = f"{job['kind']} {job['api']}{' stream' if job['stream'] else ''}: {outcome}"
                done[key] = done.get(key, 0) + 1


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) points (0 for fewer than two distinct t)."""
    n = len(points)
    if n < 2:
        return 0.0
    mt, my = sum(t for t, _ in points) / n, sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / var if var else 0.0


def verdict(samples: list[dict], bound: float, level_mb: float) -> dict:
    """Bounded and level, from RSS samples ({"t", "rss"}) and the server's bound (bytes)."""
    rss = [s["rss"] for s in samples]
    t_end = samples[-1]["t"]
    last = [(s["t"], s["rss"]) for s in samples if s["t"] >= 2 * t_end / 3]
    middle = [s["rss"] for s in samples if t_end / 3 <= s["t"] < 2 * t_end / 3] or rss
    k = slope(last)
    rise = k * (last[-1][0] - last[0][0]) if len(last) > 1 else 0.0
    return {
        "rss_max_mib": round(max(rss) / MiB, 1),
        "bound_mib": round(bound / MiB, 1),
        "headroom_mib": round((bound - max(rss)) / MiB, 1),
        "last_third_slope_mib_per_hour": round(k * 3600 / MiB, 1),
        "last_third_rise_mib": round(rise / MiB, 1),
        "last_third_over_middle_mib": round((max(r for _, r in last) - max(middle)) / MiB, 1),
        "bounded": max(rss) <= bound,
        "level": rise < level_mb * MiB,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=4500, help="seconds after which no request is sent")
    p.add_argument("--cancel-share", type=float, default=0.1, help="share streamed and dropped after a few chunks")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefix-cache-mb", type=float, default=384)
    p.add_argument("--level-mb", type=float, default=32, help="rise of the last third that still counts as level")
    p.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument(
        "--no-tune", action="store_true", help="serve with the checkpoint's block size (no first-launch tuning)"
    )
    p.add_argument("--out", type=Path, default=None, help="write samples and verdict as JSON")
    args = p.parse_args()
    args.pair = [x for k in ("target", "drafter") if getattr(args, k) for x in (f"--{k}", getattr(args, k))]
    rnd = random.Random(args.seed)
    jobs = [make_job(i, rnd, args.cancel_share) for i in range(args.requests)]
    began = time.monotonic()
    proc, url, log = start_server(args)
    me = psutil.Process(proc.pid)
    text = httpx.get(f"{url}/metrics", timeout=60).text
    bound = metric(text, "memory_bound_bytes")
    if bound is None:
        proc.terminate()
        raise SystemExit("the server states no memory_bound_bytes in /metrics (no memory plan?):\n" + "".join(log))
    terms = {
        t: metric(text, "memory_bound_term_bytes", f'{{term="{t}"}}')
        for t in ("runtime", "weights", "sequences", "prefix_cache", "mlx_cache", "heap")
    }
    rss_loaded = metric(text, "memory_rss_loaded_bytes")
    samples: list[dict] = []
    stop = threading.Event()
    done: dict = {}
    lock = threading.Lock()

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            try:
                m = httpx.get(f"{url}/metrics", timeout=60).text
                rss = me.memory_info().rss
            except (httpx.HTTPError, psutil.Error):
                stop.wait(args.every)
                continue
            with lock:
                finished = sum(done.values())
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 2),
                    "rss": rss,
                    "finished": finished,
                    "requests": metric(m, "requests_total"),
                    "batch": metric(m, "batch_active"),
                    "prefix": metric(m, "prefix_cache_bytes"),
                    "reserved": metric(m, "memory_sequences_reserved_bytes"),
                    **{k: metric(m, f"mlx_memory_{k}_bytes") for k in ("active", "cache", "peak")},
                }
            )
            stop.wait(args.every)

    try:
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        stop_at = started + args.duration
        threads = [
            threading.Thread(target=client, args=(url, jobs, lock, done, stop_at), daemon=True)
            for _ in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, stop_at + 900 - time.monotonic()))  # a request in flight at the end may finish
        took = time.monotonic() - started
        time.sleep(2 * args.every)
        stop.set()
        sampler.join(120)
        text = httpx.get(f"{url}/metrics", timeout=60).text
    finally:
        proc.terminate()
        proc.wait(60)
    v = verdict(samples, bound, args.level_mb)
    # the same bound with the sequences counted as admission counted them at most during this run
    reserved_max = metric(text, "memory_sequences_reserved_max_bytes") or 0
    accounted = bound - (terms["sequences"] or 0) + reserved_max
    # MLX's high-water mark: its peak of active bytes (the samples, read after each engine step,
    # miss what a long step allocates meanwhile) + its buffer cache at its largest
    mlx_high = max(s["peak"] or 0 for s in samples) + max(s["cache"] or 0 for s in samples)
    runtime = terms["runtime"] or 0
    summary = {
        "requests_sent": args.requests - len(jobs),
        "requests_planned": args.requests,
        "clients": args.clients,
        "outcomes": dict(sorted(done.items())),
        "seconds": round(took, 1),
        "wall_seconds_with_load": round(time.monotonic() - began, 1),
        "samples": len(samples),
        "context": args.context,
        "prefix_cache_mb": args.prefix_cache_mb,
        "prefix_cache_hits": metric(text, "prefix_cache_hits_total", '{tier="memory"}'),
        "prompt_tokens_total": metric(text, "prompt_tokens_total"),
        "prompt_tokens_cached_total": metric(text, "prompt_tokens_cached_total"),
        "requests_cancelled_total": metric(text, "requests_cancelled_total"),
        "rss_loaded_mib": round((rss_loaded or 0) / MiB, 1),
        "rss_first_mib": round(samples[0]["rss"] / MiB, 1),
        "rss_last_mib": round(samples[-1]["rss"] / MiB, 1),
        "bound_terms_mib": {k: round((b or 0) / MiB, 1) for k, b in terms.items()},
        "mlx_active_max_mib": round(max(s["active"] or 0 for s in samples) / MiB, 1),
        "mlx_cache_max_mib": round(max(s["cache"] or 0 for s in samples) / MiB, 1),
        "mlx_peak_mib": round(max(s["peak"] or 0 for s in samples) / MiB, 1),
        "prefix_cache_max_mib": round(max(s["prefix"] or 0 for s in samples) / MiB, 1),
        "reserved_max_mib": round(reserved_max / MiB, 1),
        "accounted_bound_mib": round(accounted / MiB, 1),
        "within_accounted_bound": max(s["rss"] for s in samples) <= accounted,
        "heap_releases": metric(text, "memory_heap_releases_total"),
        "heap_released_mib": round((metric(text, "memory_heap_released_bytes_total") or 0) / MiB, 1),
        # RSS beyond the runtime and MLX's own high-water mark: what malloc and the Python heap
        # held beyond MLX at worst (freed buffers not yet handed back to the OS included)
        "heap_growth_mib": round((max(s["rss"] for s in samples) - runtime - mlx_high) / MiB, 1),
        **v,
    }
    print(json.dumps(summary, indent=2))
    ok = v["bounded"] and v["level"]
    t = summary["bound_terms_mib"]
    print(
        f"RSS {summary['rss_loaded_mib']} MiB once loaded -> max {v['rss_max_mib']} MiB; bound {v['bound_mib']} = "
        f"runtime {t['runtime']} + weights {t['weights']} + sequences {t['sequences']} + prefix cache "
        f"{t['prefix_cache']} + MLX cache {t['mlx_cache']} + heap {t['heap']}\n"
        f"with the sequences as admission counted them at most ({summary['reserved_max_mib']} MiB): "
        f"{summary['accounted_bound_mib']} MiB; RSS beyond the runtime and MLX's high-water mark: "
        f"{summary['heap_growth_mib']} MiB\n"
        f"last third: {v['last_third_rise_mib']} MiB ({v['last_third_slope_mib_per_hour']} MiB/h): "
        + ("levelled off within the bound" if ok else "NOT levelled off within the bound")
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
