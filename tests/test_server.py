"""`mlx_spec serve` over real HTTP on loopback: the official openai client, greedy equality with
generation.run, SSE framing, stop sequences, metrics, disconnect -> cancel, API key."""

import contextlib
import json
import socket
import threading
import time

from mlx_spec.engine import Engine
from mlx_spec.generation import GenConfig, engine_info, run
from mlx_spec.loading import load_pair
from mlx_spec.server.app import create_app
from mlx_spec.session import Session
from mlx_spec.text import encode_prompt

import httpx
import openai
import pytest
import uvicorn
from helpers import save_tiny_pair

LONG_CHAT = [{"role": "user", "content": "hello"}]  # the tiny pair never emits EOS here (300+ tokens)


@contextlib.contextmanager
def serve_in_thread(app):
    """uvicorn on a free loopback port in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def running_engine(loader, **kw):
    """A started, ready Engine over ``loader`` (queue of 4), closed on exit."""
    e = Engine(loader, max_queue=4, **kw).start()
    e.wait_ready(60)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def engine(pair_dirs):
    t, d = pair_dirs

    def loader():
        pair = load_pair(str(t), str(d))
        return Session.of(pair, engine_info(pair, 4, "flag"))

    with running_engine(loader, prefix_cache=16 << 20) as e:  # as `serve` runs by default
        yield e


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(create_app(engine, keepalive_s=0.5)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(engine):
    return engine.info.target


def reference(engine, max_tokens, *, messages=None, prompt=None, stop=()):
    """generation.run on the engine thread, for the same prompt (greedy)."""

    def fn(pair):
        ids = encode_prompt(pair.tokenizer, prompt, messages)
        return run(pair, engine.info, ids, GenConfig(max_tokens=max_tokens, stop=tuple(stop)))

    return engine.call(fn).result(60)


def test_a_conversation_reuses_its_prefix_and_output_is_unchanged(engine, client, model, url):
    turn1 = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "name a colour"}]
    r1 = client.chat.completions.create(model=model, messages=turn1, max_tokens=16, temperature=0)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "and another"},
    ]
    r2 = client.chat.completions.create(model=model, messages=turn2, max_tokens=16, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens  # at least turn 1's whole prompt was not prefilled again
    assert r2.model_extra["timings"]["cache_n"] == cached
    assert r2.choices[0].message.content == reference(engine, 16, messages=turn2).text
    assert _metrics(url)["mlx_spec:prompt_tokens_cached_total"] >= cached


def test_chat_non_stream_equals_generation_run(engine, client, model):
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    ref = reference(engine, 24, messages=messages)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.model_extra
    t = extra["timings"]
    assert {
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "draft_n",
        "draft_n_accepted",
        "draft_rounds",
        "block_size",
    } <= set(t)
    assert t["predicted_n"] == r.usage.completion_tokens
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    assert t["cache_n"] == r.usage.prompt_tokens_details.cached_tokens
    assert t["draft_n"] > 0 and t["block_size"] == 4
    spec = extra["speculation"]
    assert spec["enabled"] and spec["method"] == "dflash2" and spec["block_size_source"] == "flag"
    assert "draft_vocab" in spec and spec["draft_vocab"] is None  # the tiny drafter ships no vocabulary
    # the basename of a path-valued model id is accepted too; A/B plain decoding says so
    plain = client.chat.completions.create(
        model="target", messages=messages, max_tokens=24, temperature=0, extra_body={"speculate": False}
    )
    assert plain.choices[0].message.content == ref.text
    assert plain.model_extra["speculation"]["enabled"] is False and plain.model_extra["timings"]["draft_n"] == 0


def test_chat_stream_with_usage_chunk(engine, client, model, url):
    messages = [{"role": "user", "content": "abc"}]
    ref = reference(engine, 30, messages=messages)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == ref.finish_reason
    assert finals[0].model_extra["timings"]["predicted_n"] == len(ref.tokens)
    assert finals[0].model_extra["speculation"]["method"] == "dflash2"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.tokens)
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # raw framing: data lines, then [DONE]; without include_usage no usage chunk
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 5, "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(ln[6:]) for ln in lines[:-1] if ln.startswith("data: ")]
    assert all(p["choices"] for p in payloads) and "usage" not in payloads[-1]


def test_stop_sequences(engine, client, model):
    messages = LONG_CHAT
    full = reference(engine, 20, messages=messages).text
    stop = full[5:7]
    expect = full[: full.index(stop)]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0, stop=[stop, "never-there"]
    )
    assert r.choices[0].message.content == expect and r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0, stop=stop, stream=True
    )
    parts = list(s)
    assert "".join(c.choices[0].delta.content or "" for c in parts) == expect
    assert parts[-1].choices[0].finish_reason == "stop"


def test_completions_endpoint(engine, client, model):
    ref = reference(engine, 16, prompt="x")
    r = client.completions.create(model=model, prompt="x", max_tokens=16, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.model_extra["timings"]["predicted_n"] == 16
    chunks = list(
        client.completions.create(
            model=model, prompt="x", max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == 16
    # token ids as the prompt; sampling with a seed is reproducible
    ids = engine.call(lambda pair: encode_prompt(pair.tokenizer, "x")).result()
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == ref.text
    a, b = (
        client.completions.create(model=model, prompt="x", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text


def test_models_health_and_tools(engine, client, model, url):
    models = client.models.list()
    card = models.data[0]
    assert card.id == model and card.model_extra["context_length"] == 4096
    spec = card.model_extra["speculation"]
    assert spec == {
        "enabled": True,
        "method": "dflash2",
        "target": model,
        "drafter": engine.info.drafter,
        "block_size": 4,
        "block_size_source": "flag",
        "draft_vocab": None,
        "policy": "fixed",
        "sources": ["dflash"],
        "chains": {},
        "chain_depths": {},
        "group": {"size": 1, "rank": 0, "backend": "none", "sharded": False},
    }
    h = httpx.get(f"{url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["speculation"] == spec
    assert h.json()["group"] == spec["group"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        tools=tools,
        max_tokens=3,
        temperature=0,
    )
    assert r.usage.completion_tokens <= 3


def _metrics(url) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_disconnect_cancels_generation(engine, url):
    before = engine.snapshot()["cancelled"]
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"messages": LONG_CHAT, "max_tokens": 3000, "temperature": 0, "stream": True},
        timeout=30,
    ) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # got some text: hang up mid-generation
    deadline = time.monotonic() + 15
    while engine.snapshot()["cancelled"] == before:
        assert time.monotonic() < deadline, "generation was not cancelled after the client left"
        time.sleep(0.05)
    # non-stream: a client that times out also cancels its generation
    before = engine.snapshot()["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": LONG_CHAT, "max_tokens": 3000, "temperature": 0},
            timeout=1.0,
        )
    deadline = time.monotonic() + 15
    while engine.snapshot()["cancelled"] == before:
        assert time.monotonic() < deadline, "non-stream generation was not cancelled"
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").status_code == 200


def test_load_many_clients(engine, url):
    """8 clients x 10 requests against a queue of 4: each completes or gets a clean 503, and the
    counters add up to what the clients saw."""
    m0, s0 = _metrics(url), engine.snapshot()
    results, lock = [], threading.Lock()

    def worker(k):
        with httpx.Client(base_url=url, timeout=60) as c:
            for i in range(10):
                stream = (k + i) % 3 == 0
                body = {
                    "messages": [{"role": "user", "content": f"q{k}-{i}"}],
                    "max_tokens": 4,
                    "temperature": 0,
                    "stream": stream,
                    "stream_options": {"include_usage": True},
                }
                if stream:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        status, text = r.status_code, r.read().decode()
                    if status == 200:
                        assert text.rstrip().endswith("data: [DONE]")
                        usage = json.loads(text.strip().split("\n\n")[-2][6:])
                        rec = ("ok", usage["usage"]["completion_tokens"], usage["timings"])
                    else:
                        rec = (status, r.headers.get("retry-after"), json.loads(text))
                else:
                    r = c.post("/v1/chat/completions", json=body)
                    if r.status_code == 200:
                        j = r.json()
                        rec = ("ok", j["usage"]["completion_tokens"], j["timings"])
                    else:
                        rec = (r.status_code, r.headers.get("retry-after"), r.json())
                with lock:
                    results.append(rec)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 80
    ok = [r for r in results if r[0] == "ok"]
    busy = [r for r in results if r[0] != "ok"]
    for status, retry, body in busy:
        assert status == 503 and retry is not None and body["error"]["code"] == "server_busy"
    assert ok, "no request completed"
    print(f"load: {len(ok)} completed, {len(busy)} answered 503")
    m1, s1 = _metrics(url), engine.snapshot()
    assert s1["requests"] - s0["requests"] == len(ok)
    assert s1["tokens"] - s0["tokens"] == sum(r[1] for r in ok)
    assert s1["drafted"] - s0["drafted"] == sum(r[2]["draft_n"] for r in ok)
    assert s1["accepted"] - s0["accepted"] == sum(r[2]["draft_n_accepted"] for r in ok)
    assert s1["cycles"] - s0["cycles"] == sum(r[2]["draft_rounds"] for r in ok)
    assert m1["mlx_spec:requests_rejected_total"] - m0["mlx_spec:requests_rejected_total"] == len(busy)
    assert m1["mlx_spec:tokens_predicted_total"] - m0["mlx_spec:tokens_predicted_total"] == sum(r[1] for r in ok)
    assert m1["mlx_spec:spec_decode_num_draft_tokens_total"] == s1["drafted"]
    key = 'mlx_spec:http_requests_total{route="/v1/chat/completions",status="200"}'
    assert m1[key] - m0.get(key, 0) == len(ok)
    assert m1["mlx_spec:queue_depth"] == 0 and m1["mlx_spec:engine_ready"] == 1
    per_pos = sum(v for k, v in m1.items() if k.startswith("mlx_spec:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == m1["mlx_spec:spec_decode_num_accepted_tokens_total"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_api_key(engine):
    with serve_in_thread(create_app(engine, api_key="s3cret")) as u:
        assert httpx.get(f"{u}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(f"{u}{path}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{u}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        c = openai.OpenAI(base_url=f"{u}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model=engine.info.target, messages=LONG_CHAT, max_tokens=2)
        c = openai.OpenAI(base_url=f"{u}/v1", api_key="s3cret", max_retries=0)
        r = c.chat.completions.create(model=engine.info.target, messages=LONG_CHAT, max_tokens=2)
        assert r.usage.completion_tokens == 2


def test_a_batched_server_says_which_drafter_pass_it_runs_in_health_and_metrics(pair_dirs):
    """The batch's drafter path (one pass for all, or per sequence and why) is in /health and
    /metrics, not only in the log."""
    t, d = pair_dirs

    def loader():
        pair = load_pair(str(t), str(d))
        return Session.of(pair, engine_info(pair, 4, "flag"))

    with running_engine(loader, max_batch=2) as e, serve_in_thread(create_app(e, keepalive_s=0.5)) as u:
        assert e.batch_drafter == "one pass for all"
        health = httpx.get(f"{u}/health", timeout=30).json()
        assert health["batch_drafter"] == "one pass for all"
        text = httpx.get(f"{u}/metrics", timeout=30).text
        assert 'mlx_spec:batch_drafter_packed{path="one pass for all"} 1' in text
