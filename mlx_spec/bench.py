"""Timing and measurement, shared by `mlx_spec bench` and the tuner (one implementation).

- ``costs.measure_costs`` / ``CostMeter``: the model passes alone (T1 plain decode step, Td(B)
  draft pass, Tt(B) B-token verify pass), interleaved over rounds, warm-up discarded, medians.
- ``Runner``: one generation of any method (mlx-lm's own ``stream_generate``, our plain path,
  DFlash at a block size, the per-cycle policy over DFlash, lookup or both, fixed prompt lookup,
  mlx-lm AR draft, the official ``dflash`` package), timed by wall clock, at its BLAS thread
  count (mlx-lm at the BLAS's own default, ours at the engine's).
- ``bench``: methods side by side in one process, alternating order, repeated; ``summarize``
  turns the runs into rows (medians, spread, speedup vs our plain path and vs mlx-lm's plain
  decoding, per kind and the worst single prompt, tau, the eta ceiling, efficiency, and the
  engaged-mechanism check); ``prompt_report`` gives per-prompt figures and the share of each
  reply that repeats its prompt, with its copy ceiling (``analysis``).

Definitions (docs/bench.md): decode tok/s = tokens after the first step / time after the first
step; end to end = all tokens / all time (prefill included); speedup = median over repeats of
(method tok/s / baseline tok/s) of the same repeat (two baselines: our plain path and mlx-lm's);
ceiling = tau * T1 / (Td + Tt(B)), in general committed tokens * T1 / sum over cycles of
(Td(L) + Tt(L)); efficiency = speedup / ceiling.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from .analysis import copy_max_draft, copy_oracle, copy_share, oracle_ceiling
from .baselines import ar_draft_steps, load_peer, lookup_steps, peer_steps
from .blas import set_threads
from .costs import CostMeter, Costs, Progress, ceiling, efficiency
from .decode import Step, plain_steps, spec_steps
from .policy import PolicyFactory
from .stats import Stats
from .target import make_cache

# ---------------------------------------------------------------- pure arithmetic


def engaged(
    drafted: int, accepted: int, *, policy: bool = False, cycles: int = 0, probes: bool = False, drafter_ran: int = 0
) -> bool:
    """A fixed-source speculative row counts only if it drafted and at least one draft was
    accepted. A per-cycle policy row counts once the policy decided its cycles (staying plain
    where drafts do not pay is its mechanism working; the table shows drafted / accepted), but a
    policy that ``probes`` (DFlash among its sources: a probe is due by its third cycle) must have
    drafted, or run the drafter (``drafter_ran`` passes: a probe whose block the policy trimmed
    to the anchor), once a run went past 3 cycles. ``cycles``: the most cycles one run of the row had."""
    if policy:
        return cycles > 0 and (drafted > 0 or drafter_ran > 0 or cycles <= 3 or not probes)
    return drafted > 0 and accepted > 0


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median: the relative width of the repeats."""
    m = statistics.median(xs) if xs else 0.0
    return (max(xs) - min(xs)) / m if m else math.nan


# ---------------------------------------------------------------- one generation

# kind -> the per-cycle policy's draft sources (policy.PolicyFactory); "default" is the default engine,
# "auto" every source the loaded pair has (its ``draft_sources``)
POLICY_SOURCES = {
    "adaptive": ("dflash",),
    "lookup-policy": ("lookup",),
    "default": ("dflash", "lookup"),
    "mtp-policy": ("mtp",),
    "eagle-policy": ("eagle",),
    "auto": ("dflash", "lookup", "mtp", "eagle"),
}
# `bench --methods` names -> the policy row restricted to that source set
METHOD_KINDS = {
    "lookup": "lookup-policy",
    "mtp": "mtp-policy",
    "eagle": "eagle-policy",
    "dflash": "adaptive",
    "auto": "auto",
}
CHAIN_KINDS = ("mtp", "eagle")  # a fixed chain of depth block_size - 1 every cycle (the tuner's probe)


def policy_sources(kind: str, pair) -> tuple[str, ...]:
    """The draft sources of a policy row on ``pair``: "auto" is every source the pair has."""
    if kind == "auto":
        return tuple(getattr(pair, "draft_sources", ("dflash", "lookup")))
    return POLICY_SOURCES[kind]


@dataclass(frozen=True, slots=True)
class Method:
    kind: str  # mlx-lm | plain | dflash | mtp | eagle | a POLICY_SOURCES kind | lookup | ar-draft | peer
    block_size: int = 1  # tokens per verify incl. the anchor (lookup/ar-draft: drafts + 1)
    full_vocab: bool = False  # dflash with the whole head though the drafter ships a draft vocabulary

    @property
    def label(self) -> str:
        if self.kind == "mlx-lm":
            return "mlx-lm plain"
        if self.kind == "plain":
            return "plain (ours)"
        if self.kind == "adaptive":
            return "dflash per-cycle"
        if self.kind == "lookup-policy":
            return "lookup per-cycle"
        if self.kind == "default":
            return "default engine"
        if self.kind in ("mtp-policy", "eagle-policy"):
            return f"{self.kind[:-7]} per-cycle"
        if self.kind == "auto":
            return "auto (every source)"
        if self.kind in CHAIN_KINDS:
            return f"{self.kind} k={self.block_size - 1}"
        return f"{self.kind} B={self.block_size}" + (" full-vocab" if self.full_vocab else "")

    @property
    def speculative(self) -> bool:
        return self.kind not in ("plain", "mlx-lm")


@dataclass
class Run:
    tokens: list[int]
    total_s: float
    first_s: float  # time to the first step (prefill + first token or round)
    first_tokens: int
    stats: Stats
    blocks: dict[int, int]  # cycles per block size L (drafted + 1), prefill excluded
    drafter_blocks: dict[int, int] = field(default_factory=dict)  # cycles the drafter ran in, per its own block

    @property
    def heads(self) -> dict[str, int]:
        """Chain head passes by kind (a chain of depth k: k passes, its drafted tokens)."""
        return {k: c["drafted"] for k, c in self.stats.sources.items() if k in CHAIN_KINDS}

    @property
    def decode_s(self) -> float:
        return self.total_s - self.first_s


class Runner:
    """Runs any method on one loaded pair. Everything here must run on the pair's thread."""

    def __init__(
        self,
        pair,
        *,
        ar_model=None,
        costs: Costs | None = None,
        stop_at_eos: bool = True,
        tuned=None,
        threads: int | None = None,
        blas=None,
    ):
        """``threads``: BLAS threads for our methods (None: leave the count as it is); the
        mlx-lm row always runs at the BLAS's own default (or the user's pinned count:
        OPENBLAS_NUM_THREADS / MKL_NUM_THREADS).
        ``tuned``: the tuner's stored result (the per-cycle policy's prior)."""
        self.pair, self.ar_model, self.costs = pair, ar_model, costs
        self.stop_at_eos = stop_at_eos
        self.eos = tuple(pair.tokenizer.eos_token_ids) if stop_at_eos else ()
        self.tuned, self.threads, self.blas = tuned, threads, blas
        self._peer = None
        self._policies: dict = {}

    def _policy(self, method: Method):
        """A fresh per-cycle policy over ``method``'s draft sources (policy.PolicyFactory)."""
        if method not in self._policies:  # as the engine builds them: the tuner's curve and prior
            self._policies[method] = PolicyFactory(
                self.pair, self.tuned, sources=policy_sources(method.kind, self.pair)
            )
        return self._policies[method]()

    def steps(self, method: Method, ids: Sequence[int], max_tokens: int) -> Iterator[Step]:
        p, B = self.pair, method.block_size
        if method.kind == "mlx-lm":
            return mlx_lm_steps(p.model, p.tokenizer, ids, max_tokens=max_tokens, stop_at_eos=self.stop_at_eos, kv=p.kv)
        if method.kind == "plain":
            return plain_steps(p.model, ids, max_tokens=max_tokens, eos_ids=self.eos, kv=p.kv)
        chains = getattr(p, "chains", None) or None
        if method.kind == "dflash":
            return spec_steps(
                p.target, p.drafter, ids, block_size=B, max_tokens=max_tokens, eos_ids=self.eos, chains=chains
            )
        if method.kind in CHAIN_KINDS:
            return spec_steps(
                p.target,
                p.drafter,
                ids,
                block_size=B,
                max_tokens=max_tokens,
                eos_ids=self.eos,
                chains=chains,
                source=method.kind,
            )
        if method.kind in POLICY_SOURCES:
            return spec_steps(
                p.target,
                p.drafter,
                ids,
                block_size=B,
                max_tokens=max_tokens,
                eos_ids=self.eos,
                policy=self._policy(method),
                chains=chains,
            )
        if method.kind == "lookup":
            return lookup_steps(p.model, ids, num_draft=B - 1, max_tokens=max_tokens, eos_ids=self.eos)
        if method.kind == "ar-draft":
            return ar_draft_steps(p.model, self.ar_model, ids, num_draft=B - 1, max_tokens=max_tokens, eos_ids=self.eos)
        if method.kind == "peer":
            if self._peer is None:
                self._peer = load_peer(p)
            return peer_steps(self._peer, ids, block_size=B, max_tokens=max_tokens, eos_ids=self.eos)
        raise ValueError(f"unknown method {method.kind}")

    def run(self, method: Method, ids: Sequence[int], max_tokens: int) -> Run:
        if self.blas is not None and self.blas.settable:
            set_threads(self.blas, self.blas.pinned if method.kind == "mlx-lm" else self.threads)
        if not method.full_vocab:
            return self._run(method, ids, max_tokens)
        prev = self.pair.drafter.set_vocab(None)
        try:
            return self._run(method, ids, max_tokens)
        finally:
            self.pair.drafter.set_vocab(prev)

    def _run(self, method: Method, ids: Sequence[int], max_tokens: int) -> Run:
        stats, tokens, blocks, drafter = Stats(), [], {}, {}
        first_s, first_tokens = None, 0
        t0 = time.perf_counter()
        for step in self.steps(method, ids, max_tokens):
            now = time.perf_counter()
            stats.add(step)
            tokens.extend(step.tokens)
            if first_s is None:
                first_s, first_tokens = now - t0, len(step.tokens)
            if not step.prefill:
                blocks[step.drafted + 1] = blocks.get(step.drafted + 1, 0) + 1
                if step.draft_block:  # the drafter ran, at its own block (pick() may then have verified the lookup's)
                    drafter[step.draft_block] = drafter.get(step.draft_block, 0) + 1
        total = time.perf_counter() - t0
        return Run(tokens, total, first_s or total, first_tokens, stats, blocks, drafter)


def mlx_lm_steps(
    model, tokenizer, ids: Sequence[int], *, max_tokens: int, stop_at_eos: bool = True, kv=None
) -> Iterator[Step]:
    """mlx-lm's own ``stream_generate`` (greedy), one Step per token it yields: what a user would
    run instead of us. Its final response repeats the last token (EOS or the max_tokens-th).
    ``kv`` (``target.KVQuant``): its prompt cache quantized from the first row, as ours is."""
    if not stop_at_eos:
        tokenizer = copy.copy(tokenizer)
        tokenizer.eos_token_ids = []
    t = time.perf_counter()
    first = True
    extra = {} if kv is None else {"prompt_cache": make_cache(model, kv)}
    for r in stream_generate(
        model, tokenizer, mx.array(list(ids), mx.int32), max_tokens=max_tokens, sampler=make_sampler(0.0), **extra
    ):
        now = time.perf_counter()
        ms = (now - t) * 1e3
        yield Step(
            (int(r.token),),
            elapsed_ms=ms,
            verify_ms=ms,
            prefill=first,
            prompt_tokens=len(ids) if first else 0,
            finish_reason=r.finish_reason,
        )
        first, t = False, now


def model_ms(
    method: Method,
    blocks: dict[int, int],
    costs: Costs,
    drafter_blocks: dict[int, int] | None = None,
    heads: dict[str, int] | None = None,
) -> float:
    """The two passes' time over a run's cycles by the cost curve (nan where unknown). A
    per-cycle policy's cycles: Tt(L) each (a plain step: T1), plus Td(L) for those the drafter
    ran in (``drafter_blocks``), plus Tc per chain head pass (``heads``: kind -> passes)."""
    if method.full_vocab:  # the cost curve's draft passes used the reduced draft head
        return math.nan
    heads = {k: n for k, n in (heads or {}).items() if n}
    if any(k not in costs.tc_ms for k in heads):
        return math.nan  # a chain ran whose head pass was not timed
    chain = sum(n * costs.tc_ms[k] for k, n in heads.items())
    if method.kind in POLICY_SOURCES:
        return (
            sum(n * costs.step_ms(L) for L, n in blocks.items())
            + sum(n * costs.draft(L) for L, n in (drafter_blocks or {}).items())
            + chain
        )
    total = 0.0
    for L, n in blocks.items():
        if method.kind in ("plain", "mlx-lm"):
            c = costs.t1_ms
        elif method.kind in CHAIN_KINDS:
            c = costs.t1_ms if L == 1 else costs.verify(L)  # (its head passes: ``chain``)
        elif method.kind == "lookup":
            c = costs.verify(L)
        elif method.kind == "ar-draft":
            c = (L - 1) * costs.t1_draft_ms + costs.verify(L) if costs.t1_draft_ms else math.nan
        else:
            c = costs.draft(L) + costs.verify(L)
        total += n * c
    return total + chain


# ---------------------------------------------------------------- side by side


@dataclass
class Sample:
    method: Method
    repeat: int
    prompt_id: str
    kind: str
    run: Run


def bench(
    runner: Runner,
    methods: Sequence[Method],
    prompts: Sequence[tuple[str, str, list[int]]],
    *,
    repeats: int = 3,
    max_tokens: int = 128,
    warmup_tokens: int = 16,
    progress: Progress | None = None,
    meter: CostMeter | None = None,
) -> tuple[list[Sample], dict[Method, str]]:
    """Every method on every prompt, ``repeats`` times, order rotated per prompt and repeat.

    ``prompts``: (id, kind, token ids). A warm-up pass (every method, first prompt, short) is
    discarded. ``meter`` (optional) gets one round of pass timings before every repeat.
    Returns the samples and {method: why} for methods that raised (they are dropped).
    """
    total = len(methods) * (1 + repeats * len(prompts))
    done = 0
    failed: dict[Method, str] = {}

    def attempt(m: Method, ids, n: int) -> Run | None:
        try:
            return runner.run(m, ids, n)
        except Exception as e:  # one broken method must not hide the others' numbers
            failed[m] = f"failed: {type(e).__name__}: {e}"
            return None

    for m in methods:
        attempt(m, prompts[0][2], warmup_tokens)
        done += 1
        if progress:
            progress(done, total, f"warm-up {m.label}")
    samples = []
    for r in range(repeats):
        if meter is not None:
            meter.round()
        for j, (pid, kind, ids) in enumerate(prompts):
            k = (r * len(prompts) + j) % len(methods)
            for m in list(methods[k:]) + list(methods[:k]):
                run = None if m in failed else attempt(m, ids, max_tokens)
                if run is not None:
                    samples.append(Sample(m, r, pid, kind, run))
                done += 1
                if progress:
                    progress(done, total, f"repeat {r + 1}/{repeats} {pid} {m.label}")
    return [s for s in samples if s.method not in failed], failed


@dataclass
class Row:
    label: str
    kind: str
    block_size: int
    status: str = "ok"  # "ok" | "failed: ..."
    decode_tps: float | None = None
    e2e_tps: float | None = None
    spread: float | None = None  # of decode tok/s over repeats
    speedup: float | None = None  # decode, vs our plain path
    e2e_speedup: float | None = None
    speedup_by_kind: dict = field(default_factory=dict)
    worst: tuple | None = None  # (prompt id, decode speedup vs our plain): the worst single prompt
    speedup_mlx: float | None = None  # the same four against mlx-lm's plain decoding
    e2e_speedup_mlx: float | None = None
    speedup_by_kind_mlx: dict = field(default_factory=dict)
    worst_mlx: tuple | None = None
    sources: dict = field(default_factory=dict)  # draft source -> {cycles, drafted, accepted}
    tau: float | None = None
    tau_by_kind: dict = field(default_factory=dict)  # prompt kind -> tau over that kind's runs
    acceptance: float | None = None
    acceptance_by_position: list = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    t1_ms: float | None = None
    td_ms: float | None = None
    tt_ms: float | None = None
    ceiling: float | None = None
    efficiency: float | None = None
    mean_block: float | None = None
    diverged: int = 0  # runs whose tokens differ from plain's (greedy; near-ties in the target)
    runs: int = 0
    tokens: int = 0


def _per_repeat(
    samples: list[Sample], kinds: set[str] | None = None, prompts: set[str] | None = None
) -> dict[int, tuple[float, float]]:
    """repeat -> (decode tok/s, end-to-end tok/s) over the prompts (of the given kinds / ids)."""
    acc: dict[int, list[float]] = {}
    for s in samples:
        if (kinds is not None and s.kind not in kinds) or (prompts is not None and s.prompt_id not in prompts):
            continue
        a = acc.setdefault(s.repeat, [0, 0.0, 0, 0.0])
        a[0] += len(s.run.tokens) - s.run.first_tokens
        a[1] += s.run.decode_s
        a[2] += len(s.run.tokens)
        a[3] += s.run.total_s
    nan = math.nan  # a repeat whose runs all ended in their first step has no decode rate
    return {r: (a[0] / a[1] if a[0] and a[1] else nan, a[2] / a[3] if a[3] else nan) for r, a in acc.items()}


def _median_ratio(num: dict, den: dict, i: int) -> float | None:
    """Median over repeats of num[r][i] / den[r][i], skipping repeats without both rates."""
    xs = [num[r][i] / den[r][i] for r in num if r in den and num[r][i] > 0 and den[r][i] > 0]
    return _r(statistics.median(xs)) if xs else None


def _median(xs) -> float | None:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else None


def _r(x, n=3):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, n)


def summarize(
    samples: list[Sample],
    costs: Costs | None = None,
    failed: dict | None = None,
    methods: Sequence[Method] | None = None,
) -> list[Row]:
    """One Row per method (in ``methods`` order); raised or unengaged methods are marked failed."""
    failed = failed or {}
    methods = list(methods or dict.fromkeys(s.method for s in samples))
    plain = [s for s in samples if s.method.kind == "plain"]
    plain_tokens = {(s.repeat, s.prompt_id): s.run.tokens for s in plain}
    kinds = sorted({s.kind for s in samples})
    pids = list(dict.fromkeys(s.prompt_id for s in samples))
    bases = {}  # suffix -> (all, by kind, by prompt) per-repeat rates of the baseline
    for suffix, kind in (("", "plain"), ("_mlx", "mlx-lm")):
        b = [s for s in samples if s.method.kind == kind]
        if b:
            bases[suffix] = (
                _per_repeat(b),
                {k: _per_repeat(b, {k}) for k in kinds},
                {p: _per_repeat(b, prompts={p}) for p in pids},
            )
    rows = []
    for m in methods:
        if m in failed:
            rows.append(Row(m.label, m.kind, m.block_size, status=failed[m]))
            continue
        mine = [s for s in samples if s.method == m]
        st = Stats.merged([s.run.stats for s in mine])
        committed = st.committed_in_cycles
        row = Row(
            m.label,
            m.kind,
            m.block_size,
            runs=len(mine),
            tokens=sum(len(s.run.tokens) for s in mine),
            drafted=st.drafted,
            accepted=st.accepted,
            diverged=sum(1 for s in mine if plain_tokens.get((s.repeat, s.prompt_id), s.run.tokens) != s.run.tokens),
        )
        if m.speculative:
            row.tau = _r(st.mean_acceptance_length)
            for k in kinds:
                st_k = Stats.merged([s.run.stats for s in mine if s.kind == k])
                if st_k.cycles:
                    row.tau_by_kind[k] = _r(st_k.mean_acceptance_length)
            row.acceptance = _r(st.acceptance_rate)
            row.acceptance_by_position = [_r(x) for x in st.acceptance_by_position]
            row.mean_block = _r(1 + st.drafted / st.cycles) if st.cycles else None
            longest = max((s.run.stats.cycles for s in mine), default=0)
            if not engaged(
                st.drafted,
                st.accepted,
                policy=m.kind in POLICY_SOURCES,
                cycles=longest,
                probes=bool({"dflash", "mtp", "eagle"} & set(POLICY_SOURCES.get(m.kind, ()))),
                drafter_ran=st.drafter_passes + st.head_passes,
            ):
                row.status = (
                    f"failed: mechanism did not engage (drafted {st.drafted}, accepted {st.accepted}, "
                    f"drafter passes {st.drafter_passes})"
                )
                rows.append(row)
                continue
        per = _per_repeat(mine)
        dec = [v[0] for v in per.values() if not math.isnan(v[0])]
        row.decode_tps = _r(_median(dec), 2)
        row.e2e_tps = _r(_median([v[1] for v in per.values()]), 2)
        row.spread = _r(spread(dec)) if dec else None
        if getattr(st, "sources", None):
            row.sources = (
                st.source_stats() if hasattr(st, "source_stats") else {k: dict(v) for k, v in st.sources.items()}
            )
        mine_kind = {k: _per_repeat(mine, {k}) for k in kinds}
        mine_prompt = {p: _per_repeat(mine, prompts={p}) for p in pids}
        for suffix, (base, base_kind, base_prompt) in bases.items():
            setattr(row, "speedup" + suffix, _median_ratio(per, base, 0))
            setattr(row, "e2e_speedup" + suffix, _median_ratio(per, base, 1))
            by_kind = getattr(row, "speedup_by_kind" + suffix)
            for k in kinds:
                x = _median_ratio(mine_kind[k], base_kind[k], 0)
                if x is not None:
                    by_kind[k] = x
            per_prompt = [(p, _median_ratio(mine_prompt[p], base_prompt[p], 0)) for p in pids]
            per_prompt = [(p, x) for p, x in per_prompt if x is not None]
            if per_prompt:
                setattr(row, "worst" + suffix, min(per_prompt, key=lambda px: px[1]))
        if costs is not None:
            row.t1_ms = _r(costs.t1_ms, 2)
            if m.kind in ("dflash", "peer"):
                row.td_ms = None if m.full_vocab else _r(costs.draft(m.block_size), 2)
                row.tt_ms = _r(costs.verify(m.block_size), 2)
            elif m.kind == "lookup":
                row.td_ms, row.tt_ms = 0.0, _r(costs.verify(m.block_size), 2)
            elif m.kind in CHAIN_KINDS or m.kind in ("mtp-policy", "eagle-policy"):
                kind = m.kind.split("-")[0]  # Td is the head pass (Tc); a chain of depth k costs k
                row.td_ms = _r(costs.tc_ms.get(kind), 2)
                row.tt_ms = _r(costs.verify(m.block_size), 2) if m.kind in CHAIN_KINDS else None
            elif m.kind == "ar-draft" and costs.t1_draft_ms:
                row.td_ms, row.tt_ms = _r((m.block_size - 1) * costs.t1_draft_ms, 2), _r(costs.verify(m.block_size), 2)
            passes = sum(model_ms(m, s.run.blocks, costs, s.run.drafter_blocks, s.run.heads) for s in mine)
            if m.speculative and passes and not math.isnan(passes):
                # committed tokens * T1 / model time: tau * T1 / (Td + Tt(B)) when B is fixed
                row.ceiling = _r(ceiling(committed / st.cycles, costs.t1_ms, passes / st.cycles, 0.0))
                if row.speedup is not None:
                    row.efficiency = _r(efficiency(row.speedup, row.ceiling))
        rows.append(row)
    return rows


@dataclass
class PromptRow:
    """One prompt: how much of its reply repeats it, and per method tau and speedups."""

    prompt_id: str
    kind: str
    prompt_tokens: int
    reply_tokens: int
    copy_share: float  # of our plain reply (greedy: every method's reply, near-ties aside)
    tau: dict = field(default_factory=dict)  # method label -> mean acceptance length
    speedup: dict = field(default_factory=dict)  # method label -> decode speedup vs our plain
    speedup_mlx: dict = field(default_factory=dict)  # ... vs mlx-lm's plain decoding
    ceiling: float | None = None  # copy_ceiling of the reply at the bench's cost curve
    oracle: tuple | None = None  # copy_oracle: (tokens, ms), to add prompts up
    of_ceiling: dict = field(default_factory=dict)  # method label -> speedup vs our plain / ceiling


def prompt_report(
    samples: list[Sample],
    prompts: Sequence[tuple[str, str, list[int]]],
    eos: Sequence[int] = (),
    costs: Costs | None = None,
) -> list[PromptRow]:
    """Per prompt: the reply's ``copy_share`` of the prompt, and every method's tau and speedups;
    with ``costs`` also the reply's ``copy_ceiling`` and each method's share of it."""
    eos = set(eos)
    out = []
    base = {
        k: {p: _per_repeat([s for s in samples if s.method.kind == k], prompts={p}) for p, _, _ in prompts}
        for k in ("plain", "mlx-lm")
    }
    for pid, kind, ids in prompts:
        mine = [s for s in samples if s.prompt_id == pid]
        ref = next((s for s in mine if s.method.kind == "plain"), None) or next(iter(mine), None)
        if ref is None:
            continue
        reply = [t for t in ref.run.tokens if t not in eos]
        row = PromptRow(pid, kind, len(ids), len(reply), round(copy_share(ids, reply), 3))
        if costs is not None and len(reply) > 1:
            # blocks up to the longest measured verify: Tt past it would be extrapolated
            tokens, ms = copy_oracle(ids, reply, costs, max_draft=copy_max_draft(costs))
            row.oracle, row.ceiling = (tokens, round(ms, 1)), _r(oracle_ceiling([(tokens, ms)], costs.t1_ms))
        for m in dict.fromkeys(s.method for s in mine):
            runs = [s for s in mine if s.method == m]
            if m.speculative:
                st = Stats.merged([s.run.stats for s in runs])
                row.tau[m.label] = _r(st.mean_acceptance_length)
            rates = _per_repeat(runs)
            for k, target in (("plain", row.speedup), ("mlx-lm", row.speedup_mlx)):
                x = _median_ratio(rates, base[k][pid], 0) if base[k][pid] else None
                if x is not None:
                    target[m.label] = x
            if m.speculative and row.ceiling and m.label in row.speedup:
                row.of_ceiling[m.label] = _r(row.speedup[m.label] / row.ceiling)
        out.append(row)
    return out


def pooled_ceiling(rows: Sequence[PromptRow], t1_ms: float) -> float | None:
    """The copy ceiling of several prompts together (``oracle_ceiling`` of their oracles)."""
    return _r(oracle_ceiling((r.oracle for r in rows if r.oracle), t1_ms))


def subset_speedups(samples: list[Sample], prompt_ids: set[str]) -> dict[str, tuple[float | None, float | None]]:
    """method label -> (decode speedup vs our plain, vs mlx-lm) over just these prompts."""
    keep = [s for s in samples if s.prompt_id in prompt_ids]
    base = {k: _per_repeat([s for s in keep if s.method.kind == k]) for k in ("plain", "mlx-lm")}
    out = {}
    for m in dict.fromkeys(s.method for s in keep):
        rates = _per_repeat([s for s in keep if s.method == m])
        out[m.label] = tuple(_median_ratio(rates, base[k], 0) if base[k] else None for k in ("plain", "mlx-lm"))
    return out
