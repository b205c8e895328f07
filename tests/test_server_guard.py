"""Host and Origin checks (server/guard.py): web pages in the user's browser cannot drive a
local server, listed origins get CORS, every route is covered, /health answers a minimal body."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from mlx_spec.errors import BadRequest
from mlx_spec.server import guard
from mlx_spec.server.app import create_app

import httpx
import pytest
import uvicorn
from helpers import save_tiny_pair, tiny_engine_loader
from test_server import running_engine

MSG = [{"role": "user", "content": "hi"}]
CHAT, TEXT, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
GOOD = "http://good.example:3000"
EVIL = "http://evil.example"


@contextlib.contextmanager
def serve_policy(engine, **policy_kw):
    """uvicorn on a free loopback port with a guard that knows that port; yields (url, port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(engine, policy=guard.Policy(bound="127.0.0.1", port=port, **policy_kw))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", port, app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tiny_engine_loader(tmp_path_factory.mktemp("pair"), context=512)) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    with serve_policy(engine, allowed_origins=(GOOD,)) as s:
        yield s


def test_host_names_that_are_loopback_pass_and_others_are_refused():
    p = guard.Policy(bound="127.0.0.1", port=8080)
    for ok in ("127.0.0.1:8080", "localhost:8080", "LOCALHOST", "localhost.", "[::1]:8080", "[::1]", "127.0.0.1", None):
        assert p.host_problem(ok) is None, ok
    for bad in (
        "evil.example",
        "evil.example:8080",
        "localhost:9999",
        "127.0.0.1:80",
        "127.0.0.2.evil.example",
        "localhost.evil.example:8080",
        "[::2]:8080",
        "",
    ):
        assert p.host_problem(bad) is not None, bad
    assert guard.Policy(bound="0.0.0.0", port=8080).host_problem("evil.example") is None  # (not loopback)
    assert guard.Policy(bound="::1").check_host and guard.Policy(bound="localhost").check_host


def test_allowed_origins_are_normalized_and_a_bare_wildcard_needs_a_key():
    assert guard.parse_origins(" http://Localhost:3000/ ,https://app.example,http://localhost:3000") == (
        "http://localhost:3000",
        "https://app.example",
    )
    for bad in ("localhost:3000", "ftp://x", "http://x/path", "http://x:99999", "http://user@x"):
        with pytest.raises(BadRequest, match="--allowed-origins"):
            guard.parse_origins(bad)
    with pytest.raises(BadRequest, match="needs --api-key"):
        guard.parse_origins("*")
    assert guard.parse_origins("*", api_key=True) == ("*",)


def _no_generation(engine, before):
    snap = engine.snapshot()
    assert snap["requests"] == before["requests"] and snap["tokens"] == before["tokens"]


def test_a_rebinding_host_is_refused_on_every_route(engine, server):
    url, port, _ = server
    before = engine.snapshot()
    evil = {"Host": f"evil.example:{port}"}
    with httpx.Client(base_url=url, timeout=30) as c:
        for method, path, body in (
            ("POST", CHAT, {"messages": MSG, "max_tokens": 3}),
            ("POST", TEXT, {"prompt": "a", "max_tokens": 3}),
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
        ):
            r = c.request(method, path, json=body, headers=evil)
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "permission_error" and err["code"] == "forbidden", path
            assert "evil.example" in err["message"] and "DNS rebinding" in err["message"]
        r = c.post(MESSAGES, json={"model": "x", "max_tokens": 3, "messages": MSG}, headers=evil)
        assert r.status_code == 403 and r.json()["type"] == "error"  # Anthropic's error shape
        assert r.json()["error"]["type"] == "permission_error"
        r = c.get("/health", headers=evil)  # minimal: the status word, nothing about the model
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert set(c.get("/health").json()) > {"status", "model"}  # a good Host: the full body
        metrics = c.get("/metrics").text
    _no_generation(engine, before)
    assert re.search(r'requests_refused_total\{reason="host"\} [1-9]', metrics)
    assert re.search(r'http_requests_total\{route="/v1/chat/completions",status="403"\} [1-9]', metrics)


def test_an_unlisted_origin_is_refused_and_a_listed_one_gets_cors(engine, server):
    url, _, _ = server
    before = engine.snapshot()
    with httpx.Client(base_url=url, timeout=30) as c:
        for path in ("/v1/models", "/metrics"):
            assert c.get(path, headers={"Origin": EVIL}).status_code == 403
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 3}, headers={"Origin": EVIL})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert "--allowed-origins" in r.json()["error"]["message"]
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 3}, headers={"Origin": "null"})
        assert r.status_code == 403  # sandboxed frames and file:// pages
        r = c.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403  # a browser's no-cors request (no Origin)
        _no_generation(engine, before)
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 3, "temperature": 0}, headers={"Origin": GOOD})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["access-control-allow-origin"] == GOOD and "Origin" in r.headers["vary"]
        assert "access-control-allow-credentials" not in r.headers
        r = c.get("/v1/models", headers={"Origin": GOOD, "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD


def test_preflight_is_answered_only_for_allowed_origins(engine, server):
    url, _, _ = server
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type, authorization"}
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.options(CHAT, headers={"Origin": GOOD, **ask})
        assert r.status_code == 204
        assert r.headers["access-control-allow-origin"] == GOOD
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "content-type, authorization"
        r = c.options(MESSAGES, headers={"Origin": EVIL, **ask})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        metrics = c.get("/metrics").text
    assert re.search(r'requests_refused_total\{reason="preflight"\} [1-9]', metrics)


def test_the_api_key_works_alone_and_with_the_origin_checks(engine):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(engine, api_key="k3y", policy=guard.Policy(port=port, allowed_origins=(GOOD,)))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer k3y"}).status_code == 200
            assert c.get("/v1/models", headers={"x-api-key": "k3y"}).status_code == 200
            assert c.get("/v1/models", headers={"Authorization": "Bearer k3y", "Origin": EVIL}).status_code == 403
            r = c.get("/v1/models", headers={"Authorization": "Bearer k3y", "Origin": GOOD})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
            assert c.get("/v1/models", headers={"Origin": GOOD}).status_code == 401  # origin is not a key
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _serve(args, env=None, timeout=90):
    """`mlx_spec serve` in the foreground on a free port; returns (process, url)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_spec", "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + timeout
    url, lines = None, []
    while url is None:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "".join(lines)
        lines.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
        assert time.monotonic() < deadline, "".join(lines)
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    return proc, url, lines


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^mlx_spec:{name} (\S+)$", text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def test_a_browser_style_sequence_against_a_default_serve_generates_nothing(tmp_path):
    """What a hostile page can make the user's browser send to `mlx_spec serve` as it starts by
    default: a DNS-rebinding request (its own name as Host), a cross-origin 'simple' POST
    (text/plain: no preflight), a preflight for a JSON POST and the JSON POST itself."""
    t, d = save_tiny_pair(tmp_path)
    proc, url, _ = _serve(["--target", str(t), "--drafter", str(d), "--block-size", "4"])
    try:
        port = url.rsplit(":", 1)[1]
        body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}'
        page = {"Origin": "http://attacker.example", "Sec-Fetch-Site": "cross-site"}
        with httpx.Client(base_url=url, timeout=30) as c:
            seen = [
                c.post(
                    CHAT,
                    content=body,
                    headers={
                        "Host": f"attacker.example:{port}",
                        "Content-Type": "application/json",
                        "Origin": f"http://attacker.example:{port}",
                        "Sec-Fetch-Site": "same-origin",
                    },
                ),
                c.post(CHAT, content=body, headers={**page, "Content-Type": "text/plain"}),
                c.post(MESSAGES, content=body, headers={**page, "Content-Type": "text/plain"}),
                c.options(
                    CHAT,
                    headers={
                        **page,
                        "Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "content-type",
                    },
                ),
                c.post(CHAT, content=body, headers={**page, "Content-Type": "application/json"}),
                c.get("/metrics", headers=page),
                c.get("/v1/models", headers={"Host": f"attacker.example:{port}"}),
            ]
            assert [r.status_code for r in seen] == [403] * len(seen), [r.text for r in seen]
            metrics = c.get("/metrics").text
        assert _metric(metrics, "requests_total") == 0  # the engine took no request
        assert _metric(metrics, "tokens_predicted_total") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_serve_warns_when_open_to_the_network_without_a_key():
    """Bound to a non-loopback address without --api-key, the server says what anyone on the
    network can do (checked on the message `serve` prints; no test binds beyond loopback)."""
    from mlx_spec.commands.serve import open_warning

    text = open_warning("0.0.0.0", guard.Policy(bound="0.0.0.0"), None)
    assert "without --api-key" in text and "run generations" in text and "/metrics" in text
    assert open_warning("0.0.0.0", guard.Policy(bound="0.0.0.0"), "key") is None
    assert open_warning("127.0.0.1", guard.Policy(bound="127.0.0.1"), None) is None


def test_serve_refuses_bad_bounds_and_origins_before_loading(tmp_path, monkeypatch, capsys):
    from mlx_spec.cli import main

    missing = str(tmp_path / "none")  # would fail later, at the target check
    assert main(["serve", "--target", missing, "--allowed-origins", "*"]) != 0
    assert "needs --api-key" in capsys.readouterr().err
    assert main(["serve", "--target", missing, "--stall-timeout", "-1"]) != 0
    assert "--stall-timeout must be a finite number >= 0" in capsys.readouterr().err
    assert main(["serve", "--target", missing, "--prefill-timeout", "nan"]) != 0
    assert "--prefill-timeout must be" in capsys.readouterr().err
    monkeypatch.setenv(guard.ORIGINS_ENV, "nope")
    assert main(["serve", "--target", missing]) != 0
    assert "$MLX_SPEC_ALLOWED_ORIGINS: 'nope' is not an origin" in capsys.readouterr().err
