"""The engine thread: plain-value events, cancel, failures arrive as Failed."""

import dataclasses

from mlx_spec.engine import Delta, Done, Engine, Failed, Request, Started
from mlx_spec.generation import EngineInfo
from mlx_spec.session import Session
from mlx_spec.stats import StatsSnapshot

import mlx.core as mx
import pytest
from helpers import tiny_engine_loader


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with Engine(tiny_engine_loader(tmp_path_factory.mktemp("pair"))) as e:
        e.wait_ready(60)
        yield e


def _no_arrays(x):
    if isinstance(x, mx.array):
        return False
    if dataclasses.is_dataclass(x):
        return all(_no_arrays(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, dict):
        return all(_no_arrays(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_no_arrays(v) for v in x)
    return True


def test_events_are_plain_values_and_sequential_requests(engine):
    texts = []
    for _ in range(2):
        evs = list(engine.submit(Request(prompt="hello", max_tokens=12)))
        assert isinstance(evs[0], Started) and isinstance(evs[-1], Done)
        assert all(_no_arrays(e) for e in evs)
        done = evs[-1]
        assert done.completion_tokens == 12 and done.finish_reason == "length"
        assert done.engine.method == "dflash2" and done.engine.block_size == 4 and done.engine.mode == "speculative"
        assert isinstance(done.engine, EngineInfo) and isinstance(done.stats, StatsSnapshot)
        assert all(isinstance(e.stats, StatsSnapshot) for e in evs if isinstance(e, Delta))
        with pytest.raises(dataclasses.FrozenInstanceError):
            done.stats.drafted = 0
        assert done.timings["draft_n"] > 0 and done.timings["draft_rounds"] > 0
        assert "".join(e.text for e in evs if isinstance(e, Delta)) == done.text
        texts.append(done.text)
    assert texts[0] == texts[1]


def test_plain_ab_gives_same_greedy_text(engine):
    spec = engine.submit(Request(messages=[{"role": "user", "content": "hi"}], max_tokens=10)).result()
    plain = engine.submit(
        Request(messages=[{"role": "user", "content": "hi"}], max_tokens=10, speculate=False)
    ).result()
    assert plain.engine.method == "plain" and plain.engine.mode == "plain" and plain.timings["draft_n"] == 0
    assert spec.text == plain.text


def test_cancel_and_failure(engine):
    h = engine.submit(Request(prompt="abc", max_tokens=200))
    seen = []
    for ev in h:
        seen.append(ev)
        if isinstance(ev, Delta):
            h.cancel()
    assert isinstance(seen[-1], Done) and seen[-1].finish_reason == "cancelled"
    assert seen[-1].completion_tokens < 200
    bad = list(engine.submit(Request(prompt="abc", max_tokens=0)))
    assert isinstance(bad[-1], Failed) and bad[-1].kind == "BadRequest"
    # still serving
    assert engine.submit(Request(prompt="abc", max_tokens=3)).result().completion_tokens == 3


def test_loader_failure_is_reported():
    def boom():
        raise ValueError("drafter is broken")

    e = Engine(boom).start()
    with pytest.raises(Exception, match="drafter is broken"):
        e.wait_ready(10)
    e.close()


def test_adaptive_engine_is_lossless_and_uses_the_controller(engine, tmp_path):
    """--adaptive through the engine: same text as the fixed block, blocks chosen per cycle."""
    from mlx_spec.generation import engine_info

    base = tiny_engine_loader(tmp_path / "a")

    def loader():
        session = base()
        return Session.of(session.pair, engine_info(session.pair, 4, "flag", adaptive=True, pinned=True))

    with Engine(loader) as adaptive, Engine(base) as fixed:
        adaptive.wait_ready(60)
        fixed.wait_ready(60)
        req = dict(prompt="hello", max_tokens=40)
        got, ref = adaptive.submit(Request(**req)).result(), fixed.submit(Request(**req)).result()
        assert got.text == ref.text and got.engine.adaptive_max == 16
        assert 0 < got.timings["draft_n"] < ref.timings["draft_n"]  # it stopped drafting a useless drafter
        # A fresh controller per request: it starts from the prior and drafts again (one carried
        # over would have backed off to plain steps). Its choices depend on measured timings.
        again = adaptive.submit(Request(**req)).result()
        assert again.text == ref.text and again.timings["draft_n"] > 0


def test_counters_come_from_the_requests_stats(tmp_path):
    """/metrics counters are the requests' Stats added up (no second count of the same cycles)."""
    with Engine(tiny_engine_loader(tmp_path)) as e:
        e.wait_ready(60)
        a = e.submit(Request(prompt="hello", max_tokens=12)).result()
        b = e.submit(Request(prompt="world", max_tokens=9)).result()
        snap = e.snapshot()
    assert snap["requests"] == 2 and snap["tokens"] == a.completion_tokens + b.completion_tokens
    assert snap["drafted"] == a.stats.drafted + b.stats.drafted
    assert snap["accepted"] == a.stats.accepted + b.stats.accepted
    assert snap["cycles"] == a.timings["draft_rounds"] + b.timings["draft_rounds"]
    assert snap["prompt_tokens"] == a.prompt_tokens + b.prompt_tokens
    assert sum(snap["accepted_by_position"]) == snap["accepted"]
    assert snap["drafted_by_position"][0] == snap["cycles"]


def test_engine_fields_are_read_only_and_switched_on_its_thread(engine):
    info = engine.info
    with pytest.raises(AttributeError):
        engine.info = info
    with pytest.raises(AttributeError):
        engine.context_length = 1
    with pytest.raises(Exception, match="engine thread"):
        engine.use_info(info)
    plain = dataclasses.replace(info, method="plain", block_size=1, mode="tuned-off", block_size_source="test: off")
    engine.call(lambda pair: engine.use_info(plain)).result(10)
    try:
        done = engine.submit(Request(prompt="hello", max_tokens=6)).result()
        assert done.engine.mode == "tuned-off" and done.timings["draft_n"] == 0
    finally:
        engine.call(lambda pair: engine.use_info(info)).result(10)
