"""Block-size tuner: measure on this machine, store the best (or "off") per machine and pair.

The choice is made to be the same run after run. At greedy on fixed prompts the acceptance is
deterministic; only timings are noisy. So ``tune`` decides from

1. the **pass-cost curve**: T1, Td(B), Tt(B) for every candidate block (and T1 and the reference
   block at every other BLAS thread count), each pass timed alone many times in interleaved,
   rotated rounds, medians (``costs.CostMeter``), with the standard error of each median;
2. the **acceptance by position** of one deterministic probe (DFlash at the checkpoint's block on
   a fixed, balanced set of built-in prompts): E(B) = 1 + sum of the first B-1 positions, for
   every block;
3. the **per-cycle overhead** (loop and host time beyond the two passes) and the plain loop's
   overhead beyond T1, each pooled (a median of per-run residuals) over every end-to-end run of
   ``race``: plain decoding, the predicted best few, always the predicted runner-up and the
   neighbours of the leader, and the runner-up thread count, interleaved (every round every
   candidate once, the order rotated: ABAB, never one candidate's runs back to back), dropping
   clear losers, adding the measured leader's neighbours, stopping on a clear margin.

The model speedup of a block is E(B) * (T1 + plain overhead) / (Td(B) + Tt(B) + overhead).
``decide`` (pure) picks from it: candidates within the noise of the best (twice the combined
standard error, at least ``NOISE_FLOOR``) are a tie, broken by a fixed rule (the largest block
that still buys expected tokens; the default thread count) and the result says so. The race
calibrates and checks: it overrides the model only on a clear margin (``race_check``): a
candidate faster than the model's choice in every one of at least ``CHECK_ROUNDS`` rounds both
ran, by a mean gain of at least ``CLEAR_Z`` standard errors of the race's own run-to-run noise
(and ``NOISE_FLOOR``), so a block faster by well over the race's noise can win within the
default budget's 3 rounds (simulated: a 20 % gain at 3-6 % run-to-run noise; the quiet runs
here, runs/tune8-7..9, measured a noise that put a clear margin at +13 to +37 %), and a noisy or
split race cannot flip the choice.

The whole sweep keeps to its budget: the probe (fixed work) runs first, the pass-cost rounds take
their share while the race's core still fits, and the race is planned from the measured costs
(candidates it cannot afford are not raced, and ``why`` names them) and checks the deadline
before every round. The result reports the time taken against the budget (``TuneResult.timing``).

The result is stored as JSON under ``<cache>/tuning/`` keyed by everything that changes the
answer (``tune_key``: the machine and the models' weights, however they are spelled; thread
count not included: it is part of the answer); ``ensure_tuned`` is what generate/chat/serve
call on start, and it applies the stored thread count.
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
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

from .adaptive import expected_tokens
from .bench import Method, Runner, model_ms, spread
from .blas import cpuinfo, default_threads, set_threads, thread_candidates
from .costs import Costs, CostMeter, Progress
from .errors import MlxSpecError
from .stats import Stats

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 90.0
FORMAT = 3  # 2: the BLAS thread count is part of the answer; 3: chosen by the model (noise, why)
READ_FORMATS = (2, 3)  # a format-2 result has all the engine uses (block, threads, curve, prior): it loads
NOISE_FLOOR = 0.03  # model speedups closer than this are a tie, however small the measured noise
NOISE_CAP = 0.10  # a tie tolerance above this: timings too noisy to separate blocks (no tie, best score)
CHECK_ROUNDS = 3  # the race overrides the model only with this many rounds run by both (one of each prompt kind)
CLEAR_Z = 3.0  # a clear margin: the mean gain at least this many standard errors of the race's run-to-run noise
MIN_NOISE_DF = 4  # ... that noise measured with at least this many degrees of freedom (3 candidates x 3 rounds)
BUDGET_RESERVE = 0.05  # share of the budget the plan leaves for a round slower than predicted
MIN_COST_ROUNDS = 3  # timed pass-cost rounds always run (``cost_rounds[0]`` of them while the budget allows)
# How ``tune`` shares out its budget. The pass costs' share is the one that changes what is
# measured: past ``cost_rounds[0]`` a pass-cost round runs only within it. The probe is fixed work
# and the race takes what is left (planned from the measured costs, stopped by the deadline), so
# the probe's share only places the progress bar.
PROBE_SHARE = 0.15
COSTS_SHARE = 0.3


class TuneSkipped(MlxSpecError):
    """The user skipped first-launch tuning (a key in the TUI): nothing is stored."""


# ---------------------------------------------------------------- the key

def cpu_name() -> str:
    try:
        from . import backend

        b = backend.current()
        if b.gpu and not b.faked:
            return b.device
    except Exception:
        pass
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def _backend_kind() -> str:
    from . import backend

    return backend.current().kind


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
            "backend": _backend_kind(),
            "blas": " ".join(x for x in (BLAS.name, BLAS.path, BLAS.version) if x),  # a new library (version) re-tunes
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


def legacy_fingerprint(path_or_id: str) -> str:
    """The key's model hash before session 7: the resolved folder, the weight files' names, sizes
    and mtimes, config.json. It depends on where the files lie and when they were written; kept
    only to find results stored under it (``load_result`` moves them to the weights' key)."""
    d = _model_dir(path_or_id)
    h = hashlib.sha256(str(d.resolve() if d else path_or_id).encode())
    if d is not None:
        for f in sorted(d.glob("*.json")) + sorted(d.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


SAMPLE_BYTES = 1 << 16  # bytes of tensor data read at each of SAMPLES points spread over a weight file
SAMPLES = 16
HEADER_MAX = 1 << 24  # a safetensors header longer than this is not read whole (its length is hashed)


def _file_digest(h, f: Path) -> None:
    """Add one weight file: its name, size, safetensors header (tensor names, dtypes, shapes,
    offsets) and 16 samples of its data spread evenly, the last at its end (about a MiB, whatever
    the file's size); a file in a Hugging Face cache also by its blob's name (the sha256 of its
    content)."""
    size = f.stat().st_size
    h.update(f"{f.name}:{size}".encode())
    real = f.resolve()
    if real.parent.name == "blobs" and len(real.name) == 64:
        h.update(real.name.encode())
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        start = 8 + n if 0 < n <= HEADER_MAX else 0
        h.update(head + (fh.read(n) if start else b""))
        span = max(0, size - SAMPLE_BYTES - start)
        for at in sorted({start + span * k // (SAMPLES - 1) for k in range(SAMPLES)}):
            fh.seek(at)
            h.update(fh.read(SAMPLE_BYTES))


def weights_id(path_or_id: str) -> str | None:
    """The identity of a checkpoint's weights, not of how the command spelled it: a digest of
    config.json, the safetensors index, draft_vocab.json (a drafter's) and every weight file's
    name, size, header and 16 64 KiB samples of its data (cheap: no file is hashed whole; an
    edit that misses every sample, e.g. one retrained tensor in a large file, is not told apart:
    `mlx_spec tune` again after such an edit; a Hugging Face blob is also known by its sha256). The
    default target's id and its cache folder, a Hugging Face repo and its local snapshot, a
    relative and an absolute path all give the same one; a retrained or re-quantized checkpoint
    another. None when the files cannot be found here."""
    d = _model_dir(path_or_id)
    if d is None:
        return None
    from .loading import DRAFT_VOCAB_FILE

    d = d.resolve()
    h = hashlib.sha256()
    for name in ("config.json", DRAFT_VOCAB_FILE, *sorted(x.name for x in d.glob("*.safetensors.index.json"))):
        f = d / name
        if f.is_file():
            h.update(f"{name}:".encode() + f.read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        _file_digest(h, f)
    return h.hexdigest()[:20]


def quantization(model) -> str:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return f"q{m.bits}g{m.group_size}"
    params = tree_flatten(model.parameters())
    return str(params[0][1].dtype).replace("mlx.core.", "") if params else "none"


def _weights(path_or_id: str) -> str:
    return weights_id(path_or_id) or "id:" + hashlib.sha256(path_or_id.encode()).hexdigest()[:16]


def tune_key(pair) -> dict:
    """What the answer depends on: the machine and, per model, the weights' identity
    (``weights_id``) and quantization as loaded. The ``id`` (as the command spelled it) is kept
    for people reading the file, and is no part of the key (``identity``)."""
    return {"machine": machine_info(),
            "target": {"id": pair.target_id, "weights": _weights(pair.target_id), "quant": quantization(pair.model)},
            "drafter": {"id": pair.drafter_id, "weights": _weights(pair.drafter_id),
                        "quant": quantization(pair.drafter), "draft_vocab": pair.drafter.vocab_size_drafted or "full"}}


def identity(key: dict) -> dict:
    """The key without what does not change the answer: a model's ``id`` where its ``weights``
    identify it (a key from before session 7, with ``hash``, keeps its id: it was part of it)."""
    return {k: ({n: x for n, x in v.items() if n != "id"} if isinstance(v, dict) and "weights" in v else v)
            for k, v in key.items()}


def legacy_key(key: dict) -> dict | None:
    """The key the same models had before session 7 (the spelled id and ``legacy_fingerprint``),
    where results tuned then are stored; None for a key that is not a weights key."""
    if not all(isinstance(key.get(k), dict) and "weights" in key[k] for k in ("target", "drafter")):
        return None
    old = {}
    for k in ("target", "drafter"):
        v = {n: x for n, x in key[k].items() if n != "weights"}
        old[k] = {"id": v.pop("id", None), "hash": legacy_fingerprint(str(key[k].get("id"))), **v}
    return {"machine": key.get("machine"), **old}


def models_of(target: str, drafter: str) -> dict:
    """What ``same_models`` compares a stored key with, computed once: per model, the id as
    spelled and its ``weights_id`` (the old fingerprint only where a stored key is that old)."""
    return {k: (v, weights_id(v)) for k, v in (("target", target), ("drafter", drafter))}


def same_models(key: dict, models: dict) -> bool:
    """Whether a stored key is for these models (``models_of``; spelled any way), before loading
    them: the weights' identity, or for a key from before session 7 the id and its old hash."""
    got = {k: key.get(k) if isinstance(key.get(k), dict) else {} for k in models}
    if all("weights" in v for v in got.values()):
        return all(got[k]["weights"] == w and w is not None for k, (_, w) in models.items())
    return all(got[k].get("id") == spelled and got[k].get("hash") == legacy_fingerprint(spelled)
               for k, (spelled, _) in models.items())


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(identity(key), sort_keys=True).encode()).hexdigest()[:20]


# ---------------------------------------------------------------- the result

@dataclass(frozen=True)
class Candidate:
    block: int  # 1 = off (plain decoding)
    measured: bool  # raced end to end (else only modelled)
    median_tps: float | None = None  # committed tok/s after the first step (prefill excluded), median
    spread: float | None = None  # (max - min) / median over rounds: of the speedup (off: of tok/s)
    speedup: float | None = None  # race: median over rounds of tok/s / plain tok/s (same prompt)
    tau: float | None = None  # E(B) from the deterministic probe (expected tokens per cycle)
    predicted: float | None = None  # model speedup over plain (the score ``decide`` compares)
    rounds: int = 0
    note: str = ""
    final: bool = False  # still in the race at the end
    threads: int | None = None  # BLAS threads it ran with (None: no thread knob here)
    noise: float | None = None  # relative standard error of ``predicted`` (from the pass timings)

    @property
    def label(self) -> str:
        return "off" if self.block == 1 else str(self.block)

    @property
    def key(self) -> tuple[int, int | None]:
        return self.block, self.threads

    @property
    def score(self) -> float | None:
        """The model speedup (what ``decide`` compares), else the race's (older results)."""
        return self.predicted if self.predicted is not None else self.speedup


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
    why: str = ""  # how ``decide`` chose (ties named), shown by `mlx_spec tune`
    overhead_ms: float | None = None  # per-cycle time beyond the two passes, pooled over the race
    phases: dict = field(default_factory=dict)  # where the time went: probe_s, costs_s, cost_rounds, race_s, ...

    @property
    def block_size(self) -> int:
        return self.best

    @property
    def timing(self) -> str:
        """The elapsed time against the budget, by phase (what `mlx_spec tune` prints). ``tune``
        writes every phase; a result without phases (a file stored before session 7) has the
        first part alone."""
        line = f"{self.elapsed_s:.0f} s of {self.budget_s:.0f} s"
        p = self.phases
        if not p:
            return line
        parts = [f"probe {p['probe_s']:.0f} s", f"pass costs {p['costs_s']:.0f} s ({p['cost_rounds']} rounds)",
                 f"race {p['race_s']:.0f} s ({p['race_rounds']} rounds, stopped on {p['race_stop']})"]
        over = self.elapsed_s - self.budget_s
        fixed = p["probe_s"] + p["costs_s"]
        note = ""
        if over > 0:
            note = (f"; over budget by {over:.0f} s" + (": the probe and the minimum pass-cost rounds alone took "
                                                       f"{fixed:.0f} s" if fixed > self.budget_s else ""))
        return f"{line} ({', '.join(parts)}){note}"

    @property
    def source(self) -> str:
        day = self.date[:10] + (f", {self.threads} BLAS thread{'s' if self.threads != 1 else ''}"
                                if self.threads else "")
        if self.best > 1:
            return f"tuned {day}"
        spec = [c for c in self.candidates if c.block > 1 and c.score is not None and c.threads == self.threads]
        best = max(spec, key=lambda c: c.score, default=None)
        why = f"; best DFlash B={best.block} x{best.score:.2f}" if best else ""
        return f"tuned {day}: off — plain decoding faster on this machine{why}"

    def as_dict(self) -> dict:
        return {"format": self.format, "best": "off" if self.best == 1 else self.best, "date": self.date,
                "source": self.source, "key": self.key,
                "candidates": [{"block": c.label, **{k: getattr(c, k) for k in (
                    "measured", "median_tps", "spread", "speedup", "tau", "predicted", "rounds", "note", "final",
                    "threads", "noise")}}
                    for c in self.candidates],
                "costs": self.costs.as_dict() if self.costs else None,
                "acceptance_by_position": list(self.acceptance_by_position),
                "prompt_kinds": list(self.prompt_kinds), "tokens_per_run": self.tokens_per_run,
                "budget_s": self.budget_s, "elapsed_s": self.elapsed_s, "threads": self.threads,
                "why": self.why, "overhead_ms": self.overhead_ms, "phases": dict(self.phases)}

    @classmethod
    def from_dict(cls, d: dict) -> "TuneResult":
        def block(x):
            return 1 if x == "off" else int(x)

        cands = tuple(Candidate(block(c["block"]), bool(c["measured"]), c.get("median_tps"), c.get("spread"),
                                c.get("speedup"), c.get("tau"), c.get("predicted"), int(c.get("rounds", 0)),
                                c.get("note", ""), bool(c.get("final", False)), _opt_int(c.get("threads")),
                                c.get("noise"))
                      for c in d["candidates"])
        return cls(d["key"], block(d["best"]), str(d["date"]), cands,
                   Costs.from_dict(d["costs"]) if d.get("costs") else None,
                   tuple(float(x) for x in d.get("acceptance_by_position", ())),
                   tuple(d.get("prompt_kinds", ())), int(d.get("tokens_per_run", 0)),
                   float(d.get("budget_s", 0)), float(d.get("elapsed_s", 0)), int(d.get("format", FORMAT)),
                   _opt_int(d.get("threads")), str(d.get("why", "")), d.get("overhead_ms"), dict(d.get("phases") or {}))


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


def result_path(key: dict, root: Path | None = None) -> Path:
    from .default_target import cache_dir

    return (root or cache_dir()) / "tuning" / f"{key_hash(key)}.json"


def save_result(result: TuneResult, root: Path | None = None, *, keep_existing: bool = False) -> Path:
    """Write ``result`` under its key (atomically). ``keep_existing``: only where no result is
    stored yet (a migration must not overwrite what a ``tune`` in another process just saved)."""
    path = result_path(result.key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result.as_dict(), indent=2))
    if not keep_existing:
        tmp.replace(path)
        return path
    try:
        os.link(tmp, path)  # fails if a result is there: that one stays
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _read(path: Path, key: dict) -> TuneResult | None:
    if not path.exists():
        return None
    try:
        result = TuneResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring unreadable tuning result %s (%s); re-tuning", path, e)
        return None
    if result.format not in READ_FORMATS or not isinstance(result.key, dict) or identity(result.key) != identity(key):
        return None
    return result


def load_result(key: dict, root: Path | None = None) -> TuneResult | None:
    """The stored result for this key (the models however spelled: ``identity``); None if
    absent, stale or unreadable. A result stored before session 7 under the spelled id
    (``legacy_key``) is migrated: saved under this key (the old file is left as it was) and
    returned with it."""
    result = _read(result_path(key, root), key)
    if result is not None:
        return result
    old = legacy_key(key)
    found = _read(result_path(old, root), old) if old is not None else None
    if found is None:
        return None
    result = replace(found, key=key)
    try:
        log.info("tuning result %s moved to the weights' key: %s", result_path(old, root),
                 save_result(result, root, keep_existing=True))
    except OSError as e:  # a read-only cache: use it as it is, move it another time
        log.warning("could not move tuning result %s to the weights' key (%s)", result_path(old, root), e)
    return result


# ---------------------------------------------------------------- pure choice

def cycle_overhead(run, costs: Costs, spec: bool) -> float | None:
    """A run's measured time per cycle after the first step minus its passes' model time
    (``bench.model_ms``: a drafted run's last cycle with one token of room verifies the anchor
    alone, a Tt(1) pass, not a plain step's T1); None for a run without cycles."""
    n = sum(run.blocks.values())
    if not n:
        return None
    return (run.decode_s * 1e3 - model_ms(Method("dflash" if spec else "plain"), run.blocks, costs)) / n


def _with_overhead(passes_ms: float, overhead_ms: float) -> float:
    """A loop's time from its passes and the overhead on top, never below half the passes (a loop
    that overlaps passes runs cheaper than the passes alone, but not for free)."""
    return max(passes_ms / 2, passes_ms + overhead_ms)


def predict(costs: Costs, acceptance_by_position: Sequence[float], block: int, overhead_ms: float = 0.0,
            plain_ms: float | None = None) -> float:
    """Model speedup of DFlash at ``block`` over plain decoding: E(B) * plain step / cycle, the
    plain step ``plain_ms`` (default T1) and the cycle Td(B) + Tt(B) + ``overhead_ms``. The
    overhead may be negative (a loop that overlaps passes runs cheaper than the passes alone);
    a cycle is never taken below half its passes."""
    if block <= 1:
        return 1.0
    passes = costs.step_ms(block, block)
    return expected_tokens(acceptance_by_position, block) * (plain_ms or costs.t1_ms) / \
        _with_overhead(passes, overhead_ms)


@dataclass(frozen=True)
class Decision:
    block: int  # 1 = off
    threads: int | None
    why: str  # one line: the tie (if any) and the rule that broke it
    tied: tuple[int, ...] = ()  # blocks within noise of the best at the chosen thread count


def _tol(a: Candidate, b: Candidate | None, floor: float) -> float:
    """How far apart two model speedups must be to count as different: twice their combined
    standard error, at least ``floor``."""
    return max(floor, 2 * math.hypot(_sd(a), _sd(b)))


def _sd(c: Candidate | None) -> float:
    """A candidate's noise; an unmeasured one (None, nan, inf; no candidate) counts as none, neither
    a free pass nor a veto."""
    return c.noise if c is not None and c.noise is not None and math.isfinite(c.noise) else 0.0


def _pooled(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates with one noise each: the median of theirs. Their passes were timed in the
    same rounds on the same machine; one block's median absolute deviation over a dozen rounds
    is itself noisy, and one wide estimate must not widen every comparison."""
    xs = [c.noise for c in cands if c.noise is not None and math.isfinite(c.noise)]
    n = statistics.median(xs) if xs else None
    return [replace(c, noise=n) for c in cands]


def _lbl(c: Candidate) -> str:
    return "plain" if c.block == 1 else f"B={c.block}"


def _names(xs: Sequence[str]) -> str:
    return xs[0] if len(xs) == 1 else f"{', '.join(xs[:-1])} and {xs[-1]}"


def decide(cands: Sequence[Candidate], *, default_threads: int | None = None, floor: float = NOISE_FLOOR,
           min_gain: float = 0.02, cap: float = NOISE_CAP) -> Decision:
    """The (block, threads) to store, from the model speedups (``predicted``, with ``noise``) and
    the deterministic expected tokens per cycle (``tau`` = E(B)). Pure: the same inputs always
    give the same answer, and inputs within noise give the same answer by rule, not by chance.

    - Thread count: the one whose best block scores highest; if the ``default_threads`` count
      (all cores, what a machine never tuned runs) has a best block within noise of it, the
      default. (Plain's own thread count is chosen the same way, and is where "off" runs.)
    - Off: no block beats plain by its own noise (twice the standard error of the gain, at least
      ``floor``): plain is the safe choice, and a gain within the noise does not overturn it.
    - Block: the blocks within noise of the best that also beat plain by that much are a tie (a
      block the model puts below that never is). It goes to the largest block that still buys
      expected tokens (E(B) at least ``min_gain`` above the last block kept, going up from the
      smallest tied one). A tolerance above ``cap`` (timings too noisy to separate blocks) makes
      no tie: the best score is taken, and ``why`` says so.
      A tie's lower end moves with the timings; where E(B) stops growing (the drafter's trained
      block) does not, so this lands on the same block run after run. It also leaves the fixed
      engine (``--no-adaptive``) the longer drafts that code and agent edits accept; the per-cycle
      policy chooses each cycle's length itself.
    """
    ok = [c for c in cands if c.predicted is not None and not math.isnan(c.predicted)]
    plains = [c for c in ok if c.block == 1]
    plain = max(plains, key=lambda c: c.predicted, default=None)
    if plain is not None and plain.threads != default_threads:  # a faster plain count must be clearly faster
        dflt = next((c for c in plains if c.threads == default_threads), None)
        if dflt is not None and dflt.predicted >= plain.predicted * (1 - _tol(dflt, plain, floor)):
            plain = dflt
    by_t: dict = {}
    for c in ok:
        if c.block > 1:
            by_t.setdefault(c.threads, []).append(c)
    by_t = {t: _pooled(cs) for t, cs in by_t.items()}
    if not by_t:
        t = plain.threads if plain else default_threads
        return Decision(1, t, "off: no block to draft with" if plain else "nothing could be measured: plain decoding")
    tops = {t: max(cs, key=lambda c: (c.predicted, -c.block)) for t, cs in by_t.items()}
    lead_t = max(tops, key=lambda t: (tops[t].predicted, t == default_threads))
    words = []
    if len(tops) > 1:
        lead = tops[lead_t]
        others = sorted((t for t in tops if t != lead_t), key=lambda t: -tops[t].predicted)
        near = [t for t in others if tops[t].predicted >= lead.predicted * (1 - _tol(tops[t], lead, floor))]
        if default_threads in near:
            gap = 1 - tops[default_threads].predicted / lead.predicted
            words.append(f"{lead_t} and {default_threads} threads within noise ({gap:.1%}); kept {default_threads}, "
                         "the default (all cores)")
            lead_t = default_threads
        else:
            nxt = tops[others[0]]
            words.append(f"{lead_t} threads (x{lead.predicted:.2f}) over {others[0]} (x{nxt.predicted:.2f})")
    spec = sorted(by_t[lead_t], key=lambda c: c.block)
    best = tops[lead_t]
    base = plain.predicted if plain else 1.0
    # a block must beat plain by more than its own noise (twice the standard error of the gain, at
    # least the floor): a gain within the noise does not overturn plain, the safe choice
    noisy = _tol(best, plain, 0.0)
    need = max(floor, noisy)
    if best.predicted < base * (1 + need):
        what = "its noise" if noisy >= floor else "the floor"
        why = (f"off: the best block {_lbl(best)} x{best.predicted:.2f} does not beat plain"
               f"{'' if plain is None or plain.threads is None else f' at {plain.threads} threads'} "
               f"(x{base:.2f}) by {need:.1%} ({what})")
        return Decision(1, plain.threads if plain else lead_t, "; ".join([why] + words))
    tol = _tol(best, best, floor)
    if tol > cap:  # a tie this wide would be "the largest block" whatever the timings say
        return Decision(best.block, lead_t, "; ".join(
            [f"{_lbl(best)} x{best.predicted:.2f}: timings too noisy to separate blocks (tolerance {tol:.1%} "
             f"above {cap:.0%}), took the best score"] + words), (best.block,))
    # only blocks that beat plain by that much themselves can be tied
    tied = [c for c in spec if c.predicted >= max(best.predicted * (1 - tol), base * (1 + need))]
    kept, gain_of = [], {}
    for c in tied:  # smallest first: a larger block must buy expected tokens over the last kept one
        prev = kept[-1] if kept else None
        if prev is None or c.tau is None or prev.tau is None or c.tau >= prev.tau + min_gain:
            kept.append(c)
        else:
            gain_of[c.block] = prev.block
    win = kept[-1]
    if len(tied) == 1:
        rest = [c for c in spec if c is not best]
        nxt = max(rest, key=lambda c: c.predicted, default=None)
        why = f"{_lbl(best)} x{best.predicted:.2f}" + (
            f", next {_lbl(nxt)} x{nxt.predicted:.2f} ({1 - nxt.predicted / best.predicted:.1%} below, "
            f"tolerance {tol:.1%})" if nxt else "")
    else:
        width = max(1 - c.predicted / best.predicted for c in tied)
        names = _names([_lbl(c) for c in tied]) if len(tied) <= 4 else \
            f"B={tied[0].block} to B={tied[-1].block} ({len(tied)} blocks)"
        why = (f"{names} within noise ({width:.1%} apart, tolerance "
               f"{tol:.1%}); chose {win.block}: the largest that still buys expected tokens (where E(B) stops "
               "growing is set by the deterministic acceptance, not by timings)")
        for a in dict.fromkeys(gain_of.values()):
            bs = [f"B={b}" for b, x in gain_of.items() if x == a]
            why += f"; {_names(bs)} add{'s' if len(bs) == 1 else ''} no expected tokens over B={a}"
    return Decision(win.block, lead_t, "; ".join([why] + words), tuple(c.block for c in tied))


def default_candidates(checkpoint_block: int) -> list[int]:
    top = max(checkpoint_block, 16)
    return sorted({b for b in (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32) if b <= top} | {checkpoint_block, top})


# ---------------------------------------------------------------- the race (pure but for run)

Key = tuple  # (block, threads): block 1 = plain decoding; threads None = no thread knob


@dataclass(frozen=True)
class Lap:
    """One timed run of the race."""
    tps: float  # committed tok/s after the first step
    cycle_s: float | None = None  # seconds per cycle (a plain step or a drafted block); None: not known


def _ratio(laps: dict, base: Key, key: Key) -> list[float]:
    """``key``'s tok/s over ``base``'s in the same round (the same prompt), per round it ran in."""
    b = laps[base]
    return [lap.tps / b[r].tps if r in b and b[r].tps > 0 else math.nan for r, lap in sorted(laps[key].items())]


@dataclass(frozen=True)
class RaceResult:
    laps: dict  # key -> {round: its Lap} for every round it ran in; the first key is the baseline (plain)
    final: tuple  # keys still in the race at the end
    dropped: dict  # key -> why
    rounds: int
    order: tuple  # every timed run's key, in the order they ran
    stop: str  # why it stopped: "clear margin" | "budget" | "max rounds"

    @cached_property
    def tps(self) -> dict:
        """key -> its tok/s per round it ran in, in round order."""
        return {k: [lap.tps for _, lap in sorted(rs.items())] for k, rs in self.laps.items()}

    @cached_property
    def ratio(self) -> dict:
        """key -> its tok/s over the baseline's in the same round, per round it ran in."""
        return {k: _ratio(self.laps, next(iter(self.laps)), k) for k in self.laps}

    def paired(self, a: Key, b: Key) -> list[tuple[float, float]]:
        """The tok/s of ``a`` and of ``b`` in every round both ran (the same prompt, the same
        machine state)."""
        la, lb = self.laps.get(a, {}), self.laps.get(b, {})
        return [(la[r].tps, lb[r].tps) for r in sorted(la.keys() & lb.keys())]

    @property
    def noise(self) -> float:
        """The race's run-to-run noise (``noise_fit``'s first value)."""
        return self.noise_fit[0]

    @cached_property
    def noise_fit(self) -> tuple[float, int]:
        """(sigma, degrees of freedom): the standard deviation of one run's log(seconds per cycle)
        about a candidate effect plus a round effect, both fitted (alternating means over the
        runs there are; a candidate that joined late or was dropped has fewer). A cycle of a fixed
        block costs the same whatever the prompt's drafts accept (at greedy the prompt sets how
        many cycles a run takes, not what one costs), and what moves every candidate's cycles in
        a round alike (the round's prompt length, the machine's drift within the round) is the
        round effect, which the paired ratios cancel too: what is left is the timing's own noise
        (and a last cycle the run's room cut short). inf with no degree of freedom."""
        cells = {(k, r): math.log(lap.cycle_s) for k, rs in self.laps.items() for r, lap in rs.items()
                 if lap.cycle_s is not None and lap.cycle_s > 0}
        by_k: dict = {}
        by_r: dict = {}
        for (k, r), v in cells.items():
            by_k.setdefault(k, []).append((r, v))
            by_r.setdefault(r, []).append((k, v))
        df = len(cells) - len(by_k) - len(by_r) + 1
        if df < 1:
            return math.inf, 0
        a, b = dict.fromkeys(by_k, 0.0), dict.fromkeys(by_r, 0.0)
        for _ in range(30):  # additive fit log c = a[k] + b[r], alternating means (small tables: converges fast)
            for k, xs in by_k.items():
                a[k] = sum(v - b[r] for r, v in xs) / len(xs)
            for r, xs in by_r.items():
                b[r] = sum(v - a[k] for k, v in xs) / len(xs)
        ss = sum((v - a[k] - b[r]) ** 2 for (k, r), v in cells.items())
        return math.sqrt(ss / df), df


@dataclass(frozen=True)
class Check:
    """One raced candidate against the chosen one, over the rounds both ran."""
    key: Key
    rounds: int  # rounds both ran
    wins: int  # rounds in which it was the faster
    gain: float  # geometric mean over those rounds of its tok/s / the chosen's (1.12: 12 % faster)
    needed: float  # the gain a clear margin needs (inf: fewer than ``CHECK_ROUNDS`` rounds, or no noise measured)

    @property
    def clear(self) -> bool:
        """Faster in every round it ran with the chosen, by at least ``needed``."""
        return self.rounds > 0 and self.wins == self.rounds and self.gain >= self.needed


def check(res: RaceResult, key: Key, chosen: Key, *, rounds: int = CHECK_ROUNDS, z: float = CLEAR_Z,
          floor: float = NOISE_FLOOR, min_df: int = MIN_NOISE_DF) -> Check:
    """``key`` against ``chosen`` in the rounds both ran. A clear margin needs at least ``rounds``
    such rounds (one of each prompt kind), a win in every one, a race whose noise was measured
    with at least ``min_df`` degrees of freedom (``RaceResult.noise_fit``: with fewer, sigma
    itself is too uncertain for ``z`` to mean much), and a geometric-mean gain of at least
    ``floor`` and at least ``z`` standard errors of a paired round's noise (sqrt(2) times the
    race's run-to-run noise, over sqrt(rounds)): more rounds let a smaller margin through, a
    noisier race needs a larger one."""
    logs = [math.log(a / b) for a, b in res.paired(key, chosen) if a > 0 and b > 0]
    n = len(logs)
    gain = math.exp(statistics.fmean(logs)) if n else math.nan
    sigma, df = res.noise_fit
    enough = n >= rounds and df >= min_df
    needed = math.exp(max(math.log1p(floor), z * math.sqrt(2 / n) * sigma)) if enough else math.inf
    return Check(key, n, sum(x > 0 for x in logs), gain, needed)


def checks(res: RaceResult, chosen: Key, **kw) -> list[Check]:
    """Every other raced candidate against ``chosen`` (``check``)."""
    return [check(res, k, chosen, **kw) for k, rs in res.laps.items() if k != chosen and rs]


def race_check(res: RaceResult, chosen: Key, **kw) -> Check | None:
    """The raced candidate that beat ``chosen`` by a clear margin (``check``; the largest gain of
    those), else None. Simulated at 3 rounds of 4 candidates (the default budget's race), each
    round's prompt moving every cycle cost alike by ~10 %, the noise estimated as here (20 000
    races a figure, runs/tune8-sim.txt): a candidate equal to the chosen one passes about 1
    time in 100 (one of three equal challengers 1 in 36: harmless, equal speed), one 3 % slower
    1 in 500 (6 % run-to-run noise) to 1 in 5000 (3 %), one 20 % faster 3 times in 4 at 6 %
    noise and always at 3 %; a race whose rounds disagree never overrides."""
    return _clearest(checks(res, chosen, **kw))


def _clearest(got: Sequence[Check]) -> Check | None:
    """The largest gain among the checks with a clear margin, else None."""
    return max((c for c in got if c.clear), key=lambda c: c.gain, default=None)


def race(keys: Sequence[Key], run: Callable[[Key, int], Lap], *, n_prompts: int, judge_every: int = 1,
         neighbours: Callable[[Key], Sequence[Key]] = lambda k: (), clock: Callable[[], float] = time.perf_counter,
         deadline: float = math.inf, min_rounds: int = 3, max_rounds: int = 12, clear_margin: float = 0.15,
         drop_margin: float = 0.03, note: Callable[[int, Key], None] | None = None,
         keep: Sequence[Key] = (), cost: Callable[[Key], float] | None = None) -> RaceResult:
    """Time ``keys`` end to end, interleaved: every round runs every candidate still in the race
    once on the round's prompt (``run(key, prompt_index)`` -> its ``Lap``), the order rotated by one
    each round (A B C, B C A, ...), so all candidates see the same machine. ``keys[0]`` is the
    baseline (plain decoding): every ratio is against it in the same round. Each lap's seconds
    per cycle go to ``RaceResult.noise``, what ``race_check`` measures a margin against.

    After every ``judge_every`` rounds (a whole cycle of the prompt kinds, which disagree), once
    every candidate has ``min_rounds`` rounds: drop candidates (never the baseline nor ``keep``,
    the model's choice the race is there to check) whose best round is below the
    leader's median by ``drop_margin``; add the leader's ``neighbours`` not timed yet, while the
    budget has room for their own ``min_rounds``; stop when the leader's median is ``clear_margin`` above every
    other candidate's best round. Otherwise stop after ``max_rounds``.

    The deadline is checked before every round, the first included: the race stops when the next
    round would end past ``deadline``, ``min_rounds`` or not (the caller plans the candidates so
    that their minimum fits; a machine that slows down mid-race must not overrun the budget).
    ``cost(key)`` is one run's estimated seconds (from the pass costs): a round is predicted as
    the sum over the candidates in it, scaled by how the last round compared with its estimate;
    without it, by the last round's time per candidate (the first round then always runs).
    """
    base = keys[0]
    alive = list(dict.fromkeys(keys))
    laps: dict = {k: {} for k in alive}
    dropped: dict = {}
    order: list = []
    rounds, stop = 0, "max rounds"
    last: tuple[float, float, int] | None = None  # the last round: seconds, its estimate, candidates

    def predict_round(ks: Sequence[Key]) -> float:
        """Seconds the next round over ``ks`` should take."""
        if cost is not None:
            scale = last[0] / last[1] if last and last[1] > 0 else 1.0
            return scale * sum(cost(k) for k in ks)
        return last[0] * len(ks) / last[2] if last else 0.0

    while rounds < max_rounds:
        if clock() + predict_round(alive) > deadline:
            stop = "budget"
            break
        tr = clock()
        k = rounds % len(alive)
        for key in alive[k:] + alive[:k]:
            if note:
                note(rounds, key)
            laps[key][rounds] = run(key, rounds % n_prompts)
            order.append(key)
        rounds += 1
        last = (clock() - tr, sum(cost(k) for k in alive) if cost is not None else 0.0, len(alive))
        if rounds % judge_every or any(len(laps[k]) < min_rounds for k in alive):
            continue
        ratio = {k: _ratio(laps, base, k) for k in alive}
        med = {k: statistics.median(ratio[k]) for k in alive if ratio[k]}
        lead = max(med, key=lambda k: med[k])
        for key in list(alive):  # clearly worse: even its best round is below the leader's median
            if key not in (base, lead, *keep) and max(ratio[key]) < med[lead] * (1 - drop_margin):
                alive.remove(key)
                dropped[key] = f"dropped after {rounds} rounds"
        added = False
        for n in neighbours(lead):  # the measured leader's neighbours, each while the budget has
            # room for its own min_rounds in rounds with everyone else (the predicted leader's always ran)
            if n not in laps and clock() + min_rounds * predict_round(alive + [n]) <= deadline:
                alive.append(n)
                laps[n] = {}
                added = True
        if added:
            continue
        if len(alive) > 1 and all(max(ratio[k]) < med[lead] * (1 - clear_margin) for k in alive if k != lead):
            stop = "clear margin"
            break
    return RaceResult(laps=laps, final=tuple(alive), dropped=dropped, rounds=rounds, order=tuple(order), stop=stop)


# ---------------------------------------------------------------- the sweep

def _threads_to_try(blas) -> list[int | None]:
    """Thread counts the tuner times: none where there is no knob or the user pinned it."""
    if not blas.settable:
        return [None]
    if blas.pinned:
        return [blas.pinned]
    return thread_candidates()


def _threads(t: int) -> str:
    return f"{t} thread{'s' if t != 1 else ''}"


def _label(key: Key) -> str:
    B, t = key
    return ("plain" if B == 1 else f"B={B}") + (f" {t}T" if t else "")


def median_se(xs: Sequence[float]) -> float:
    """Standard error of the median of ``xs`` (robust: from the median absolute deviation)."""
    if len(xs) < 2:
        return math.inf
    m = statistics.median(xs)
    return 1.2533 * 1.4826 * statistics.median(abs(x - m) for x in xs) / math.sqrt(len(xs))


def _decode_rate(r) -> float:
    """Committed tokens per second after the first step (the prefill is the same for every
    candidate and only adds noise); the whole run's rate when the reply ended at once."""
    n = len(r.tokens) - r.first_tokens
    return n / r.decode_s if n > 0 and r.decode_s > 0 else len(r.tokens) / r.total_s


def tune(pair, *, budget_s: float = DEFAULT_BUDGET_S, progress: Progress | None = None, prompts=None,
         tokens: int = 24, finalists: int = 3, min_rounds: int = 3, max_rounds: int = 12,
         clear_margin: float = 0.15, candidates: Sequence[int] | None = None,
         threads: Sequence[int | None] | None = None, blas=None, probe_prompts: int = 6,
         cost_rounds: tuple[int, int] = (5, 30), noise_floor: float = NOISE_FLOOR,
         clock: Callable[[], float] = time.perf_counter) -> TuneResult:
    """Measure and choose the block size and BLAS thread count for this pair on this machine
    (see the module docstring). ``threads``: thread counts to try (default: 1, powers of two,
    all cores; one value where the user pinned it; None where there is no knob).
    ``cost_rounds``: timed pass-cost rounds, past the first number (and up to the second) only
    within ``COSTS_SHARE`` of the budget; ``probe_prompts``: prompts in the acceptance probe."""
    from . import BLAS
    from .prompts import CHAT_KINDS, builtin_prompts, interleave

    blas = blas or BLAS
    t0 = clock()
    deadline = t0 + (1 - BUDGET_RESERVE) * budget_s  # what the plan aims at: a round may run slow
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

    # 1. Acceptance: deterministic at greedy on fixed prompts (a balanced mix of the kinds). Run
    # first: it is fixed work (the same prompts every run, whatever the budget), and what it takes
    # tells the rest of the sweep what a run costs here.
    use(main_t)
    runner = Runner(pair)
    probe = []
    for n, (_, _, ids) in enumerate(encoded[:max(1, probe_prompts)]):
        probe.append(runner.run(Method("dflash", probe_block), ids, tokens))
        frac(PROBE_SHARE * (n + 1) / max(1, probe_prompts), "acceptance probe")
    st = Stats.merged([p.stats for p in probe])
    acc = st.acceptance_by_position + [0.0] * (cands[-1] - probe_block)
    E = {B: expected_tokens(acc, B) for B in cands}
    warm = probe[1:] or probe  # the first run pays one-time costs
    probe_run_s = statistics.median(r.total_s for r in warm)
    prefill_s = statistics.median(r.first_s for r in warm)
    t_costs = clock()
    phases = {"probe_s": round(t_costs - t0, 2)}

    # 2. Pass costs: every candidate block at the main thread count, the probe block at the
    # others; many short rounds, interleaved across thread counts and rotated within a meter.
    # ``MIN_COST_ROUNDS`` timed rounds always; up to ``cost_rounds[0]`` while the race's core still
    # fits after the next round (plain at T1 so far and the probe's block at the probe's run time,
    # a warm-up and ``min_rounds`` each), and past it also only within ``COSTS_SHARE`` of the budget.
    meters = {t: CostMeter(pair.model, pair.target, pair.drafter, cands if t == main_t else [probe_block], context)
              for t in tlist}
    lo, hi = cost_rounds

    def core_s() -> float:
        plain_run = prefill_s + max(0, tokens - 1) * meters[main_t].costs().t1_ms / 1e3
        return (min_rounds + 8 / max(1, tokens)) * (plain_run + probe_run_s)

    floor = max(1, min(lo, MIN_COST_ROUNDS))
    r, round_s = 0, 0.0
    while r <= hi:
        if r > floor and (clock() + round_s + core_s() > deadline
                          or (r > lo and clock() - t_costs >= COSTS_SHARE * budget_s)):
            break
        tr = clock()
        for j, t in enumerate(tlist[r % len(tlist):] + tlist[:r % len(tlist)]):
            use(t)

            def step(d, n, m, j=j):
                done = max((clock() - t_costs) / (COSTS_SHARE * budget_s), (r + (j + d / n) / len(tlist)) / (hi + 1))
                frac(PROBE_SHARE + COSTS_SHARE * min(1.0, done), m)
            meters[t].round(step, f"pass costs{'' if t is None else f' at {_threads(t)}'} (round {r + 1})")
        r += 1
        round_s = clock() - tr
    phases |= {"costs_s": round(clock() - t_costs, 2), "cost_rounds": r - 1}  # timed rounds (after the warm-up)
    all_costs = {t: m.costs() for t, m in meters.items()}
    costs = all_costs[main_t]
    smooth = costs.smoothed()
    use(main_t)

    def curve(t) -> Costs:
        """The pass costs at ``t`` threads: the main curve (smoothed), scaled by how the probe
        block's cycle costs at ``t``; T1 as measured at ``t``."""
        c = all_costs[t]
        ref = costs.step_ms(probe_block, probe_block)
        k = c.step_ms(probe_block, probe_block) / ref if t != main_t and ref else 1.0
        return Costs(c.t1_ms, {B: v * k for B, v in smooth.td_ms.items()},
                     {B: v * k for B, v in smooth.tt_ms.items()}, c.context)

    curves = {t: curve(t) for t in tlist}

    def cycle_ms(t, B: int) -> float:  # (B = 1: a plain step)
        return curves[t].step_ms(B, B)

    def residuals(t, runs, spec: bool) -> list[float]:
        return [x for x in (cycle_overhead(r, curves[t], spec) for r in runs) if x is not None]

    o_probe = statistics.median(residuals(main_t, warm, True) or [0.0])

    def se(t, name: str, B: int) -> float:
        return median_se(meters[t].times.get((name, B)) or [])

    def noise(key: Key) -> float:
        """Relative standard error of a key's model speedup from its own pass timings: blocks at
        one thread count share T1 and the overhead, so only Td(B) and Tt(B) tell them apart."""
        B, t = key
        c = all_costs[t]
        if B == 1:
            return 0.0 if t == main_t else math.hypot(se(t, "t1", 1) / c.t1_ms, se(main_t, "t1", 1) / costs.t1_ms)
        main = math.hypot(se(main_t, "td", B), se(main_t, "tt", B)) / _with_overhead(cycle_ms(main_t, B), o_probe)
        if t == main_t:
            return main
        ref = c.step_ms(probe_block, probe_block)
        return math.hypot(main, math.hypot(se(t, "td", probe_block), se(t, "tt", probe_block)) / ref)

    def model(o: dict, op: dict) -> dict[Key, float]:
        """Speedup over plain at the main thread count: E(B) * plain step / cycle."""
        def step(t):  # the plain loop may beat a synced T1 (it overlaps the next step): never below half
            return _with_overhead(all_costs[t].t1_ms, op.get(t, 0.0))

        plain = step(main_t)
        out = {}
        for t in tlist:
            out[(1, t)] = plain / step(t)
            for B in cands:
                out[(B, t)] = predict(curves[t], acc, B, o.get(t, o_probe), plain)
        return out

    def candidates_of(predicted: dict[Key, float]) -> list[Candidate]:
        return [Candidate(B, False, tau=round(E[B], 3) if B > 1 else None, predicted=round(x, 4), threads=t,
                          noise=round(noise((B, t)), 4)) for (B, t), x in predicted.items()]

    # 3. The race: which candidates the first model (the probe's overhead) puts in front, timed
    # end to end to calibrate the overheads and to check the model.
    predicted = model({}, {})
    by_thread = sorted(tlist, key=lambda t: (-max(predicted[(B, t)] for B in [1] + cands), t != main_t))
    lead_t = by_thread[0]
    ranked = sorted(cands, key=lambda B: (-predicted[(B, lead_t)], -B))
    top = ranked[:max(2, finalists)]  # the predicted runner-up is always timed
    i = cands.index(ranked[0])
    near = cands[max(0, i - 1):i + 2]  # and the neighbours of the predicted leader
    keys = [(1, lead_t)] + [(B, lead_t) for B in sorted(set(top) | set(near))]
    if len(by_thread) > 1:  # the runner-up thread count: plain and the predicted leader
        keys += [(1, by_thread[1]), (ranked[0], by_thread[1])]
    dflt = main_t if len(tlist) > 1 else None
    first = decide(candidates_of(predicted), default_threads=dflt, floor=noise_floor)
    first_key = (first.block, first.threads)
    keys += [first_key]  # what the tie rule would choose: the race checks it too
    keys = list(dict.fromkeys(keys))

    def run_s(key: Key, n: int) -> float:
        """Estimated seconds of one ``n``-token run (prefill as the probe's, the cycles from the
        pass costs, the expected tokens and the probe's overhead)."""
        B, t = key
        per = _with_overhead(cycle_ms(t, B), o_probe) if B > 1 else all_costs[t].t1_ms
        return prefill_s + max(0, n - 1) / (E[B] if B > 1 else 1.0) * per / 1e3

    # Plan the race within what is left of the budget: in order of importance (plain, the
    # model's choice, the predicted leader and runner-up, ...), a candidate is raced only if its
    # warm-up and ``min_rounds`` rounds still fit. Without room for plain and one block, no race.
    left = deadline - clock()
    need, planned, unaffordable = 0.0, [], []
    for k in dict.fromkeys([(1, lead_t), first_key] + [(B, lead_t) for B in ranked if (B, lead_t) in keys] + keys):
        c = run_s(k, 8) + min_rounds * run_s(k, tokens)
        if need + c <= left:
            planned.append(k)
            need += c
        else:
            unaffordable.append(k)
    if len(planned) < 2 or planned[0] != (1, lead_t) or all(B == 1 for B, _ in planned):  # (a block, raced)
        unaffordable, planned = list(dict.fromkeys(planned + unaffordable)), []
    keys = [k for k in keys if k in planned]

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

    start = clock()
    for B, t in keys:  # warm-up, discarded
        use(t)
        runner.run(method(B), encoded[0][2], 8)

    runs: dict[Key, list] = {}

    def run(key: Key, i: int) -> Lap:
        B, t = key
        use(t)
        r = runner.run(method(B), encoded[i][2], tokens)
        runs.setdefault(key, []).append(r)
        n = sum(r.blocks.values())
        return Lap(_decode_rate(r), r.decode_s / n if n else None)

    def timing(rnd: int, key: Key) -> None:
        done = (clock() - start) / max(1e-9, deadline - start)
        frac(PROBE_SHARE + COSTS_SHARE + (1 - PROBE_SHARE - COSTS_SHARE) * min(1.0, done),
             f"round {rnd + 1}: timing {_label(key)}")

    if keys:
        res = race(keys, run, n_prompts=len(encoded), judge_every=max(1, len(kinds)), neighbours=neighbours,
                   clock=clock, deadline=deadline, min_rounds=min_rounds, max_rounds=max_rounds,
                   clear_margin=clear_margin, note=timing, keep=[first_key], cost=lambda k: run_s(k, tokens))
    else:
        res = RaceResult(laps={}, final=(), dropped={}, rounds=0, order=(), stop="budget")
    left_after = deadline - clock()  # (what a race stopped before its first round had left)
    log.debug("tuner race: %d rounds in %.1f s, stopped on %s", res.rounds, clock() - start, res.stop)
    phases |= {"race_s": round(clock() - start, 2), "race_rounds": res.rounds, "race_stop": res.stop}

    # 4. Calibrate: the per-cycle overhead pooled over every drafted run at a thread count (the
    # main one's where another has too few), the plain loop's beyond T1 likewise.
    o, op = {}, {}
    for t in tlist:
        spec_res = [x for k, rs in runs.items() if k[1] == t and k[0] > 1 for x in residuals(t, rs, True)]
        plain_res = [x for k, rs in runs.items() if k == (1, t) for x in residuals(t, rs, False)]
        if len(spec_res) >= 3:
            o[t] = statistics.median(spec_res)
        if plain_res:
            op[t] = statistics.median(plain_res)
    if main_t not in o:
        o[main_t] = o_probe
    for t in tlist:
        o.setdefault(t, o[main_t])
        op.setdefault(t, op.get(main_t, 0.0))
    predicted = model(o, op)

    out = []
    shown = [(B, lead_t) for B in [1] + cands] + [k for k in predicted if k[1] != lead_t]
    for key in dict.fromkeys(shown):
        B, t = key
        other = "" if t == lead_t or t is None else _threads(t)
        tau = round(E[B], 3) if B > 1 else None
        common = dict(tau=tau, predicted=round(predicted[key], 4), threads=t, noise=round(noise(key), 4))
        if res.tps.get(key):
            out.append(Candidate(B, True, round(statistics.median(res.tps[key]), 3),
                                 round(spread(res.ratio[key] if B > 1 else res.tps[key]), 4),
                                 round(statistics.median(res.ratio[key]), 4), rounds=len(res.tps[key]),
                                 note="; ".join(x for x in (other, res.dropped.get(key, "")) if x),
                                 final=key in res.final, **common))
        else:
            why_not = "not raced: budget" if key in unaffordable or (key in keys and not res.rounds) else "not raced"
            out.append(Candidate(B, False, note="; ".join(x for x in (other, why_not) if x), **common))
    d = decide(out, default_threads=dflt, floor=noise_floor)
    best, best_t, why = d.block, d.threads, d.why
    unaffordable = [k for k in unaffordable if not res.laps.get(k)]  # (a neighbour may have joined later)
    if unaffordable:  # what the budget could not afford, and why
        gone = _names([_label(k) for k in unaffordable])
        why_budget = (f"{gone} not raced: {max(0.0, left):.0f} s of the budget left for the race, "
                      f"{min_rounds} rounds of each would need ~"
                      f"{sum(run_s(k, 8) + min_rounds * run_s(k, tokens) for k in unaffordable):.0f} s more")
        if not planned:
            why_budget = f"no race ({why_budget})"
    else:
        why_budget = ""
    if keys and not res.rounds:  # planned, then the warm-ups left too little for one round
        first = (f"no race: its first round (~{sum(run_s(k, tokens) for k in keys):.0f} s: "
                 f"{_names([_label(k) for k in keys])}) would have ended past the budget "
                 f"({max(0.0, left_after):.0f} s left after the warm-ups)")
        why_budget = f"{why_budget}; {first}" if why_budget else first
    chosen = (best, best_t)
    every = checks(res, chosen, floor=noise_floor)
    over = _clearest(every)
    if over is not None:
        why = (f"the race overrode the model ({d.why}): {_label(over.key)} beat {_label(chosen)} in every one "
               f"of {over.rounds} rounds, by {over.gain - 1:.1%} (a clear margin here: {over.needed - 1:.1%}, "
               f"{CLEAR_Z:g} standard errors of a paired round, sqrt(2/{over.rounds}) x the race's run-to-run "
               f"noise {res.noise:.1%}, at least {noise_floor:.0%})")
        best, best_t = over.key
    else:  # say what the race could tell about the stored choice
        why += _unchecked(res, chosen, every)
    if why_budget:
        why += f"; {why_budget}"
    use(best_t)
    return TuneResult(key=tune_key(pair), best=best, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      candidates=tuple(out), costs=costs, acceptance_by_position=tuple(round(x, 4) for x in acc),
                      prompt_kinds=tuple(kinds), tokens_per_run=tokens, budget_s=budget_s,
                      elapsed_s=round(clock() - t0, 2), format=FORMAT, threads=best_t, why=why,
                      overhead_ms=round(o[main_t], 3), phases=phases)


def _unchecked(res: RaceResult, chosen: Key, every: Sequence[Check]) -> str:
    """What the race said of a choice it did not overrule (for ``why``), from its ``checks``."""
    mine = len(res.laps.get(chosen, {}))
    if not mine:
        return "; not checked by the race (not raced)"
    dropped = f", {res.dropped[chosen]}" if chosen in res.dropped else ""
    enough = [c for c in every if c.rounds >= CHECK_ROUNDS]
    if not enough:
        return (f"; not checked by the race (it ran {mine} rounds{dropped}; no other candidate ran "
                f"{CHECK_ROUNDS} rounds with it)")
    c = max(enough, key=lambda c: c.gain)
    need = f"{c.needed - 1:+.1%}" if math.isfinite(c.needed) else "a run-to-run noise measured"
    return (f"; checked by the race ({mine} rounds{dropped}): no candidate clearly faster (closest "
            f"{_label(c.key)}: {c.gain - 1:+.1%} over {c.rounds} rounds, faster in {c.wins}; a clear margin "
            f"needs every round and {need})")


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
    """Set the BLAS thread count the engine runs with: the user's pin (OPENBLAS_NUM_THREADS or
    MKL_NUM_THREADS) if set, else the stored choice, else the default (all cores). The count in
    effect; None: no knob."""
    from . import BLAS

    blas = blas or BLAS
    if not blas.settable:
        return None
    n = blas.pinned or (result.threads if result is not None else None)
    return set_threads(blas, n)

