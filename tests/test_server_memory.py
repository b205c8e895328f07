"""A server's resident memory: the bound it states in /metrics (measured at start + the plan's
growth + allowances), and no per-request object outliving its request."""

import gc
import re
import time

from mlx_spec import memory, quantize
from mlx_spec.engine import Delta, Done, Handle, Started
from mlx_spec.generation import Request, engine_info
from mlx_spec.loading import load_pair
from mlx_spec.server.app import create_app
from mlx_spec.session import Session

import httpx
import pytest
from helpers import save_tiny_pair
from test_server import running_engine, serve_in_thread

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
FLOAT = quantize.QuantChoice(None, None, 64, False, "")


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^mlx_spec:{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert m, name + labels
    return float(m.group(1))


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def planned_loader(pair_dirs, prefix_cache: int = 1 << 20):
    """A loader whose session carries the tiny pair's memory plan (as `serve` loads)."""
    t, d = pair_dirs

    def loader():
        pair = load_pair(str(t), str(d))
        plan = memory.plan_for(
            str(t), str(d), FLOAT, context=512, prefix_cache=prefix_cache, budget=(1 << 40, "test"), metal=False
        )
        return Session.of(pair, engine_info(pair, 4, "flag"), context=512, plan=plan)

    return loader


def test_metrics_state_the_resident_memory_bound_and_its_terms(pair_dirs):
    with running_engine(planned_loader(pair_dirs), prefix_cache=1 << 20, max_batch=2) as e:
        with serve_in_thread(create_app(e)) as url:
            assert httpx.post(f"{url}{CHAT}", json={"messages": MSG, "max_tokens": 3}, timeout=60).status_code == 200
            text = httpx.get(f"{url}/metrics", timeout=30).text
        plan = e._session.plan
    terms = {
        t: _metric(text, "memory_bound_term_bytes", f'{{term="{t}"}}')
        for t in ("runtime", "weights", "sequences", "prefix_cache", "mlx_cache", "heap")
    }
    assert _metric(text, "memory_bound_bytes") == sum(terms.values())
    rows = {i.name: i.bytes for i in plan.items}
    assert terms["sequences"] == 2 * sum(rows.get(n, 0) for n in memory.PER_SEQUENCE)  # the batch of 2
    assert terms["prefix_cache"] == rows["prefix cache"] == 1 << 20
    assert terms["mlx_cache"] == rows["MLX cache allowance"]
    assert terms["heap"] == memory.HEAP_ALLOWANCE
    # measured once loaded: the weights are MLX's active bytes, the runtime is the rest of the RSS
    assert terms["weights"] >= rows["target weights"] + rows["drafter weights"]
    assert terms["runtime"] > 0
    assert _metric(text, "memory_rss_loaded_bytes") >= terms["runtime"] + terms["weights"]
    assert _metric(text, "memory_rss_bytes") > 0
    assert _metric(text, "memory_sequences_reserved_bytes") == 0  # (the request has finished)
    assert 0 < _metric(text, "memory_sequences_reserved_max_bytes") <= terms["sequences"] / 2  # (one request)


def test_per_request_objects_do_not_accumulate_over_requests(pair_dirs):
    """Rounds of plain, streamed and cancelled requests: the handles, events and event queues of
    finished requests are let go (the engine keeps merged counters, not requests), so a second
    round leaves exactly as many alive as the first (at most the last request's, which the
    engine thread still names until it takes the next job)."""
    kinds = (Handle, Started, Delta, Done)

    def alive() -> dict:
        gc.collect()
        return {k.__name__: sum(isinstance(o, k) for o in gc.get_objects()) for k in kinds}

    def one_round(c: httpx.Client, e) -> None:
        for i in range(4):
            body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 6}
            assert c.post(CHAT, json=body).status_code == 200
            with c.stream("POST", CHAT, json={**body, "stream": True}) as s:
                for n, _ in enumerate(s.iter_lines()):
                    if i % 2 and n >= 2:
                        break  # dropped mid-stream: cancelled
        e.submit(Request(messages=MSG, max_tokens=2)).result()
        deadline = time.monotonic() + 30
        while e.snapshot()["batch_active"] and time.monotonic() < deadline:
            time.sleep(0.05)

    with running_engine(planned_loader(pair_dirs), prefix_cache=1 << 20, max_batch=2) as e:
        with serve_in_thread(create_app(e, keepalive_s=0.5)) as url:
            with httpx.Client(base_url=url, timeout=60) as c:
                one_round(c, e)
                first = alive()
                for _ in range(2):
                    one_round(c, e)
                later = alive()
        assert e.snapshot()["memory"]["reserved"] == 0
    assert later == first, (first, later)


def test_the_engine_hands_the_free_heap_back_once_requests_end(pair_dirs, monkeypatch):
    """Freed MLX buffers stay in malloc's arenas until something releases them: the engine does
    once requests have ended (one release for the requests that ended together), and counts it."""
    import mlx_spec.engine

    calls = []
    monkeypatch.setattr(mlx_spec.engine, "release_free_heap", lambda: calls.append(1) or True)
    for batch in (1, 2):
        calls.clear()
        with running_engine(planned_loader(pair_dirs), max_batch=batch) as e:
            handles = [e.submit(Request(messages=MSG, max_tokens=3)) for _ in range(2)]
            for h in handles:
                h.result()
        # read once the engine thread has stopped: a release made as the second request ends
        # may still be between its call and its count while the engine runs
        assert 1 <= len(calls) <= 2, (batch, calls)
        assert e.snapshot()["memory"]["heap_releases"] == len(calls)
