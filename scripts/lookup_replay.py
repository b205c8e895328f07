"""Replay the target's greedy replies through the lookup index and a lookup-only policy, in
seconds and by counts: how a change to ``lookup.SuffixIndex`` (or to the copy model) moves the
model-time speedup, with no model pass after the replies are cached.

Greedy replies are deterministic, so a lookup draft's acceptance is known from the reply
itself: each cycle the index proposes from the prompt and the reply so far, the policy
(``adaptive.DraftPolicy``, lookup only, learning from the cost curve's times) chooses plain or a
draft of L rows, and the reply's own next tokens say how many are accepted. A run of plain steps
decides one token late, as the engine's pipelined plain steps do. Per reply: model time (T1 per
plain step, Tt(L) per verify), speedup over plain steps, cycles; for the replies that repeat
their prompt (copy share >= 50 %) also the copy ceiling (bench.copy_ceiling) and a clairvoyant
bound: the same proposals with the best length taken every cycle (what a policy that knew each
proposal's acceptance would reach). ``--baseline`` replays the index without following the copy
(``follow=False``) and without stop tokens, side by side.

    python scripts/lookup_replay.py --replies runs/replies-agent128.json --kinds agent --tokens 128   # caches
    python scripts/lookup_replay.py --replies runs/replies-agent128.json --tokens 64 --costs runs/issue17-bench6.json --baseline
"""

from __future__ import annotations

import argparse
import json
import os

from mlx_spec.adaptive import LOOKUP, PLAIN, Context, DraftPolicy
from mlx_spec.bench import COPY_SUBSET, copy_oracle, copy_share
from mlx_spec.costs import Costs
from mlx_spec.decode import Step
from mlx_spec.lookup import SuffixIndex


def cache_replies(path: str, kinds: tuple[str, ...], tokens: int) -> None:
    """The default target's greedy replies to the built-in prompts of ``kinds`` (mlx-lm's own
    generate_step: plain decoding), written to ``path``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlx_spec.config import LoadConfig
    from mlx_spec.default_target import DEFAULT_TARGET_ID
    from mlx_spec.prompts import builtin_prompts
    from mlx_spec.session import open_session

    pair = open_session(LoadConfig(target=DEFAULT_TARGET_ID), tuning="none").pair
    eos = [int(t) for t in pair.tokenizer.eos_token_ids]
    out = {}
    for p in builtin_prompts(kinds):
        ids = [int(t) for t in p.encode(pair.tokenizer)]
        reply = []
        for tok, _ in generate_step(mx.array(ids), pair.model, max_tokens=tokens):
            if int(tok) in eos:
                break
            reply.append(int(tok))
        out[p.id] = {"kind": p.kind, "prompt": ids, "reply": reply}
        print(f"{p.id}: {len(ids)} prompt tokens, {len(reply)} reply tokens", flush=True)
    with open(path, "w") as f:
        json.dump({"eos": eos, "tokens": tokens, "replies": out}, f)


def _agreement(look, full, n) -> int:
    a = 0
    while a < len(look) and n + a < len(full) and look[a] == full[n + a]:
        a += 1
    return a


def replay(prompt, full, costs: Costs, max_tokens: int, make) -> tuple[float, int]:
    """(model ms, cycles) of a lookup-only policy on the
    reply ``full`` (its EOS included when it ended early)."""
    index, policy = make(prompt), DraftPolicy(costs, 8, sources=(LOOKUP,))
    index.extend(full[:1])  # the first token comes from the prefill
    n, ms, cycles, stale = 1, 0.0, 0, None
    while n < len(full):
        room = max_tokens - n
        look, match = index.propose(min(policy.max_lookup, room - 1))
        ctx = Context(tuple(look), match, room, True)
        # a run of plain steps asks one token ahead (the engine's pipelined plain steps)
        d = policy.choose(stale if stale is not None and policy.stays_plain(stale) else ctx)
        drafts = list(look[:d.length - 1]) if d.source == LOOKUP else []
        a = _agreement(drafts, full, n)
        L = len(drafts) + 1
        t = costs.t1_ms if L == 1 else costs.verify(L)
        toks = tuple(full[n:n + a + 1])
        policy.observe(Step(toks, drafted=len(drafts), accepted=a, block_size=L,
                            source=LOOKUP if L > 1 else PLAIN, verify_ms=t, elapsed_ms=t))
        stale = ctx if L == 1 else None
        index.extend(toks)
        n, ms, cycles = n + len(toks), ms + t, cycles + 1
    return ms, cycles


def clairvoyant(prompt, full, costs: Costs, make, max_draft: int = 32) -> float:
    """The least model time with the index's own proposals, each cycle's acceptance known."""
    index = make(prompt)
    index.extend(full[:1])
    agree = [0]
    for n in range(1, len(full)):
        agree.append(_agreement(index.propose(max_draft)[0], full, n))
        index.extend(full[n:n + 1])
    N = len(full)
    best = [0.0] * (N + 1)
    for i in range(N - 1, 0, -1):
        best[i] = costs.t1_ms + best[i + 1]
        a = min(agree[i], max_draft, N - i - 1)
        if a > 0:
            best[i] = min(best[i], costs.verify(a + 1) + best[min(i + a + 1, N)])
    return best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replies", required=True, help="JSON of cached replies (written first if missing)")
    ap.add_argument("--kinds", default="agent", help="built-in prompt kinds to cache (default: agent)")
    ap.add_argument("--tokens", type=int, default=64, help="reply tokens (cached: generated; replayed: cut)")
    ap.add_argument("--costs", default=None, help="a `mlx_spec bench --json-out` file whose pass costs to use")
    ap.add_argument("--baseline", action="store_true", help="also replay the index without following the copy")
    a = ap.parse_args()
    if not os.path.exists(a.replies):
        cache_replies(a.replies, tuple(a.kinds.split(",")), a.tokens)
        if a.costs is None:
            return
    if a.costs is None:
        ap.error("--costs is needed to replay")
    with open(a.replies) as f:
        data = json.load(f)
    with open(a.costs) as f:
        costs = Costs.from_dict(json.load(f)["costs"])
    eos = data["eos"]
    indexes = {"index": lambda p: SuffixIndex(p, 4, stop=eos)}
    if a.baseline:
        indexes = {"baseline": lambda p: SuffixIndex(p, 4, follow=False), **indexes}
    totals = {name: [0.0, 0, 0.0, 0] for name in indexes}  # copying replies: ms, tokens, clairvoyant ms, cycles
    ceiling = [0, 0.0]
    for pid, r in data["replies"].items():
        reply = r["reply"][:a.tokens]
        ended = len(r["reply"]) < data.get("tokens", 0)  # (it stopped at EOS before the recording's limit)
        full = reply + ([eos[0]] if ended and len(reply) < a.tokens else [])
        if len(full) < 2:
            continue
        share = copy_share(r["prompt"], reply)
        o_tok, o_ms = copy_oracle(r["prompt"], reply, costs, max_draft=min(32, max(costs.tt_ms) - 1))
        cells = []
        for name, make in indexes.items():
            ms, cycles = replay(r["prompt"], full, costs, a.tokens, make)
            cv = clairvoyant(r["prompt"], full, costs, make)
            cells.append(f"{name} {(len(full) - 1) * costs.t1_ms / ms:.2f}x ({cycles} cycles)")
            if share >= COPY_SUBSET:
                t = totals[name]
                t[0] += ms
                t[1] += len(full) - 1
                t[2] += cv
                t[3] += cycles
        if share >= COPY_SUBSET:
            ceiling[0] += o_tok
            ceiling[1] += o_ms
        print(f"{pid}: copy share {share:.0%}, ceiling {o_tok * costs.t1_ms / o_ms:.2f}x; " + "; ".join(cells))
    if ceiling[1] > 0:
        c = ceiling[0] * costs.t1_ms / ceiling[1]
        print(f"\ncopying replies (ceiling {c:.2f}x):")
        for name, (ms, tokens, cv, cycles) in totals.items():
            s = tokens * costs.t1_ms / ms
            print(f"  {name}: {s:.2f}x ({s / c:.0%} of the ceiling), {cycles} cycles; "
                  f"clairvoyant {tokens * costs.t1_ms / cv:.2f}x")


if __name__ == "__main__":
    main()
