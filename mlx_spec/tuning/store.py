"""The tuner's store: what a tuning result is keyed by, and how it is saved and loaded.

A result is stored as JSON under ``<cache>/tuning/<key_hash>.json``. The key (``tune_key``) is
everything that changes the answer: the machine (CPU or GPU, cores, memory, OS, backend, BLAS
library and version, mlx and mlx-lm versions) and, per model, the weights' identity
(``weights_id``: however the command spelled the model) and its quantization as loaded. The BLAS
thread count is no part of the key: it is part of the answer. A result of another format, or one
that cannot be read, is ignored (with a warning when unreadable) and the pair is tuned again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from huggingface_hub import snapshot_download
from mlx.utils import tree_flatten

from .. import BLAS, backend
from ..blas import cpuinfo
from ..costs import Costs
from ..default_target import DEFAULT_TARGET_ID, cache_dir
from ..loading import DRAFT_VOCAB_FILE

log = logging.getLogger(__name__)

SOURCE_NAMES = {"dflash": "DFlash", "mtp": "MTP", "eagle": "EAGLE-3"}  # (as the engine line names them)
# 4: the curve's measured context term (ctx_ms, ctx_draft_ms) and the chain drafters' head pass
# (Tc), acceptance prior and depth; 3: BLAS threads
FORMAT = 4
READ_FORMATS = (FORMAT,)  # results of other formats are tuned again


# ---------------------------------------------------------------- the key


def cpu_name() -> str:
    try:
        b = backend.current()
        if b.gpu and not b.faked:
            return b.device
    except Exception:
        pass
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def machine_info() -> dict:
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "backend": backend.current().kind,
        "blas": " ".join(x for x in (BLAS.name, BLAS.path, BLAS.version) if x),  # a new library (version) re-tunes
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
    }


def _model_dir(path_or_id: str) -> Path | None:
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if path_or_id == DEFAULT_TARGET_ID:
        found = sorted((cache_dir() / "models").glob(f"{DEFAULT_TARGET_ID}-*"))
        return found[0] if found else None
    try:
        return Path(snapshot_download(path_or_id, local_files_only=True))  # path holds the revision
    except Exception:
        return None


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
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return f"q{m.bits}g{m.group_size}"
    params = tree_flatten(model.parameters())
    return str(params[0][1].dtype).replace("mlx.core.", "") if params else "none"


def _weights(path_or_id: str) -> str:
    return weights_id(path_or_id) or "id:" + hashlib.sha256(path_or_id.encode()).hexdigest()[:16]


def tune_key(pair) -> dict:
    """What the answer depends on: the machine and, per model, the weights' identity
    (``weights_id``) and quantization as loaded: the target (with its K/V quantization where
    set), the DFlash drafter (with its drafting window where set; none in a pair that drafts with
    chain drafters alone) and each chain drafter loaded. The ``id`` (as the command spelled it) is
    kept for people reading the file, and is no part of the key (``identity``)."""
    key = {
        "machine": machine_info(),
        "target": {"id": pair.target_id, "weights": _weights(pair.target_id), "quant": quantization(pair.model)},
    }
    if pair.drafter is not None:  # (a pair drafting with chain drafters alone has no DFlash entry)
        key["drafter"] = {
            "id": pair.drafter_id,
            "weights": _weights(pair.drafter_id),
            "quant": quantization(pair.drafter),
            "draft_vocab": pair.drafter.vocab_size_drafted or "full",
        }
    for kind, chain in sorted((getattr(pair, "chains", None) or {}).items()):  # (a chain drafter: its own)
        ref = pair.chain_ids.get(kind, kind)
        key[kind] = {"id": ref, "weights": _weights(ref), "quant": quantization(chain)}
    kv = getattr(pair, "kv", None)
    if kv is not None:  # quantized K/V: other pass costs (--kv-bits)
        key["target"]["kv"] = kv.describe()
    window = getattr(pair.drafter, "context_limit", None)
    if window:  # a drafting window: other draft costs and acceptance past it (--draft-window)
        key["drafter"]["window"] = window
    return key


def identity(key: dict) -> dict:
    """The key without what does not change the answer: a model's ``id`` where its ``weights``
    identify it (a key without ``weights`` keeps its id)."""
    return {
        k: ({n: x for n, x in v.items() if n != "id"} if isinstance(v, dict) and "weights" in v else v)
        for k, v in key.items()
    }


def models_of(target: str, drafter: str) -> dict:
    """What ``same_models`` compares a stored key with, computed once: per model, the id as
    spelled and its ``weights_id``."""
    return {k: (v, weights_id(v)) for k, v in (("target", target), ("drafter", drafter))}


def same_models(key: dict, models: dict) -> bool:
    """Whether a stored key is for these models (``models_of``; spelled any way), before loading
    them: the weights' identity of each."""
    got = {k: key.get(k) if isinstance(key.get(k), dict) else {} for k in models}
    return all(got[k].get("weights") == w and w is not None for k, (_, w) in models.items())


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
    source: str = (
        "dflash"  # what drafts: a DFlash block of ``block`` rows, or a chain ("mtp", "eagle") of depth block - 1
    )

    @property
    def label(self) -> str:
        if self.block == 1:
            return "off"
        return str(self.block) if self.source == "dflash" else f"{self.source} k={self.block - 1}"

    @property
    def what(self) -> str:
        """The candidate in words: "DFlash B=4", "MTP k=3", "EAGLE-3 k=2", "plain"."""
        if self.block == 1:
            return "plain"
        return (
            f"DFlash B={self.block}" if self.source == "dflash" else f"{SOURCE_NAMES[self.source]} k={self.block - 1}"
        )

    @property
    def key(self) -> tuple:
        """(block, threads) for DFlash and plain; (rows, threads, source) for a chain."""
        return (
            (self.block, self.threads)
            if self.source == "dflash" or self.block == 1
            else (
                self.block,
                self.threads,
                self.source,
            )
        )

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
    # per chain drafter ("mtp", "eagle"): acceptance_by_position (its probe at the deepest chain),
    # pass_ms (Tc, one head pass), depth (the depth the model puts first) and predicted (its
    # speedup); in a pair without a DFlash drafter also speedup and rounds (the race's, at that depth)
    chains: dict = field(default_factory=dict)
    # what ``best`` drafts with: "dflash" (a block of ``best`` rows), or in a pair without a DFlash
    # drafter the chain drafter ("mtp", "eagle") whose chain of depth best - 1 the tuner chose
    best_source: str = "dflash"

    @property
    def block_size(self) -> int:
        return self.best

    @property
    def timing(self) -> str:
        """The elapsed time against the budget, by phase (what `mlx_spec tune` prints). ``tune``
        writes every phase; a result without phases has the first part alone."""
        line = f"{self.elapsed_s:.0f} s of {self.budget_s:.0f} s"
        p = self.phases
        if not p:
            return line
        parts = [
            f"probe {p['probe_s']:.0f} s",
            f"pass costs {p['costs_s']:.0f} s ({p['cost_rounds']} rounds)",
            *(
                [
                    f"context term {p['context_s']:.0f} s ({p['context_tokens']} tokens, {p['context_rounds']} rounds)"
                    if p.get("context_term") == "measured"
                    else "no context term (budget)"
                ]
                if "context_term" in p
                else []
            ),
            f"race {p['race_s']:.0f} s ({p['race_rounds']} rounds, stopped on {p['race_stop']})",
        ]
        over = self.elapsed_s - self.budget_s
        fixed = p["probe_s"] + p["costs_s"] + p.get("context_s", 0.0)
        note = ""
        if over > 0:
            note = f"; over budget by {over:.0f} s" + (
                f": the probe and the minimum pass-cost rounds alone took {fixed:.0f} s"
                if fixed > self.budget_s
                else ""
            )
        return f"{line} ({', '.join(parts)}){note}"

    @property
    def source(self) -> str:
        day = self.date[:10] + (
            f", {self.threads} BLAS thread{'s' if self.threads != 1 else ''}" if self.threads else ""
        )
        if self.best > 1:
            return f"tuned {day}"
        spec = [c for c in self.candidates if c.block > 1 and c.score is not None and c.threads == self.threads]
        best = max(spec, key=lambda c: c.score, default=None)
        why = f"; best {best.what} x{best.score:.2f}" if best else ""
        return f"tuned {day}: off — plain decoding faster on this machine{why}"

    @property
    def chosen(self) -> str:
        """What the result chose, in words: "DFlash B=4", "MTP k=3" or "off"."""
        if self.best == 1:
            return "off"
        return Candidate(self.best, False, source=self.best_source).what

    def as_dict(self) -> dict:
        return {
            "format": self.format,
            "best": "off" if self.best == 1 else self.best,
            "date": self.date,
            "source": self.source,
            "key": self.key,
            "candidates": [
                {
                    "block": "off" if c.block == 1 else str(c.block),  # (rows: a chain's depth + 1)
                    **{
                        k: getattr(c, k)
                        for k in (
                            "measured",
                            "median_tps",
                            "spread",
                            "speedup",
                            "tau",
                            "predicted",
                            "rounds",
                            "note",
                            "final",
                            "threads",
                            "noise",
                            "source",
                        )
                    },
                }
                for c in self.candidates
            ],
            "costs": self.costs.as_dict() if self.costs else None,
            "acceptance_by_position": list(self.acceptance_by_position),
            "prompt_kinds": list(self.prompt_kinds),
            "tokens_per_run": self.tokens_per_run,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "threads": self.threads,
            "why": self.why,
            "overhead_ms": self.overhead_ms,
            "phases": dict(self.phases),
            "chains": {k: dict(v) for k, v in self.chains.items()},
            "best_source": self.best_source,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TuneResult:
        def block(x):
            return 1 if x == "off" else int(x)

        cands = tuple(
            Candidate(
                block(c["block"]),
                bool(c["measured"]),
                c.get("median_tps"),
                c.get("spread"),
                c.get("speedup"),
                c.get("tau"),
                c.get("predicted"),
                int(c.get("rounds", 0)),
                c.get("note", ""),
                bool(c.get("final", False)),
                _opt_int(c.get("threads")),
                c.get("noise"),
                str(c.get("source", "dflash")),
            )
            for c in d["candidates"]
        )
        return cls(
            d["key"],
            block(d["best"]),
            str(d["date"]),
            cands,
            Costs.from_dict(d["costs"]) if d.get("costs") else None,
            tuple(float(x) for x in d.get("acceptance_by_position", ())),
            tuple(d.get("prompt_kinds", ())),
            int(d.get("tokens_per_run", 0)),
            float(d.get("budget_s", 0)),
            float(d.get("elapsed_s", 0)),
            int(d.get("format", FORMAT)),
            _opt_int(d.get("threads")),
            str(d.get("why", "")),
            d.get("overhead_ms"),
            dict(d.get("phases") or {}),
            {str(k): dict(v) for k, v in (d.get("chains") or {}).items()},
            str(d.get("best_source", "dflash")),
        )


def _opt_int(x) -> int | None:
    return None if x is None else int(x)


def result_path(key: dict, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "tuning" / f"{key_hash(key)}.json"


def save_result(result: TuneResult, root: Path | None = None) -> Path:
    """Write ``result`` under its key (atomically: a reader never sees half a file)."""
    path = result_path(result.key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result.as_dict(), indent=2))
    tmp.replace(path)
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
    absent, of another format or unreadable."""
    return _read(result_path(key, root), key)
