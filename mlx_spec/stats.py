"""Counters a user sees, defined once:

- tau (mean acceptance length) = committed tokens per drafted cycle, bonus included (plain
  steps the drafting policy took are not draft cycles; a run without drafts has tau 1);
- cycles = plain cycles + drafted cycles; per draft source ("dflash", "lookup", "mtp", "eagle")
  its cycles, drafted and accepted tokens and acceptance by position; the block-size histogram
  counts cycles by verify rows L (1 = a plain step); drafter passes = cycles the DFlash drafter
  ran in, trimmed = those where the policy verified only a prefix of its block (a block cut to
  the anchor is a plain cycle); head passes = chain drafter passes (a chain of depth k: k);
- acceptance rate = accepted / drafted draft tokens;
- acceptance by position k = share of cycles that drafted position k where it was accepted;
- decode tok/s = tokens committed after the first / wall time of those steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from itertools import zip_longest
from types import MappingProxyType
from typing import Any

from .decode import Step


def _add_counts(a: Any, b: Any) -> Any:
    """Nested counters added up: numbers, dicts of them (block histograms, per-source counts) and
    lists of them by position (the shorter padded with zeros)."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        return {k: _add_counts(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, list) or isinstance(b, list):
        return [x + y for x, y in zip_longest(a or [], b or [], fillvalue=0)]
    return (a or 0) + (b or 0)


# Per-request fields that ``Stats.merged`` leaves out: the prompt's own counts (the engine adds
# them per request), the timings (rates are taken per run) and the per-cycle trace.
NOT_MERGED = frozenset(
    {
        "prompt_tokens",
        "cached_tokens",
        "draft_ms",
        "verify_ms",
        "rollback_ms",
        "prefill_ms",
        "decode_ms",
        "first_token_ms",
        "trace",
        "finish_reason",
    }
)


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, reused from the prefix cache
    tokens: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    committed_in_cycles: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    rollback_ms: float = 0.0
    plain_cycles: int = 0  # cycles without drafts (cycles - plain_cycles = drafted cycles)
    drafter_passes: int = 0  # cycles the DFlash drafter ran in
    head_passes: int = 0  # chain drafter (MTP / EAGLE-3) passes
    trimmed: int = 0  # ... of which the policy verified only a prefix of its block (or none of it)
    committed_in_drafted: int = 0  # tokens committed by drafted cycles
    block_sizes: dict[int, int] = field(default_factory=dict)  # cycles by verify rows L
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # per draft source
    trace: list[tuple[str, int, int]] = field(default_factory=list)  # (source, L, accepted) per cycle
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    first_token_ms: float = 0.0
    reached: list[int] = field(default_factory=list)  # cycles that drafted position k
    hits: list[int] = field(default_factory=list)  # ... and accepted it
    finish_reason: str | None = None

    def add(self, step: Step) -> None:
        self.tokens += len(step.tokens)
        if step.finish_reason:
            self.finish_reason = step.finish_reason
        if step.prefill:
            self.prompt_tokens = step.prompt_tokens
            self.cached_tokens = step.cached_tokens
            self.prefill_ms += step.elapsed_ms
            self.first_token_ms = step.elapsed_ms
            return
        self.decode_ms += step.elapsed_ms
        self.draft_ms += step.draft_ms
        self.verify_ms += step.verify_ms
        self.rollback_ms += step.rollback_ms
        self.cycles += 1
        L = step.drafted + 1
        self.block_sizes[L] = self.block_sizes.get(L, 0) + 1
        source = step.source or ("dflash" if step.drafted else "plain")
        self.trace.append((source, L, step.accepted))
        if step.draft_block:
            self.drafter_passes += 1
            self.trimmed += int(source == "dflash" and L < step.draft_block)
        self.head_passes += step.head_passes
        if not step.drafted:
            self.plain_cycles += 1
        else:
            self.committed_in_drafted += len(step.tokens)
            c = self.sources.setdefault(source, {"cycles": 0, "drafted": 0, "accepted": 0, "reached": [], "hits": []})
            c["cycles"] += 1
            c["drafted"] += step.drafted
            c["accepted"] += step.accepted
            reached, hits = c.setdefault("reached", []), c.setdefault("hits", [])
            while len(reached) < step.drafted:
                reached.append(0)
                hits.append(0)
            for k in range(step.drafted):
                reached[k] += 1
                hits[k] += k < step.accepted
        self.committed_in_cycles += len(step.tokens)
        self.drafted += step.drafted
        self.accepted += step.accepted
        while len(self.reached) < step.drafted:
            self.reached.append(0)
            self.hits.append(0)
        for k in range(step.drafted):
            self.reached[k] += 1
            if k < step.accepted:
                self.hits[k] += 1

    @classmethod
    def merged(cls, parts: Iterable[Stats]) -> Stats:
        """The counters of several runs added up (the cycle counters, histograms, per-source
        counts and per-position counts; the per-request fields in ``NOT_MERGED`` keep their
        defaults)."""
        out = cls()
        names = [f.name for f in fields(cls) if f.name not in NOT_MERGED]
        for p in parts:
            for name in names:
                setattr(out, name, _add_counts(getattr(out, name), getattr(p, name)))
        return out

    @property
    def drafted_cycles(self) -> int:
        return self.cycles - self.plain_cycles

    @property
    def mean_acceptance_length(self) -> float:
        if self.drafted_cycles:
            return self.committed_in_drafted / self.drafted_cycles
        return self.committed_in_cycles / self.cycles if self.cycles else 0.0

    def source_stats(self) -> dict[str, dict]:
        """Per draft source: cycles, drafted, accepted, acceptance rate, tau and acceptance by
        position (share of its cycles that drafted position k where it was accepted)."""
        return {
            name: {
                **{k: v for k, v in c.items() if k not in ("reached", "hits")},
                "acceptance_rate": round(c["accepted"] / c["drafted"], 4) if c["drafted"] else 0.0,
                "mean_acceptance_length": round((c["accepted"] + c["cycles"]) / c["cycles"], 4),
                "acceptance_by_position": [
                    round(h / r, 4) if r else 0.0 for h, r in zip(c.get("hits", []), c.get("reached", []))
                ],
            }
            for name, c in sorted(self.sources.items())
        }

    def trace_text(self, limit: int | None = None) -> str:
        """The cycles in short form: ``d4:2`` = DFlash, 4 rows, 2 accepted; ``l9:8`` lookup;
        ``m3:2`` an MTP chain (3 rows: 2 head passes); ``e4:3`` EAGLE-3; ``p`` a plain step (the
        last ``limit`` cycles)."""
        items = self.trace if limit is None else self.trace[-limit:]
        return " ".join("p" if s == "plain" else f"{s[0]}{L}:{a}" for s, L, a in items)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [h / r if r else 0.0 for h, r in zip(self.hits, self.reached)]

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens actually run per second (cached ones excluded)."""
        n = self.prompt_tokens - self.cached_tokens
        return n / (self.prefill_ms / 1e3) if self.prefill_ms else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.tokens - 1 if self.tokens else 0
        return n / (self.decode_ms / 1e3) if self.decode_ms else 0.0

    @property
    def end_to_end_tps(self) -> float:
        total = self.prefill_ms + self.decode_ms
        return self.tokens / (total / 1e3) if total else 0.0

    def snapshot(self, trace: bool = False) -> StatsSnapshot:
        """The figures of ``as_dict(trace)`` as a frozen value (what engine events carry)."""
        return StatsSnapshot(**{k: _freeze(v) for k, v in self.as_dict(trace).items()})

    def as_dict(self, trace: bool = False) -> dict:
        """The user-facing counters; ``trace`` adds ``cycle_trace``: [source, L, accepted] for
        every cycle (left out of running updates: it grows with the reply)."""
        out = {
            "cached_tokens": self.cached_tokens,
            "cycles": self.cycles,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "plain_cycles": self.plain_cycles,
            "drafted_cycles": self.drafted_cycles,
            "drafter_passes": self.drafter_passes,
            "head_passes": self.head_passes,
            "trimmed": self.trimmed,
            "block_sizes": {str(L): n for L, n in sorted(self.block_sizes.items())},
            "sources": self.source_stats(),
            "draft_ms": round(self.draft_ms, 2),
            "verify_ms": round(self.verify_ms, 2),
            "rollback_ms": round(self.rollback_ms, 2),
            "prefill_ms": round(self.prefill_ms, 2),
            "decode_ms": round(self.decode_ms, 2),
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "end_to_end_tps": round(self.end_to_end_tps, 2),
        }
        if trace:
            out["cycle_trace"] = [list(t) for t in self.trace]
        return out


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """A frozen copy of ``Stats.as_dict()``: one field per key (add a field with a new key), lists
    as tuples, dicts as read-only mappings. ``as_dict()`` gives the same JSON back."""

    cached_tokens: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    mean_acceptance_length: float = 0.0
    acceptance_rate: float = 0.0
    acceptance_by_position: tuple[float, ...] = ()
    plain_cycles: int = 0
    drafted_cycles: int = 0
    drafter_passes: int = 0
    head_passes: int = 0
    trimmed: int = 0
    block_sizes: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    sources: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    rollback_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    end_to_end_tps: float = 0.0
    cycle_trace: tuple | None = None  # only in a snapshot(trace=True)

    def as_dict(self) -> dict:
        return {
            f.name: _thaw(getattr(self, f.name))
            for f in fields(self)
            if not (f.name == "cycle_trace" and self.cycle_trace is None)
        }


def _freeze(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return MappingProxyType({k: _freeze(x) for k, x in v.items()})
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    if isinstance(v, MappingProxyType):
        return {k: _thaw(x) for k, x in v.items()}
    return v
