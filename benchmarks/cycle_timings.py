"""Do the loop's per-phase timings add up? One reply with a fixed DFlash block (no policy), then
the passes timed alone (costs.CostMeter at the reply's context) for the same block:

    sum(draft_ms + verify_ms) vs (Td(B) + Tt(B)) * cycles   (want within 15 %)

(a fixed block builds its verify graph on the drafter's lazy tokens and reads them with the
target's choices in one wait, so both passes are booked to ``verify_ms`` and ``draft_ms`` is 0:
their sum is what is compared), and the cost of a plain step inside the speculative loop (the policy
allowed no drafts: one pipelined run of plain steps, taps and the drafter's context included)
against mlx-lm's ``generate_step`` (``plain_steps``), alternated. Prints one table; nothing is
stored.

    python benchmarks/cycle_timings.py [--prompt TEXT] [--tokens 64] [--block 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlx_spec.costs import CostMeter
from mlx_spec.decode import plain_steps, spec_steps
from mlx_spec.default_target import DEFAULT_TARGET_ID, resolve_target_id
from mlx_spec.loading import load_pair
from mlx_spec.policy import DraftPolicy, estimate_costs
from mlx_spec.stats import Stats


def run(steps):
    st, toks, t = Stats(), [], None
    for s in steps:
        if s.prefill:
            t = time.perf_counter()
        st.add(s)
        toks += s.tokens
    return toks, st, (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_ID)
    ap.add_argument("--drafter", default="models/smollm2-135m-dflash2")
    ap.add_argument("--prompt", default="Explain why the sky is blue to a child.")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    target = str(resolve_target_id(a.target) or a.target)
    pair = load_pair(target, a.drafter)
    ids = pair.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True)
    B, N = a.block, a.tokens
    run(spec_steps(pair.target, pair.drafter, ids, block_size=B, max_tokens=8))  # warm-up
    run(plain_steps(pair.model, ids, max_tokens=8))
    toks, _, _ = run(plain_steps(pair.model, ids, max_tokens=N))
    meter = CostMeter(pair.model, pair.target, pair.drafter, [B], ids + toks[: N // 2])
    meter.round()  # warm-up round (discarded)
    spec, plain_in_loop, mlx_lm = [], [], []
    for r in range(a.repeats):
        meter.round()
        spec.append(run(spec_steps(pair.target, pair.drafter, ids, block_size=B, max_tokens=N))[1:])
        no_drafts = DraftPolicy(estimate_costs(pair), B, sources=())
        order = [
            ("loop", lambda: spec_steps(pair.target, pair.drafter, ids, block_size=B, max_tokens=N, policy=no_drafts)),  # noqa: B023
            ("mlx-lm", lambda: plain_steps(pair.model, ids, max_tokens=N)),
        ]
        for name, make in order if r % 2 == 0 else order[::-1]:
            (plain_in_loop if name == "loop" else mlx_lm).append(run(make())[1:])
    c = meter.costs()
    print(
        f"context {meter.context} tokens; passes alone (median of {a.repeats} rounds): "
        f"Td({B}) {c.td_ms[B]:.1f} ms, Tt({B}) {c.tt_ms[B]:.1f} ms, Tt(1) {c.tt_ms[1]:.1f} ms, T1 {c.t1_ms:.1f} ms"
    )
    print(f"{'repeat':>6} {'cycles':>6} {'passes ms':>9} {'(Td+Tt)*cyc':>11} {'ratio':>6} {'host ms':>8}")
    for r, (st, ms) in enumerate(spec):
        both, model = st.draft_ms + st.verify_ms, (c.td_ms[B] + c.tt_ms[B]) * st.cycles
        print(f"{r:>6} {st.cycles:>6} {both:>9.1f} {model:>11.1f} {both / model:>6.2f} {ms - both:>8.1f}")
    per = lambda runs: statistics.median(ms / st.cycles for st, ms in runs)  # noqa: E731
    lp, ml = per(plain_in_loop), per(mlx_lm)
    print(
        f"plain step: inside spec_steps {lp:.1f} ms, mlx-lm generate_step {ml:.1f} ms "
        f"(loop / mlx-lm = {lp / ml:.3f}; medians of {a.repeats}, alternated)"
    )


if __name__ == "__main__":
    main()
