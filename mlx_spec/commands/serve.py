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
from dataclasses import replace

import psutil
import uvicorn

from .. import distributed
from ..cli import (
    DEFAULT_PREFIX_CACHE_MB,
    LAUNCH_DESTS,
    add_launch_args,
    add_model_args,
    add_prefix_cache_arg,
    add_prefix_disk_args,
    flags_of,
    launch_of,
    load_config,
    prefix_disk_of,
    think_kwargs,
)
from ..engine import Engine
from ..errors import BadRequest, MlxSpecError
from ..server import guard, process
from ..server.app import create_app
from ..server.schemas import ModelNames, RequestDefaults
from ..session import check, open_session, run_follower, serve_sizing

DETACH_WAIT_S = 900.0  # how long `serve --detach` waits for the model to load


SIZED_HELP = {  # serve sizes these from the memory plan when they are not given (session.serve_sizing): default None
    "context": "max prompt + completion tokens per request (default: the target's trained context, "
    "capped by the memory plan so that one whole context of K/V still fits in the prefix cache)",
    "prefix_cache_mb": "K/V kept between requests so a shared prefix (an agent's system prompt and "
    "tools) is not prefilled again, counted in the memory plan, in MiB; 0 = off (default: "
    "two whole contexts of K/V when half the plan's headroom holds them, else less)",
}


def add_arguments(p) -> None:
    add_model_args(p, sized_context=SIZED_HELP["context"])
    add_prefix_cache_arg(p, None, SIZED_HELP["prefix_cache_mb"])
    p.add_argument(
        "--served-model-name",
        dest="served_model_names",
        action="append",
        default=None,
        metavar="NAME",
        help="another name the pair answers to, listed by /v1/models (repeatable, or a comma list); "
        "any name reaches the pair anyway unless --strict-model-name",
    )
    p.add_argument(
        "--strict-model-name",
        action="store_true",
        help="refuse (404) a request naming a model other than the target's id, its folder name "
        "and the --served-model-name aliases (default: any name reaches the loaded pair)",
    )
    add_prefix_disk_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $MLX_SPEC_API_KEY if set)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait behind the running ones; more get 503 + Retry-After",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        metavar="N",
        help="requests decoded together (continuous batching with batched speculation); "
        "1 = one at a time (default: as many as the memory plan's K/V per sequence "
        "allows, at most 8)",
    )
    p.add_argument(
        "--context-length",
        dest="context",
        type=int,
        default=argparse.SUPPRESS,
        help="alias of --context: max prompt + completion tokens per request, which the "
        "memory plan must fit (capped at the target's trained context)",
    )
    p.add_argument(
        "--detach",
        action="store_true",
        help="run in the background (see `mlx_spec status`, `mlx_spec stop`); with --ranks/--hosts/"
        "--hostfile, the whole group (`mlx_spec stop` stops every rank)",
    )
    add_launch_args(p, "rank 0 serves, the others follow it")
    b = p.add_argument_group("who may call the server, and bounds on each client (docs/security.md)")
    b.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="comma-separated web origins (scheme://host[:port]) whose pages may call the server, "
        "with CORS headers for those only; any other browser Origin gets 403 (default: "
        "$MLX_SPEC_ALLOWED_ORIGINS, else none; '*' only with --api-key)",
    )
    b.add_argument(
        "--max-streams-per-client",
        type=int,
        default=16,
        metavar="N",
        help="generation requests one client address may have open at once; more get 429 (0: no limit)",
    )
    b.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a stream may wait for a client that stopped reading before it is cut off and "
        "its generation cancelled (0: never)",
    )
    b.add_argument(
        "--prefill-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds one request's prefill may take before it fails and frees its slot, checked between "
        "prefill chunks (0: no limit)",
    )
    g = p.add_argument_group("defaults for requests that omit a field (as mlx_lm.server and llama-server)")
    g.add_argument(
        "--temp",
        "--temperature",
        dest="default_temperature",
        type=float,
        default=None,
        metavar="T",
        help="sampling temperature (default: 1, the APIs' own default)",
    )
    g.add_argument(
        "--top-p", dest="default_top_p", type=float, default=None, metavar="P", help="nucleus sampling (default: 1)"
    )
    g.add_argument(
        "--top-k", dest="default_top_k", type=int, default=None, metavar="K", help="top-k sampling (default: 0 = off)"
    )
    g.add_argument(
        "--max-tokens",
        dest="default_max_tokens",
        type=int,
        default=None,
        metavar="N",
        help="completion tokens for an OpenAI request without max_tokens (default: up to the "
        "context); Anthropic requests always carry their own",
    )
    p.set_defaults(serve_parser=p)  # --detach rebuilds the child's flags from it


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise BadRequest(f"--port must be in 0..65535 (got {args.port})")
    if args.max_queue < 1:
        raise BadRequest(f"--max-queue must be >= 1 (got {args.max_queue})")
    if args.max_batch is not None and args.max_batch < 1:
        raise BadRequest(f"--max-batch must be >= 1 (got {args.max_batch})")
    request_defaults(args)  # bad --temp/--top-p/--top-k/--max-tokens are refused before loading
    model_names(args)
    check_bounds(args)
    # a bad --allowed-origins is refused before loading
    guard_policy(args, args.host, args.port, args.api_key or os.environ.get("MLX_SPEC_API_KEY") or None)

    launch = launch_of(args)  # --ranks/--hosts/--hostfile: mlx_spec runs mlx.launch itself
    cfg = load_config(args)
    if getattr(args, "prefix_cache_mb", None) is None:  # without a plan to size it from
        cfg = replace(cfg, prefix_cache=int(DEFAULT_PREFIX_CACHE_MB * 2**20))
    drafter = check(cfg)  # a missing target or drafter is refused before listening (or detaching)
    api_key = args.api_key or os.environ.get("MLX_SPEC_API_KEY") or None

    if distributed.launched():  # under mlx.launch: rank 0 serves, the others follow it
        if args.detach:
            raise BadRequest(
                "--detach cannot run under mlx.launch (it would detach one rank from its group): "
                "run `mlx_spec serve --detach` with --ranks N, --hosts or --hostfile instead; it "
                "starts mlx.launch in the background, and `mlx_spec stop` stops every rank"
            )
        if distributed.follower_process():
            return run_follower(sized(args, cfg), lambda m: print(m, file=sys.stderr, flush=True))
    if args.detach:
        return _detach(args, api_key, drafter, launch)
    if launch is not None:
        return _launch(args, api_key, launch)
    return _serve(args, sized(args, cfg), api_key)


def sized(args, cfg):
    """The config with the context and prefix cache the memory plan chose for those not given
    (--context, --prefix-cache-mb); says what it chose and why."""
    cfg, why = serve_sizing(
        cfg, context=getattr(args, "context", None) is None, prefix_cache=getattr(args, "prefix_cache_mb", None) is None
    )
    if why:
        print(f"serving at {why}", file=sys.stderr, flush=True)
    return cfg


def model_names(args):
    """``schemas.ModelNames`` from --served-model-name (repeatable, comma lists) and --strict-model-name."""
    aliases = [n.strip() for v in getattr(args, "served_model_names", None) or () for n in v.split(",")]
    if any(not n for n in aliases):
        raise BadRequest(f"--served-model-name needs non-empty names (got {args.served_model_names})")
    return ModelNames(tuple(dict.fromkeys(aliases)), bool(getattr(args, "strict_model_name", False)))


def request_defaults(args):
    """``schemas.RequestDefaults`` from --temp/--top-p/--top-k/--max-tokens/--think (checked)."""
    t, p, k, n = (getattr(args, f"default_{x}", None) for x in ("temperature", "top_p", "top_k", "max_tokens"))
    if t is not None and not 0 <= t <= 2:
        raise BadRequest(f"--temp must be in [0, 2] (got {t:g})")
    if p is not None and not 0 < p <= 1:
        raise BadRequest(f"--top-p must be in (0, 1] (got {p:g})")
    if k is not None and k < 0:
        raise BadRequest(f"--top-k must be >= 0 (got {k})")
    if n is not None and n < 1:
        raise BadRequest(f"--max-tokens must be >= 1 (got {n})")
    return RequestDefaults(t, p, k, n, think_kwargs(args))


def check_bounds(args) -> None:
    """Bad --max-streams-per-client/--stall-timeout/--prefill-timeout are refused before loading."""
    for flag, v in (
        ("--max-streams-per-client", args.max_streams_per_client),
        ("--stall-timeout", args.stall_timeout),
        ("--prefill-timeout", args.prefill_timeout),
    ):
        if not v >= 0 or v == float("inf"):
            raise BadRequest(f"{flag} must be a finite number >= 0 (got {v})")


def guard_policy(args, host: str, port: int, api_key: str | None):
    """The server's ``guard.Policy`` from the flags (and $MLX_SPEC_ALLOWED_ORIGINS)."""
    if args.allowed_origins is not None:
        origins = guard.parse_origins(args.allowed_origins, api_key=api_key is not None)
    else:
        origins = guard.parse_origins(
            os.environ.get(guard.ORIGINS_ENV), api_key=api_key is not None, source=f"${guard.ORIGINS_ENV}"
        )
    return guard.Policy(
        bound=host,
        port=port,
        allowed_origins=origins,
        max_streams=args.max_streams_per_client,
        stall_s=args.stall_timeout,
    )


def open_warning(host: str, policy, api_key: str | None) -> str | None:
    """What `serve` says when it listens beyond loopback without an API key."""
    if api_key is not None or policy.check_host:
        return None
    return (
        f"warning: listening on {host} without --api-key: anyone who can reach this address can run "
        "generations, read /v1/models and /metrics, and fill the prefix cache (browsers are still held "
        "to --allowed-origins); set --api-key or put it behind a proxy (docs/security.md)"
    )


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


def _serve(args, cfg, api_key: str | None) -> int:
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def loader():  # on the engine thread: /health answers 503 meanwhile
        return open_session(cfg, log=say, group_aware=True)

    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    policy = guard_policy(args, host, port, api_key)
    if (warning := open_warning(args.host, policy, api_key)) is not None:
        say(warning)
    engine = Engine(
        loader,
        max_queue=args.max_queue,
        prefix_cache=cfg.prefix_cache,
        max_batch=args.max_batch,
        prefix_disk=prefix_disk_of(args),
        prefill_timeout=args.prefill_timeout,
    )
    engine.start()
    names = model_names(args)
    app = create_app(engine, api_key=api_key, defaults=request_defaults(args), names=names, policy=policy)
    config = uvicorn.Config(
        app, log_config=None, access_log=bool(args.verbose), lifespan="off", timeout_graceful_shutdown=3
    )
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
        if engine.rss_bound is not None:  # what /metrics compares the process's RSS with
            say(engine.rss_bound.describe())
        say(
            f"ready: {url}/v1 (context {engine.context_length} tokens, batch {engine.max_batch}, queue {args.max_queue}"
            f"{', API key required' if api_key else ''})"
        )
        shown = ", ".join(names.listed(engine.info.target))
        say(
            f"model names: {shown}"
            + (" only (--strict-model-name)" if names.strict else "; requests naming any other model reach it too")
        )

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
    the ones the detached child or the group's ranks get another way)."""
    return flags_of(args, args.serve_parser, {"detach", "api_key", "host", "port", *LAUNCH_DESTS})


def _child(args, port: int, api_key: str | None, launch=None) -> tuple[list[str], dict]:
    """The serving process's command line and environment (with ``launch``: mlx.launch running
    it on every rank; the API key travels in the environment, never on a command line that
    ``ps`` shows: rank 0, the one that serves, always runs here as mlx.launch's child and
    inherits it, and the other ranks only follow rank 0)."""
    cmd = [sys.executable, "-m", "mlx_spec"] + (["--verbose"] if getattr(args, "verbose", False) else [])
    cmd += ["serve", "--host", args.host, "--port", str(port)] + _flags(args)
    env = {k: v for k, v in os.environ.items() if k != "MLX_SPEC_API_KEY"}
    if api_key:
        env["MLX_SPEC_API_KEY"] = api_key
    if launch is not None:
        cmd = launch.command(cmd)
    return cmd, env


def _launch(args, api_key: str | None, launch) -> int:
    """``serve --ranks/--hosts/--hostfile`` in the foreground: mlx.launch runs the group (in
    its own session, so Ctrl-C reaches this process only) until Ctrl-C, SIGTERM or SIGHUP,
    which stop it as `mlx_spec stop` does: rank 0 first (it shuts the group down), then the rest."""
    cmd, env = _child(args, args.port, api_key, launch)
    print(f"starting {launch.describe()}: {launch.shown(cmd)}", file=sys.stderr, flush=True)
    asked: list[int] = []  # handlers first: a signal right after the spawn still stops the group
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal or ssh link closed
    previous = {s: signal.signal(s, lambda n, _f: asked.append(n)) for s in stops}
    try:
        child = process.spawn(cmd, None, env, quiet_stdin=True)  # output to this terminal
        while child.poll() is None and not asked:
            time.sleep(0.2)
        if asked:
            try:
                print("stopping the group (rank 0 first)", file=sys.stderr, flush=True)
            except OSError:  # SIGHUP: the terminal is gone
                pass
            process.stop_launched(child, timeout=10.0)
        return child.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _free_port(host: str) -> int:
    with _bind(host, 0) as s:
        return s.getsockname()[1]


def _detach(args, api_key: str | None, drafter: str | None, launch=None) -> int:
    """``drafter``: the one the child will load (the bundled one filled in), as status shows it.
    ``launch``: a group: mlx.launch runs in the background, the state file holds its pid and
    every rank it started on this machine (``mlx_spec stop`` stops them all)."""
    port = args.port or _free_port(args.host)
    directory = process.state_dir()
    for _, state, _ in process.scan(directory).running:
        if state.port == port:
            raise MlxSpecError(
                f"a server is already running on port {port} (pid {state.pid}); `mlx_spec stop --port {port}` first"
            )
    cmd, env = _child(args, port, api_key, launch)
    log_path = directory / f"server-{port}.log"
    child = process.spawn(cmd, log_path, env, quiet_stdin=launch is not None)
    try:
        me = psutil.Process(child.pid)
        create_time = me.create_time()
    except psutil.NoSuchProcess:
        me, create_time = None, 0.0
    group = None
    if launch is not None:
        group = {**launch.as_dict(), "size": launch.ranks, "launcher_pid": child.pid, "ranks": []}
        local = launch.local_ranks
    state = process.ServerState(
        child.pid,
        create_time,
        args.host,
        port,
        args.target,
        drafter,
        str(log_path),
        time.time(),
        auth=api_key is not None,
        group=group,
    )
    path = process.write_state(state, directory)
    what = f"group of {launch.describe()} under mlx.launch pid" if launch else "server pid"
    print(f"started {what} {child.pid} on {state.url}; loading (log: {log_path})", file=sys.stderr)
    deadline = time.monotonic() + DETACH_WAIT_S
    while True:
        code = child.poll()
        if code is not None:
            path.unlink(missing_ok=True)
            raise MlxSpecError(
                f"the server exited (code {code}) before it was ready; last lines of "
                f"{log_path}:\n{process.tail(log_path)}"
            )
        if group is not None and me is not None and len(group["ranks"]) < local:
            ranks = process.group_ranks(me)  # the ranks appear as mlx.launch starts them
            if len(ranks) > len(group["ranks"]):
                group["ranks"] = ranks
                state = replace(state, group=dict(group))
                process.write_state(state, directory)
        status, body = process.health(state.url, timeout=1.0)
        if status == 200:
            spec = body.get("speculation") or {}
            what = (
                f"{spec.get('method')} block {spec.get('block_size')}"
                if spec.get("enabled")
                else "plain decoding (--no-draft)"
            )
            if launch is not None:
                pids = ", ".join(f"rank {r['rank']} pid {r['pid']}" for r in group["ranks"])
                what += f"; {launch.describe()}: {pids or 'no rank on this machine'}"
            print(f"ready: {state.url}/v1 (pid {child.pid}, {what}); stop with `mlx_spec stop`")
            return 0
        if time.monotonic() > deadline:
            print(f"server pid {child.pid} is still loading after {DETACH_WAIT_S:.0f} s; `mlx_spec status` shows it")
            return 0
        time.sleep(0.2)
