"""Stand-ins that replay a known greedy reply through the engine's own loop (``decode.spec_steps``).

Greedy replies are deterministic, so a lookup draft's acceptance is known from the reply
itself: ``ReplyTarget`` answers with the reply, ``NoDrafter`` only takes context (a lookup-only
policy never asks it to draft), ``CurveTimed`` learns the cost curve's times instead of the
clock's, and ``replay`` runs the loop on them and times every cycle by the curve.
"""

from __future__ import annotations

from mlx_spec.costs import Costs
from mlx_spec.decode import Step, spec_steps
from mlx_spec.policy import LOOKUP, Context, DraftPolicy
from mlx_spec.target import TargetOut

import mlx.core as mx


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
        nxt = [
            self.seq[r + 1] if r + 1 < len(self.seq) else self.end
            for r in ([p + L - 1] if last_only else range(p, p + L))
        ]
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


def replay(
    prompt, full, costs: Costs, max_tokens: int, make, *, eos=(), policy: DraftPolicy | None = None
) -> tuple[list[Step], int]:
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
    for s in spec_steps(
        ReplyTarget(list(prompt) + list(full), end),
        NoDrafter(),
        prompt,
        block_size=8,
        max_tokens=max_tokens,
        eos_ids=eos,
        policy=policy,
        index=make(prompt),
    ):
        steps.append(s)  # one at a time: noting reads how many have come
    got = [t for s in steps for t in s.tokens]
    if got != list(full):
        raise ValueError(
            f"the replay made {len(got)} tokens, not the reply's {len(full)}: "
            "is its EOS among eos, or is the reply cut at max_tokens?"
        )
    # a step queued by a run's last step (the reply ended there) never ran
    return [costs.timed(s) for s in steps[1:]], sum(1 for k, yes in said if yes and k < len(steps) - 1)
