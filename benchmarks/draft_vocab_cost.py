"""Draft-pass time with the drafter's reduced draft vocabulary vs the full head, interleaved.

    python benchmarks/draft_vocab_cost.py [--drafter models/smollm2-135m-dflash2] [--repeats 25]

One prompt's target features as context, then `propose` at blocks 4 and 8 with each head in
turn; medians after 3 warm-up rounds. The drafter must ship draft_vocab.json.
"""

import argparse
import statistics
import time

import mlx_spec  # noqa: F401  (loads the BLAS before MLX)
from mlx_spec.default_target import DEFAULT_TARGET_ID
from mlx_spec.loading import load_pair

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=DEFAULT_TARGET_ID)
    ap.add_argument("--drafter", default="models/smollm2-135m-dflash2")
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    p = load_pair(args.target, args.drafter)
    d, t = p.drafter, p.target
    if d.vocab is None:
        raise SystemExit(f"{args.drafter} ships no draft_vocab.json")
    ids = p.tokenizer.encode("Write a Python function that reverses a list. " * 8)
    feats = t(mx.array([ids]), t.make_cache()).hidden
    heads = (("full", None), (f"reduced ({d.vocab.size} ids)", d.vocab))
    times: dict = {}
    for _ in range(args.repeats):
        for name, vocab in heads:
            d.set_vocab(vocab)
            for B in (4, 8):
                cache = d.make_cache()
                d.add_context(feats[:, :-1], cache)
                t0 = time.perf_counter()
                mx.eval(d.propose(mx.array(ids[-1]), feats[:, -1:], cache, B).tokens)
                times.setdefault((name, B), []).append(time.perf_counter() - t0)
    for (name, B), v in times.items():
        print(f"block {B} {name:22s} draft pass median {statistics.median(v[3:]) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
