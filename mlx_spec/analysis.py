"""What drafting could reach: the copy oracle and its ceiling, and the reach of each block.

Pure arithmetic over token ids and a pass-cost curve (``costs.Costs``), used by `mlx_spec bench`
(its per-prompt copy ceiling and its "what drafting can reach" table) and by the benchmark
harness in benchmarks/.

- ``copy_share``: the share of a reply's tokens inside spans that also occur in its prompt (what
  lookup drafting from the prompt could propose).
- ``copy_oracle`` / ``copy_ceiling``: the least model time an oracle needs for a reply, drafting
  every copied token right and stepping plain otherwise, and the speedup over plain steps that
  allows; ``oracle_ceiling`` adds replies up.
- ``reach_table``: per measured block, the break-even acceptance and a perfect drafter's speedup
  (``Costs.reach``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .costs import Costs
from .policy import MAX_LOOKUP


def _covered(prompt: Sequence[int], reply: Sequence[int], n: int) -> list[bool]:
    """Per reply token: inside a span of >= ``n`` tokens that also occurs in ``prompt``."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(reply)
    for i in range(len(reply) - n + 1):
        if tuple(reply[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return covered


def copy_share(prompt: Sequence[int], reply: Sequence[int], n: int = 4) -> float:
    """Share of ``reply``'s tokens covered by n-grams (``n`` tokens or longer spans) that also
    occur in ``prompt``: how much of the reply repeats the prompt, the ceiling that lookup
    drafting from the prompt can reach."""
    return sum(_covered(prompt, reply, n)) / len(reply) if reply else 0.0


def copy_oracle(
    prompt: Sequence[int],
    reply: Sequence[int],
    costs: Costs,
    *,
    n: int = 4,
    max_draft: int = MAX_LOOKUP,
    right: Sequence[int] | None = None,
) -> tuple[int, float]:
    """(tokens, ms): the model time an oracle needs for the reply's tokens after the first (the
    first comes from the prefill). The oracle drafts every copied token (``copy_share``'s spans)
    right, in blocks of up to ``max_draft`` drafts verified at the cost curve's Tt(L), and takes
    a plain step (T1) for every other token; it splits the reply into cycles by dynamic
    programming (the least time).

    ``right`` (one per reply token; ``prompt`` is then unused): how many drafts a cycle anchored
    before token i gets right, instead of the copied span's tokens from i on — a drafter's own
    proposals, each one's acceptance known (a clairvoyant bound on a drafter's proposals)."""
    N = len(reply)
    if right is not None and len(right) != N:
        raise ValueError(f"right needs one count per reply token ({len(right)} for {N})")
    if N < 2:
        return 0, 0.0
    if right is None:
        covered = _covered(prompt, reply, n)
        run = [0] * (N + 1)  # run[i]: covered tokens from i on, without a gap
        for i in range(N - 1, -1, -1):
            run[i] = run[i + 1] + 1 if covered[i] else 0
    else:
        run = list(right)
    tt = [0.0] + [costs.verify(L) for L in range(1, max_draft + 2)]
    best = [0.0] * (N + 1)  # best[i]: least time to commit reply[i:] with reply[i - 1] the anchor
    for i in range(N - 1, 0, -1):
        t = costs.t1_ms + best[i + 1]
        for k in range(1, min(run[i], max_draft) + 1):  # k drafts + the target's bonus token
            t = min(t, tt[k + 1] + best[min(i + k + 1, N)])
        best[i] = t
    return N - 1, best[1]


def copy_ceiling(
    prompt: Sequence[int], reply: Sequence[int], costs: Costs, *, n: int = 4, max_draft: int = MAX_LOOKUP
) -> float:
    """The decode speedup over plain steps that the reply's repetition of the prompt allows:
    ``tokens * T1 / time`` of ``copy_oracle`` (1.0 for a reply with nothing to copy, nan for a
    reply of one token)."""
    tokens, ms = copy_oracle(prompt, reply, costs, n=n, max_draft=max_draft)
    return tokens * costs.t1_ms / ms if ms > 0 else math.nan


COPY_SUBSET = 0.5  # replies with copy_share >= this count as "repeat their prompt"
SCOPES = ("all", "copying")  # totals over all replies, and over those that repeat their prompt


def scopes(share: float) -> tuple[str, ...]:
    """The totals a reply of this ``copy_share`` counts in: "all", and "copying" where it
    repeats its prompt (share >= COPY_SUBSET)."""
    return SCOPES if share >= COPY_SUBSET else SCOPES[:1]


def copy_max_draft(costs: Costs) -> int:
    """The longest draft the copy ceiling prices: MAX_LOOKUP, or up to the curve's longest
    measured verify (Tt past it would be extrapolated)."""
    return min(MAX_LOOKUP, max(costs.tt_ms, default=1) - 1)


def oracle_ceiling(oracles: Iterable[tuple[int, float]], t1_ms: float) -> float | None:
    """The copy ceiling of several replies together, from their ``copy_oracle`` (tokens, ms):
    all their tokens * T1 / all their oracle time (None without any time)."""
    oracles = list(oracles)
    ms = sum(t for _, t in oracles)
    return sum(n for n, _ in oracles) * t1_ms / ms if ms > 0 else None


def reach_table(costs: Costs, dflash_max: int = 0) -> list:
    """``Costs.reach`` at every block the curve measured, one sequence: for the lookup (free
    proposals) at each, for DFlash up to ``dflash_max`` (the longest block the drafter proposes;
    0: none)."""
    out = []
    for B in sorted(b for b in costs.tt_ms if b >= 2):
        if B <= dflash_max and B in costs.td_ms:
            out.append(costs.reach(B))
        out.append(costs.reach(B, source="lookup"))
    return out
