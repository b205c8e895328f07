"""The suffix index follows the copy an agent's reply makes of a file it was given (lookup.SuffixIndex).

A reply that re-emits a file with an edit (a rename, an inserted line, a deleted token) goes on
copying after the edit point; there the tail's own match is short and ties among many earlier
occurrences of a common token (a newline, a bracket). The index remembers where in the file the
copy broke and proposes the file's text after the edit; the latest occurrence (what the index
proposed before, and still does with ``follow=False``) is elsewhere. Greedy decoding through
these proposals stays lossless: tests/test_policy.py and tests/test_hybrid.py cover that.
"""

from mlx_spec.lookup import SuffixIndex

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
    idx = _index(LINES[0] + LINES[1] + [99] + [97, 96] * 30)  # new text past the expiry
    assert idx.broke is None


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
