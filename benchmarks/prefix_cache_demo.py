"""Turn-2 prefill with and without the prefix cache on the default pair (engine thread, greedy).

    python benchmarks/prefix_cache_demo.py [--tokens 48] [--cache-mb 256]

Prints the second turn's prompt tokens, how many came from the cache, the prefill time, and a
digest of the reply (equal with and without the cache: reuse does not change the output).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads the optimized BLAS before MLX)
from mlx_spec.default_target import DEFAULT_TARGET_ID
from mlx_spec.engine import Engine, Request
from mlx_spec.generation import engine_info
from mlx_spec.loading import load_pair
from mlx_spec.session import Session

DRAFTER = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-dflash2"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens per reply")
    ap.add_argument("--cache-mb", type=int, default=256, help="prefix cache budget of the cached run")
    args = ap.parse_args(argv)

    def loader():
        p = load_pair(DEFAULT_TARGET_ID, str(DRAFTER))
        return Session.of(p, engine_info(p, 4, "flag"))

    system = "You are a careful Python tutor. " * 40
    turn1 = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Write a function that reverses a string."},
    ]
    for budget in (args.cache_mb << 20, 0):
        with Engine(loader, prefix_cache=budget) as e:
            e.wait_ready(120)
            d1 = e.submit(Request(messages=turn1, max_tokens=args.tokens)).result()
            turn2 = turn1 + [
                {"role": "assistant", "content": d1.text},
                {"role": "user", "content": "Now add type hints."},
            ]
            d2 = e.submit(Request(messages=turn2, max_tokens=args.tokens)).result()
            digest = hashlib.sha256(d2.text.encode()).hexdigest()[:12]
            print(
                f"prefix cache {budget >> 20} MiB: turn 2 prompt {d2.prompt_tokens} tok, cached "
                f"{d2.timings['cache_n']}, prefill {d2.timings['prompt_ms']:.0f} ms, reply {digest}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
