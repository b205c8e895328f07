"""The pass-cost curve's model time of a cycle (costs.Costs.step_ms / timed): what bench's
per-cycle rows, scripts/agent_trace.py --model-time and scripts/lookup_replay.py charge."""

import pytest

from mlx_spec.costs import Costs
from mlx_spec.decode import Step

CURVE = Costs(100.0, {4: 30.0, 8: 50.0}, {1: 110.0, 4: 140.0, 8: 180.0}, 0)


def test_a_step_costs_t1_plain_tt_when_verified_and_td_where_the_drafter_ran():
    assert CURVE.step_ms(1) == 100.0  # a plain step: T1, not the verify of one row
    assert CURVE.step_ms(4) == 140.0 and CURVE.step_ms(6) == pytest.approx(160.0)  # Tt, interpolated
    assert CURVE.step_ms(8, 8) == 230.0 and CURVE.step_ms(1, 4) == 130.0  # + Td (pick() trimmed to the anchor)
    assert CURVE.step_ms(1, 1) == CURVE.step_ms(1, 0) == 100.0  # a block of 1: no draft pass


def test_a_timed_step_carries_the_curves_times_and_nothing_else():
    step = Step((1, 2, 3), drafted=3, accepted=2, block_size=4, draft_ms=7.0, verify_ms=9.0, rollback_ms=2.0,
                elapsed_ms=25.0, source="dflash", draft_block=8)
    got = CURVE.timed(step)
    assert (got.verify_ms, got.draft_ms, got.rollback_ms, got.elapsed_ms) == (140.0, 50.0, 0.0, 190.0)
    assert got.tokens == step.tokens and got.draft_block == 8 and got.source == "dflash"
    plain = CURVE.timed(Step((5,), elapsed_ms=3.0, verify_ms=3.0, source="plain"))
    assert (plain.verify_ms, plain.draft_ms, plain.elapsed_ms) == (100.0, 0.0, 100.0)
