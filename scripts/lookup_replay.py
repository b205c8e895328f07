"""Replay the target's greedy replies through the lookup index and a lookup-only policy, in
seconds and by counts: how a change to ``lookup.SuffixIndex`` (or to the copy model) moves the
model-time speedup, with no model pass after the replies are cached.

Greedy replies are deterministic, so a lookup draft's acceptance is known from the reply
itself: the engine's own loop (``decode.spec_steps``) runs on a stand-in target that answers
with the cached reply (``ReplyTarget``), each cycle the index proposes from the prompt and the
reply so far, the policy (``adaptive.DraftPolicy``, lookup only, learning from the cost curve's
times: ``CurveTimed``) chooses plain or a draft of L rows, and the reply's own next tokens say
how many are accepted. Per reply: model time (T1 per plain step, Tt(L) per verify), speedup
over plain steps, cycles; for the replies that repeat their prompt (copy share >= 50 %) also
the copy ceiling (bench.copy_ceiling) and a clairvoyant bound: bench.copy_oracle's dynamic
programme over the index's own proposals, each one's acceptance known (what a policy that knew
it would reach). ``--baseline`` replays the index without following the copy
(``follow=False``) and without stop tokens, side by side.

    python scripts/lookup_replay.py --replies runs/replies-agent128.json --kinds agent --tokens 128   # caches
    python scripts/lookup_replay.py --replies runs/replies-agent128.json --tokens 64 --costs runs/issue17-bench6.json --baseline
"""

from __future__ import annotations

import argparse
import json
import os

import mlx_spec  # noqa: F401  (before MLX: it loads the BLAS, or cache_replies runs on the reference one)
import mlx.core as mx

from mlx_spec.adaptive import LOOKUP, Context, DraftPolicy
from mlx_spec.bench import SCOPES, copy_max_draft, copy_oracle, copy_share, oracle_ceiling, scopes
from mlx_spec.costs import Costs
from mlx_spec.decode import Step, plain_steps, spec_steps
from mlx_spec.lookup import SuffixIndex
from mlx_spec.target import TargetOut


def cache_replies(path: str, kinds: tuple[str, ...], tokens: int) -> None:
    """The default target's greedy replies to the built-in prompts of ``kinds`` (plain decoding:
    ``decode.plain_steps``, mlx-lm's own generate_step), written to ``path``."""
    from mlx_spec.config import LoadConfig
    from mlx_spec.default_target import DEFAULT_TARGET_ID
    from mlx_spec.prompts import builtin_prompts
    from mlx_spec.session import open_session

    pair = open_session(LoadConfig(target=DEFAULT_TARGET_ID), tuning="none").pair
    eos = [int(t) for t in pair.tokenizer.eos_token_ids]
    out = {}
    for p in builtin_prompts(kinds):
        ids = [int(t) for t in p.encode(pair.tokenizer)]
        # (the run ends at its first EOS, which the reply leaves out)
        reply = [int(t) for s in plain_steps(pair.model, ids, max_tokens=tokens, eos_ids=eos)
                 for t in s.tokens if t not in eos]
        out[p.id] = {"kind": p.kind, "prompt": ids, "reply": reply}
        print(f"{p.id}: {len(ids)} prompt tokens, {len(reply)} reply tokens", flush=True)
    with open(path, "w") as f:
        json.dump({"eos": eos, "tokens": tokens, "replies": out}, f)


def _agreement(look, full, n) -> int:
    a = 0
    while a < len(look) and n + a < len(full) and look[a] == full[n + a]:
        a += 1
    return a


class _Offset:
    def __init__(self):
        self.offset, self.state = 0, mx.array(0)


class ReplyTarget:
    """A stand-in target whose greedy choice after position p is ``seq[p + 1]`` (``end`` past
    it): the reply's own next token wherever the inputs so far are the reply's, all a greedy
    verify reads."""

    def __init__(self, seq, end):
        self.seq, self.end, self.vocab = list(seq), end, max(list(seq) + [end]) + 1

    def make_cache(self):
        return [_Offset()]

    def __call__(self, ids, cache, last_only=False, record=False):
        p, L = cache[0].offset, ids.shape[1]
        cache[0].offset += L
        nxt = [self.seq[r + 1] if r + 1 < len(self.seq) else self.end
               for r in ([p + L - 1] if last_only else range(p, p + L))]
        logits = (mx.arange(self.vocab)[None] == mx.array(nxt)[:, None]).astype(mx.float32)[None]
        return TargetOut(logits, mx.zeros((1, len(nxt), 1)))

    def rollback(self, cache, n, keep):
        cache[0].offset -= n - keep


class NoDrafter:
    """The drafter of a lookup-only policy, which never asks it to draft: it only takes context."""

    def make_cache(self):
        return []

    def add_context(self, features, cache):
        pass


class CurveTimed(DraftPolicy):
    """A policy that learns the cost curve's times (``Costs.timed``), not the clock's."""

    def __init__(self, curve: Costs, *a, **kw):
        super().__init__(curve, *a, **kw)
        self.curve = curve

    def observe(self, step):
        super().observe(self.curve.timed(step))


def replay(prompt, full, costs: Costs, max_tokens: int, make, *, eos=(),
           policy: DraftPolicy | None = None) -> tuple[list[Step], int]:
    """The cycles of a lookup-only policy (default: a fresh ``CurveTimed``) on the reply
    ``full`` (its EOS, one of ``eos``, included when it ended early): ``decode.spec_steps`` on
    a ``ReplyTarget`` that answers with the reply, drafting from the index ``make(prompt)``;
    as Steps timed by the cost curve, and how many of its plain steps were queued (pipelined:
    decided while the one before them ran, with the context from before its token)."""
    policy = CurveTimed(costs, 8, sources=(LOOKUP,)) if policy is None else policy
    steps, said = [], []  # said: (the step asking, queued?) per stays_plain answer
    stays = policy.stays_plain

    def noting(ctx: Context) -> bool:
        said.append((len(steps), stays(ctx)))
        return said[-1][1]

    policy.stays_plain = noting
    end = int(eos[0]) if eos else 0  # (never read: the reply ends at EOS or at max_tokens)
    for s in spec_steps(ReplyTarget(list(prompt) + list(full), end), NoDrafter(), prompt, block_size=8,
                        max_tokens=max_tokens, eos_ids=eos, policy=policy, index=make(prompt)):
        steps.append(s)  # one at a time: noting reads how many have come
    got = [t for s in steps for t in s.tokens]
    if got != list(full):
        raise ValueError(f"the replay made {len(got)} tokens, not the reply's {len(full)}: "
                         "is its EOS among eos, or is the reply cut at max_tokens?")
    # a step queued by a run's last step (the reply ended there) never ran
    return [costs.timed(s) for s in steps[1:]], sum(1 for k, yes in said if yes and k < len(steps) - 1)


QUEUE_RULES = ("engine", "fresh", "ahead")


def queue_rule(policy: DraftPolicy, rule: str) -> DraftPolicy:
    """``policy`` with its answer to "queue the next plain step now?" (``stays_plain``, asked
    while a plain step runs, with the context from before its token) replaced, to measure that
    one-token lag: "engine" leaves it; "fresh" never queues (every plain step is decided with
    its own context, as if unpipelined); "ahead" queues only if the context one token on would
    stay plain too, supposing the lookup's first guess is that token (its proposal less it, the
    match one longer)."""
    if rule not in QUEUE_RULES:
        raise ValueError(f"queue rule must be one of {', '.join(QUEUE_RULES)} (got {rule!r})")
    stays = policy.stays_plain
    if rule == "fresh":
        def never(ctx: Context) -> bool:
            stays(ctx)  # asked all the same: it sets the context the next observe scores the lookup by
            return False

        policy.stays_plain = never
    elif rule == "ahead":
        def ahead(ctx: Context) -> bool:
            on = not ctx.lookup or stays(Context(ctx.lookup[1:], ctx.match + 1, ctx.room - 1, ctx.greedy))
            return stays(ctx) and on  # asked last with ctx: the next observe scores the lookup by it

        policy.stays_plain = ahead
    return policy


def clairvoyant(prompt, full, costs: Costs, max_tokens: int, make, max_draft: int) -> float:
    """The least model time with the index's own proposals, each cycle's acceptance known:
    ``bench.copy_oracle``'s dynamic programme over what the index's proposal (up to ``max_draft``
    tokens, as the engine asks: within ``max_tokens``) gets right at every position."""
    index = make(prompt)
    index.extend(full[:1])
    right = [0]
    for n in range(1, len(full)):
        right.append(_agreement(index.propose(min(max_draft, max_tokens - n - 1))[0], full, n))
        index.extend(full[n:n + 1])
    return copy_oracle(prompt, full, costs, max_draft=max_draft, right=right)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replies", required=True, help="JSON of cached replies (written first if missing)")
    ap.add_argument("--kinds", default="agent", help="built-in prompt kinds to cache (default: agent)")
    ap.add_argument("--tokens", type=int, default=64, help="reply tokens (cached: generated; replayed: cut)")
    ap.add_argument("--costs", default=None, help="a `mlx_spec bench --json-out` file whose pass costs to use")
    ap.add_argument("--baseline", action="store_true", help="also replay the index without following the copy")
    ap.add_argument("--queue", choices=QUEUE_RULES, default="engine",
                    help="when a run of plain steps queues the next one (see queue_rule; default: as the engine)")
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
    if "tokens" not in data:
        ap.error(f"{a.replies} does not say how many tokens its replies were generated to (\"tokens\"): "
                 "which of them stopped at EOS is unknown; cache them again")
    if a.tokens > data["tokens"]:
        ap.error(f"--tokens {a.tokens}: {a.replies} holds replies of at most {data['tokens']} tokens "
                 "(cache them again at the length to replay)")
    eos = data["eos"]
    indexes = {"index": lambda p: SuffixIndex(p, 4, stop=eos)}
    if a.baseline:
        indexes = {"baseline": lambda p: SuffixIndex(p, 4, follow=False), **indexes}
    # per index, all replies and the copying ones: ms, tokens, clairvoyant ms, cycles, plain steps, queued ones
    totals = {(scope, name): [0.0, 0, 0.0, 0, 0, 0] for scope in SCOPES for name in indexes}
    copying = []  # copy_oracle's (tokens, ms) per reply that repeats its prompt (the ceiling's)
    max_draft = copy_max_draft(costs)  # as bench prices the ceiling
    for pid, r in data["replies"].items():
        reply = r["reply"][:a.tokens]
        ended = len(r["reply"]) < data["tokens"]  # (it stopped at EOS before the recording's limit)
        full = reply + ([eos[0]] if ended and len(reply) < a.tokens else [])
        if len(full) < 2:
            continue
        share = copy_share(r["prompt"], reply)
        o_tok, o_ms = copy_oracle(r["prompt"], reply, costs, max_draft=max_draft)
        cells = []
        for name, make in indexes.items():
            policy = queue_rule(CurveTimed(costs, 8, sources=(LOOKUP,)), a.queue)
            steps, queued = replay(r["prompt"], full, costs, a.tokens, make, eos=eos, policy=policy)
            ms, cycles = sum(s.elapsed_ms for s in steps), len(steps)
            cv = clairvoyant(r["prompt"], full, costs, a.tokens, make, max_draft)
            cells.append(f"{name} {(len(full) - 1) * costs.t1_ms / ms:.2f}x ({cycles} cycles)")
            plain = sum(1 for s in steps if s.block_size == 1)
            for scope in scopes(share):
                for i, v in enumerate((ms, len(full) - 1, cv, cycles, plain, queued)):
                    totals[scope, name][i] += v
        if "copying" in scopes(share):
            copying.append((o_tok, o_ms))
        print(f"{pid}: copy share {share:.0%}, ceiling {o_tok * costs.t1_ms / o_ms:.2f}x; " + "; ".join(cells))
    c = oracle_ceiling(copying, costs.t1_ms)
    for scope in SCOPES if c else SCOPES[:1]:
        print(f"\n{scope} replies" + (f" (ceiling {c:.2f}x):" if scope == "copying" else ":"))
        for name in indexes:
            ms, tokens, cv, cycles, plain, queued = totals[scope, name]
            s = tokens * costs.t1_ms / ms
            print(f"  {name}: {s:.2f}x" + (f" ({s / c:.0%} of the ceiling)" if scope == "copying" else "")
                  + f", {cycles} cycles, {plain} plain steps ({queued} queued); "
                  f"clairvoyant {tokens * costs.t1_ms / cv:.2f}x")


if __name__ == "__main__":
    main()
