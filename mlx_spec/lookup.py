"""Lookup drafting inside the speculative loops: ``SuffixIndex``, an n-gram index over what the
target has seen (the prompt, earlier turns, the reply so far) that proposes the continuation of
the best earlier match of the tail, following the copy a reply makes of its prompt. Its drafts
cost no model pass; ``decode.spec_steps`` and ``batch.BatchDecoder`` verify them like DFlash
drafts. (The baseline loops bench compares against are in ``baselines``.)
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

# Following the copy (SuffixIndex's re-sync after an edit breaks it), in tokens:
LONG_COPY = 6  # a copy at least this long that breaks is remembered, to re-join
SHORT_MATCH = 4  # while the tail's own match is shorter, a re-join candidate may win
REJOIN_MARGIN = 2  # ... unless the tail's match is at least this much longer than the candidate's
REJOIN_WINDOW = 16  # the reply may re-join its source up to this far after the break
COPYING_AGAIN = 3  # a copy that runs again this long puts the break behind
BREAK_EXPIRES = 48  # a break is forgotten after this many tokens that do not copy


class SuffixIndex:
    """An n-gram index over a growing token sequence, for lookup drafts inside ``spec_steps``.

    For every n in 1..``ngram_max`` it maps each n-gram to the (up to ``keep``) latest positions
    that follow it, updated incrementally as tokens are appended (``extend``: O(ngram_max) per
    token, no rescans). ``propose(k)`` finds the earlier occurrences of the sequence's last n
    tokens (n large first) and, among them, the one whose match extends furthest back (up to
    ``max_match`` tokens; ties: one that does not continue with a ``stop`` token, then the
    latest), and returns ``k`` tokens that followed it (where they run past the end, the copy
    continues periodically: a repeating tail keeps repeating; cut after a ``stop`` token, which
    would end the reply) and that match length.

    With ``follow`` (the default) it also follows the copy the appended tokens make (not the
    constructor's ``ids``, the prompt): a pointer to where the reply is copying from, moved on
    by each token that continues it. So an agent's edit of a file it was given is followed:

    - locality: the pointer's candidate wins ties of match length (the file's next line, not
      the latest line that ends the same way: after a blank line, a fence, a common token);
    - re-sync: when a copy of at least ``LONG_COPY`` tokens breaks (a rename, an inserted
      docstring, a deleted line), the index remembers where in its source it broke; while the
      tail's own match is short (below ``SHORT_MATCH`` tokens), a candidate found by the tail's
      last token from the token before that point to ``REJOIN_WINDOW`` tokens after it (the
      reply re-joins the source after the edit: after an insertion at the point itself, after a
      rename or a deletion of up to ``REJOIN_WINDOW`` tokens further on) wins unless the tail's
      match is ``REJOIN_MARGIN`` tokens longer. It is forgotten once a copy runs again for
      ``COPYING_AGAIN`` tokens, or after ``BREAK_EXPIRES`` tokens.

    The index only proposes: the target verifies every draft (greedy output is plain decoding's).
    """

    def __init__(
        self,
        ids: Sequence[int] = (),
        ngram_max: int = 4,
        *,
        keep: int = 4,
        max_match: int = 64,
        stop: Sequence[int] = (),
        follow: bool = True,
    ):
        if ngram_max < 1:
            raise ValueError(f"ngram_max must be >= 1 (got {ngram_max})")
        self.ngram_max, self.keep, self.max_match = ngram_max, keep, max_match
        self.stop = frozenset(int(t) for t in stop)
        self.ids: list[int] = []
        self._at: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(ngram_max + 1)]
        self.pointer: int | None = None  # where the copy continues: ids[pointer] is its next token
        # tokens the pointer has followed since ``_step`` took it (0: taken at this length, its
        # choice then is the choice now); None until then (the prompt alone)
        self._run: int | None = None
        self.broke: int | None = None  # where in its source the last long copy broke
        self._since = 0  # tokens appended since it broke
        self._follow = False  # the constructor's ids (the prompt) are the source, not a copy
        self.extend(ids)
        self._follow = follow

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, ids: Sequence[int]) -> None:
        if len(ids) > 256:  # a prompt: new containers by the thousand would trigger full GC passes
            enabled = gc.isenabled()
            gc.disable()
            try:
                self._extend(ids)
            finally:
                if enabled:
                    gc.enable()
        else:
            self._extend(ids)

    def _extend(self, ids: Sequence[int]) -> None:
        h, keep = self.ids, self.keep
        for t in ids:
            h.append(int(t))
            p = len(h) - 1  # the new token follows the n-grams ending at p - 1
            for n in range(1, min(self.ngram_max, p) + 1):
                key = tuple(h[p - n : p])
                where = self._at[n].get(key)
                if where is None:
                    self._at[n][key] = [p]
                else:
                    where.append(p)
                    if len(where) > keep:
                        del where[0]
            if self._follow:
                self._step(p)

    def _step(self, p: int) -> None:
        """Token ``p`` was appended: move the pointer on, or note where the copy broke and take
        the best candidate for the new tail."""
        h = self.ids
        if self.pointer is not None and self.pointer < p and h[self.pointer] == h[p]:
            self.pointer += 1
            self._run += 1
            if self._run >= COPYING_AGAIN:  # copying again: the break is behind
                self.broke = None
            return
        if self.pointer is not None and self._run >= LONG_COPY:
            self.broke, self._since = self.pointer, 0
        if self.broke is not None:
            self._since += 1
            if self._since > BREAK_EXPIRES:
                self.broke = None
        self.pointer = None
        self.pointer, self._run = self._choose()[0], 0

    def _match(self, j: int) -> int:
        """How many tokens before position j equal the sequence's last tokens."""
        h, end, m = self.ids, len(self.ids), 0
        while m < self.max_match and j - 1 - m >= 0 and h[j - 1 - m] == h[end - 1 - m]:
            m += 1
        return m

    def _longest(self) -> tuple[int | None, int]:
        """(position, match) of the kept occurrence of the tail's last n tokens (n large first)
        whose match extends furthest back; ties: not followed by a stop token, then the latest."""
        h = self.ids
        for n in range(min(self.ngram_max, len(h) - 1), 0, -1):
            where = self._at[n].get(tuple(h[-n:]))
            if where:
                best_j, best = where[-1], None
                for j in reversed(where):
                    key = (self._match(j), h[j] not in self.stop)
                    if best is None or key > best:
                        best_j, best = j, key
                return best_j, best[0]
        return None, 0

    def _rejoin(self) -> tuple[int | None, int]:
        """(position, match) after the tail's last token from the token before the break (an
        insertion that ends as the text before it did re-joins at the break) to ``REJOIN_WINDOW``
        tokens after it: the longest match, ties: the nearest."""
        h, best_j, best_m = self.ids, None, 0
        t = h[-1]
        for s in range(max(0, self.broke - 1), min(self.broke + REJOIN_WINDOW + 1, len(h) - 1)):
            if h[s] == t:
                m = self._match(s + 1)
                if m > best_m:
                    best_j, best_m = s + 1, m
        return best_j, best_m

    def _choice(self) -> tuple[int | None, int]:
        """``_choose()`` now. Where ``_step`` took the pointer at this length, that was the
        choice, and the pointer it set does not change it (the pointer's own match is the one it
        was chosen at, which won then): it is not chosen again."""
        if self._run == 0:
            return (None, 0) if self.pointer is None else (self.pointer, self._match(self.pointer))
        return self._choose()

    def _choose(self) -> tuple[int | None, int]:
        """(position the proposal copies from, its match length), or (None, 0)."""
        j, m = self._longest()
        if self.pointer is not None:
            pm = self._match(self.pointer)
            if pm > 0 and pm >= m:  # (no earlier match at all: m = 0)
                return self.pointer, pm
        if self.broke is not None and m < SHORT_MATCH:
            rj, rm = self._rejoin()
            if rj is not None and m < rm + REJOIN_MARGIN:
                return rj, rm
        return j, m

    def propose(self, k: int) -> tuple[list[int], int]:
        """(up to ``k`` tokens that followed the best earlier match of the tail, its length)."""
        h = self.ids
        if k <= 0 or len(h) < 2:
            return [], 0
        j, m = self._choice() if self._follow else self._longest()
        if j is None:
            return [], 0
        out = h[j : j + k]
        period = len(h) - j  # past the end, the copy continues itself
        while len(out) < k:
            out.append(out[len(out) - period])
        for i, t in enumerate(out):
            if t in self.stop:  # the reply would end there
                return out[: i + 1], m
        return out, m
