"""The suffix index follows the copy an agent's reply makes of a file it was given (lookup.SuffixIndex).

A reply that re-emits a file with an edit (a rename, an inserted line, a deleted token) goes on
copying after the edit point; there the tail's own match is short and ties among many earlier
occurrences of a common token (a newline, a bracket). The index remembers where in the file the
copy broke and proposes the file's text after the edit; the latest occurrence (what the index
proposed before, and still does with ``follow=False``) is elsewhere. Greedy decoding through
these proposals stays lossless: tests/test_policy.py and tests/test_hybrid.py cover that.

Also here: the index chooses once per token; analysis.copy_oracle over a drafter's own proposals
(a clairvoyant bound); tests/reply_replay.py replays a reply through
decode.spec_steps itself (on a stand-in target that answers with the reply, drafting from the
index it is given), whose pipelined plain steps are decided one token early, never more.
"""

import random

from mlx_spec.analysis import copy_oracle
from mlx_spec.costs import Costs
from mlx_spec.decode import spec_steps
from mlx_spec.lookup import BREAK_EXPIRES, SuffixIndex
from mlx_spec.policy import LOOKUP, PLAIN

import pytest
import reply_replay

# A file of lines [A_i, 7, 8, B_i, 9]: A_i and B_i distinct (names), 7, 8, 9 common (brackets,
# newlines), framed like a chat prompt.
LINES = [[10 + i, 7, 8, 30 + i, 9] for i in range(6)]
FILE = [t for line in LINES for t in line]
PROMPT = [1, 2] + FILE + [3, 4]


def _index(reply, **kw):
    idx = SuffixIndex(PROMPT, 4, **kw)
    for t in reply:  # a reply arrives a few tokens per cycle
        idx.extend([t])
    return idx


def _both(reply):
    """(the following index's proposal, the plain index's) after ``reply``."""
    return _index(reply).propose(5)[0], _index(reply, follow=False).propose(5)[0]


def test_a_plain_copy_is_proposed_with_its_match():
    toks, m = _index(FILE[:7]).propose(5)
    assert toks == FILE[7:12] and m == 7
    assert _index(FILE[:7], follow=False).propose(5) == (toks, m)


def test_rename_resyncs_after_the_new_name():
    # lines 0 and 1 copied, then A_2 renamed to 99: after "99 7" the file's line 2 goes on
    reply = LINES[0] + LINES[1] + [99, 7]
    new, old = _both(reply)
    assert new == [8, 32, 9, 13, 7]
    assert old == [8, 31, 9, 99, 7]  # the latest "7" (the reply's own copy of line 1) goes on with B_1


def test_insertion_rejoins_at_the_break():
    # a new line [98, 9] inserted before line 2: after it the file goes on at line 2
    reply = LINES[0] + LINES[1] + [98, 9]
    new, old = _both(reply)
    assert new == LINES[2]
    assert old == [98, 9, 98, 9, 98]  # the latest "9" is the inserted line's own: it repeats


def test_deletion_rejoins_after_the_deleted_tokens():
    # B_2 deleted from line 2: after "A_2 7 8 9" the file goes on at line 3
    reply = LINES[0] + LINES[1] + [12, 7, 8, 9]
    new, old = _both(reply)
    assert new == LINES[3]
    assert old == [12, 7, 8, 9, 12]  # the reply's own shortened line 2, repeating


def test_the_break_is_forgotten_once_the_copy_runs_again():
    reply = LINES[0] + LINES[1] + [99, 7, 8, 32, 9]  # re-synced and copying again
    idx = _index(reply)
    assert idx.broke is None and idx.propose(5)[0] == LINES[3]
    # new text that never repeats (so no copy of its own clears the break): kept for ``BREAK_EXPIRES``
    # tokens that break the copy (99 and the new ones), forgotten after
    broken = LINES[0] + LINES[1] + [99]
    assert _index(broken + list(range(200, 200 + BREAK_EXPIRES - 1))).broke is not None
    assert _index(broken + list(range(200, 200 + BREAK_EXPIRES))).broke is None


def test_a_short_copy_that_breaks_is_no_anchor():
    # two tokens of the file then new text: nothing to re-sync to
    idx = _index([10, 7, 95, 94])
    assert idx.broke is None


def test_the_prompt_is_not_followed():
    idx = SuffixIndex(PROMPT, 4)
    assert idx.pointer is None and idx.broke is None


def test_stop_tokens_cut_the_proposal_and_lose_ties():
    # "5 6" follows 8 and 9 and ends with 7: two matches of 2 tokens, the latest before the
    # reply's end (2), which no reply in mid-copy is about to reach
    ids = [8, 5, 6, 40, 41, 9, 5, 6, 2, 7, 5, 6]
    assert SuffixIndex(ids, 4, follow=False).propose(3) == ([2, 7, 5], 2)  # no stop tokens: the latest
    assert SuffixIndex(ids, 4, follow=False, stop=(2,)).propose(3) == ([40, 41, 9], 2)
    assert SuffixIndex(ids, 4, stop=(2,)).propose(3) == ([40, 41, 9], 2)
    # a proposal that runs into a stop token ends with it
    assert SuffixIndex([7, 8, 9, 2, 3, 7, 8], 4, stop=(2,)).propose(5) == ([9, 2], 2)
    assert SuffixIndex([7, 8, 9, 2, 3, 7, 8], 4).propose(5) == ([9, 2, 3, 7, 8], 2)


def test_the_pointer_wins_ties_with_a_later_copy():
    """The prompt holds the file twice, the second with its last line changed; the reply copies
    the first (its "2" before it says which). Once both copies match the tail as far back as the
    index looks (``max_match``), the one the reply is copying from is proposed, not the latest."""
    file_b = FILE[:-5] + [60, 7, 8, 61, 9]
    prompt = [1, 2] + FILE + [3, 4] + file_b + [5]
    reply = [2] + FILE[:24]
    idx = SuffixIndex(prompt, 4, max_match=8)
    for t in reply:
        idx.extend([t])
    assert idx.propose(5) == (FILE[24:29], 8)
    plain = SuffixIndex(prompt + reply, 4, max_match=8, follow=False)
    assert plain.propose(5)[0] == file_b[24:29]  # the latest copy


EDITED = LINES[0] + LINES[1] + [99, 7, 8, 32, 9] + LINES[3] + [98, 9] + LINES[4] + [14, 7, 8, 9] + LINES[5][:2]


def test_a_proposal_chooses_once_per_token():
    """Where the copy breaks, ``_step`` chooses the pointer's successor; ``propose`` at that
    length (as the loops ask: once per token) then takes that choice instead of choosing again."""
    idx = SuffixIndex(PROMPT, 4)
    calls = []
    longest = idx._longest
    idx._longest = lambda: calls.append(len(idx)) or longest()
    for t in EDITED:
        idx.extend([t])
        idx.propose(5)
    assert sorted(calls) == list(range(len(PROMPT) + 1, len(PROMPT) + len(EDITED) + 1))


def _edited_copies(n=300):
    """(prompt, reply) pairs over a 12-token vocabulary: replies copy spans of their prompt with
    new tokens between them, so matches of every length compete with the pointer's."""
    rng = random.Random(0)
    for _ in range(n):
        prompt, reply = [rng.randrange(12) for _ in range(rng.randint(20, 80))], []
        while len(reply) < 60:
            if rng.random() < 0.6:
                s = rng.randrange(len(prompt))
                reply += prompt[s : s + rng.randint(3, 20)]
            else:
                reply += [rng.randrange(12) for _ in range(rng.randint(1, 4))]
        yield prompt, reply[:60]


def test_a_reused_choice_is_the_choice_now():
    """Every proposal along an edited copy (a rename, an insertion, a deletion), a token or a few
    at a time, equals the one chosen afresh at that point; so along random edited copies, where
    a longer match elsewhere often beats a pointer that has followed the copy (reusing the
    pointer then, not only where it was just taken, fails here)."""
    cases = [(PROMPT, EDITED, chunk) for chunk in (1, 3)]
    cases += [(p, r, 1 + k % 3) for k, (p, r) in enumerate(_edited_copies())]
    for prompt, reply, chunk in cases:
        idx = SuffixIndex(prompt, 4, stop=[0])
        for i in range(0, len(reply), chunk):
            idx.extend(reply[i : i + chunk])
            got = idx.propose(5)
            run, idx._run = idx._run, None  # as if the pointer had not just been taken: chosen afresh
            assert got == idx.propose(5)
            idx._run = run


def test_the_clairvoyant_bound_is_the_copy_oracle_over_the_proposals():
    """``analysis.copy_oracle(right=...)`` prices a drafter's own proposals, each one's acceptance
    known (a clairvoyant bound): the copied spans' runs give the default
    oracle back, and where the cost curve jumps a proposal is drafted shorter than it would hold
    (drafting all that it gets right, or nothing, would cost 3900 ms here)."""
    step = Costs(100.0, {}, {1: 100.0, 9: 100.0, 10: 1000.0, 33: 1000.0}, 0)
    file = list(range(100, 140))
    assert copy_oracle([], file, step, right=[40 - i for i in range(40)]) == copy_oracle(file, file, step)
    # the proposal after the first token holds for 9 drafts, none after: 8 drafts + bonus, 30 plain steps
    assert copy_oracle([], file, step, right=[0, 9] + [0] * 38) == (39, pytest.approx(100 + 30 * 100))
    with pytest.raises(ValueError, match="one count per reply token"):
        copy_oracle([], file, step, right=[0] * 39)


# ---- tests/reply_replay.py replays a reply through decode.spec_steps

REPLAY = reply_replay  # its stand-ins: ReplyTarget (answers with the reply), NoDrafter, CurveTimed
ReplyTarget, NoDrafter, CurveTimed = REPLAY.ReplyTarget, REPLAY.NoDrafter, REPLAY.CurveTimed

# a CPU cost curve `mlx_spec bench` measured on a 2-core x86 machine: a draft must be likely to pay for its rows
CPU = Costs(
    87.8,
    {},
    {1: 88.1, 2: 104.7, 3: 112.3, 4: 137.4, 6: 133.1, 8: 147.0, 12: 197.5, 16: 185.2, 24: 284.4, 33: 298.8},
    239,
)
REPLIES = {  # new text (plain runs), copied lines (lookup drafts), edits inside them (re-syncs)
    "edits": [5]
    + LINES[0]
    + [61, 62]
    + LINES[1]
    + [12, 7, 70, 32, 9]
    + LINES[3]
    + [71, 72, 73]
    + LINES[4]
    + [74, 7, 8, 35, 9]
    + [75, 76, 77, 78],
    "new text first": [5, 80, 81, 82, 83, 84, 85, 86, 87] + FILE[:12] + [88, 89, 90] + FILE[12:] + [91, 92],
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_the_replay_is_the_engines_run_timed_by_the_curve(name):
    """The replay is spec_steps on a target that answers with the reply, drafting from the index
    it is given: the reply's tokens, every cycle timed by the cost curve (T1 per plain step,
    Tt(L) per verify), lookup drafts accepted, and runs of plain steps pipelined (queued while
    the step before them ran; at most one per pair of plain steps in a row)."""
    reply, eos = REPLIES[name], 0
    steps, queued = REPLAY.replay(
        PROMPT, reply + [eos], CPU, len(reply) + 4, lambda p: SuffixIndex(p, 4, stop=[eos]), eos=[eos]
    )
    assert [t for s in steps for t in s.tokens] == reply[1:] + [eos]  # (the first is the prefill's)
    assert all(s.elapsed_ms == s.verify_ms == CPU.step_ms(s.block_size) and s.draft_ms == 0 for s in steps)
    assert any(s.source == LOOKUP and s.accepted > 0 for s in steps)
    assert 5 <= queued <= sum(a.source == b.source == PLAIN for a, b in zip(steps, steps[1:]))
    # a reply cut at max_tokens needs no EOS; one that ended needs its EOS named
    cut, _ = REPLAY.replay(PROMPT, reply[:20], CPU, 20, lambda p: SuffixIndex(p, 4))
    assert [t for s in cut for t in s.tokens] == reply[1:20]
    with pytest.raises(ValueError, match="not the reply's"):
        REPLAY.replay(PROMPT, reply + [eos], CPU, len(reply) + 4, lambda p: SuffixIndex(p, 4))


def test_spec_steps_drafts_from_the_index_it_is_given():
    """``spec_steps(index=...)`` (the replay's --baseline): the loop proposes from and extends
    that index, not one of its own; an index needs a lookup policy and must hold the prompt."""
    reply, eos = REPLIES["edits"], 0

    class Noting(CurveTimed):
        def choose(self, ctx):
            shown.append(ctx.lookup)
            return super().choose(ctx)

    def run(index=None, sources=(LOOKUP,)):
        list(
            spec_steps(
                ReplyTarget(PROMPT + reply, eos),
                NoDrafter(),
                PROMPT,
                block_size=8,
                max_tokens=len(reply) + 4,
                eos_ids=[eos],
                policy=Noting(CPU, 8, sources=sources),
                index=index,
            )
        )

    shown = []
    run()
    default, shown = shown, []
    mine = SuffixIndex(PROMPT, 4, stop=[eos])
    run(mine)
    assert shown == default and mine.ids == PROMPT + reply + [eos]
    shown = []
    run(SuffixIndex(PROMPT, 1, follow=False))  # one token of match: other proposals
    assert shown != default
    with pytest.raises(ValueError, match="hold the prompt"):
        run(SuffixIndex(PROMPT[:-1], 4))
    with pytest.raises(ValueError, match="hold the prompt"):
        run(mine)  # (it holds the reply too now)
    with pytest.raises(ValueError, match="LOOKUP"):
        run(SuffixIndex(PROMPT, 4), sources=("dflash",))


def test_a_pipelined_plain_step_is_decided_one_token_early_never_more():
    """Every cycle is decided with the lookup context of the tokens committed before it, or, a
    plain step queued while the one before it ran, of all but that one's token: a match the
    lookup finds at token k costs at most the plain step already queued, never a further cycle.
    (Never queueing, or queueing only when the context one token on would stay plain too,
    measured no better.)"""
    reply, eos = REPLIES["edits"], 0

    class At(int):
        """A match length that also says how long the index was when it was proposed."""

    class Noted(SuffixIndex):
        def propose(self, k):
            look, match = super().propose(k)
            match = At(match)
            match.at = len(self)
            return look, match

    index = Noted(PROMPT, 4, stop=[eos])
    seen = []  # at every decision, the index's length its lookup context was proposed at

    class Noting(CurveTimed):
        def choose(self, ctx):
            seen.append(ctx.match.at)
            return super().choose(ctx)

    steps = list(
        spec_steps(
            ReplyTarget(PROMPT + reply, eos),
            NoDrafter(),
            PROMPT,
            block_size=8,
            max_tokens=len(reply) + 4,
            eos_ids=[eos],
            policy=Noting(CPU, 8, sources=(LOOKUP,)),
            index=index,
        )
    )
    # one decision per cycle, in order (and one for a step queued as the reply's EOS was read)
    assert len(seen) - (len(steps) - 1) in (0, 1)
    n, lags = len(PROMPT) + 1, []
    for s, at in zip(steps[1:], seen):
        lags.append(n - at)  # tokens the decision's lookup context lacks
        n += len(s.tokens)
    early = [i for i, lag in enumerate(lags) if lag]
    assert set(lags) == {0, 1} and len(early) >= 5
    # only a plain step queued while a plain step ran (steps[0] is the prefill's)
    assert all(i > 0 and steps[i].source == steps[i + 1].source == PLAIN for i in early)
