"""What malloc keeps of MLX's freed buffers, with and without the engine handing it back.

Loads the embedded pair into an ``Engine`` in this process (no HTTP), sends ``--rounds`` rounds of
``--per-round`` requests from 8 threads (agent-like prompts of ~1 K and ~3 K tokens behind shared
system prompts, and short chats; ``max_tokens`` 8 to 128) and prints after each round the RSS,
MLX's active and cached bytes, the RSS outside MLX, and malloc's own figures (glibc's
``mallinfo2``: bytes in use and bytes free in its arenas). ``--no-release`` runs the engine
without handing malloc's free pages back when requests end.

    python benchmarks/heap_release.py --rounds 2 --per-round 8 [--no-release]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import threading
import time

from mlx_spec import memory
from mlx_spec.config import LoadConfig
from mlx_spec.engine import Engine, Request
from mlx_spec.session import open_session

MiB = 2**20
WORDS = "the quick brown fox jumps over a lazy dog read file call tool search result line code test".split()
# (share, system prompt words): about a token a word with SmolLM2's tokenizer
KINDS = ((0.4, 0), (0.35, 1000), (0.25, 3000))


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def malloc_figures() -> dict:
    """glibc's view of its heap: bytes in use and bytes free in its arenas, bytes mmapped."""
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is None:
        return {}
    fn.restype = MallInfo2
    m = fn()
    return {
        "malloc_in_use_mib": m.uordblks // MiB,
        "malloc_free_mib": m.fordblks // MiB,
        "mmapped_mib": m.hblkhd // MiB,
    }


def request(rnd: random.Random) -> Request:
    _, n = rnd.choices(KINDS, weights=[k[0] for k in KINDS])[0]
    system = []
    if n:
        agent = rnd.randrange(2)
        own = random.Random(f"{n}-{agent}")
        system = [{"role": "system", "content": " ".join(own.choice(WORDS) for _ in range(n))}]
    user = " ".join(rnd.choice(WORDS) for _ in range(rnd.choice((4, 12, 40))))
    return Request(
        messages=system + [{"role": "user", "content": user}], max_tokens=rnd.choice((8, 32, 64, 128)), temperature=0
    )


def figures(e: Engine, tag: str) -> dict:
    m = e.snapshot()["memory"]
    now = memory.rss()
    return {
        "after": tag,
        "rss_mib": now // MiB,
        "mlx_active_mib": m["active"] // MiB,
        "mlx_cache_mib": m["cache"] // MiB,
        "outside_mlx_mib": (now - m["active"] - m["cache"]) // MiB,
        "prefix_cache_mib": e.snapshot()["prefix_cache_bytes"] // MiB,
        "heap_releases": m["heap_releases"],
        **malloc_figures(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--per-round", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefix-cache-mb", type=float, default=384)
    p.add_argument("--no-release", action="store_true", help="keep malloc's free pages (the engine before the fix)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = LoadConfig(context=args.context, prefix_cache=int(args.prefix_cache_mb * MiB), tune=False)
    e = Engine(
        lambda: open_session(cfg, log=lambda m: print(m, file=sys.stderr)),
        max_queue=64,
        prefix_cache=cfg.prefix_cache,
        max_batch=None,
        release_heap=not args.no_release,
    ).start()
    e.wait_ready(1800)
    rnd = random.Random(args.seed)
    try:
        print(json.dumps(figures(e, "loading")), flush=True)
        for r in range(args.rounds):
            handles = [e.submit(request(rnd)) for _ in range(args.per_round)]
            threads = [threading.Thread(target=h.result) for h in handles]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(1.0)  # (the engine hands the pages back as it goes back to its queue)
            print(json.dumps(figures(e, f"round {r + 1} ({(r + 1) * args.per_round} requests)")), flush=True)
    finally:
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
