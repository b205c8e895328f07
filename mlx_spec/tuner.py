"""Block-size tuner: measure on this machine, store the best (or "off") per machine and pair.

``tune`` runs a bounded sweep: the pass costs Tt(B), Td(B) for every candidate, one acceptance
probe at the checkpoint's block (acceptance by position gives tau for every smaller block), a cost
model that ranks the candidates, then a race of the best few against plain decoding, end to end
on the built-in prompt mix, alternating order, warm-up discarded, until the medians are stable,
dropping clearly worse candidates early, within a time budget. ``choose`` (pure) picks the
winner. The result is stored as JSON under ``<cache>/tuning/`` keyed by everything that changes
the answer (``tune_key``); ``ensure_tuned`` is what generate/chat/serve call on start.
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
from .costs import Costs, Progress, measure_costs

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 90.0
FORMAT = 1


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

    @property
    def label(self) -> str:
        return "off" if self.block == 1 else str(self.block)


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

    @property
    def block_size(self) -> int:
        return self.best

    @property
    def source(self) -> str:
        day = self.date[:10]
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
                    "measured", "median_tps", "spread", "speedup", "tau", "predicted", "rounds", "note", "final")}}
                    for c in self.candidates],
                "costs": self.costs.as_dict() if self.costs else None,
                "acceptance_by_position": list(self.acceptance_by_position),
                "prompt_kinds": list(self.prompt_kinds), "tokens_per_run": self.tokens_per_run,
                "budget_s": self.budget_s, "elapsed_s": self.elapsed_s}

    @classmethod
    def from_dict(cls, d: dict) -> "TuneResult":
        def block(x):
            return 1 if x == "off" else int(x)

        cands = tuple(Candidate(block(c["block"]), bool(c["measured"]), c.get("median_tps"), c.get("spread"),
                                c.get("speedup"), c.get("tau"), c.get("predicted"), int(c.get("rounds", 0)),
                                c.get("note", ""), bool(c.get("final", False))) for c in d["candidates"])
        return cls(d["key"], block(d["best"]), str(d["date"]), cands,
                   Costs.from_dict(d["costs"]) if d.get("costs") else None,
                   tuple(float(x) for x in d.get("acceptance_by_position", ())),
                   tuple(d.get("prompt_kinds", ())), int(d.get("tokens_per_run", 0)),
                   float(d.get("budget_s", 0)), float(d.get("elapsed_s", 0)), int(d.get("format", FORMAT)))


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


def choose(trials: Sequence[Candidate], margin: float = 0.02, tie: float = 0.01) -> int:
    """The winning block (1 = off) from the final candidates' median speedups vs plain.

    Speculation must beat plain by ``margin`` (else "off": same output, less memory); among
    candidates within ``tie`` of the best, the smallest block wins (cheaper, steadier).
    """
    spec = [c for c in trials if c.block > 1 and c.final and c.speedup is not None and not math.isnan(c.speedup)]
    if not spec:
        return 1
    best = max(c.speedup for c in spec)
    if best < 1.0 + margin:
        return 1
    return min(c.block for c in spec if c.speedup >= best * (1 - tie))


def default_candidates(checkpoint_block: int) -> list[int]:
    top = max(checkpoint_block, 16)
    return sorted({b for b in (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32) if b <= top} | {checkpoint_block, top})


# ---------------------------------------------------------------- the sweep

def tune(pair, *, budget_s: float = DEFAULT_BUDGET_S, progress: Progress | None = None, prompts=None,
         tokens: int = 24, finalists: int = 3, min_rounds: int = 3, max_rounds: int = 12,
         clear_margin: float = 0.15,
         candidates: Sequence[int] | None = None) -> TuneResult:
    """Measure and choose the block size for this pair on this machine (see module docstring)."""
    from .prompts import builtin_prompts, interleave

    t0 = time.perf_counter()
    deadline = t0 + budget_s
    cands = sorted(set(candidates or default_candidates(pair.drafter.args.block_size)))
    prompts = prompts or interleave(builtin_prompts())
    encoded = [(p.id, p.kind, p.encode(pair.tokenizer)) for p in prompts]
    note = progress or (lambda d, t, m: None)

    def frac(x: float, msg: str):  # progress as a share of the budget
        note(min(999, int(1000 * x)), 1000, msg)

    kinds = list(dict.fromkeys(k for _, k, _ in encoded))
    context = max((ids for _, _, ids in encoded), key=len)
    costs = measure_costs(pair.model, pair.target, pair.drafter, cands, context, reps=2,
                          progress=lambda d, t, m: frac(0.15 * d / t, m))
    runner = Runner(pair, costs=costs)
    # Probe at the trained block: more masks than the drafter saw in training lower the early
    # positions too. Positions past it are untrained (counted as never accepted).
    probe_block = min(pair.drafter.args.block_size, cands[-1])
    probe = [runner.run(Method("dflash", probe_block), ids, tokens) for _, _, ids in encoded[:3]]
    frac(0.3, "acceptance probe")
    st = merge_stats([r.stats for r in probe])
    acc = st.acceptance_by_position + [0.0] * (cands[-1] - probe_block)
    passes = sum(model_ms(Method("dflash", probe_block), r.blocks, costs) for r in probe)
    overhead = max(0.0, (sum(r.decode_s for r in probe) * 1e3 - passes) / max(1, st.cycles))
    smooth = costs.smoothed()
    predicted = {B: predict(smooth, acc, B, overhead) for B in cands}
    ranked = sorted(cands, key=lambda B: -predicted[B])
    alive = [1] + sorted(ranked[:finalists])
    method = {B: Method("plain") if B == 1 else Method("dflash", B) for B in alive}
    for B in alive:  # warm-up, discarded
        runner.run(method[B], encoded[0][2], 8)
    tps: dict[int, list[float]] = {B: [] for B in alive}
    ratio: dict[int, list[float]] = {B: [] for B in alive}
    taus: dict[int, list] = {B: [] for B in alive}
    dropped: dict[int, str] = {}
    leader_hist: list[tuple[int, float]] = []
    rounds = 0
    round_s = 0.0
    # The budget bounds the optional rounds; min_rounds run unless the answer is already clear
    # (one close round is noise: a 2 s budget once stored block 6 at tau 1.00).
    def standings():
        med = {B: statistics.median(ratio[B]) for B in alive}
        return med, max(alive, key=lambda B: med[B])

    def clear() -> bool:
        med, lead = standings()
        return all(max(ratio[B]) < med[lead] * (1 - clear_margin) for B in alive if B != lead)

    while rounds < max_rounds and (rounds == 0 or time.perf_counter() + round_s < deadline
                                   or (rounds < min_rounds and not clear())):
        tr = time.perf_counter()
        _, _, ids = encoded[rounds % len(encoded)]
        k = rounds % len(alive)
        got = {}
        for B in alive[k:] + alive[:k]:
            run = runner.run(method[B], ids, tokens)
            got[B] = len(run.tokens) / run.total_s
            taus[B].append(run.stats)
        for B in alive:
            tps[B].append(got[B])
            ratio[B].append(got[B] / got[1])
        rounds += 1
        round_s = time.perf_counter() - tr
        frac(0.3 + 0.7 * (time.perf_counter() - t0) / budget_s, f"round {rounds}: " + ", ".join(
            f"{'off' if B == 1 else B} x{statistics.median(ratio[B]):.2f}" for B in alive))
        if rounds < max(min_rounds, len(kinds)) or rounds % len(kinds):
            continue  # judge only after whole cycles of the prompt kinds (they disagree)
        med, lead = standings()
        for B in list(alive):  # clearly worse: even its best round is below the leader's median
            if B not in (1, lead) and max(ratio[B]) < med[lead] * 0.97:
                alive.remove(B)
                dropped[B] = f"dropped after {rounds} rounds"
        leader_hist.append((lead, med[lead]))
        if len(leader_hist) >= 2:
            (a, ma), (b, mb) = leader_hist[-2:]
            if a == b and abs(ma - mb) <= 0.02 * mb:
                break
    out = []
    for B in cands if 1 in cands else [1] + cands:
        if B in tps:
            s = merge_stats(taus[B]) if B > 1 else None
            out.append(Candidate(B, True, round(statistics.median(tps[B]), 3),
                                 round(spread(ratio[B] if B > 1 else tps[B]), 4),
                                 round(statistics.median(ratio[B]), 4),
                                 round(s.mean_acceptance_length, 3) if s else None,
                                 round(predicted.get(B, 1.0), 4), len(tps[B]), dropped.get(B, ""), B in alive))
        else:
            out.append(Candidate(B, False, predicted=round(predicted[B], 4),
                                 tau=round(expected_tokens(acc, B), 3), note="ranked out by the cost model"))
    return TuneResult(tune_key(pair), choose(out), datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      tuple(out), costs, tuple(round(x, 4) for x in acc), tuple(dict.fromkeys(k for _, k, _ in encoded)),
                      tokens, budget_s, round(time.perf_counter() - t0, 2))


def ensure_tuned(pair, args, progress: Progress | None = None, *, root: Path | None = None,
                 tune_fn: Callable[..., TuneResult] = tune) -> tuple[int | None, str | None]:
    """(block size, source) for a pair: --block-size, --no-tune, the stored result, or a fresh tune.

    Block size 1 means the tuner chose "off": run plain decoding (the source says why).
    """
    if pair.drafter is None:
        return None, None
    if getattr(args, "block_size", None) is not None:
        return args.block_size, "flag"
    ckpt = pair.drafter.args.block_size
    if getattr(args, "no_tune", False):
        return ckpt, "checkpoint (--no-tune)"
    key = tune_key(pair)
    result = load_result(key, root)
    if result is None:
        budget = getattr(args, "tune_budget", None) or DEFAULT_BUDGET_S
        log.info("no tuned block size for this machine and pair: tuning (at most ~%.0f s)", budget)
        result = replace(tune_fn(pair, budget_s=budget, progress=progress), key=key)
        path = save_result(result, root)
        log.info("tuning result stored in %s", path)
    return result.block_size, result.source

