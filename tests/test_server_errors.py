"""Bad input never hurts the server; loading / failed engines; SSE keep-alives; error shape."""

import asyncio
import json
import threading

from mlx_spec.engine import Delta, Done, Engine, Handle, Started
from mlx_spec.generation import EngineInfo
from mlx_spec.server import guard
from mlx_spec.server.app import create_app
from mlx_spec.session import Session
from mlx_spec.stats import StatsSnapshot

import httpx
import pytest
from helpers import tiny_engine_loader
from test_server import running_engine, serve_in_thread


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tiny_engine_loader(tmp_path_factory.mktemp("pair"), context=512)) as e:
        yield e


@pytest.fixture(scope="module")
def url(engine):
    # as `serve` runs: the Host/Origin checks on (loopback, any port: the test's own)
    with serve_in_thread(create_app(engine, max_body_bytes=1 << 20, policy=guard.Policy())) as u:
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
    (
        "NaN temperature",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    ("missing messages", "POST", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("message not an object", "POST", CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("content is a number", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    (
        "image content",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
    ),
    ("max_tokens 0", "POST", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "POST", CHAT, {"messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens string", "POST", CHAT, {"messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens float", "POST", CHAT, {"messages": MSG, "max_tokens": 2.5}, 400, "max_tokens"),
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
    ("model wrong type", "POST", CHAT, {"model": 7, "messages": MSG}, 400, "model"),
    ("prompt longer than context", "POST", TEXT, {"prompt": "a" * 600, "max_tokens": 1}, 400, None),
    (
        "long chat, stream",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": "a" * 600}], "stream": True},
        400,
        None,
    ),
    ("missing prompt", "POST", TEXT, {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt", "POST", TEXT, {"prompt": ""}, 400, "prompt"),
    ("two prompts", "POST", TEXT, {"prompt": ["a", "b"]}, 400, "prompt"),
    ("negative token id", "POST", TEXT, {"prompt": [1, -2]}, 400, "prompt"),
    ("token id beyond vocab", "POST", TEXT, {"prompt": [1, 99999], "max_tokens": 2}, 400, "prompt"),
    ("echo", "POST", TEXT, {"prompt": "a", "echo": True}, 400, "echo"),
    ("body too large", "POST", CHAT, b'{"messages": "' + b"a" * (2 << 20) + b'"}', 413, None),
    ("GET on a POST route", "GET", CHAT, None, 405, None),
    ("unknown route", "POST", "/v1/nothing", {"a": 1}, 404, None),
    # messages without content, by role
    ("user message without content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("user content null", "POST", CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    (
        "system content null",
        "POST",
        CHAT,
        {"messages": [{"role": "system", "content": None}, *MSG]},
        400,
        "messages[0].content",
    ),
    (
        "tool message without content",
        "POST",
        CHAT,
        {"messages": [*MSG, {"role": "tool", "tool_call_id": "1"}]},
        400,
        "messages[1].content",
    ),
    ("message without role", "POST", CHAT, {"messages": [*MSG, {"content": "x"}]}, 400, "messages[1].role"),
    (
        "content is an object",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": {"a": 1}}]},
        400,
        "messages[0].content",
    ),
    (
        "text part not a string",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "messages[0].content",
    ),
    (
        "text part without type",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"text": "a"}]}]},
        400,
        "messages[0].content",
    ),
    # bodies that are not JSON objects, or not JSON at all
    ("text/plain body", "POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}]}', 415, None),
    ("form body", "POST", CHAT, b"messages=hi", 415, None),
    ("string body", "POST", CHAT, b'"hi"', 400, None),
    ("null body", "POST", CHAT, b"null", 400, None),
    ("trailing garbage", "POST", CHAT, b'{"messages": []} x', 400, None),
    ("lone high surrogate", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("lone low surrogate", "POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\udc00"}]}', 400, None),
    (
        "Infinity top_p",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        400,
        "top_p",
    ),
    (
        "-Infinity temperature",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}',
        400,
        "temperature",
    ),
    # out-of-range and mistyped sampling fields
    ("temperature above 2", "POST", CHAT, {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("top_p above 1", "POST", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", "POST", CHAT, {"messages": MSG, "top_k": -1}, 400, "top_k"),
    ("top_k float", "POST", CHAT, {"messages": MSG, "top_k": 1.5}, 400, "top_k"),
    ("stop list with a number", "POST", CHAT, {"messages": MSG, "stop": ["a", 1]}, 400, "stop"),
    (
        "stream_options not an object",
        "POST",
        CHAT,
        {"messages": MSG, "stream": True, "stream_options": 1},
        400,
        "stream_options",
    ),
    ("frequency penalty", "POST", CHAT, {"messages": MSG, "frequency_penalty": 1}, 400, "frequency_penalty"),
    ("logit_bias", "POST", CHAT, {"messages": MSG, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    (
        "response_format json",
        "POST",
        CHAT,
        {"messages": MSG, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "tool_choice required",
        "POST",
        CHAT,
        {"messages": MSG, "tools": [], "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    ("speculate not bool", "POST", CHAT, {"messages": MSG, "speculate": "no"}, 400, "speculate"),
    # /v1/completions
    ("prompt a number", "POST", TEXT, {"prompt": 5}, 400, "prompt"),
    ("prompt list of floats", "POST", TEXT, {"prompt": [1.5, 2.5]}, 400, "prompt"),
    ("prompt list of lists", "POST", TEXT, {"prompt": [[1, 2]]}, 400, "prompt"),
    ("empty token list", "POST", TEXT, {"prompt": []}, 400, "prompt"),
    ("best_of 2", "POST", TEXT, {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("suffix", "POST", TEXT, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("completion logprobs", "POST", TEXT, {"prompt": "a", "logprobs": 2}, 400, "logprobs"),
    ("NaN seed", "POST", TEXT, b'{"prompt": "a", "seed": NaN}', 400, "seed"),
    ("text/plain completions", "POST", TEXT, b'{"prompt": "a"}', 415, None),
    ("DELETE a model", "DELETE", "/v1/models/x", None, 405, None),
    # web pages in the user's browser (server/guard.py): refused before anything is parsed
    ("rebinding Host", "POST", CHAT, {"messages": MSG, "max_tokens": 3}, 403, None),
    ("rebinding Host, completions", "POST", TEXT, {"prompt": "a", "max_tokens": 3}, 403, None),
    ("rebinding Host, models", "GET", "/v1/models", None, 403, None),
    ("rebinding Host, metrics", "GET", "/metrics", None, 403, None),
    ("cross-origin JSON POST", "POST", CHAT, {"messages": MSG, "max_tokens": 3}, 403, None),
    ("cross-origin text/plain POST", "POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}]}', 403, None),
    ("null Origin", "POST", TEXT, {"prompt": "a"}, 403, None),
    ("cross-site fetch without Origin", "GET", "/v1/models", None, 403, None),
    ("preflight from an unlisted origin", "OPTIONS", CHAT, None, 403, None),
]

# Extra checks for some cases: the code, and words the message must (not) contain.
EXPECT = {
    "token id beyond vocab": {"code": "invalid_value"},
    "negative token id": {"code": "invalid_value"},
    "NaN temperature": {"code": "invalid_value", "says": "finite", "not": "less than"},
    "Infinity top_p": {"says": "finite"},
    "-Infinity temperature": {"says": "finite", "not": "greater than"},
    "lone high surrogate": {"says": "surrogate \\ud800", "not": "end of hex escape"},
    "lone low surrogate": {"says": "surrogate \\udc00"},
    "user message without content": {"code": "invalid_value", "says": "no content"},
    "user content null": {"code": "invalid_value", "says": "content is null"},
    "text/plain body": {"code": "unsupported_media_type", "says": "text/plain"},
    "form body": {"code": "unsupported_media_type"},
}
HEADERS = {
    "text/plain body": "text/plain",
    "form body": "application/x-www-form-urlencoded",
    "text/plain completions": "text/plain; charset=utf-8",
    "cross-origin text/plain POST": "text/plain",
}
EVIL = {"Origin": "http://evil.example"}
EXTRA_HEADERS = {  # (the battery's other headers are Content-Type only)
    "rebinding Host": {"Host": "evil.example"},
    "rebinding Host, completions": {"Host": "evil.example:8080"},
    "rebinding Host, models": {"Host": "127.0.0.1.evil.example"},
    "rebinding Host, metrics": {"Host": "evil.example"},
    "cross-origin JSON POST": EVIL,
    "cross-origin text/plain POST": EVIL,
    "null Origin": {"Origin": "null"},
    "cross-site fetch without Origin": {"Sec-Fetch-Site": "cross-site"},
    "preflight from an unlisted origin": {**EVIL, "Access-Control-Request-Method": "POST"},
}
for _name in EXTRA_HEADERS:
    EXPECT[_name] = {"type": "permission_error", "code": "forbidden"}


def test_bad_input_battery(engine, url):
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
    ok_before = engine.snapshot()["requests"]
    with httpx.Client(base_url=url, timeout=30) as c:
        for name, method, path, body, status, param in CASES:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
            r = c.request(
                method,
                path,
                headers={"Content-Type": HEADERS.get(name, "application/json"), **EXTRA_HEADERS.get(name, {})},
                **kw,
            )
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], name
            want = EXPECT.get(name, {})
            assert err["type"] == want.get("type", "invalid_request_error"), name
            if param is not None:
                assert err["param"] == param, (name, err)
            if name.startswith(("prompt longer", "long chat")):
                assert err["code"] == "context_length_exceeded", (name, err)
            if "code" in want:
                assert err["code"] == want["code"], (name, err)
            assert want.get("says", "") in err["message"], (name, err)
            assert not want.get("not") or want["not"] not in err["message"], (name, err)
            assert c.get("/health").status_code == 200, name  # healthy after each
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


def _Info():
    return EngineInfo("dflash2", "fake", "fake-drafter", 4, "flag")


class SlowEngine:
    """The Engine interface with scripted events: a long 'prefill' between Started and text."""

    state, error, info, context_length, queue_depth = "ready", None, _Info(), 1024, 0

    def __init__(self, prefill_s: float):
        self.prefill_s = prefill_s

    def submit(self, req, loop=None):
        h = Handle(req, loop)

        def script():
            h._put(Started(req.id, 3, self.info))
            if h.cancelled.wait(self.prefill_s):
                return
            h._put(Delta(req.id, "hi", (1, 2), 0, 0, StatsSnapshot()))
            h._put(Done(req.id, "hi", "stop", 3, 2, self.info, StatsSnapshot(), {"draft_n": 0}))

        threading.Thread(target=script, daemon=True).start()
        return h

    def snapshot(self):
        return {
            "requests": 0,
            "cancelled": 0,
            "errors": 0,
            "prompt_tokens": 0,
            "tokens": 0,
            "cycles": 0,
            "drafted": 0,
            "accepted": 0,
            "accepted_by_position": [],
            "queue_depth": 0,
            "state": self.state,
        }


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
        return Session(object(), _Info())

    e = Engine(loader).start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(e)), base_url="http://t") as c:
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "loading" and "Retry-After" in h.headers
            assert h.json()["error"]["code"] == "model_not_ready" and h.json()["error"]["type"] == "server_error"
            r = await c.post(CHAT, json={"messages": MSG})
            assert r.status_code == 503 and r.json()["error"] == h.json()["error"]  # one loading body
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
    with pytest.raises(Exception):  # noqa: B017
        f.wait_ready(10)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(f)), base_url="http://t") as c:
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "failed"
        assert "drafter checkpoint missing" in h.json()["error"]["message"]
        r = await c.post(CHAT, json={"messages": MSG})
        assert r.status_code == 503 and json.loads(r.text)["error"]["type"] == "server_error"
    f.close()


def test_openai_client_sees_the_same_errors(url):
    """The official client gets 400s with the OpenAI error body for the inputs above (NaN and a
    lone surrogate it refuses to send itself: the raw-HTTP cases cover them)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    calls = [
        (lambda: client.chat.completions.create(model="x", messages=[{"role": "user", "content": None}]), None),
        (lambda: client.chat.completions.create(messages=[{"role": "user"}], model=None), "messages[0].content"),
        (lambda: client.chat.completions.create(messages=MSG, model=None, temperature=5), "temperature"),
        (lambda: client.chat.completions.create(messages=MSG, model=None, extra_body={"top_k": -1}), "top_k"),
        (
            lambda: client.chat.completions.create(messages=[{"role": "system", "content": None}, *MSG], model=None),
            "messages[0].content",
        ),
        (lambda: client.completions.create(model=None, prompt=[1, 99999], max_tokens=2), "prompt"),
        (lambda: client.completions.create(model=None, prompt=[1, -2], max_tokens=2), "prompt"),
    ]
    for i, (call, param) in enumerate(calls):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            call()
        err = e.value.body
        assert set(err) >= {"message", "type", "param", "code"}, (i, err)
        if param is not None:
            assert err["param"] == param and err["code"] == "invalid_value", (i, err)
    r = client.chat.completions.create(model=None, messages=MSG, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_docs_describe_the_loading_body():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "server.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `GET /health`"))
    assert "model_not_ready" in row and "server_error" in row and "model_loading" not in doc
