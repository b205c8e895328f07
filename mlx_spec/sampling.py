"""Pure acceptance and sampling rules (no model access).

Greedy: accept the longest prefix of drafts equal to the target's argmax, plus the target's
token at the first mismatch (or after the last draft). Sampling (temperature > 0): standard
speculative rejection sampling against the drafter's *realized* proposal probabilities q, with
the residual ``max(p - q, 0)`` on rejection, so the output is distributed as the target's.
top_p / top_k apply to the target side only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")

    def mlx_sampler(self):
        """The equivalent mlx-lm sampler, for the plain-decoding path."""
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0, top_k=self.top_k)


def accept_greedy(drafts: Sequence[int], target_choice: Sequence[int]) -> tuple[int, int]:
    """drafts (L-1,), target argmax at each verify position (L,) -> (accepted, bonus)."""
    a = 0
    while a < len(drafts) and drafts[a] == target_choice[a]:
        a += 1
    return a, target_choice[a]


def target_probs(logits: mx.array, cfg: SamplingConfig) -> mx.array:
    """(..., V) logits -> float32 probabilities after temperature, top_k, top_p."""
    x = logits.astype(mx.float32) / cfg.temperature
    V = x.shape[-1]
    if 0 < cfg.top_k < V:
        kth = mx.sort(x, axis=-1)[..., V - cfg.top_k][..., None]
        x = mx.where(x < kth, -mx.inf, x)
    p = mx.softmax(x, axis=-1)
    if cfg.top_p < 1.0:
        order = mx.argsort(-p, axis=-1)
        sorted_p = mx.take_along_axis(p, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < cfg.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        p = mx.where(keep, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    return p


def _categorical(p: mx.array, key: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(mx.maximum(p, 1e-38)), key=key)


def sample_target(logits: mx.array, cfg: SamplingConfig, key: mx.array) -> mx.array:
    """(N, V) logits -> (N,) tokens under the target's sampling rule."""
    if cfg.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return _categorical(target_probs(logits, cfg), key)


def accept_sampled(logits: mx.array, proposal, cfg: SamplingConfig, key: mx.array,
                   residual: bool = True) -> tuple[int, int]:
    """Rejection sampling. logits (L, V) target verify logits; proposal.tokens (L-1,),
    proposal.q (L-1, V). Returns (accepted, bonus). ``residual=False`` exists only so tests can
    show that dropping the residual step breaks the output distribution."""
    p = target_probs(logits, cfg)  # (L, V)
    k_u, k_s = mx.random.split(key)
    if proposal is None or proposal.tokens.size == 0:
        return 0, _categorical(p[-1:], k_s).item()
    d = proposal.tokens.astype(mx.int32)[:, None]
    n = d.shape[0]
    pd = mx.take_along_axis(p[:n], d, axis=-1)[:, 0]
    qd = mx.take_along_axis(proposal.q, d, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(n,), key=k_u)
    ok = (u * qd) < pd
    a = int(mx.cumprod(ok.astype(mx.int32)).sum().item())
    if a == n:
        row = p[n]
    elif residual:
        r = mx.maximum(p[a] - proposal.q[a], 0.0)
        s = r.sum()
        row = mx.where(s > 0, r / mx.maximum(s, 1e-38), p[a])
    else:
        row = p[a]
    return a, _categorical(row[None], k_s).item()
