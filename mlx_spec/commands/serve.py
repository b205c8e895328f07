"""`mlx_spec serve`: an OpenAI-compatible local server (foreground, or ``--detach``).

It listens at once (``/health`` answers 503 while the pair loads) and exits non-zero if the
pair fails to load: a drafter that cannot load never turns into plain decoding; ``--no-draft``
is the only way to serve plain decoding, and then every response says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from ..cli import add_model_args, add_prefix_cache_arg, prefix_cache_bytes
from ..errors import BadRequest, MlxSpecError

DETACH_WAIT_S = 900.0  # how long `serve --detach` waits for the model to load


def add_arguments(p) -> None:
    add_model_args(p)
    add_prefix_cache_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $MLX_SPEC_API_KEY if set)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the running one; more get 503 + Retry-After")
    p.add_argument("--context-length", dest="context", type=int, default=argparse.SUPPRESS,
                   help="alias of --context: max prompt + completion tokens per request, which the "
                        "memory plan must fit (capped at the target's trained context)")
    p.add_argument("--detach", action="store_true",
                   help="run in the background (see `mlx_spec status`, `mlx_spec stop`)")
    p.set_defaults(serve_parser=p)  # --detach rebuilds the child's flags from it


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise BadRequest(f"--port must be in 0..65535 (got {args.port})")
    if args.max_queue < 1:
        raise BadRequest(f"--max-queue must be >= 1 (got {args.max_queue})")
    if getattr(args, "context", None) is not None and args.context < 2:
        raise BadRequest(f"--context must be >= 2 (got {args.context})")
    prefix_cache_bytes(args)
    api_key = args.api_key or os.environ.get("MLX_SPEC_API_KEY") or None
    if args.detach:
        return _detach(args, api_key)
    return _serve(args, api_key)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MlxSpecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _serve(args, api_key: str | None) -> int:
    import uvicorn

    from ..engine import Engine, model_context_length
    from ..generation import engine_info
    from ..pair import open_pair, resolve_block_size
    from ..server.app import create_app

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def loader():
        pair = open_pair(args, log=say)
        block, source = resolve_block_size(pair, args)
        info = engine_info(pair, block, source, adaptive=args.adaptive)
        trained = model_context_length(pair.model)
        wanted = getattr(args, "context", None)
        if wanted and trained and wanted > trained:
            say(f"context limited to the target's trained {trained} tokens (asked {wanted})")
        limits = [x for x in (wanted, trained) if x]
        engine.context_length = min(limits) if limits else None
        return pair, info

    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        say(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use it")
    engine = Engine(loader, max_queue=args.max_queue, prefix_cache=prefix_cache_bytes(args))
    engine.start()
    app = create_app(engine, api_key=api_key)
    config = uvicorn.Config(app, log_config=None, access_log=bool(args.verbose), lifespan="off",
                            timeout_graceful_shutdown=3)
    server = _server_class()(config, on_exit=app.state.cancel_all)
    failure: list[str] = []

    def watch() -> None:
        try:
            engine.wait_ready()
        except MlxSpecError as e:
            failure.append(str(e))
            server.should_exit = True
            return
        say(engine.info.describe())
        say(f"ready: {url}/v1 (context {engine.context_length} tokens, queue {args.max_queue}"
            f"{', API key required' if api_key else ''})")

    say(f"listening on {url} (loading; /health answers 503 until ready)")
    threading.Thread(target=watch, name="serve-watch", daemon=True).start()
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown; make that a clean exit.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close(timeout=2.0)
    if failure:
        raise MlxSpecError(f"not serving: the pair failed to load: {failure[0]}")
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, but a stop signal first ends running generations, so open streams close
        cleanly instead of holding the graceful shutdown until its timeout."""

        def __init__(self, config, on_exit):
            super().__init__(config)
            self._on_exit = on_exit

        def handle_exit(self, sig, frame):
            self._on_exit()
            super().handle_exit(sig, frame)

    return Server


def _flags(args) -> list[str]:
    """The command line for the same settings (every non-default option of this parser, except
    the ones the detached child gets another way)."""
    skip = {"help", "detach", "api_key", "host", "port"}
    out, seen = [], set()
    for action in args.serve_parser._actions:
        dest = action.dest
        if dest in skip or dest in seen or not action.option_strings or not hasattr(args, dest):
            continue
        seen.add(dest)
        value = getattr(args, dest)
        if value is None or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            out.append(flag)
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def _free_port(host: str) -> int:
    with _bind(host, 0) as s:
        return s.getsockname()[1]


def _detach(args, api_key: str | None) -> int:
    import psutil

    from ..server import process

    port = args.port or _free_port(args.host)
    directory = process.state_dir()
    for _, state, _ in process.scan(directory).running:
        if state.port == port:
            raise MlxSpecError(f"a server is already running on port {port} (pid {state.pid}); "
                               f"`mlx_spec stop --port {port}` first")
    cmd = [sys.executable, "-m", "mlx_spec"] + (["--verbose"] if getattr(args, "verbose", False) else [])
    cmd += ["serve", "--host", args.host, "--port", str(port)] + _flags(args)
    env = {k: v for k, v in os.environ.items() if k != "MLX_SPEC_API_KEY"}
    if api_key:  # through the environment: never visible in `ps`
        env["MLX_SPEC_API_KEY"] = api_key
    log_path = directory / f"server-{port}.log"
    child = process.spawn(cmd, log_path, env)
    try:
        create_time = psutil.Process(child.pid).create_time()
    except psutil.NoSuchProcess:
        create_time = 0.0
    state = process.ServerState(child.pid, create_time, args.host, port, args.target,
                                None if args.no_draft else args.drafter, str(log_path), time.time(),
                                auth=api_key is not None)
    path = process.write_state(state, directory)
    print(f"started server pid {child.pid} on {state.url}; loading (log: {log_path})", file=sys.stderr)
    deadline = time.monotonic() + DETACH_WAIT_S
    while True:
        code = child.poll()
        if code is not None:
            path.unlink(missing_ok=True)
            raise MlxSpecError(f"the server exited (code {code}) before it was ready; last lines of "
                               f"{log_path}:\n{process.tail(log_path)}")
        status, body = process.health(state.url, timeout=1.0)
        if status == 200:
            spec = body.get("speculation") or {}
            what = (f"{spec.get('method')} block {spec.get('block_size')}" if spec.get("enabled")
                    else "plain decoding (--no-draft)")
            print(f"ready: {state.url}/v1 (pid {child.pid}, {what}); stop with `mlx_spec stop`")
            return 0
        if time.monotonic() > deadline:
            print(f"server pid {child.pid} is still loading after {DETACH_WAIT_S:.0f} s; "
                  "`mlx_spec status` shows it")
            return 0
        time.sleep(0.2)
