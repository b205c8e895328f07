"""Speculative decoding with the target sharded over MLX's distributed runtime (session layer).

Launched by ``mlx.launch`` (``ring`` over TCP, or ``jaccl`` over RDMA), every process loads the
same pair: the target is split tensor-parallel with mlx-lm's own ``Model.shard(group)`` (each
decoder layer ends in an all-reduce, so the layer outputs the drafter taps are full width and the
same on every rank), while the drafter, the embedding and the output head stay replicated. Every
rank then runs the same decode loop: the same drafts, the same verify pass (its all-reduces are
the only cross-rank traffic), the same acceptance decision and the same rollback (hybrid targets
roll back the GDN state of their own heads).

Rank 0 alone talks to the user (HTTP, terminal). The other ranks *follow*: rank 0 sends each
request (prompt ids, sampling parameters, seed, max tokens, block size), then one "go on / stop"
flag after every step (so a cancellation or a stop string ends every rank at the same step), and
heartbeats while idle, all as small int/float arrays through ``mx.distributed.all_sum`` on the
group (rank 0 contributes the values, the others zeros). No sockets of our own.

Failure: a peer that exits makes the next collective raise on the others; a peer that hangs
would block a collective forever, so both sides run a watchdog thread. A follower that hears
nothing from rank 0 for ``timeout`` seconds exits; rank 0 marks the group unhealthy, fails the
running request with ``GroupFailed`` and refuses new ones, while its server stays up to say so.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx._distributed_utils.common import Hostfile

from .errors import BadRequest, MlxSpecError, UnsupportedModel
from .generation import SINGLE, GenConfig, GroupInfo, for_request, token_steps
from .policy import PLAIN as PLAIN_SOURCE  # policy's "plain" source (PLAIN here: the wire code)
from .policy import Decision
from .sampling import SamplingConfig

log = logging.getLogger(__name__)

# Environment variables mlx.launch sets on every process it starts (ring: MLX_HOSTFILE, jaccl:
# MLX_IBV_DEVICES / MLX_JACCL_COORDINATOR). A process without MLX_RANK is never put in a group.
LAUNCH_ENV = ("MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR")
TIMEOUT_ENV = "MLX_SPEC_GROUP_TIMEOUT"
CHECK_ENV = "MLX_SPEC_GROUP_CHECK"
DEFAULT_TIMEOUT_S = 120.0  # a step (a prefill chunk of a large target included) must finish in this
HEARTBEAT_S = 2.0  # rank 0 -> followers while idle

# Header: [command, n_ids, max_tokens, seed, top_k, block_size, method, adaptive_max,
#          policy sources (bit 1 dflash, bit 2 lookup, bit 3 mtp, bit 4 eagle; 0: no policy), policy max_lookup]
GEN, HEARTBEAT, SHUTDOWN = 1, 2, 3
PLAIN, SPEC = 0, 1
HEADER = 10
SOURCE_CODES = ("plain", "dflash", "lookup", "mtp", "eagle")  # policy.PLAIN / DFLASH / LOOKUP / MTP / EAGLE


class GroupFailed(MlxSpecError):
    """A rank of the distributed group died, hung or disagreed."""


def launched(environ=os.environ) -> bool:
    """True when this process was started by ``mlx.launch`` (so it belongs to a group)."""
    return "MLX_RANK" in environ and any(environ.get(k) for k in LAUNCH_ENV)


def follower_process(environ=os.environ) -> bool:
    """Started by mlx.launch as a rank other than 0 (known before joining the group)."""
    return launched(environ) and environ.get("MLX_RANK", "0") != "0"


def backend_name(environ=os.environ) -> str:
    if environ.get("MLX_HOSTFILE"):
        return "ring"
    if environ.get("MLX_IBV_DEVICES") or environ.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    return "any"


def init_group(backend: str | None = None, environ=os.environ):
    """The MLX group of this process, or None when it was not started by ``mlx.launch``.
    Single-process runs never call ``mx.distributed.init``."""
    if not launched(environ):
        return None
    backend = backend or backend_name(environ)
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as e:  # no backend compiled in, peers unreachable: say which
        raise GroupFailed(
            f"could not join the {backend} group (rank {environ.get('MLX_RANK')}, "
            f"hostfile {environ.get('MLX_HOSTFILE')}): {e}"
        ) from None
    if group.size() < 2:
        raise GroupFailed(
            f"mlx.launch started a {backend} group of size {group.size()}; a sharded target needs at least 2 processes"
        )
    return group


def group_info(group, sharded: bool = True, backend: str | None = None) -> GroupInfo:
    if group is None:
        return SINGLE
    return GroupInfo(group.size(), group.rank(), backend or backend_name(), sharded)


def timeout_s(environ=os.environ) -> float:
    raw = environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        raise MlxSpecError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if t <= 0:
        raise MlxSpecError(f"{TIMEOUT_ENV} must be > 0 (got {raw})")
    return t


# -- sharding -----------------------------------------------------------------------------------


def _args(model):
    lm = getattr(model, "language_model", model)
    return lm, lm.args


def shard_problems(model, n: int) -> list[str]:
    """Why mlx-lm's ``shard`` cannot split this target ``n`` ways (empty: it can)."""
    mt = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    if not callable(getattr(model, "shard", None)):
        return [f"mlx-lm's '{mt}' model defines no shard(), so it cannot be split over processes"]
    if getattr(getattr(_args(model)[0], "model", None), "pipeline_size", 1) > 1:
        return ["the target is already pipelined"]
    _, a = _args(model)
    out = []
    for name in (
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ):
        v = getattr(a, name, None)
        if (
            isinstance(v, int)
            and v % n
            and not (name == "num_key_value_heads" and mt and mt.startswith("qwen3_5") and n % v == 0)
        ):
            out.append(f"{name}={v} is not divisible by {n} processes")
    # mlx-lm's qwen3_5 family splits an untied output head by vocabulary (muse_spark always): an
    # uneven split ends in its AssertionError, so it is named here, before anything loads
    vocab = getattr(a, "vocab_size", None)
    splits_vocab = mt is not None and (
        mt.startswith("muse_spark") or (mt.startswith("qwen3_5") and not getattr(a, "tie_word_embeddings", True))
    )
    if splits_vocab and isinstance(vocab, int) and vocab % n:
        out.append(
            f"vocab_size={vocab} is not divisible by {n} processes ('{mt}' splits its output head by vocabulary)"
        )
    return out


def shard_target(model, group) -> None:
    """Split ``model`` in place over ``group`` with mlx-lm's ``shard`` (before its weights are
    materialized, so each rank only ever holds its shard). The output head stays whole: the
    replicated drafter drafts through it, and a whole head needs no gather in the verify pass."""
    n = group.size()
    problems = shard_problems(model, n)
    if problems:
        raise UnsupportedModel(f"target cannot be sharded over {n} processes: " + "; ".join(problems))
    lm, _ = _args(model)
    head = lm.get("lm_head") if hasattr(lm, "get") else getattr(lm, "lm_head", None)
    model.shard(group)
    if head is not None and getattr(lm, "lm_head", None) is not head:
        lm.lm_head = head  # undo a vocabulary-sharded head (qwen3_5): keep one whole copy per rank
        lm.sharding_group = None


# -- the wire: small arrays through all_sum ----------------------------------------------------


class Wire:
    """Rank 0 -> every rank messages as all_sums (rank 0 adds the values, the others zeros).
    A watchdog thread fails the group when a collective (or a step) outlasts ``timeout``."""

    def __init__(self, group, timeout: float, on_timeout: Callable[[str], None]):
        self.group = group
        self.rank = group.rank()
        self.timeout = timeout
        self._on_timeout = on_timeout
        self._since: float | None = None  # a collective or a step started and has not finished
        self._what = ""
        self._lock = threading.Lock()
        self.failed: str | None = None
        self.stopped = False  # the group was shut down: nothing left to watch
        self.stats = {"messages": 0, "ms": 0.0}
        threading.Thread(target=self._watch, name="mlx-spec-group-watchdog", daemon=True).start()

    def _watch(self) -> None:
        tick = min(0.25, self.timeout / 4)
        while self.failed is None and not self.stopped:
            time.sleep(tick)
            with self._lock:
                since, what = self._since, self._what
            if since is not None and time.monotonic() - since > self.timeout:
                self.fail(f"no answer from the group within {self.timeout:g} s ({what}); a rank died or hangs")

    def fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            self._on_timeout(why)

    def busy(self, what: str) -> None:
        with self._lock:
            self._since, self._what = time.monotonic(), what

    def idle(self) -> None:
        with self._lock:
            self._since = None

    def exchange(
        self, ints: list[int] | None, n: int, floats: list[float] | None = None, nf: int = 0, what: str = "message"
    ) -> tuple[list[int], list[float]]:
        """Rank 0 passes the values; the others pass None and get them."""
        if self.failed is not None:
            raise GroupFailed(self.failed)
        t = time.perf_counter()
        i = mx.array(ints if self.rank == 0 else [0] * n, mx.int32)
        f = mx.array(floats if self.rank == 0 else [0.0] * nf, mx.float32) if nf else None
        self.busy(what)
        try:
            i = mx.distributed.all_sum(i, group=self.group, stream=mx.cpu)
            f = mx.distributed.all_sum(f, group=self.group, stream=mx.cpu) if nf else None
            mx.eval(i, *([f] if nf else []))
        except RuntimeError as e:  # a peer closed its connection
            self.fail(f"lost a rank of the group ({what}): {e}")
            raise GroupFailed(self.failed) from None
        finally:
            self.idle()
        self.stats["messages"] += 1
        self.stats["ms"] += (time.perf_counter() - t) * 1e3
        return i.tolist(), (f.tolist() if nf else [])

    def agree(self, tokens: tuple[int, ...], width: int) -> None:
        """Debug check: every rank committed the same tokens (all_gather and compare)."""
        row = list(tokens)[:width] + [-1] * (width - len(tokens)) + [len(tokens)]
        self.busy("agreement check")
        try:
            rows = mx.distributed.all_gather(mx.array(row, mx.int32)[None], group=self.group, stream=mx.cpu).tolist()
        except RuntimeError as e:
            self.fail(f"lost a rank of the group (agreement check): {e}")
            raise GroupFailed(self.failed) from None
        finally:
            self.idle()
        if any(r != rows[0] for r in rows):
            self.fail(f"ranks disagree on the committed tokens: {rows}")
            raise GroupFailed(self.failed)


def _next(wire: Wire, it: Iterator):
    """The next step (None at the end), watched: a collective error inside the model (a peer
    lost mid-verify) fails the group instead of surfacing as a bare RuntimeError."""
    wire.busy("step")
    try:
        return next(it)
    except StopIteration:
        return None
    except RuntimeError as e:
        if wire.failed is None and not any(k in str(e) for k in ("[ring]", "[jaccl]", "[mpi]", "peer")):
            raise
        wire.fail(f"lost a rank of the group during a step: {e}")
        raise GroupFailed(wire.failed) from None
    finally:
        wire.idle()


# -- rank 0 ------------------------------------------------------------------------------------


def _header(ids, cfg, info, policy=None) -> tuple[list[int], list[float]]:
    s = cfg.sampling
    seed = s.seed if s.seed is not None else 0
    method = PLAIN if info.method == "plain" else SPEC
    mask = 0 if policy is None else sum(1 << SOURCE_CODES.index(x) for x in policy.sources)
    ints = [
        GEN,
        len(ids),
        cfg.max_tokens,
        seed,
        s.top_k,
        info.block_size,
        method,
        0,  # (slot 7: unused)
        mask,
        0 if policy is None else policy.max_lookup,
    ]
    return ints, [s.temperature, s.top_p]


class RankSharedPolicy:
    """A draft policy (``policy.DraftPolicy``) whose choices rank 0 makes and every rank follows.

    The policy learns from local timings, so two ranks running their own would choose different
    sources or lengths and their collectives would no longer pair up. Rank 0 wraps its policy
    (``inner``); the others pass None and the ``sources`` / ``max_lookup`` from the header. Each
    ``choose`` / ``pick`` costs one three-int message, each ``stays_plain`` one int; the
    ``choose`` that follows a True ``stays_plain`` (the loop queues a plain step on it and drops
    the answer) sends nothing. A decision method the loop calls that this class does not share
    fails loudly on the followers (AttributeError), never silently diverging."""

    def __init__(self, wire: Wire, inner=None, sources=(), max_lookup: int = 0):
        self.wire, self.inner = wire, inner
        self.sources = tuple(inner.sources) if inner is not None else tuple(sources)
        self.max_lookup = inner.max_lookup if inner is not None else max_lookup
        self.queued = False  # every rank got True from stays_plain: the next choose is plain

    def __getattr__(self, name):  # anything else the loop reads comes from rank 0's policy
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _share(self, decision):
        ints = None if decision is None else [SOURCE_CODES.index(decision.source), decision.length, int(decision.probe)]
        (src, length, probe), _ = self.wire.exchange(ints, 3, what="draft decision")
        if decision is not None:
            return decision
        return Decision(SOURCE_CODES[src], length, bool(probe))

    def observe(self, step) -> None:
        if self.inner is not None:
            self.inner.observe(step)

    def choose(self, ctx):
        mine = self.inner.choose(ctx) if self.inner is not None else None
        if self.queued:  # already agreed (plain): no message
            self.queued = False
            return mine if mine is not None else Decision(PLAIN_SOURCE, 1)
        return self._share(mine)

    def stays_plain(self, ctx) -> bool:
        """Rank 0's answer (the loop queues the next plain step on it): one one-int message."""
        mine = None if self.inner is None else [int(bool(self.inner.stays_plain(ctx)))]
        (stay,), _ = self.wire.exchange(mine, 1, what="plain run")
        self.queued = bool(stay)
        return self.queued

    def pick(self, decision, drafts, confidence, ctx=None, *, trim=False):
        return self._share(
            self.inner.pick(decision, drafts, confidence, ctx, trim=trim) if self.inner is not None else None
        )


class Leader:
    """Rank 0's side: announces requests, paces every step, beats while idle, knows the health.

    Use from the engine thread only (every message is an MLX collective)."""

    def __init__(self, group, *, timeout: float | None = None, check: bool | None = None, backend: str | None = None):
        self.info = group_info(group, True, backend)
        self.timeout = timeout_s() if timeout is None else timeout
        self.check = bool(os.environ.get(CHECK_ENV)) if check is None else check
        self._listeners: list[Callable[[str], None]] = []
        self.wire = Wire(group, self.timeout, self._failed)
        self._last = time.monotonic()
        self._active = None  # the running request's wrapped steps
        self.closed = False

    # health ---------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.wire.failed is None

    def health(self) -> dict:
        return {**self.info.as_dict(), "healthy": self.healthy, "error": self.wire.failed, "timeout_s": self.timeout}

    def on_failure(self, fn: Callable[[str], None]) -> Callable[[], None]:
        """Call ``fn(why)`` (from the watchdog thread) if the group fails; returns an unsubscribe."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def _failed(self, why: str) -> None:
        log.error("distributed group failed: %s", why)
        for fn in list(self._listeners):
            try:
                fn(why)
            except Exception:  # pragma: no cover - a listener must not stop the others
                log.exception("group failure listener")

    def ensure_healthy(self) -> None:
        if not self.healthy:
            raise GroupFailed(f"the distributed group is unhealthy: {self.wire.failed}")

    # requests -------------------------------------------------------------------------------
    def seeded(self, cfg):
        """``cfg`` with a seed every rank will use (a fresh one if the request had none)."""
        if cfg.sampling.seed is not None or cfg.sampling.greedy:
            return cfg
        return replace(cfg, sampling=replace(cfg.sampling, seed=time.time_ns() % 2**31))

    def lead(self, steps: Iterator, ids, cfg, info, policy: RankSharedPolicy | None = None) -> Iterator:
        """Wrap rank 0's steps: announce the request at the first pull, then after each step
        tell the followers whether another step is wanted (1) or the run ends here (0).
        ``policy``: the ``RankSharedPolicy`` the steps were made with (its sources go in the header);
        A run still open when the next one (or a heartbeat) starts is closed first."""
        self.finish()
        self._active = self._lead(steps, ids, cfg, info, policy)
        return self._active

    def finish(self) -> None:
        """Close the running request's steps (sending "stop" if they were not done)."""
        gen, self._active = self._active, None
        if gen is not None:
            gen.close()

    def _lead(self, steps, ids, cfg, info, policy) -> Iterator:
        self.ensure_healthy()
        ints, floats = _header(ids, cfg, info, policy)
        self.wire.exchange(ints, HEADER, floats, 2, what="request header")
        self.wire.exchange(list(ids), len(ids), what="prompt ids")
        width = max(info.block_size, ints[7], 1)
        it = iter(steps)
        try:
            while True:
                step = _next(self.wire, it)
                if step is None:
                    return
                if self.check:
                    self.wire.agree(step.tokens, width)
                try:
                    yield step
                except GeneratorExit:
                    if self.healthy:
                        self.wire.exchange([0], 1, what="stop")
                    raise
                self.wire.exchange([1], 1, what="step")
        finally:
            it.close()
            self._last = time.monotonic()

    def share(self, policy) -> RankSharedPolicy | None:
        """Rank 0's draft policy, its choices sent to every rank (None stays None)."""
        return None if policy is None else RankSharedPolicy(self.wire, policy)

    def heartbeat(self) -> None:
        """Call while idle (at least every HEARTBEAT_S): followers exit without it, and a dead
        follower shows up here even when no request runs."""
        self.finish()
        if self.healthy and not self.closed:
            try:
                self.wire.exchange([HEARTBEAT] + [0] * (HEADER - 1), HEADER, [0.0, 0.0], 2, what="heartbeat")
            except GroupFailed:
                pass
            self._last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._last >= HEARTBEAT_S

    def shutdown(self) -> None:
        """Tell the followers to exit (best effort)."""
        self.finish()
        if self.healthy and not self.closed:
            try:
                self.wire.exchange([SHUTDOWN] + [0] * (HEADER - 1), HEADER, [0.0, 0.0], 2, what="shutdown")
            except GroupFailed:
                pass
        self.closed = self.wire.stopped = True


# -- the other ranks ---------------------------------------------------------------------------


def follow(
    group,
    run_steps: Callable,
    *,
    timeout: float | None = None,
    check: bool | None = None,
    exit_fn: Callable[[int], None] = os._exit,
) -> int:
    """A follower's main loop: run every request rank 0 announces, step for step, until it says
    shut down. ``run_steps(ids, cfg, method, block_size, policy)`` returns the step generator
    (the same ``token_steps`` rank 0 runs, through the one decode loop; ``policy`` is None or a
    ``RankSharedPolicy`` that receives rank 0's per-cycle choices). Returns the number of requests followed.

    If rank 0 is silent for ``timeout`` seconds (it died or hangs), ``exit_fn(3)`` ends this
    process: its collectives could otherwise block forever."""
    timeout = timeout_s() if timeout is None else timeout
    check = bool(os.environ.get(CHECK_ENV)) if check is None else check

    def lost(why: str) -> None:
        print(f"mlx_spec rank {group.rank()}: {why}; exiting", file=sys.stderr, flush=True)
        exit_fn(3)

    wire = Wire(group, timeout, lost)
    served = 0
    while True:
        wire.busy("waiting for rank 0")  # heartbeats arrive every HEARTBEAT_S while idle
        try:
            (cmd, n, max_tokens, seed, top_k, block, method, _, mask, max_lookup), (temp, top_p) = wire.exchange(
                None, HEADER, None, 2, what="waiting for rank 0"
            )
        except GroupFailed as e:
            lost(str(e))
            return served
        if cmd == HEARTBEAT:
            continue
        if cmd == SHUTDOWN:
            wire.stopped = True
            return served
        ids, _ = wire.exchange(None, n, what="prompt ids")
        cfg = GenConfig(max_tokens=max_tokens, sampling=SamplingConfig(temp, top_p, top_k, seed if temp > 0 else None))

        policy = None
        if mask:
            policy = RankSharedPolicy(wire, None, [c for i, c in enumerate(SOURCE_CODES) if mask >> i & 1], max_lookup)
        steps = run_steps(ids, cfg, "plain" if method == PLAIN else "spec", block, policy)
        width = max(block, 1)
        try:
            while True:
                step = _next(wire, steps)
                if step is None:
                    break
                if check:
                    wire.agree(step.tokens, width)
                (go,), _ = wire.exchange(None, 1, what="waiting for rank 0's next step")
                if not go:
                    break
        except GroupFailed as e:
            lost(str(e))
            return served
        finally:
            steps.close()
        served += 1


def follow_session(session, *, timeout: float | None = None) -> int:
    """A follower's life on a loaded ``session.Session``: run what rank 0 announces with the same
    ``generation.token_steps`` rank 0 runs, until rank 0 shuts the group down."""
    pair, info = session.pair, session.info

    def run_steps(ids, cfg, method, block, policy):
        if method == "plain":
            p, i = for_request(pair, info, speculate=False)
        else:
            p, i = pair, replace(info, block_size=block)
        return token_steps(p, i, ids, cfg, policy=policy)

    return follow(session.group, run_steps, timeout=timeout)


# -- measuring the link: what a verify pass adds on a group ----------------------------------------


def timed_ms(fn: Callable[[], None], reps: int) -> float:
    """Median wall time of ``fn`` in ms over ``reps`` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(out), 3)


def link_costs(group, layers: int, hidden: int, sizes, reps: int = 5) -> dict:
    """What the group adds to a pass, timed alone (every rank must call this at the same point):
    ``allreduce_ms[B]``, a chain of 2 x ``layers`` all_sums of (1, B, hidden) float32 (the traffic
    of one verify pass of B positions: attention out + MLP down in every layer), and
    ``message_ms``, one all_sum of one int32 (the per-step flag rank 0 sends). Medians in ms."""
    allreduce = {}
    for B in sorted({1, *sizes}):
        x0 = mx.ones((1, B, hidden), mx.float32)
        mx.eval(x0)

        def chain(x0=x0):
            x = x0
            for _ in range(2 * layers):
                x = mx.distributed.all_sum(x, group=group) * 0.5
            mx.eval(x)

        allreduce[B] = timed_ms(chain, reps)
    flag = mx.ones((1,), mx.int32)
    message = timed_ms(lambda: mx.eval(mx.distributed.all_sum(flag, group=group, stream=mx.cpu)), 5 * reps)
    return {"allreduce_ms": allreduce, "message_ms": message}


# -- starting a group: mlx.launch run by mlx_spec itself -----------------------------------------

BACKENDS = ("ring", "jaccl")
LOCAL = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Launch:
    """A group ``mlx_spec serve/bench --ranks/--hosts/--hostfile`` starts with ``mlx.launch``:
    ``ranks`` processes on ``hosts`` (one rank per entry, in rank order; a single host repeated
    ``ranks`` times), or the hosts of ``hostfile``; ``port``: the ring's first port."""

    ranks: int
    hosts: tuple[str, ...] = (LOCAL,)
    hostfile: str | None = None
    backend: str = "ring"
    port: int | None = None

    @property
    def local(self) -> bool:
        """Every rank runs on this machine (so ``mlx_spec stop`` can signal each one)."""
        return self.hostfile is None and set(self.hosts) == {LOCAL}

    @property
    def local_ranks(self) -> int:
        """How many ranks mlx.launch starts on this machine (as its own children, not over ssh)."""
        hosts = self.hosts if len(self.hosts) > 1 else self.hosts * self.ranks  # one host: every rank on it
        return sum(h == LOCAL for h in hosts)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        where = (
            f"hostfile {self.hostfile}"
            if self.hostfile
            else (f"{self.ranks} x {self.hosts[0]}" if len(self.hosts) == 1 else ", ".join(self.hosts))
        )
        return f"{self.ranks} ranks ({self.backend}; {where})"

    def command(self, argv: list[str]) -> list[str]:
        """The mlx.launch command line that runs ``argv`` on every rank (no ``--env``: a secret
        such as the API key reaches rank 0, always a local child, through its environment)."""
        cmd = [launcher(), "--backend", self.backend]
        if self.hostfile:
            cmd += ["--hostfile", self.hostfile]
        elif len(self.hosts) == 1:
            cmd += ["--hosts", self.hosts[0], "-n", str(self.ranks)]
        else:
            cmd += ["--hosts", ",".join(self.hosts)]
        if self.port is not None:
            cmd += ["--starting-port", str(self.port)]
        return cmd + ["--", *argv]

    @staticmethod
    def shown(cmd: list[str]) -> str:
        """``command``'s mlx.launch part, to print (the command it runs left out)."""
        return " ".join(cmd[: cmd.index("--")] if "--" in cmd else cmd)


def launcher() -> str:
    """The ``mlx.launch`` of this Python environment (the mlx package installs it)."""
    here = Path(sys.executable).parent / "mlx.launch"
    found = str(here) if here.exists() else shutil.which("mlx.launch")
    if not found:
        raise MlxSpecError("mlx.launch is not installed next to this Python (it comes with the mlx package)")
    return found


def _free_run(n: int, tries: int = 50) -> int:
    """A first port P with P .. P+n-1 free on 127.0.0.1 (a local ring needs one per rank)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((LOCAL, 0))
            p = s.getsockname()[1]
        if p + n > 65535:
            continue
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind((LOCAL, q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise MlxSpecError(f"found no {n} consecutive free ports on {LOCAL} for the ring")


def launch_plan(
    ranks: int | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    backend: str | None = None,
    port: int | None = None,
    environ=os.environ,
) -> Launch | None:
    """The group ``--ranks/--hosts/--hostfile/--backend/--ring-port`` ask for (None: none of them,
    one process). Checked before anything loads; a local ring gets free ports."""
    if ranks is None and hosts is None and hostfile is None:
        if backend is not None or port is not None:
            raise BadRequest(
                "--backend/--ring-port need --ranks, --hosts or --hostfile (they describe a group; "
                "without one, one process runs)"
            )
        return None
    if launched(environ):
        raise BadRequest(
            "--ranks/--hosts/--hostfile start mlx.launch themselves; this process is already "
            "a rank of an mlx.launch group (drop them, or run mlx_spec without mlx.launch)"
        )
    if hosts is not None and hostfile is not None:
        raise BadRequest("give --hosts or --hostfile, not both")
    if port is not None and not 1024 <= port <= 65535:
        raise BadRequest(f"--ring-port must be in 1024..65535 (got {port})")
    names: tuple[str, ...] = (LOCAL,)
    if hostfile is not None:
        if not Path(hostfile).is_file():
            raise BadRequest(f"--hostfile {hostfile}: no such file")
        try:
            parsed = Hostfile.from_file(hostfile)
        except (ValueError, KeyError, TypeError) as e:
            raise BadRequest(f"--hostfile {hostfile} is not an mlx.launch hostfile: {e}") from None
        names = tuple(h.ssh_hostname for h in parsed.hosts)
        backend = backend or parsed.backend or None  # the hostfile may name its backend
        hostfile = str(Path(hostfile).resolve())
        n = len(names)
    elif hosts is not None:
        names = tuple(h.strip() for h in hosts.split(",") if h.strip())
        if not names:
            raise BadRequest("--hosts wants host names or IPs separated by commas")
        n = len(names) if len(names) > 1 else (ranks or 1)
    else:
        n = ranks
    backend = backend or "ring"
    if backend not in BACKENDS:
        raise BadRequest(f"--backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    if backend == "jaccl" and hostfile is None:
        raise BadRequest("--backend jaccl needs --hostfile (it lists each Mac's RDMA devices)")
    if ranks is not None and ranks != n:
        raise BadRequest(f"--ranks {ranks} but {n} hosts are given (one rank per host)")
    if n < 2:
        raise BadRequest(f"a group needs at least 2 ranks (got {n}); one process needs no --ranks")
    if port is not None and port + n - 1 > 65535:
        raise BadRequest(f"--ring-port {port}: a ring of {n} ranks uses ports {port}..{port + n - 1}, past 65535")
    if names[0] != LOCAL:
        raise BadRequest(
            f"rank 0 must run on this machine: the first host must be {LOCAL} (got {names[0]!r}). "
            f"mlx.launch starts every other name, this machine's own name included, through ssh, "
            f"so mlx_spec could neither record rank 0 nor stop it first; in a hostfile, write "
            f'"ssh": "{LOCAL}" for the first entry and keep its ring "ips"'
        )
    if backend == "ring" and hostfile is None:
        for h in names:
            try:
                ipaddress.ip_address(h)
            except ValueError:
                raise BadRequest(
                    f"--hosts {h!r}: the ring backend needs IP addresses (mlx.launch refuses host "
                    'names for it); give IPs, or a --hostfile with each host\'s "ips"'
                ) from None
    plan = Launch(n, names, hostfile, backend, port)
    if port is None and backend == "ring" and plan.local:
        plan = replace(plan, port=_free_run(n))
    return plan


__all__ = [
    "follow_session",
    "Launch",
    "launch_plan",
    "link_costs",
    "timed_ms",
    "GroupFailed",
    "Leader",
    "RankSharedPolicy",
    "follow",
    "init_group",
    "group_info",
    "launched",
    "shard_target",
    "shard_problems",
    "timeout_s",
    "Wire",
]
