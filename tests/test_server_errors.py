"""Bad input never hurts the server; loading / failed engines; SSE keep-alives; error shape."""

import asyncio
import json
import threading

import httpx
import pytest
from helpers import tiny_engine_loader
from test_server import serve_in_thread

from mlx_spec.engine import Delta, Done, Engine, Handle, Started
from mlx_spec.server.app import create_app


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    loader = tiny_engine_loader(tmp_path_factory.mktemp("pair"))
    e = Engine(loader, max_queue=4, context_length=512).start()
    e.wait_ready(60)
    yield e
    e.close()


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine, max_body_bytes=1 << 20)) as u:
        yield u


MSG = [{"role": "user", "content": "hi"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"

# (name, method, path, body (dict -> JSON, bytes -> raw), expected status, expected param or None)
CASES = [
    ("malformed json", "POST", CHAT, b'{"messages": [', 400, None),
    ("invalid utf-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    ("empty body", "POST", CHAT, b"", 400, None),
    ("array body", "POST", CHAT, b"[1, 2]", 400, None),
    ("deep nesting", "POST", CHAT, b"[" * 100_000, 400, None),
    ("NaN temperature", "POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    ("missing messages", "POST", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("message not an object", "POST", CHAT, {"messages": ["hi"]}, 400, "messages.0"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("content is a number", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("image content", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content"),
    ("max_tokens 0", "POST", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "POST", CHAT, {"messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens string", "POST", CHAT, {"messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens float", "POST", CHAT, {"messages": MSG, "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens beyond context", "POST", CHAT, {"messages": MSG, "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_completion_tokens = context", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 512}, 400, "max_tokens"),
    ("temperature negative", "POST", CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("temperature string", "POST", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", "POST", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("seed string", "POST", CHAT, {"messages": MSG, "seed": "abc"}, 400, "seed"),
    ("seed huge", "POST", CHAT, {"messages": MSG, "seed": 10**30}, 400, "seed"),
    ("stop number", "POST", CHAT, {"messages": MSG, "stop": 123}, 400, "stop"),
    ("too many stops", "POST", CHAT, {"messages": MSG, "stop": [str(i) for i in range(20)]}, 400, "stop"),
    ("stream not bool", "POST", CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("n = 2", "POST", CHAT, {"messages": MSG, "n": 2}, 400, "n"),
    ("presence penalty", "POST", CHAT, {"messages": MSG, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("logprobs", "POST", CHAT, {"messages": MSG, "logprobs": True}, 400, "logprobs"),
    ("tools not a list", "POST", CHAT, {"messages": MSG, "tools": "f"}, 400, "tools"),
    ("unknown model", "POST", CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model"),
    ("model wrong type", "POST", CHAT, {"model": 7, "messages": MSG}, 400, "model"),
    ("prompt longer than context", "POST", TEXT, {"prompt": "a" * 600, "max_tokens": 1}, 400, None),
    ("prompt + max_tokens > context", "POST", TEXT, {"prompt": "a" * 400, "max_tokens": 200}, 400, None),
    ("long chat, stream", "POST", CHAT, {"messages": [{"role": "user", "content": "a" * 600}],
                                         "stream": True}, 400, None),
    ("missing prompt", "POST", TEXT, {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt", "POST", TEXT, {"prompt": ""}, 400, "prompt"),
    ("two prompts", "POST", TEXT, {"prompt": ["a", "b"]}, 400, "prompt"),
    ("negative token id", "POST", TEXT, {"prompt": [1, -2]}, 400, "prompt"),
    ("token id beyond vocab", "POST", TEXT, {"prompt": [1, 99999], "max_tokens": 2}, 400, None),
    ("echo", "POST", TEXT, {"prompt": "a", "echo": True}, 400, "echo"),
    ("body too large", "POST", CHAT, b'{"messages": "' + b"a" * (2 << 20) + b'"}', 413, None),
    ("GET on a POST route", "GET", CHAT, None, 405, None),
    ("unknown route", "POST", "/v1/nothing", {"a": 1}, 404, None),
]


def test_bad_input_battery(engine, url):
    assert len(CASES) >= 20
    ok_before = engine.snapshot()["requests"]
    with httpx.Client(base_url=url, timeout=30) as c:
        for name, method, path, body, status, param in CASES:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
            r = c.request(method, path, headers={"Content-Type": "application/json"}, **kw)
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], name
            assert err["type"] == "invalid_request_error", name
            if param is not None:
                assert err["param"] == param, (name, err)
            if name.startswith(("prompt", "long chat")):
                assert err["code"] == "context_length_exceeded", (name, err)
        # still serving, and the bad requests never became generations that ran
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert c.get("/health").status_code == 200
    assert engine.snapshot()["tokens"] > 0 and engine.snapshot()["requests"] > ok_before


def test_chunked_body_too_large(url):
    def chunks():
        for _ in range(40):
            yield b"a" * (64 << 10)

    r = httpx.post(f"{url}{CHAT}", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{url}/health").status_code == 200


# -- engines that are loading, failed, or slow (no MLX needed) --------------------------------


class _Info:
    def as_dict(self):
        return {"method": "dflash2", "target": "fake", "drafter": "fake-drafter", "block_size": 4,
                "block_size_source": "flag"}

    target = "fake"


class SlowEngine:
    """The Engine interface with scripted events: a long 'prefill' between Started and text."""

    state, error, info, context_length, queue_depth = "ready", None, _Info(), 1024, 0

    def __init__(self, prefill_s: float):
        self.prefill_s = prefill_s

    def submit(self, req, loop=None):
        h = Handle(req, loop)

        def script():
            h._put(Started(req.id, 3, self.info.as_dict()))
            if h.cancelled.wait(self.prefill_s):
                return
            h._put(Delta(req.id, "hi", (1, 2), 0, 0, {}))
            h._put(Done(req.id, "hi", "stop", 3, 2, self.info.as_dict(), {}, {"draft_n": 0}))

        threading.Thread(target=script, daemon=True).start()
        return h

    def snapshot(self):
        return {"requests": 0, "cancelled": 0, "errors": 0, "prompt_tokens": 0, "tokens": 0, "cycles": 0,
                "drafted": 0, "accepted": 0, "accepted_by_position": [], "queue_depth": 0, "state": self.state}


async def test_keepalive_during_long_prefill():
    app = create_app(SlowEngine(prefill_s=0.6), keepalive_s=0.1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.post(CHAT, json={"messages": MSG, "stream": True})
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0].startswith("data: ") and '"role":"assistant"' in events[0]
        assert events.count(": keep-alive") >= 2
        assert events[-1] == "data: [DONE]"
        assert any('"content":"hi"' in e for e in events)


async def test_loading_then_ready_and_failed_engines():
    gate = threading.Event()

    def loader():
        gate.wait(30)
        return object(), _Info()

    e = Engine(loader).start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(e)), base_url="http://t") as c:
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "loading" and "Retry-After" in h.headers
            assert h.json()["error"]["code"] == "model_loading"
            r = await c.post(CHAT, json={"messages": MSG})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
            assert (await c.get("/v1/models")).status_code == 503
            gate.set()
            await asyncio.to_thread(e.wait_ready, 10)
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["speculation"]["method"] == "dflash2"
    finally:
        gate.set()
        e.close()

    def broken():
        raise FileNotFoundError("drafter checkpoint missing")

    f = Engine(broken).start()
    with pytest.raises(Exception):
        f.wait_ready(10)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(f)), base_url="http://t") as c:
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "drafter checkpoint missing" in h.json()["error"]["message"]
        r = await c.post(CHAT, json={"messages": MSG})
        assert r.status_code == 503 and json.loads(r.text)["error"]["type"] == "server_error"
    f.close()
