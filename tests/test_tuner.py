"""Tuner: the pure choice, the key, storage, first-launch trigger, "off", the online controller."""

import argparse
import json
import random
import statistics

import pytest
from helpers import save_tiny_pair

from mlx_spec.adaptive import AdaptiveController, expected_tokens
from mlx_spec.bench import Costs
from mlx_spec.decode import Step
from mlx_spec.tuner import (Candidate, TuneResult, TuneSkipped, apply_threads, choose, default_candidates, ensure_tuned,
                            key_hash, load_result, pick, predict, race, result_path, save_result, tune, tune_key)


def C(block, speedup, final=True, **kw):
    return Candidate(block, True, speedup=speedup, final=final, **kw)


def test_choose_clear_winner_off_and_ties():
    assert choose([C(1, 1.0), C(2, 1.3), C(4, 1.6), C(8, 1.4)]) == 4
    assert choose([C(1, 1.0), C(2, 0.9), C(4, 1.01)]) == 1  # nothing beats plain by the margin: off
    assert choose([C(1, 1.0)]) == 1 and choose([]) == 1
    assert choose([C(1, 1.0), C(4, 1.500), C(6, 1.505), C(8, 1.49)]) == 4  # within 1 %: smaller block
    assert choose([C(1, 1.0), C(4, 1.2), C(8, 2.0, final=False)]) == 4  # dropped early: cannot win
    assert choose([C(1, 1.0), Candidate(4, False, predicted=3.0)]) == 1  # predicted only: never chosen


def test_choose_on_noisy_synthetic_measurements():
    """True speedups 1.00 / 1.25 / 1.45 / 1.30 with 8 % noise: the median of 7 rounds finds 4."""
    rng = random.Random(0)
    truth = {2: 1.25, 4: 1.45, 8: 1.30}
    wins = 0
    for trial in range(50):
        cands = [C(1, 1.0)]
        for b, mu in truth.items():
            xs = sorted(mu * (1 + rng.gauss(0, 0.08)) for _ in range(7))
            cands.append(C(b, xs[3]))
        wins += choose(cands) == 4
    assert wins >= 45
    slow = {2: 0.85, 4: 0.9, 8: 0.8}  # a machine where drafting never pays
    for trial in range(20):
        cands = [C(1, 1.0)] + [C(b, sorted(mu * (1 + rng.gauss(0, 0.05)) for _ in range(5))[2]) for b, mu in slow.items()]
        assert choose(cands) == 1


def test_predict_and_candidates():
    costs = Costs(100.0, {2: 20.0, 8: 30.0}, {1: 100.0, 2: 105.0, 8: 150.0}, 64)
    acc = [0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05]
    assert expected_tokens(acc, 1) == 1.0 and expected_tokens(acc, 3) == pytest.approx(2.4)
    assert predict(costs, acc, 8) == pytest.approx((1 + sum(acc)) * 100 / 180)
    assert predict(costs, acc, 1) == 1.0
    assert default_candidates(16) == [2, 3, 4, 5, 6, 8, 10, 12, 16]
    assert default_candidates(8)[-1] == 16 and default_candidates(24)[-1] == 24


def _result(key, best=4):
    cands = (Candidate(1, True, 10.0, 0.05, 1.0, None, 1.0, 3, final=True),
             Candidate(4, True, 15.0, 0.04, 1.5, 2.9, 1.6, 3, final=True),
             Candidate(8, False, predicted=1.2, tau=3.1, note="ranked out by the cost model"))
    return TuneResult(key, best, "2026-11-29T12:00:00+00:00", cands, Costs(100.0, {4: 20.0}, {1: 100.0, 4: 130.0}, 50),
                      (0.8, 0.6, 0.4), ("code", "math", "prose"), 24, 90.0, 42.0)


def test_storage_round_trip_key_change_and_corrupt_file(tmp_path):
    key = {"machine": {"cpu": "x"}, "target": {"id": "t", "hash": "1"}, "drafter": {"id": "d", "hash": "2"}}
    r = _result(key)
    path = save_result(r, tmp_path)
    assert path == result_path(key, tmp_path) and load_result(key, tmp_path) == r
    assert json.loads(path.read_text())["best"] == 4
    changed = json.loads(json.dumps(key))
    changed["drafter"]["hash"] = "3"  # a retrained drafter
    assert key_hash(changed) != key_hash(key) and load_result(changed, tmp_path) is None
    path.write_text("{ not json")
    assert load_result(key, tmp_path) is None  # corrupt: re-tune, don't crash
    path.write_text(json.dumps({"best": 4}))
    assert load_result(key, tmp_path) is None


def test_off_source_says_why():
    r = _result({"k": 1}, best=1)
    assert r.block_size == 1
    assert r.source.startswith("tuned 2026-11-29: off — plain decoding faster on this machine")
    assert _result({"k": 1}).source == "tuned 2026-11-29"
    from dataclasses import replace

    assert replace(_result({"k": 1}), threads=2).source == "tuned 2026-11-29, 2 BLAS threads"


class FakeClock:
    """Time moves only when a fake run says so: the tuner's logic, never the machine, is tested."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _fake_runs(truth: dict, clock: FakeClock, noise: float = 0.0, seconds: float = 1.0, seed: int = 0):
    """run(key, prompt) -> scripted tok/s around ``truth[key]``, advancing the clock."""
    rng = random.Random(seed)

    def run(key, i):
        clock.t += seconds
        return truth[key] * (1 + rng.uniform(-noise, noise))
    return run


def test_race_interleaves_rounds_abab():
    clock = FakeClock()
    keys = [(1, None), (2, None), (4, None)]
    res = race(keys, _fake_runs({k: 10.0 for k in keys}, clock), n_prompts=3, clock=clock, min_rounds=3,
               max_rounds=4, clear_margin=0.15)
    # every round runs every candidate once, the order rotated: never one candidate after another
    assert res.order[:6] == ((1, None), (2, None), (4, None), (2, None), (4, None), (1, None))
    assert all(res.order[i] != res.order[i + 1] for i in range(len(res.order) - 1))
    assert res.rounds == 4 and res.stop == "max rounds" and all(len(v) == 4 for v in res.tps.values())
    assert all(x == pytest.approx(1.0) for v in res.ratio.values() for x in v)


def test_race_stops_on_a_clear_margin_and_not_on_a_close_one():
    clock = FakeClock()
    keys = [(1, None), (4, None), (8, None)]
    truth = {(1, None): 10.0, (4, None): 20.0, (8, None): 12.0}
    res = race(keys, _fake_runs(truth, clock, 0.02), n_prompts=3, judge_every=3, clock=clock, min_rounds=3,
               max_rounds=12, clear_margin=0.15)
    assert res.stop == "clear margin" and res.rounds == 3  # the first judgement
    close = {(1, None): 10.0, (4, None): 14.0, (8, None): 13.8}
    res = race(keys, _fake_runs(close, clock, 0.02), n_prompts=3, judge_every=3, clock=clock, min_rounds=3,
               max_rounds=9, clear_margin=0.15, drop_margin=0.5)
    assert res.stop == "max rounds" and res.rounds == 9


def test_race_budget_bounds_optional_rounds_only():
    clock = FakeClock()
    keys = [(1, None), (4, None), (8, None)]
    close = {(1, None): 10.0, (4, None): 14.0, (8, None): 13.8}
    res = race(keys, _fake_runs(close, clock, 0.02), n_prompts=3, clock=clock, deadline=0.5, min_rounds=3,
               max_rounds=12, clear_margin=0.15, drop_margin=0.5)
    assert res.stop == "budget" and res.rounds == 3  # past the deadline at once, min_rounds still ran
    clock.t = 0.0
    res = race(keys, _fake_runs(close, clock, 0.02), n_prompts=3, clock=clock, deadline=20.0, min_rounds=3,
               max_rounds=12, clear_margin=0.15, drop_margin=0.5)
    assert res.stop == "budget" and res.rounds == 6  # 3 s a round: a 7th would end past 20 s


def test_race_times_the_leaders_neighbours_and_drops_clear_losers():
    clock = FakeClock()
    cands = [2, 3, 4, 5, 6, 8]
    truth = {(1, None): 10.0, (2, None): 12.0, (3, None): 13.0, (4, None): 14.0, (5, None): 16.0,
             (6, None): 15.5, (8, None): 11.0}

    def neighbours(key):
        j = cands.index(key[0]) if key[0] in cands else None
        return [] if j is None else [(b, None) for b in cands[max(0, j - 1):j + 2] if b != key[0]]

    keys = [(1, None), (4, None), (8, None)]  # the model mispredicted: 5 and 6 are better
    res = race(keys, _fake_runs(truth, clock, 0.01), n_prompts=3, judge_every=1, neighbours=neighbours,
               clock=clock, min_rounds=3, max_rounds=20, clear_margin=0.5)
    assert (3, None) in res.tps and (5, None) in res.tps  # 4 led first: its neighbours were timed
    assert (6, None) in res.tps  # then 5 led: its neighbours too
    assert (8, None) in res.dropped and (1, None) in res.final  # plain (the baseline) never dropped
    assert max(res.final, key=lambda k: statistics.median(res.ratio[k])) == (5, None)


def test_pick_a_thread_count_with_the_block():
    cands = [C(1, 1.0, threads=2), C(1, 1.1, threads=1), C(4, 1.5, threads=2), C(4, 1.6, threads=1)]
    assert pick(cands) == (4, 1)
    assert pick([C(1, 1.0, threads=2), C(1, 1.2, threads=1), C(4, 1.21, threads=2)]) == (1, 1)  # beat the best plain
    assert pick([C(1, 1.0), C(4, 1.5)]) == (4, None)  # no thread knob here


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from mlx_spec.loading import load_pair

    t, d = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    return load_pair(str(t), str(d))


def test_first_launch_tunes_once_then_reads_the_store(pair, tmp_path):
    calls = []

    def fake_tune(p, budget_s, progress):
        calls.append(budget_s)
        return _result({"stale": True}, best=4)

    assert ensure_tuned(pair, 30, None, root=tmp_path, tune_fn=fake_tune).best == 4
    assert ensure_tuned(pair, None, None, root=tmp_path, tune_fn=fake_tune).source == "tuned 2026-11-29"
    assert calls == [30]
    assert load_result(tune_key(pair), tmp_path).key == tune_key(pair)
    result_path(tune_key(pair), tmp_path).write_text("garbage")
    ensure_tuned(pair, None, None, root=tmp_path, tune_fn=fake_tune)
    assert len(calls) == 2  # the corrupt store was re-tuned


def test_off_runs_plain_decoding(pair, tmp_path):
    from mlx_spec.config import LoadConfig
    from mlx_spec.generation import GenConfig, run
    from mlx_spec.session import choose_block, info_for

    choice = choose_block(pair, LoadConfig(), root=tmp_path, tune_fn=lambda p, **kw: _result({}, best=1))
    info = info_for(pair, choice)
    assert info.method == "plain" and info.block_size == 1 and "off — plain decoding faster" in info.describe()
    res = run(pair, info, [5, 6, 7], GenConfig(max_tokens=6))
    assert res.stats.drafted == 0 and len(res.tokens) > 0


def test_tune_on_tiny_pair_is_bounded_and_stored(pair, tmp_path):
    r = tune(pair, budget_s=8, tokens=6, candidates=[2, 4], max_rounds=4)
    assert {c.block for c in r.candidates} == {1, 2, 4} and r.best in (1, 2, 4)
    assert r.elapsed_s < 60 and r.costs.t1_ms > 0 and set(r.costs.tt_ms) >= {1, 2, 4}
    assert r.prompt_kinds == ("code", "math", "prose")
    off = next(c for c in r.candidates if c.block == 1)
    assert off.measured and off.speedup == 1.0 and off.rounds >= 1
    save_result(r, tmp_path)
    assert load_result(r.key, tmp_path) == r


def test_a_tiny_budget_still_runs_min_rounds(pair):
    """The budget bounds the optional rounds only: a close race is never decided by one noisy
    round; a clear one (every other candidate's best round 15 % below the leader) may stop."""
    r = tune(pair, budget_s=0.01, tokens=4, candidates=[2, 3], min_rounds=3, max_rounds=6,
             clear_margin=1.0)  # nothing is ever "clear": min_rounds must run
    assert all(c.rounds >= 3 for c in r.candidates if c.measured)
    quick = tune(pair, budget_s=0.01, tokens=4, candidates=[2, 3], min_rounds=3, max_rounds=6,
                 clear_margin=-10.0, threads=[None])  # everything is "clear": it stops at the first judgement
    assert {c.rounds for c in quick.candidates if c.measured} == {3}


def test_tune_races_runner_up_neighbours_and_thread_counts(pair, monkeypatch):
    """tune() on a tiny pair with a fake clock and scripted runs: which candidates it times."""
    import mlx_spec.tuner as T

    clock = FakeClock()
    timed = []

    def fake_race(keys, run, **kw):
        timed.append(list(keys))
        return race(keys, lambda k, i: {1: 10.0, 2: 12.0, 3: 13.0, 4: 14.0}[k[0]] / (1 + 0.1 * (k[1] == 1)),
                    **{**kw, "clock": clock})

    monkeypatch.setattr(T, "race", fake_race)
    seen = []
    fake_blas = type("B", (), {"settable": True, "pinned": None})()
    monkeypatch.setattr(T, "set_threads", lambda b, n: seen.append(n) or n)
    r = tune(pair, budget_s=1.0, tokens=4, candidates=[2, 3, 4], threads=[1, 2], blas=fake_blas, clock=clock)
    keys = timed[0]
    lead_t = keys[0][1]
    assert keys[0][0] == 1  # plain at the leading thread count is the baseline
    blocks = [b for b, t in keys if t == lead_t and b > 1]
    assert len(blocks) >= 2  # the predicted leader and runner-up
    other = [k for k in keys if k[1] != lead_t]
    assert other and other[0][0] == 1  # the runner-up thread count: plain and the predicted leader
    assert {1, 2} <= set(seen)  # both thread counts were set while measuring
    assert r.threads == 2 and r.best == 4 and seen[-1] == 2  # 1 thread is 10 % slower here: 2 stored and applied
    assert any(c.threads == 1 and c.measured for c in r.candidates)


def test_thread_choice_is_stored_and_applied(pair, tmp_path, monkeypatch):
    import mlx_spec.tuner as T
    from dataclasses import replace

    applied = []
    monkeypatch.setattr(T, "apply_threads", lambda result, blas=None: applied.append(result and result.threads))
    r = replace(_result({}, best=4), threads=3)
    assert ensure_tuned(pair, 5.0, None, root=tmp_path, tune_fn=lambda p, **kw: r).threads == 3
    assert load_result(tune_key(pair), tmp_path).threads == 3 and applied == [3]  # stored, applied
    ensure_tuned(pair, 5.0, None, root=tmp_path, tune_fn=lambda p, **kw: 1 / 0)
    assert applied == [3, 3]  # read back from the store at the next load


def test_apply_threads_honours_a_pinned_count_and_no_knob():
    calls = []

    class B:
        settable, pinned, path = True, None, None

    import mlx_spec.tuner as T
    orig = T.set_threads
    T.set_threads = lambda b, n: calls.append(n) or n
    try:
        r = TuneResult({}, 4, "2026-11-29", (), threads=1)
        assert apply_threads(r, B()) == 1 and apply_threads(None, B()) is None  # None: the default
        pinned = B()
        pinned.pinned = 2
        assert apply_threads(r, pinned) == 2
        off = B()
        off.settable = False
        assert apply_threads(r, off) is None and calls == [1, None, 2]
    finally:
        T.set_threads = orig


def test_skipping_first_launch_tuning_stores_nothing(pair, tmp_path):
    def skipped(p, **kw):
        raise TuneSkipped("skipped")

    assert ensure_tuned(pair, 5.0, None, root=tmp_path, tune_fn=skipped) is None
    assert load_result(tune_key(pair), tmp_path) is None


def _step(L, accepted, ms):
    return Step(tuple(range(accepted + 1)), drafted=L - 1, accepted=accepted, block_size=L, elapsed_ms=ms)


def test_controller_picks_the_block_that_pays_falls_back_and_recovers():
    costs = Costs(100.0, {2: 20.0, 4: 25.0, 8: 35.0, 16: 60.0}, {1: 100.0, 2: 105.0, 4: 115.0, 8: 140.0, 16: 200.0}, 64)
    c = AdaptiveController(costs, 16, prior=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    L = c(Step((1,), prefill=True))
    assert L >= 4  # a good prior: draft a real block
    for _ in range(30):  # the drafter stops agreeing: nothing accepted
        L = c(_step(L, 0, costs.draft(L) + costs.verify(L)) if L > 1 else _step(1, 0, 100.0))
    trace = c.trace[-20:]
    assert trace.count(1) >= 15 and any(x > 1 for x in trace)  # plain, with occasional probes
    for _ in range(40):  # it agrees again: every probe is fully accepted
        L = c(_step(L, L - 1, costs.draft(L) + costs.verify(L)) if L > 1 else _step(1, 0, 100.0))
    assert all(x >= 8 for x in c.trace[-5:])  # recovered to long blocks


def test_controller_for_uses_the_stored_curve_and_prior(pair):
    from mlx_spec.adaptive import controller_for

    r = _result({}, best=4)
    c = controller_for(pair, r)
    assert c.costs == r.costs.smoothed() and c.max_block == 8 and c.prior[:3] == [0.8, 0.6, 0.4]
    fresh = controller_for(pair, None, max_block=4, context=[5, 6, 7, 8])  # no result: measures now
    assert fresh.max_block == 4 and fresh.costs.t1_ms > 0 and 4 in fresh.costs.tt_ms


def test_controller_reaches_most_of_the_best_fixed_rate():
    """Simulated drafter with stationary per-position acceptance c: the controller, knowing only
    the cost curve, commits tokens at >= 90 % of the rate of the best fixed block for that c."""
    costs = Costs(100.0, {2: 20.0, 4: 25.0, 8: 35.0, 16: 60.0}, {1: 100.0, 2: 105.0, 4: 115.0, 8: 140.0, 16: 200.0}, 64)

    def cycle_ms(L):
        return costs.draft(L) + costs.verify(L) if L > 1 else costs.verify(1)

    for cond in (0.3, 0.6, 0.85):
        best = max(sum(cond ** i for i in range(L)) / cycle_ms(L) for L in range(1, 17))
        rates = []
        for seed in range(8):
            rng, c = random.Random(seed), AdaptiveController(costs, 16)
            L, toks, ms = c(None), 0, 0.0
            for _ in range(150):
                a = 0
                while a < L - 1 and rng.random() < cond:
                    a += 1
                toks, ms = toks + a + 1, ms + cycle_ms(L)
                L = c(_step(L, a, cycle_ms(L)) if L > 1 else _step(1, 0, cycle_ms(1)))
            rates.append(toks / ms)
        assert sum(rates) / len(rates) >= 0.9 * best, cond
