"""Speculation at agent context lengths, taken apart (docs/context.md).

``policy``: per context, one agent (or other) prompt padded to it, prefilled once, then from the
cached prefix: plain decoding, and the default engine with its policy priced by the stored cost
curve without a context term and with the term measured at this context (the passes timed
there, ``costs.context_term``), alternated. Prints, per engine, tok/s, the rows it verified per
committed token, its cycles by rows and its draft sources (counters, not timings: they say what
the policy chose), and the pass costs at the context.

``window``: per context, fixed-block DFlash (greedy, from the cached prefix) with the drafter's
context cache bounded to each drafting window: tau and acceptance by position (deterministic),
and the drafter's pass Td(B) timed alone over each window (a median of interleaved passes).

    python benchmarks/long_context.py policy --contexts 1024,4096 --kinds agent --tokens 32
    python benchmarks/long_context.py window --contexts 4096 --kinds agent,prose --windows none,256,512,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import mlx_spec  # noqa: F401  (loads the BLAS before mlx)
from mlx_spec.contextbench import padded
from mlx_spec.costs import CostMeter, context_term
from mlx_spec.decode import plain_steps, spec_steps
from mlx_spec.default_target import DEFAULT_TARGET_ID, resolve_target_id
from mlx_spec.loading import DEFAULT_DRAFTER, MODELS_DIR, load_pair
from mlx_spec.policy import PolicyFactory
from mlx_spec.prefix import PrefixCache, take
from mlx_spec.prompts import builtin_prompts
from mlx_spec.stats import Stats
from mlx_spec.text import encode_prompt
from mlx_spec.tuning import TuneResult, apply_threads, load_result, tune_key

import mlx.core as mx


def cached(pair, kind: str, n: int):
    """(prompt ids padded to ``n``, a prefix-cache entry holding all but its last token)."""
    p = builtin_prompts((kind,), 1)[0]
    msgs, _ = padded(p, n, lambda m: len(encode_prompt(pair.tokenizer, messages=m)))
    ids = encode_prompt(pair.tokenizer, messages=msgs)
    pc = PrefixCache(1 << 40)
    g = spec_steps(pair.target, pair.drafter, ids, block_size=2, max_tokens=1, on_exit=pc.store)
    next(g)
    g.close()
    return ids, pc.lookup(ids, drafter=True)


def decode(steps) -> tuple[list[int], float, Stats]:
    st, toks, t0 = Stats(), [], None
    for s in steps:
        if t0 is None:  # the prefill step (the cached prefix's last token): not timed
            t0 = time.perf_counter()
            continue
        st.add(s)
        toks += s.tokens
    return toks, len(toks) / max(1e-9, time.perf_counter() - t0), st


def policy(pair, args) -> None:
    tuned = TuneResult.from_dict(json.load(open(args.tuned))) if args.tuned else load_result(tune_key(pair))
    if tuned is None or tuned.costs is None:
        raise SystemExit("no stored tuning result for this pair: run `mlx_spec tune`, or pass --tuned FILE")
    apply_threads(tuned)
    flat = replace(tuned, costs=replace(tuned.costs, ctx_ms={}, ctx_draft_ms={}))
    for n in args.contexts:
        for kind in args.kinds:
            ids, entry = cached(pair, kind, n)

            def copies(entry=entry):
                got = take(entry, len(entry.tokens), True)
                return got.target, got.drafter

            meter = CostMeter(pair.model, pair.target, pair.drafter, (2, 8, 16), ids[:-1], prefilled=copies)
            for _ in range(4):
                meter.round()
            here = meter.costs()
            term = context_term(tuned.costs, here)
            measured = replace(tuned, costs=replace(tuned.costs, ctx_ms=term.ctx_ms, ctx_draft_ms=term.ctx_draft_ms))
            engines = {"engine, curve without a context term": flat, "engine, measured context term": measured}
            row = {"context": len(ids), "kind": kind, "passes here": here.as_dict(), "term": term.ctx_ms}
            ref = None
            for rep in range(args.repeats):
                order = [("plain", None), *engines.items()]
                for label, result in order if rep % 2 == 0 else order[::-1]:
                    if result is None:
                        steps = plain_steps(
                            pair.model, ids, max_tokens=args.tokens, prefill=take(entry, len(entry.tokens), False)
                        )
                    else:
                        steps = spec_steps(
                            pair.target,
                            pair.drafter,
                            ids,
                            block_size=2,
                            max_tokens=args.tokens,
                            policy=PolicyFactory(pair, result)(),
                            prefill=take(entry, len(entry.tokens), True),
                        )
                    toks, tps, st = decode(steps)
                    ref = ref or toks
                    d = row.setdefault(label, {"tok/s": [], "same": True})
                    d["tok/s"].append(round(tps, 2))
                    d["same"] &= toks == ref
                    if result is not None:
                        d["rows per token"] = round(
                            sum(L * k for L, k in st.block_sizes.items()) / max(1, st.tokens), 2
                        )
                        d["cycles by rows"] = {str(L): k for L, k in sorted(st.block_sizes.items())}
                        d["sources"] = {
                            s: {k: v[k] for k in ("cycles", "drafted", "accepted")} for s, v in st.sources.items()
                        }
            print(json.dumps(row), flush=True)


def window(pair, args) -> None:
    d = pair.drafter
    for n in args.contexts:
        for kind in args.kinds:
            ids, entry = cached(pair, kind, n)

            def bounded(w, entry=entry):
                got = take(entry, len(entry.tokens), True)
                if w is not None:
                    for c in got.drafter:
                        c.limit = w
                        c.keys, c.values = c.keys[:, :, -w:], c.values[:, :, -w:]
                return got

            ref, caches = None, {}
            for w in args.windows:
                d.context_limit = w
                st, toks = Stats(), []
                for s in spec_steps(
                    pair.target, d, ids, block_size=args.block, max_tokens=args.tokens, prefill=bounded(w)
                ):
                    st.add(s)
                    toks += s.tokens
                ref = ref or toks
                caches[w] = bounded(w).drafter
                print(
                    json.dumps(
                        {
                            "context": len(ids),
                            "kind": kind,
                            "window": w,
                            "tau": round(st.mean_acceptance_length, 3),
                            "acceptance by position": [round(x, 3) for x in st.acceptance_by_position],
                            "same output": toks == ref,
                        }
                    ),
                    flush=True,
                )
            anchor, times = mx.array(int(ids[-1]), mx.int32), {w: [] for w in args.windows}
            for r in range(args.rounds + 1):
                for w in args.windows:
                    d.context_limit = w
                    t = time.perf_counter()
                    mx.eval(d.propose(anchor, None, caches[w], args.block).tokens)
                    if r:
                        times[w].append((time.perf_counter() - t) * 1e3)
            d.context_limit = None
            print(
                f"context {len(ids)} ({kind}): Td({args.block}) "
                + ", ".join(f"window {w}: {statistics.median(times[w]):.1f} ms" for w in args.windows),
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("policy", "window"))
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--kinds", default="agent")
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    ap.add_argument("--repeats", type=int, default=2, help="policy: runs of each method, alternated")
    ap.add_argument("--tuned", default=None, help="policy: a stored tuning result (JSON) to price with")
    ap.add_argument("--windows", default="none,256,512,1024", help="window: drafting windows ('none': all)")
    ap.add_argument("--block", type=int, default=8, help="window: the fixed DFlash block")
    ap.add_argument("--rounds", type=int, default=20, help="window: timed draft passes per window")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.kinds = args.kinds.split(",")
    args.windows = [None if w == "none" else int(w) for w in args.windows.split(",")]
    pair = load_pair(str(resolve_target_id(DEFAULT_TARGET_ID)), str(MODELS_DIR / DEFAULT_DRAFTER))
    (policy if args.what == "policy" else window)(pair, args)


if __name__ == "__main__":
    main()
