"""The pass-cost curve's model time of a cycle (costs.Costs.step_ms / timed): what bench's
per-cycle rows and tests/reply_replay.py charge."""

from dataclasses import replace

from mlx_spec.costs import Costs
from mlx_spec.decode import Step

import pytest

CURVE = Costs(100.0, {4: 30.0, 8: 50.0}, {1: 110.0, 4: 140.0, 8: 180.0}, 0)


def test_a_step_costs_t1_plain_tt_when_verified_and_td_where_the_drafter_ran():
    assert CURVE.step_ms(1) == 100.0  # a plain step: T1, not the verify of one row
    assert CURVE.step_ms(4) == 140.0 and CURVE.step_ms(6) == pytest.approx(160.0)  # Tt, interpolated
    assert CURVE.step_ms(8, 8) == 230.0 and CURVE.step_ms(1, 4) == 130.0  # + Td (pick() trimmed to the anchor)
    assert CURVE.step_ms(1, 1) == CURVE.step_ms(1, 0) == 100.0  # a block of 1: no draft pass


def test_a_timed_step_carries_the_curves_times_and_nothing_else():
    step = Step(
        (1, 2, 3),
        drafted=3,
        accepted=2,
        block_size=4,
        draft_ms=7.0,
        verify_ms=9.0,
        rollback_ms=2.0,
        elapsed_ms=25.0,
        source="dflash",
        draft_block=8,
    )
    got = CURVE.timed(step)
    assert (got.verify_ms, got.draft_ms, got.rollback_ms, got.elapsed_ms) == (140.0, 50.0, 0.0, 190.0)
    assert got.tokens == step.tokens and got.draft_block == 8 and got.source == "dflash"
    plain = CURVE.timed(Step((5,), elapsed_ms=3.0, verify_ms=3.0, source="plain"))
    assert (plain.verify_ms, plain.draft_ms, plain.elapsed_ms) == (100.0, 0.0, 100.0)


def test_reach_is_the_tau_where_a_cycle_costs_the_plain_steps_it_replaces():
    """Costs.reach: break-even tau = cycle / plain step; speedup at tau = tau / break-even;
    perfect = block / break-even (every draft accepted)."""
    r = CURVE.reach(4)  # Td(4) + Tt(4) = 170 against T1 = 100
    assert (r.block, r.seqs, r.source) == (4, 1, "dflash")
    assert r.break_even == pytest.approx(1.7) and r.perfect == pytest.approx(4 / 1.7)
    assert r.speedup(3.4) == pytest.approx(2.0)
    lookup = CURVE.reach(4, source="lookup")  # free proposals: the verify alone
    assert lookup.break_even == pytest.approx(1.4) and lookup.perfect == pytest.approx(4 / 1.4)
    # two sequences at once: one verify over 8 rows (and a draft pass over 8) against one plain
    # step of the pair, priced as a verify of 2 rows (110 + 30/3 by the line from 1 to 4 rows)
    two = CURVE.reach(4, seqs=2)
    assert two.break_even == pytest.approx((180.0 + 50.0) / 120.0)
    assert CURVE.reach(4, seqs=2, source="lookup").break_even == pytest.approx(180.0 / 120.0)


def test_reach_refuses_what_it_cannot_price():
    with pytest.raises(ValueError, match="block >= 2"):
        CURVE.reach(1)
    with pytest.raises(ValueError, match="seqs >= 1"):
        CURVE.reach(4, seqs=0)
    with pytest.raises(ValueError, match="unknown draft source"):
        CURVE.reach(4, source="ngram")
    no_drafter = Costs(100.0, {}, {1: 110.0, 4: 140.0}, 0)  # no draft pass: the lookup only, no nan
    with pytest.raises(ValueError, match="no draft pass"):
        no_drafter.reach(4)
    assert no_drafter.reach(4, source="lookup").break_even == pytest.approx(1.4)
    with pytest.raises(ValueError, match="no verify pass"):
        Costs(100.0, {}, {}, 0).reach(4, source="lookup")


def test_reach_reads_unmeasured_sizes_off_the_curves_lines():
    """Past the largest measured size the curve goes on along its last segment (Tt(16) = 180 +
    8 * 10: 4 -> 8 rows cost 10 ms a row; Td(16) likewise 50 + 8 * 5); between sizes, linear."""
    r = CURVE.reach(8, seqs=2)
    assert r.break_even == pytest.approx((260.0 + 90.0) / 120.0) and r.perfect == pytest.approx(8 / r.break_even)
    assert CURVE.reach(6, source="lookup").break_even == pytest.approx(1.6)


def test_the_context_term_is_read_off_two_contexts_and_prices_the_curve_at_any_length():
    from mlx_spec.costs import context_term

    short = Costs(100.0, {4: 30.0}, {1: 110.0, 4: 140.0, 8: 180.0}, 1000)
    long = Costs(130.0, {4: 31.0}, {1: 150.0, 4: 200.0, 8: 300.0}, 5000)
    term = context_term(short, long)
    assert term.ctx_ms == {1: 7.5, 4: 15.0, 8: 30.0}  # ms per 1000 tokens; B = 1 from T1
    assert term.ctx_draft_ms == {4: 0.25}  # the drafter's pass, read off the same way
    at9 = term.at(9000)
    assert at9.t1_ms == pytest.approx(160.0) and at9.verify(8) == pytest.approx(420.0) and at9.context == 9000
    assert at9.draft(4) == pytest.approx(32.0)  # the drafter attends over its context too
    # the terms on the short curve price it as the long one at the long context
    kept = replace(short, ctx_ms=term.ctx_ms, ctx_draft_ms=term.ctx_draft_ms).at(5000)
    assert kept.verify(8) == pytest.approx(300.0) and kept.draft(4) == pytest.approx(31.0)
    assert term.at(1000).verify(4) == pytest.approx(140.0)
    assert term.at(0).t1_ms >= 0.1 * term.t1_ms  # never below a tenth of the measured pass
    assert Costs.from_dict(term.as_dict()) == term and term.smoothed().ctx_ms == term.ctx_ms
    assert CURVE.at(100000) is CURVE  # no context term: the same curve
    with pytest.raises(ValueError):
        context_term(long, short)
