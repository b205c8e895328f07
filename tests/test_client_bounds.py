"""One client cannot hold the server: stalled readers are cut off (generation cancelled, slot
freed), open streams per client address are bounded, a prefill past its budget fails."""

import json
import re
import socket
import threading
import time

from mlx_spec.engine import Delta, Done, Handle, Started
from mlx_spec.generation import EngineInfo, Request
from mlx_spec.stats import StatsSnapshot

import httpx
import pytest
from helpers import tiny_engine_loader
from test_server import running_engine
from test_server_guard import serve_policy

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


class StreamingEngine:
    """The Engine interface with scripted events: a stream of big text deltas until cancelled
    (or ``n`` of them), so a client's socket buffers fill at once."""

    state, error, context_length, queue_depth = "ready", None, 1024, 0
    info = EngineInfo("dflash2", "fake", "fake-drafter", 4, "flag")

    def __init__(self, piece: int = 64 << 10):
        self.piece, self.handles, self.cancelled = piece, [], []

    def submit(self, req, loop=None):
        h = Handle(req, loop)
        self.handles.append(h)
        n = req.max_tokens

        def script():
            h._put(Started(req.id, 3, self.info))
            for i in range(n):
                if h.cancelled.wait(0.005):
                    self.cancelled.append(req.id)
                    h._put(Done(req.id, "", "cancelled", 3, i, self.info, StatsSnapshot(), {}))
                    return
                h._put(Delta(req.id, "x" * self.piece, (1,), 0, 0, StatsSnapshot()))
            h._put(Done(req.id, "x", "length", 3, n, self.info, StatsSnapshot(), {"draft_n": 0}))

        threading.Thread(target=script, daemon=True).start()
        return h

    def snapshot(self):
        return {
            "requests": len(self.handles),
            "cancelled": len(self.cancelled),
            "errors": 0,
            "prompt_tokens": 0,
            "tokens": 0,
            "cycles": 0,
            "drafted": 0,
            "accepted": 0,
            "accepted_by_position": [],
            "queue_depth": 0,
            "state": self.state,
            "prefix_cache_bytes": 0,
            "cached_tokens": 0,
        }


def _raw_stream(port: int, max_tokens: int) -> socket.socket:
    """A client that sends a streaming request and then reads nothing (small receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"messages": MSG, "stream": True, "max_tokens": max_tokens}).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return s


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^mlx_spec:{name} (\S+)$", text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


@pytest.mark.parametrize("reader", ["stops reading", "one byte at a time"])
def test_a_stalled_reader_is_cut_off_and_the_next_request_is_served_at_once(reader):
    engine = StreamingEngine()
    with serve_policy(engine, stall_s=1.0, max_streams=4) as (url, port, _):
        s = _raw_stream(port, max_tokens=1000)
        stop = threading.Event()

        def trickle():  # reads a byte now and then: never enough to drain the buffers
            while not stop.is_set():
                try:
                    s.recv(1)
                except OSError:
                    return
                time.sleep(0.05)

        if reader == "one byte at a time":
            threading.Thread(target=trickle, daemon=True).start()
        try:
            _wait(lambda: engine.cancelled, timeout=30)  # the generation was cancelled through its handle
            with httpx.Client(base_url=url, timeout=10) as c:
                t0 = time.monotonic()
                r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2})
                assert r.status_code == 200 and time.monotonic() - t0 < 5
                metrics = c.get("/metrics").text
            assert _metric(metrics, "streams_stalled_total") == 1
            assert _metric(metrics, "requests_cancelled_total") == 1
            assert _metric(metrics, "streams_open") == 0  # its slot was freed
        finally:
            stop.set()
            s.close()


def test_open_streams_per_client_are_bounded():
    engine = StreamingEngine(piece=16)
    with serve_policy(engine, max_streams=2, stall_s=0) as (url, port, _):
        held = [_raw_stream(port, max_tokens=1000) for _ in range(2)]
        try:
            _wait(lambda: len(engine.handles) == 2)
            with httpx.Client(base_url=url, timeout=10) as c:
                r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2})
                assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_streams"
                assert "already has 2 generation requests open" in r.json()["error"]["message"]
                r = c.post("/v1/messages", json={"model": "x", "max_tokens": 2, "messages": MSG})
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
                assert c.get("/v1/models").status_code == 200  # only generations count
                held.pop().close()  # one stream ends: the client may open another
                _wait(lambda: len(engine.cancelled) == 1)
                _wait(lambda: _metric(c.get("/metrics").text, "streams_open") == 1)
                r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2})
                assert r.status_code == 200
                assert _metric(c.get("/metrics").text, "streams_refused_total") == 2
        finally:
            for s in held:
                s.close()


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory):
    return tmp_path_factory.mktemp("pair")


def test_a_prefill_past_its_budget_fails_and_frees_the_slot_one_at_a_time(pair_root):
    with running_engine(tiny_engine_loader(pair_root, context=512), max_batch=1, prefill_timeout=1e-6) as e:
        with serve_policy(e) as (url, _, _):
            with httpx.Client(base_url=url, timeout=30) as c:
                r = c.post(CHAT, json={"messages": MSG, "max_tokens": 3})
                assert r.status_code == 503 and r.json()["error"]["code"] == "prefill_timeout"
                assert "--prefill-timeout" in r.json()["error"]["message"]
                assert _metric(c.get("/metrics").text, "prefill_timeouts_total") == 1
    with running_engine(tiny_engine_loader(pair_root, context=512), max_batch=1) as e:  # the default: generous
        assert e.submit(Request(messages=MSG, max_tokens=3)).result().completion_tokens == 3


def test_a_prefill_past_its_budget_fails_and_frees_the_slot_in_a_batch(pair_root):
    """A long prompt joining a running batch prefills in chunks between the others' steps; past
    the budget it fails, and the batch goes on."""
    # a budget far below one step: the long prompt's first chunk alone runs past it, whatever the
    # machine's speed (the running request has its first token before the long one joins)
    with running_engine(tiny_engine_loader(pair_root, context=512), max_batch=2, prefill_timeout=1e-4) as e:
        assert e.max_batch == 2
        running = e.submit(Request(prompt="a", max_tokens=300))  # (greedy: no end of text within 300)
        stream = iter(running)
        assert isinstance(next(stream), Started)
        next(stream)  # its first tokens: it is decoding, past its own prefill
        long = e.submit(Request(messages=[{"role": "user", "content": "a" * 460}], max_tokens=2))
        events = list(long)
        assert events[-1].kind == "PrefillTimeout", events[-1]
        done = running.result()
        assert done.completion_tokens == 300  # the batch went on
        assert e.snapshot()["prefill_timeouts"] == 1
        assert e.snapshot()["batch_active"] == 0


def test_metrics_show_the_allocator_figures_and_the_cache_bound(pair_root):
    import mlx.core as mx

    with running_engine(tiny_engine_loader(pair_root, context=512)) as e:
        e.submit(Request(messages=MSG, max_tokens=3)).result()
        with serve_policy(e) as (url, _, _):
            text = httpx.get(f"{url}/metrics", timeout=30).text
    for name in ("active", "cache", "peak"):
        assert _metric(text, f"mlx_memory_{name}_bytes") > 0 or name == "cache"
    assert _metric(text, "mlx_memory_peak_bytes") >= _metric(text, "mlx_memory_active_bytes")
    assert mx  # (MLX figures are read on the engine thread; this thread only reads /metrics)


def test_the_buffer_cache_is_bounded_by_the_plans_allowance(pair_root):
    """At start the engine thread sets MLX's cache limit to the plan's "MLX cache allowance"."""
    from types import SimpleNamespace

    from mlx_spec.generation import engine_info
    from mlx_spec.loading import load_pair
    from mlx_spec.memory import Item
    from mlx_spec.session import Session

    import mlx.core as mx

    tiny_engine_loader(pair_root)  # (writes the pair)
    plan = SimpleNamespace(items=(Item("target weights", 1 << 20, ""), Item("MLX cache allowance", 5 << 20, "")))

    def loader():
        pair = load_pair(str(pair_root / "target"), str(pair_root / "drafter"))
        return Session.of(pair, engine_info(pair, 4, "flag"), plan=plan)

    before = mx.set_cache_limit(1 << 40)
    try:
        with running_engine(loader, max_batch=1) as e:
            e.submit(Request(messages=MSG, max_tokens=3)).result()
            assert e.snapshot()["memory"]["cache_limit"] == 5 << 20
            assert mx.set_cache_limit(1 << 40) == 5 << 20  # (returns the limit it replaces)
            assert e.snapshot()["memory"]["cache"] <= 5 << 20
    finally:
        mx.set_cache_limit(before)
