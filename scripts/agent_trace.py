"""Cycle traces of the per-cycle policy on the built-in prompts (agent ones by default): per cycle its source (p plain,
D DFlash, L lookup), verify rows (D1: pick() trimmed the drafter's block to the anchor), accepted drafts (* a probe, ^ the drafter ran and pick() took
the lookup) and the lookup's match length (/m), so a reader sees where the drafts are short or
wasted. Also the reply's copy share (bench.copy_share) and, with --costs, the verify pass cost
Tt(L) for L up to 33 at the prompts' context.

With --model-time BENCH_JSON the policy learns from the pass costs of a `mlx_spec bench --json-out`
file (T1, Td(L), Tt(L)) instead of the wall clock, so its choices, and the figures, do not depend
on how busy the machine is (greedy tokens are deterministic): per reply the model time (T1 per
plain step, Tt(L) per verify, Td(L) where the drafter ran), the model-time speedup over plain
steps, the copy ceiling (bench.copy_ceiling) and its share, and the totals over the replies that
repeat their prompt (copy share >= 50 %) and, where the prompts are of several kinds, per kind.

    python scripts/agent_trace.py [--tokens 128] [--prompts agent-1,agent-3] [--sources dflash,lookup] [--costs]
    python scripts/agent_trace.py --tokens 64 --model-time runs/issue17-bench9-mkl.json [--queue fresh]
    python scripts/agent_trace.py --tokens 64 --model-time runs/issue17-bench9-mkl.json --prompts code-1,math-1,prose-1

``--queue fresh|ahead`` changes when a run of plain steps queues the next one (lookup_replay.queue_rule:
never, or only if the context one token on would stay plain too), to measure that one-token lag.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from mlx_spec.adaptive import Policies
from mlx_spec.bench import SCOPES, copy_max_draft, copy_oracle, copy_share, oracle_ceiling, scopes
from mlx_spec.costs import CostMeter, Costs
from mlx_spec.decode import spec_steps
from mlx_spec.config import LoadConfig
from mlx_spec.default_target import DEFAULT_TARGET_ID
from mlx_spec.session import open_session
from mlx_spec.prompts import builtin_prompts
from mlx_spec.tuner import apply_threads, load_result, tune_key

from lookup_replay import QUEUE_RULES, queue_rule  # (scripts/: this script's own folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_ID)
    ap.add_argument("--drafter", default=None, help="default: the bundled drafter")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None, help="prompt ids (default: all of --kinds)")
    ap.add_argument("--kinds", default=None, help="built-in prompt kinds (default: agent; with --prompts: all)")
    ap.add_argument("--sources", default="dflash,lookup")
    ap.add_argument("--costs", action="store_true", help="also time Tt(L), L = 1..33, at the prompts' context")
    ap.add_argument("--model-time", metavar="BENCH_JSON", default=None,
                    help="learn from and report the pass costs of this bench JSON, not the wall clock")
    ap.add_argument("--queue", choices=QUEUE_RULES, default="engine",
                    help="when a run of plain steps queues the next one (default: as the engine)")
    a = ap.parse_args()
    want = set(a.prompts.split(",")) if a.prompts else None
    kinds = tuple(a.kinds.split(",")) if a.kinds else None if want else ("agent",)
    prompts = [p for p in builtin_prompts(kinds) if want is None or p.id in want]
    if want and want - {p.id for p in prompts}:
        ap.error(f"no built-in prompt {', '.join(sorted(want - {p.id for p in prompts}))} among kinds {kinds or 'all'}")
    # loaded as the commands load it (the tuned result's key names the target as they do)
    cfg = LoadConfig(target=a.target, drafter=a.drafter and os.path.abspath(a.drafter))
    pair = open_session(cfg, tuning="none").pair
    tuned = load_result(tune_key(pair))
    print(f"tuned result: {tuned.source if tuned else 'none (the estimate)'}")
    apply_threads(tuned)
    eos = tuple(pair.tokenizer.eos_token_ids)
    policies = Policies(pair, tuned, sources=tuple(a.sources.split(",")))
    model = None
    if a.model_time:  # the policies price cycles by this curve (the tuned prior is kept)
        with open(a.model_time) as f:
            model = Costs.from_dict(json.load(f)["costs"])
        policies.costs, policies.measured = model, True
    totals = {scope: {"ms": 0.0, "tokens": 0, "cycles": 0} for scope in SCOPES}
    per_kind = {}  # kind -> the same totals, where the prompts are of several kinds
    oracles = {scope: [] for scope in SCOPES}  # copy_oracle's (tokens, ms) per reply
    for p in prompts:
        ids = p.encode(pair.tokenizer)
        policy = queue_rule(policies(), a.queue)
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
        if model is not None:  # the policy learns the cost curve's times, not the clock's
            observe = policy.observe
            policy.observe = lambda step, observe=observe: observe(model.timed(step))
        trace, toks = [], []
        t0 = time.perf_counter()
        for s in spec_steps(pair.target, pair.drafter, ids, block_size=8, max_tokens=a.tokens, eos_ids=eos,
                            policy=policy):
            toks += s.tokens
            if not s.prefill:
                trace.append(s)
        ms = (time.perf_counter() - t0) * 1e3
        reply = [t for t in toks if t not in eos]
        share = copy_share(ids, reply)
        print(f"\n{p.id}: prompt {len(ids)} tok, reply {len(reply)} tok, copy share {share:.0%}, "
              f"{len(trace)} cycles, {ms:.0f} ms")
        line = []
        for i, (s, d, m) in enumerate(zip(trace, policy.trace, matches)):
            tag = {"plain": "p", "dflash": "D", "lookup": "L"}.get(s.source, "?")
            line.append(f"{tag}{s.block_size}:{s.accepted}" + ("*" if d.probe else "") + ("^" if i in switched else "")
                        + f"/m{m}")
        print(" ".join(line))
        if model is not None and len(reply) > 1:
            ms = sum(model.timed(s).elapsed_ms for s in trace)
            n = sum(len(s.tokens) for s in trace)
            o_tok, o_ms = copy_oracle(ids, reply, model, max_draft=copy_max_draft(model))
            ceiling = o_tok * model.t1_ms / o_ms
            speedup = n * model.t1_ms / ms
            tau = n / len(trace)
            print(f"model time {ms:.0f} ms, speedup {speedup:.2f}x, tau {tau:.2f}, ceiling {ceiling:.2f}x "
                  f"({speedup / ceiling:.0%})")
            for scope in scopes(share):
                for k, v in (("ms", ms), ("tokens", n), ("cycles", len(trace))):
                    totals[scope][k] += v
                oracles[scope].append((o_tok, o_ms))
            kind = per_kind.setdefault(p.kind, {"ms": 0.0, "tokens": 0, "cycles": 0})
            for k, v in (("ms", ms), ("tokens", n), ("cycles", len(trace))):
                kind[k] += v
    for scope, total in totals.items():
        if model is not None and total["ms"] > 0:
            s_ = total["tokens"] * model.t1_ms / total["ms"]
            c_ = oracle_ceiling(oracles[scope], model.t1_ms)
            print(f"\n{scope} replies: model-time speedup {s_:.3f}x, ceiling {c_:.2f}x ({s_ / c_:.0%}), "
                  f"{total['cycles']} cycles, tau {total['tokens'] / total['cycles']:.2f}")
    if model is not None and len(per_kind) > 1:
        for kind, total in per_kind.items():
            print(f"{kind} replies: model-time speedup {total['tokens'] * model.t1_ms / total['ms']:.3f}x, "
                  f"{total['cycles']} cycles, tau {total['tokens'] / total['cycles']:.2f}")
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
