"""Who may call the server: Host and Origin checks, CORS for listed origins, per-client stream
limits and stalled-reader detection. One pure ASGI middleware in front of every route.

- **Host** (DNS rebinding): bound to a loopback address, a request whose ``Host`` is not a
  loopback name or address (``localhost``, ``127.0.0.1``, ``[::1]``; with the bound port or no
  port) gets 403. Bound to any other address the Host is not checked (use ``--api-key``).
- **Origin** (web pages in the user's browser): a request carrying an ``Origin`` that is not
  listed in ``--allowed-origins``, or a browser's ``Sec-Fetch-Site: cross-site``/``same-site``
  without a listed Origin, gets 403. Listed origins get ``Access-Control-Allow-Origin`` (their
  own origin, never ``*`` with credentials: the server sets no cookies and never sends
  ``Access-Control-Allow-Credentials``), and their preflight ``OPTIONS`` is answered; any
  other preflight gets 403.
- ``/health`` answers a request that fails these checks with its status word only
  (``{"status": "ok"}``, ``"loading"`` or ``"failed"``), with the usual status code: liveness
  probes behind proxies keep working, and nothing about the model leaks.
- **Streams per client**: at most ``max_streams`` generation requests in flight per client
  address; more get 429.
- **Stalled readers**: a response chunk the client has not taken within ``stall_s`` seconds
  (its socket buffers are full: it stopped reading, or reads a byte at a time) ends the
  response: the request sees a disconnect, so its generation is cancelled through the
  engine's handle and its slot freed; counted as ``streams_stalled``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..errors import BadRequest
from . import anthropic, errors

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", anthropic.PREFIX)
HEALTH_ROUTES = ("/health", "/v1/health")
MAX_STREAMS_PER_CLIENT = 16
STALL_S = 30.0
ORIGINS_ENV = "MLX_SPEC_ALLOWED_ORIGINS"
PREFLIGHT_METHODS = "GET, POST, OPTIONS"
PREFLIGHT_MAX_AGE_S = 600


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is the loopback interface."""
    h = host.strip().strip("[]").lower().rstrip(".")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def parse_origins(text: str | None, *, api_key: bool = False, source: str = "--allowed-origins") -> tuple[str, ...]:
    """``'http://localhost:3000, https://app.example'`` -> normalized origins (scheme://host[:port]).
    ``*`` (any origin) is accepted only with an API key: without one any web page could drive
    the server."""
    out: list[str] = []
    for raw in (text or "").split(","):
        item = raw.strip()
        if not item:
            continue
        if item == "*":
            if not api_key:
                raise BadRequest(
                    f"{source} '*' lets every web page the user opens call this server; it needs "
                    "--api-key (or list the origins by name)"
                )
            out.append("*")
            continue
        parts = urlsplit(item)
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
            or parts.username
            or parts.password
        ):
            raise BadRequest(f"{source}: {item!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000)")
        try:
            port = parts.port
        except ValueError:
            raise BadRequest(f"{source}: {item!r} has a bad port") from None
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out.append(f"{parts.scheme}://{host}" + (f":{port}" if port is not None else ""))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class Policy:
    """What the guard allows. ``bound``: the address the server listens on (its Host check is
    on when that is loopback); ``port``: the bound port (None: any)."""

    bound: str = "127.0.0.1"
    port: int | None = None
    allowed_origins: tuple[str, ...] = ()
    max_streams: int = MAX_STREAMS_PER_CLIENT  # 0: no limit
    stall_s: float = STALL_S  # 0: no stall detection

    @property
    def check_host(self) -> bool:
        return is_loopback(self.bound)

    def host_problem(self, host: str | None) -> str | None:
        """Why this Host header is refused (None: it is fine)."""
        if not self.check_host or host is None:
            return None  # (HTTP/1.0 clients send none; every browser does)
        value = host.strip().lower()
        name, port = value, None
        if value.startswith("["):
            end = value.find("]")
            name, rest = value[1:end] if end > 0 else value, value[end + 1 :] if end > 0 else ""
            if rest.startswith(":"):
                port = rest[1:]
        elif value.count(":") == 1:
            name, port = value.split(":")
        if name.rstrip(".") not in LOOPBACK_NAMES or (
            port is not None and self.port is not None and port != str(self.port)
        ):
            return (
                f"Host '{host}' is refused: this server listens on loopback and answers only "
                f"Host localhost, 127.0.0.1 or [::1]{f' (port {self.port})' if self.port else ''} "
                "(a page that re-resolved its own name to this machine sends its own name: DNS rebinding)"
            )
        return None

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.lower().rstrip("/") in self.allowed_origins

    def origin_problem(self, origin: str | None, fetch_site: str | None) -> str | None:
        if origin is not None:
            if self.origin_allowed(origin):
                return None
            return (
                f"Origin '{origin}' is not allowed to call this server (list the origins that may, with "
                f"--allowed-origins or ${ORIGINS_ENV})"
            )
        if fetch_site in ("cross-site", "same-site"):
            return (
                f"a {fetch_site} browser request without an allowed Origin is refused (list the origins "
                f"that may call this server with --allowed-origins or ${ORIGINS_ENV})"
            )
        return None


@dataclass
class Counters:
    """What the guard refused and cut off (read by /metrics)."""

    refused: dict = field(default_factory=lambda: {"host": 0, "origin": 0, "preflight": 0})
    streams_refused: int = 0
    streams_stalled: int = 0
    open_streams: dict = field(default_factory=dict)  # client address -> generation requests in flight


class Guard:
    """Pure ASGI middleware enforcing a ``Policy`` on every HTTP request."""

    def __init__(self, app, policy: Policy, counters: Counters):
        self.app, self.policy, self.counters = app, policy, counters

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        path, method = scope["path"], scope["method"]
        origin = headers.get("origin")
        problem = self.policy.host_problem(headers.get("host"))
        reason = "host"
        if problem is None:
            problem = self.policy.origin_problem(origin, headers.get("sec-fetch-site"))
            reason = "origin"
        preflight = method == "OPTIONS" and origin is not None and "access-control-request-method" in headers
        if problem is not None:
            self.counters.refused["preflight" if preflight else reason] += 1
            if path in HEALTH_ROUTES and not preflight:
                return await self.app(scope, receive, _minimal_health(send))
            return await _json(send, 403, _error(path, 403, problem, "permission_error", "forbidden"))
        if preflight:
            return await self._preflight(send, origin, headers)
        if origin is not None:
            send = _with_cors(send, self._allow_origin(origin))
        if method == "POST" and _generates(path):
            return await self._generation(scope, receive, send, path)
        return await self.app(scope, receive, send)

    def _allow_origin(self, origin: str) -> str:
        return "*" if "*" in self.policy.allowed_origins else origin

    async def _preflight(self, send, origin: str, headers: dict) -> None:
        asked = headers.get("access-control-request-headers", "")
        allow = [
            ("access-control-allow-origin", self._allow_origin(origin)),
            ("vary", "Origin"),
            ("access-control-allow-methods", PREFLIGHT_METHODS),
            ("access-control-max-age", str(PREFLIGHT_MAX_AGE_S)),
        ]
        names = [h.strip() for h in asked.split(",") if h.strip()]
        if names and all(_token(h) for h in names):
            allow.append(("access-control-allow-headers", ", ".join(names)))
        await send(
            {"type": "http.response.start", "status": 204, "headers": [(k.encode(), v.encode()) for k, v in allow]}
        )
        await send({"type": "http.response.body", "body": b""})

    async def _generation(self, scope, receive, send, path: str) -> None:
        client = (scope.get("client") or ("?", 0))[0]
        c, limit = self.counters, self.policy.max_streams
        if limit and c.open_streams.get(client, 0) >= limit:
            c.streams_refused += 1
            msg = (
                f"client {client} already has {limit} generation requests open (the server's "
                "--max-streams-per-client); wait for one to finish"
            )
            return await _json(
                send,
                429,
                _error(path, 429, msg, "rate_limit_error", "too_many_streams"),
                [("retry-after", str(errors.RETRY_AFTER_S))],
            )
        c.open_streams[client] = c.open_streams.get(client, 0) + 1
        stalled = asyncio.Event()
        stall_s = self.policy.stall_s

        async def watched_send(message):
            if stalled.is_set():
                raise _Stalled()
            if not stall_s or message["type"] != "http.response.body" or not message.get("more_body"):
                return await send(message)
            try:
                await asyncio.wait_for(send(message), stall_s)
            except asyncio.TimeoutError:
                stalled.set()
                c.streams_stalled += 1
                raise _Stalled() from None

        async def watched_receive():
            if stalled.is_set():
                return {"type": "http.disconnect"}
            got = asyncio.ensure_future(receive())
            stop = asyncio.ensure_future(stalled.wait())
            try:
                await asyncio.wait({got, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if got.done():
                return got.result()
            got.cancel()
            return {"type": "http.disconnect"}  # the handler cancels its generation on this

        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception:
            if not stalled.is_set():
                raise
            # a stalled reader: the response ends here (uvicorn closes the connection)
        finally:
            left = c.open_streams.get(client, 1) - 1
            if left > 0:
                c.open_streams[client] = left
            else:
                c.open_streams.pop(client, None)


class _Stalled(OSError):
    """The client stopped reading its stream (raised into the response's send)."""


def _headers(scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in scope.get("headers", ()):
        out.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
    return out


def _generates(path: str) -> bool:
    return path in GENERATION_ROUTES


def _token(name: str) -> bool:
    return all(ch.isalnum() or ch in "-_" for ch in name) and len(name) <= 64


def _error(path: str, status: int, message: str, type_: str, code: str) -> dict:
    """The error body in the shape of the API the request was for."""
    if anthropic.is_route(path):
        return anthropic.error_body(status, message)
    return errors.body(message, type_, None, code)


async def _json(send, status: int, content: dict, extra: list | None = None) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra or ()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _minimal_health(send):
    """/health's own status code, with only its status word in the body."""
    start: dict = {}

    async def minimal(message):
        if message["type"] == "http.response.start":
            start.update(message)
            return
        if message["type"] == "http.response.body":
            buf = start.setdefault("_buf", bytearray())
            buf += message.get("body", b"")
            if message.get("more_body"):
                return
            try:
                status = json.loads(bytes(buf)).get("status", "ok")
            except (ValueError, AttributeError):
                status = "ok"
            body = json.dumps({"status": status}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": start.get("status", 200),
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await send(message)

    return minimal


def _with_cors(send, allow_origin: str):
    async def cors(message):
        if message["type"] == "http.response.start":
            message = {
                **message,
                "headers": [
                    *message.get("headers", []),
                    (b"access-control-allow-origin", allow_origin.encode()),
                    (b"vary", b"Origin"),
                ],
            }
        await send(message)

    return cors


def metrics_text(counters: Counters, snap: dict) -> str:
    """Prometheus lines for the bounds: what the guard refused and cut off, the engine's prefill
    budget expiries, and MLX's allocator figures (sampled on the engine thread)."""
    out: list[str] = []

    def metric(name, kind, help_, samples):
        out.append(f"# HELP mlx_spec:{name} {help_}")
        out.append(f"# TYPE mlx_spec:{name} {kind}")
        out.extend(f"mlx_spec:{name}{labels} {value}" for labels, value in samples)

    metric(
        "requests_refused_total",
        "counter",
        "Requests refused by the Host/Origin checks (403), by reason.",
        [(f'{{reason="{k}"}}', v) for k, v in sorted(counters.refused.items())],
    )
    metric(
        "streams_refused_total",
        "counter",
        "Generation requests refused (429): the client had --max-streams-per-client open.",
        [("", counters.streams_refused)],
    )
    metric(
        "streams_stalled_total",
        "counter",
        "Streams cut off because the client stopped reading (their generation cancelled).",
        [("", counters.streams_stalled)],
    )
    metric(
        "streams_open",
        "gauge",
        "Generation requests in flight, all clients.",
        [("", sum(counters.open_streams.values()))],
    )
    metric(
        "prefill_timeouts_total",
        "counter",
        "Requests failed because their prefill ran past --prefill-timeout (their slot freed).",
        [("", snap.get("prefill_timeouts", 0))],
    )
    mem = snap.get("memory") or {}
    for key, help_ in (
        ("active", "Bytes MLX's allocator holds in live arrays."),
        ("cache", "Bytes MLX's allocator keeps in its buffer cache for reuse."),
        ("peak", "Most bytes MLX's allocator held at once since the engine started."),
        ("cache_limit", "The buffer cache's bound (mx.set_cache_limit, from the memory plan)."),
    ):
        if key in mem:
            metric(f"mlx_memory_{key}_bytes", "gauge", help_, [("", mem[key])])
    if "rss" in mem:
        metric("memory_rss_bytes", "gauge", "The server process's resident set size now.", [("", mem["rss"])])
    if "loaded" in mem:
        metric(
            "memory_rss_loaded_bytes",
            "gauge",
            "The process's resident set size once the pair had loaded.",
            [("", mem["loaded"]["rss"])],
        )
    if "reserved" in mem:
        metric(
            "memory_sequences_reserved_bytes",
            "gauge",
            "Bytes the memory plan counts for the sequences in the batch now (what admission reserved).",
            [("", mem["reserved"])],
        )
        metric(
            "memory_sequences_reserved_max_bytes",
            "gauge",
            "The most the memory plan counted for the batch's sequences at once, at an admission, since start "
            "(with the batch's shared K/V: every row as long as the longest).",
            [("", mem["reserved_max"])],
        )
    if "heap_releases" in mem:
        metric(
            "memory_heap_releases_total",
            "counter",
            "Times the engine handed the C heap's free pages back to the OS after requests ended (glibc).",
            [("", mem["heap_releases"])],
        )
        metric(
            "memory_heap_released_bytes_total",
            "counter",
            "RSS those releases took off (malloc keeps freed MLX buffers otherwise).",
            [("", mem["heap_released"])],
        )
    if "bound" in mem:
        terms = {k: v for k, v in mem["bound"].items() if k != "total"}
        metric(
            "memory_bound_bytes",
            "gauge",
            "The resident memory the process may reach: the sum of memory_bound_term_bytes.",
            [("", mem["bound"]["total"])],
        )
        metric(
            "memory_bound_term_bytes",
            "gauge",
            "Terms of memory_bound_bytes: runtime and weights (measured once loaded: RSS outside MLX, "
            "MLX's active bytes), sequences, prefix_cache and mlx_cache (the memory plan's), heap (a "
            "stated allowance).",
            [(f'{{term="{k}"}}', v) for k, v in terms.items()],
        )
    return "\n".join(out) + "\n"
