"""Counters a user sees, defined once (DESIGN.md):

- tau (mean acceptance length) = committed tokens per draft cycle, bonus included;
- acceptance rate = accepted / drafted draft tokens;
- acceptance by position k = share of cycles that drafted position k where it was accepted;
- decode tok/s = tokens committed after the first / wall time of those steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .decode import Step


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
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    first_token_ms: float = 0.0
    reached: list[int] = field(default_factory=list)  # cycles that drafted position k
    hits: list[int] = field(default_factory=list)  # ... and accepted it
    tau_trace: list[int] = field(default_factory=list)
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
        self.cycles += 1
        self.committed_in_cycles += len(step.tokens)
        self.tau_trace.append(len(step.tokens))
        self.drafted += step.drafted
        self.accepted += step.accepted
        while len(self.reached) < step.drafted:
            self.reached.append(0)
            self.hits.append(0)
        for k in range(step.drafted):
            self.reached[k] += 1
            if k < step.accepted:
                self.hits[k] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return self.committed_in_cycles / self.cycles if self.cycles else 0.0

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

    def as_dict(self) -> dict:
        return {
            "cached_tokens": self.cached_tokens,
            "cycles": self.cycles,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "draft_ms": round(self.draft_ms, 2),
            "verify_ms": round(self.verify_ms, 2),
            "prefill_ms": round(self.prefill_ms, 2),
            "decode_ms": round(self.decode_ms, 2),
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "end_to_end_tps": round(self.end_to_end_tps, 2),
        }
