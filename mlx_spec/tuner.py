"""Block-size tuner: measure on this machine, store the best (or "off") per machine and pair.

``tune`` runs a bounded sweep over (block size, BLAS thread count): the pass costs Tt(B), Td(B)
for every candidate block at all cores and at the reference block for every other thread count
(interleaved rounds), one acceptance probe at the checkpoint's block (acceptance by position gives
tau for every smaller block), a cost model that ranks the candidates, then ``race``: plain
decoding, the predicted best few, always the predicted runner-up and the neighbours of the
predicted leader, and the runner-up thread count, end to end on the built-in chat mix, every
round every candidate once in rotated order (interleaved, ABAB, never one candidate after
another), warm-up discarded. After each whole cycle of prompt kinds the race drops clearly worse
candidates, adds the neighbours of the measured leader (next block up and down, next thread count
up and down) if they were not timed yet, and stops on
a clear margin; otherwise it runs until the budget is spent (at least ``min_rounds`` rounds).
``choose`` / ``pick`` (pure) pick the winner. The result is stored as JSON under
``<cache>/tuning/`` keyed by everything that changes the answer (``tune_key``, thread count not
included: it is part of the answer); ``ensure_tuned`` is what generate/chat/serve call on start,
and it applies the stored thread count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

from .adaptive import expected_tokens
from .bench import Method, Runner, merge_stats, model_ms, spread
from .blas import default_threads, set_threads, thread_candidates
from .costs import Costs, CostMeter, Progress
from .errors import MlxSpecError

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 90.0
FORMAT = 2  # 2: the BLAS thread count is part of the answer


class TuneSkipped(MlxSpecError):
    """The user skipped first-launch tuning (a key in the TUI): nothing is stored."""


# ---------------------------------------------------------------- the key

def cpu_name() -> str:
    try:
        import mlx.core as mx

        if mx.metal.is_available():
            return str(mx.device_info().get("device_name", "apple-gpu"))
    except Exception:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import mlx.core as mx
    import mlx_lm

    from . import BLAS

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": round(mem / 2**30),
            "os": f"{platform.system()} {platform.release()}", "arch": platform.machine(),
            "backend": "metal" if mx.metal.is_available() else "cpu",
            "blas": f"{BLAS.name} {BLAS.path or ''}".strip(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def _model_dir(path_or_id: str) -> Path | None:
    from .default_target import DEFAULT_TARGET_ID, cache_dir

    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if path_or_id == DEFAULT_TARGET_ID:
        found = sorted((cache_dir() / "models").glob(f"{DEFAULT_TARGET_ID}-*"))
        return found[0] if found else None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path_or_id, local_files_only=True))  # path holds the revision
    except Exception:
        return None


def fingerprint(path_or_id: str) -> str:
    """Hash of config.json and the weight files' names, sizes and mtimes (cheap; a retrained or
    replaced checkpoint changes it)."""
    d = _model_dir(path_or_id)
    h = hashlib.sha256(str(d.resolve() if d else path_or_id).encode())
    if d is not None:
        for f in sorted(d.glob("*.json")) + sorted(d.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def quantization(model) -> str:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return f"q{m.bits}g{m.group_size}"
    params = tree_flatten(model.parameters())
    return str(params[0][1].dtype).replace("mlx.core.", "") if params else "none"


def tune_key(pair) -> dict:
    return {"machine": machine_info(),
            "target": {"id": pair.target_id, "hash": fingerprint(pair.target_id), "quant": quantization(pair.model)},
            "drafter": {"id": pair.drafter_id, "hash": fingerprint(pair.drafter_id), "quant": quantization(pair.drafter),
                        "draft_vocab": pair.drafter.vocab_size_drafted or "full"}}


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


# ---------------------------------------------------------------- the result

@dataclass(frozen=True)
class Candidate:
    block: int  # 1 = off (plain decoding)
    measured: bool  # raced end to end (else ranked out by the cost model)
    median_tps: float | None = None  # committed tok/s end to end
    spread: float | None = None  # (max - min) / median over rounds: of the speedup (off: of tok/s)
    speedup: float | None = None  # median over rounds of tok/s / plain tok/s (same prompt)
    tau: float | None = None
    predicted: float | None = None  # cost-model speedup
    rounds: int = 0
    note: str = ""
    final: bool = False  # still in the race at the end (only these can win)
    threads: int | None = None  # BLAS threads it ran with (None: no thread knob here)

    @property
    def label(self) -> str:
        return "off" if self.block == 1 else str(self.block)

    @property
    def key(self) -> tuple[int, int | None]:
        return self.block, self.threads


@dataclass(frozen=True)
class TuneResult:
    key: dict
    best: int  # 1 = off
    date: str
    candidates: tuple[Candidate, ...]
    costs: Costs | None = None
    acceptance_by_position: tuple[float, ...] = ()
    prompt_kinds: tuple[str, ...] = ()
    tokens_per_run: int = 0
    budget_s: float = 0.0
    elapsed_s: float = 0.0
    format: int = FORMAT
    threads: int | None = None  # BLAS threads chosen with the block (None: no thread knob here)

    @property
    def block_size(self) -> int:
        return self.best

    @property
    def source(self) -> str:
        day = self.date[:10] + (f", {self.threads} BLAS thread{'s' if self.threads != 1 else ''}"
                                if self.threads else "")
        if self.best > 1:
            return f"tuned {day}"
        spec = [c for c in self.candidates if c.block > 1 and c.speedup is not None]
        best = max(spec, key=lambda c: c.speedup, default=None)
        why = f"; best DFlash B={best.block} x{best.speedup:.2f}" if best else ""
        return f"tuned {day}: off — plain decoding faster on this machine{why}"

    def as_dict(self) -> dict:
        return {"format": self.format, "best": "off" if self.best == 1 else self.best, "date": self.date,
                "source": self.source, "key": self.key,
                "candidates": [{"block": c.label, **{k: getattr(c, k) for k in (
                    "measured", "median_tps", "spread", "speedup", "tau", "predicted", "rounds", "note", "final",
                    "threads")}}
                    for c in self.candidates],
                "costs": self.costs.as_dict() if self.costs else None,
                "acceptance_by_position": list(self.acceptance_by_position),
                "prompt_kinds": list(self.prompt_kinds), "tokens_per_run": self.tokens_per_run,
                "budget_s": self.budget_s, "elapsed_s": self.elapsed_s, "threads": self.threads}

    @classmethod
    def from_dict(cls, d: dict) -> "TuneResult":
        def block(x):
            return 1 if x == "off" else int(x)

        cands = tuple(Candidate(block(c["block"]), bool(c["measured"]), c.get("median_tps"), c.get("spread"),
                                c.get("speedup"), c.get("tau"), c.get("predicted"), int(c.get("rounds", 0)),
                                c.get("note", ""), bool(c.get("final", False)), _opt_int(c.get("threads")))
                      for c in d["candidates"])
        return cls(d["key"], block(d["best"]), str(d["date"]), cands,
                   Costs.from_dict(d["costs"]) if d.get("costs") else None,
                   tuple(float(x) for x in d.get("acceptance_by_position", ())),
                   tuple(d.get("prompt_kinds", ())), int(d.get("tokens_per_run", 0)),
                   float(d.get("budget_s", 0)), float(d.get("elapsed_s", 0)), int(d.get("format", FORMAT)),
                   _opt_int(d.get("threads")))


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


def result_path(key: dict, root: Path | None = None) -> Path:
    from .default_target import cache_dir

    return (root or cache_dir()) / "tuning" / f"{key_hash(key)}.json"


def save_result(result: TuneResult, root: Path | None = None) -> Path:
    path = result_path(result.key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result.as_dict(), indent=2))
    tmp.replace(path)
    return path


def load_result(key: dict, root: Path | None = None) -> TuneResult | None:
    """The stored result for exactly this key; None if absent, stale or unreadable."""
    path = result_path(key, root)
    if not path.exists():
        return None
    try:
        result = TuneResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring unreadable tuning result %s (%s); re-tuning", path, e)
        return None
    if result.format != FORMAT or result.key != key:
        return None
    return result


# ---------------------------------------------------------------- pure choice

def predict(costs: Costs, acceptance_by_position: Sequence[float], block: int, overhead_ms: float = 0.0) -> float:
    """Cost-model speedup of DFlash at ``block`` over plain decoding."""
    if block <= 1:
        return 1.0
    cost = costs.draft(block) + costs.verify(block) + overhead_ms
    return expected_tokens(acceptance_by_position, block) * costs.t1_ms / cost


def pick(trials: Sequence[Candidate], margin: float = 0.02, tie: float = 0.01) -> tuple[int, int | None]:
    """The winning (block, threads) (block 1 = off) from the final candidates' median speedups
    over the race's baseline (plain decoding at the leading thread count).

    Speculation must beat the best plain candidate by ``margin`` (else "off": same output, less
    memory); among candidates within ``tie`` of the best, the smallest block wins (cheaper,
    steadier), and within a block the faster thread count.
    """
    ok = [c for c in trials if c.final and c.speedup is not None and not math.isnan(c.speedup)]
    off = [c for c in ok if c.block == 1]
    best_off = max(off, key=lambda c: c.speedup, default=None)
    plain = (1, best_off.threads if best_off else None)
    spec = [c for c in ok if c.block > 1]
    if not spec:
        return plain
    best = max(c.speedup for c in spec)
    if best < (best_off.speedup if best_off else 1.0) * (1 + margin):
        return plain
    near = [c for c in spec if c.speedup >= best * (1 - tie)]
    win = min(near, key=lambda c: (c.block, -c.speedup))
    return win.block, win.threads


def choose(trials: Sequence[Candidate], margin: float = 0.02, tie: float = 0.01) -> int:
    """The winning block (1 = off); see ``pick``."""
    return pick(trials, margin, tie)[0]


def default_candidates(checkpoint_block: int) -> list[int]:
    top = max(checkpoint_block, 16)
    return sorted({b for b in (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32) if b <= top} | {checkpoint_block, top})


# ---------------------------------------------------------------- the race (pure but for run)

Key = tuple  # (block, threads): block 1 = plain decoding; threads None = no thread knob


@dataclass(frozen=True)
class RaceResult:
    tps: dict  # key -> tok/s per round it ran in
    ratio: dict  # key -> (its tok/s / the baseline's tok/s of the same round) per round
    final: tuple  # keys still in the race at the end
    dropped: dict  # key -> why
    rounds: int
    order: tuple  # every timed run's key, in the order they ran
    stop: str  # why it stopped: "clear margin" | "budget" | "max rounds"


def race(keys: Sequence[Key], run: Callable[[Key, int], float], *, n_prompts: int, judge_every: int = 1,
         neighbours: Callable[[Key], Sequence[Key]] = lambda k: (), clock: Callable[[], float] = time.perf_counter,
         deadline: float = math.inf, min_rounds: int = 3, max_rounds: int = 12, clear_margin: float = 0.15,
         drop_margin: float = 0.03, note: Callable[[int, Key], None] | None = None) -> RaceResult:
    """Time ``keys`` end to end, interleaved: every round runs every candidate still in the race
    once on the round's prompt (``run(key, prompt_index)`` -> tok/s), the order rotated by one
    each round (A B C, B C A, ...), so all candidates see the same machine. ``keys[0]`` is the
    baseline (plain decoding): every ratio is against it in the same round.

    After every ``judge_every`` rounds (a whole cycle of the prompt kinds, which disagree), once
    every candidate has ``min_rounds`` rounds: drop candidates whose best round is below the
    leader's median by ``drop_margin``; add the leader's ``neighbours`` not timed yet, while the
    budget has room for their own ``min_rounds``; stop when the leader's median is ``clear_margin`` above every
    other candidate's best round. Otherwise stop when the next round would pass ``deadline``
    (never before ``min_rounds``) or after ``max_rounds``.
    """
    base = keys[0]
    alive = list(dict.fromkeys(keys))
    tps: dict = {k: [] for k in alive}
    ratio: dict = {k: [] for k in alive}
    dropped: dict = {}
    order: list = []
    rounds, round_s, stop = 0, 0.0, "max rounds"

    def enough() -> bool:
        return all(len(ratio[k]) >= min_rounds for k in alive)

    def standings():
        med = {k: statistics.median(ratio[k]) for k in alive if ratio[k]}
        return med, max(med, key=lambda k: med[k])

    def clear() -> bool:
        med, lead = standings()
        return all(max(ratio[k]) < med[lead] * (1 - clear_margin) for k in alive if k != lead)

    while rounds < max_rounds:
        if rounds and enough() and clock() + round_s > deadline:
            stop = "budget"
            break
        tr = clock()
        i = rounds % n_prompts
        k = rounds % len(alive)
        got = {}
        for key in alive[k:] + alive[:k]:
            if note:
                note(rounds, key)
            got[key] = run(key, i)
            order.append(key)
        for key in alive:
            tps[key].append(got[key])
            ratio[key].append(got[key] / got[base] if got[base] > 0 else math.nan)
        rounds += 1
        round_s = clock() - tr
        if rounds % judge_every or not enough():
            continue
        med, lead = standings()
        for key in list(alive):  # clearly worse: even its best round is below the leader's median
            if key not in (base, lead) and max(ratio[key]) < med[lead] * (1 - drop_margin):
                alive.remove(key)
                dropped[key] = f"dropped after {rounds} rounds"
        new = [n for n in neighbours(lead) if n not in tps]
        if new and clock() + min_rounds * round_s <= deadline:  # the measured leader's neighbours,
            # while the budget has room for their own min_rounds (the predicted leader's always ran)
            for n in new:
                alive.append(n)
                tps[n], ratio[n] = [], []
            continue
        if len(alive) > 1 and clear():
            stop = "clear margin"
            break
    return RaceResult(tps, ratio, tuple(alive), dropped, rounds, tuple(order), stop)


# ---------------------------------------------------------------- the sweep

def _threads_to_try(blas) -> list[int | None]:
    """Thread counts the tuner times: none where there is no knob or the user pinned it."""
    if not blas.settable:
        return [None]
    if blas.pinned:
        return [blas.pinned]
    return thread_candidates()


def _label(key: Key) -> str:
    B, t = key
    return ("plain" if B == 1 else f"B={B}") + (f" {t}T" if t else "")


def tune(pair, *, budget_s: float = DEFAULT_BUDGET_S, progress: Progress | None = None, prompts=None,
         tokens: int = 24, finalists: int = 3, min_rounds: int = 3, max_rounds: int = 12,
         clear_margin: float = 0.15, candidates: Sequence[int] | None = None,
         threads: Sequence[int | None] | None = None, blas=None,
         clock: Callable[[], float] = time.perf_counter) -> TuneResult:
    """Measure and choose the block size and BLAS thread count for this pair on this machine
    (see the module docstring). ``threads``: thread counts to try (default: 1, powers of two,
    all cores; one value where the user pinned it; None where there is no knob)."""
    from . import BLAS
    from .prompts import CHAT_KINDS, builtin_prompts, interleave

    blas = blas or BLAS
    t0 = clock()
    deadline = t0 + budget_s
    cands = sorted(set(candidates or default_candidates(pair.drafter.args.block_size)))
    prompts = prompts or interleave(builtin_prompts(CHAT_KINDS))
    encoded = [(p.id, p.kind, p.encode(pair.tokenizer)) for p in prompts]
    note = progress or (lambda d, t, m: None)
    tlist = list(dict.fromkeys(threads if threads is not None else _threads_to_try(blas)))
    main_t = tlist[0] if len(tlist) == 1 else (default_threads() if default_threads() in tlist else tlist[-1])

    def use(t: int | None) -> None:
        if t is not None:
            set_threads(blas, t)

    def frac(x: float, msg: str):  # progress as a share of the budget
        note(min(999, int(1000 * x)), 1000, msg)

    kinds = list(dict.fromkeys(k for _, k, _ in encoded))
    context = max((ids for _, _, ids in encoded), key=len)
    # Probe at the trained block: more masks than the drafter saw in training lower the early
    # positions too. Positions past it are untrained (counted as never accepted).
    probe_block = min(pair.drafter.args.block_size, cands[-1])
    # Pass costs: every candidate block at the main thread count, the probe block at the others;
    # the meters' rounds interleave (same machine state for every thread count).
    meters = {t: CostMeter(pair.model, pair.target, pair.drafter, cands if t == main_t else [probe_block], context)
              for t in tlist}
    for r in range(3):  # a warm-up round and two timed ones
        for j, t in enumerate(tlist[r % len(tlist):] + tlist[:r % len(tlist)]):
            use(t)
            meters[t].round(lambda d, n, m, r=r, j=j: frac(0.15 * (r * len(tlist) + j + d / n) / (3 * len(tlist)), m),
                            f"pass costs{'' if t is None else f' at {t} threads'}")
    all_costs = {t: m.costs() for t, m in meters.items()}
    costs = all_costs[main_t]
    use(main_t)
    runner = Runner(pair, costs=costs)
    probe = [runner.run(Method("dflash", probe_block), ids, tokens) for _, _, ids in encoded[:3]]
    frac(0.3, "acceptance probe")
    st = merge_stats([r.stats for r in probe])
    acc = st.acceptance_by_position + [0.0] * (cands[-1] - probe_block)
    passes = sum(model_ms(Method("dflash", probe_block), r.blocks, costs) for r in probe)
    overhead = max(0.0, (sum(r.decode_s for r in probe) * 1e3 - passes) / max(1, st.cycles))
    smooth = costs.smoothed()

    def cycle(c: Costs, B: int) -> float:
        return c.draft(B) + c.verify(B)

    # Predicted speedup of (B, t) over plain decoding at the main thread count: the main curve,
    # scaled by how the probe block's cycle (or the plain step) costs at t.
    predicted: dict[Key, float] = {}
    for t, c in all_costs.items():
        scale = cycle(c, probe_block) / cycle(costs, probe_block) if cycle(costs, probe_block) else 1.0
        predicted[(1, t)] = costs.t1_ms / c.t1_ms if c.t1_ms else 1.0
        for B in cands:
            predicted[(B, t)] = predict(smooth, acc, B, overhead) / scale
    by_thread = sorted(tlist, key=lambda t: -max(predicted[(B, t)] for B in [1] + cands))
    lead_t = by_thread[0]
    ranked = sorted(cands, key=lambda B: -predicted[(B, lead_t)])
    top = ranked[:max(2, finalists)]  # the predicted runner-up is always timed
    i = cands.index(ranked[0])
    near = cands[max(0, i - 1):i + 2]  # and the neighbours of the predicted leader
    keys = [(1, lead_t)] + [(B, lead_t) for B in sorted(set(top) | set(near))]
    if len(by_thread) > 1:  # the runner-up thread count: plain and the predicted leader
        keys += [(1, by_thread[1]), (ranked[0], by_thread[1])]

    def neighbours(key: Key) -> list[Key]:
        """The next smaller and larger block at its thread count, and its block at the next
        smaller and larger thread count."""
        B, t = key
        j = tlist.index(t)
        out = [(B, u) for u in tlist[max(0, j - 1):j + 2] if u != t]
        if B > 1:
            i = cands.index(B)
            out += [(b, t) for b in cands[max(0, i - 1):i + 2] if b != B]
        return out

    def method(B: int) -> Method:
        return Method("plain") if B == 1 else Method("dflash", B)

    for B, t in keys:  # warm-up, discarded
        use(t)
        runner.run(method(B), encoded[0][2], 8)

    def run(key: Key, i: int) -> float:
        B, t = key
        use(t)
        r = runner.run(method(B), encoded[i][2], tokens)
        taus.setdefault(key, []).append(r.stats)
        return len(r.tokens) / r.total_s

    taus: dict[Key, list] = {}
    start = clock()

    def timing(rnd: int, key: Key) -> None:
        done = clock() - t0
        frac(0.3 + 0.7 * done / budget_s, f"round {rnd + 1}: timing {_label(key)}")

    res = race(keys, run, n_prompts=len(encoded), judge_every=max(1, len(kinds)), neighbours=neighbours,
               clock=clock, deadline=deadline, min_rounds=min_rounds, max_rounds=max_rounds,
               clear_margin=clear_margin, note=timing)
    log.debug("tuner race: %d rounds in %.1f s, stopped on %s", res.rounds, clock() - start, res.stop)
    out = []
    shown = [(B, lead_t) for B in [1] + cands] + [k for k in res.tps if k[1] != lead_t] \
        + [(1, t) for t in tlist if (1, t) not in res.tps]
    for key in dict.fromkeys(shown):
        B, t = key
        other = "" if t == lead_t or t is None else f"{t} threads"
        if key in res.tps and res.tps[key]:
            s = merge_stats(taus[key]) if B > 1 and taus.get(key) else None
            why = res.dropped.get(key, "")
            out.append(Candidate(B, True, round(statistics.median(res.tps[key]), 3),
                                 round(spread(res.ratio[key] if B > 1 else res.tps[key]), 4),
                                 round(statistics.median(res.ratio[key]), 4),
                                 round(s.mean_acceptance_length, 3) if s else None,
                                 round(predicted.get(key, 1.0), 4), len(res.tps[key]),
                                 "; ".join(x for x in (other, why) if x), key in res.final, t))
        else:
            out.append(Candidate(B, False, predicted=round(predicted[key], 4),
                                 tau=round(expected_tokens(acc, B), 3) if B > 1 else None,
                                 note="; ".join(x for x in (other, "ranked out by the cost model") if x), threads=t))
    best, best_t = pick(out)
    use(best_t)
    return TuneResult(tune_key(pair), best, datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      tuple(out), costs, tuple(round(x, 4) for x in acc), tuple(kinds),
                      tokens, budget_s, round(clock() - t0, 2), FORMAT, best_t)


def ensure_tuned(pair, budget_s: float | None = None, progress: Progress | None = None, *,
                 root: Path | None = None, tune_fn: Callable[..., TuneResult] = tune) -> TuneResult | None:
    """The stored result for this machine and pair, tuning first (within ``budget_s``, default
    ``DEFAULT_BUDGET_S``) and storing it if there is none; None when the user skipped tuning.
    Applies the result's BLAS thread count. Which block size wins (the flag, --no-tune, this
    result) is decided by ``session.choose_block``; ``best == 1`` means "off"."""
    key = tune_key(pair)
    result = load_result(key, root)
    if result is None:
        budget = budget_s or DEFAULT_BUDGET_S
        log.info("no tuned block size for this machine and pair: tuning (at most ~%.0f s)", budget)
        try:
            result = replace(tune_fn(pair, budget_s=budget, progress=progress), key=key)
        except TuneSkipped:  # threads (H17b): skipped by the user; nothing stored, tuned next launch
            apply_threads(None)
            return None
        path = save_result(result, root)
        log.info("tuning result stored in %s", path)
    apply_threads(result)  # threads (H17b)
    return result


def apply_threads(result: TuneResult | None, blas=None) -> int | None:
    """Set the BLAS thread count the engine runs with: the user's OPENBLAS_NUM_THREADS if set,
    else the stored choice, else the default (all cores). The count in effect; None: no knob."""
    from . import BLAS

    blas = blas or BLAS
    if not blas.settable:
        return None
    n = blas.pinned or (result.threads if result is not None else None)
    return set_threads(blas, n)

