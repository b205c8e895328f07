"""Cycle traces of the per-cycle policy on the built-in prompts (agent ones by default): per cycle its source (p plain,
D DFlash, L lookup), verify rows (D1: pick() trimmed the drafter's block to the anchor), accepted drafts (* a probe, ^ the drafter ran and pick() took
the lookup) and the lookup's match length (/m), so a reader sees where the drafts are short or
wasted. Also the reply's copy share (bench.copy_share) and, with --costs, the verify pass cost
Tt(L) for L up to 33 at the prompts' context.

    python scripts/agent_trace.py [--tokens 128] [--prompts agent-1,agent-3] [--sources dflash,lookup] [--costs]
"""

from __future__ import annotations

import argparse
import os
import time

from mlx_spec.adaptive import Policies
from mlx_spec.bench import copy_share
from mlx_spec.costs import CostMeter
from mlx_spec.decode import spec_steps
from mlx_spec.config import LoadConfig
from mlx_spec.default_target import DEFAULT_TARGET_ID
from mlx_spec.session import open_session
from mlx_spec.prompts import builtin_prompts
from mlx_spec.tuner import apply_threads, load_result, tune_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_ID)
    ap.add_argument("--drafter", default=None, help="default: the bundled drafter")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None, help="prompt ids (default: all of --kinds)")
    ap.add_argument("--kinds", default="agent", help="built-in prompt kinds (default: agent)")
    ap.add_argument("--sources", default="dflash,lookup")
    ap.add_argument("--costs", action="store_true", help="also time Tt(L), L = 1..33, at the prompts' context")
    a = ap.parse_args()
    # loaded as the commands load it (the tuned result's key names the target as they do)
    cfg = LoadConfig(target=a.target, drafter=a.drafter and os.path.abspath(a.drafter))
    pair = open_session(cfg, tuning="none").pair
    tuned = load_result(tune_key(pair))
    print(f"tuned result: {tuned.source if tuned else 'none (the estimate)'}")
    apply_threads(tuned)
    eos = tuple(pair.tokenizer.eos_token_ids)
    want = set(a.prompts.split(",")) if a.prompts else None
    prompts = [p for p in builtin_prompts(tuple(a.kinds.split(","))) if want is None or p.id in want]
    policies = Policies(pair, tuned, sources=tuple(a.sources.split(",")))
    for p in prompts:
        ids = p.encode(pair.tokenizer)
        policy = policies()
        matches, choose = [], policy.choose

        def noting(ctx, choose=choose, matches=matches):  # the lookup's match length before each cycle
            matches.append(ctx.match if ctx.lookup else 0)
            return choose(ctx)

        policy.choose = noting
        switched, pick = set(), policy.pick

        def picking(dec, *args, pick=pick, switched=switched, matches=matches, **kw):  # pick() took the lookup
            got = pick(dec, *args, **kw)
            if got.source != dec.source:
                switched.add(len(matches) - 1)
            return got

        policy.pick = picking
        trace, toks = [], []
        t0 = time.perf_counter()
        for s in spec_steps(pair.target, pair.drafter, ids, block_size=8, max_tokens=a.tokens, eos_ids=eos,
                            policy=policy):
            toks += s.tokens
            if not s.prefill:
                trace.append(s)
        ms = (time.perf_counter() - t0) * 1e3
        reply = [t for t in toks if t not in eos]
        print(f"\n{p.id}: prompt {len(ids)} tok, reply {len(reply)} tok, copy share {copy_share(ids, reply):.0%}, "
              f"{len(trace)} cycles, {ms:.0f} ms")
        line = []
        for i, (s, d, m) in enumerate(zip(trace, policy.trace, matches)):
            tag = {"plain": "p", "dflash": "D", "lookup": "L"}.get(s.source, "?")
            line.append(f"{tag}{s.block_size}:{s.accepted}" + ("*" if d.probe else "") + ("^" if i in switched else "")
                        + f"/m{m}")
        print(" ".join(line))
    if a.costs:
        ids = prompts[0].encode(pair.tokenizer)
        sizes = [1, 2, 4, 8, 12, 16, 20, 24, 28, 33]
        meter = CostMeter(pair.model, pair.target, None, sizes, ids)
        for _ in range(4):
            meter.round()
        c = meter.costs()
        print(f"\ncontext {c.context}: T1 {c.t1_ms:.1f} ms; Tt(L): "
              + ", ".join(f"{L} {c.tt_ms[L]:.1f}" for L in sizes))


if __name__ == "__main__":
    main()
