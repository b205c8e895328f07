"""Pure acceptance and sampling rules (no model access).

Greedy: accept the longest prefix of drafts equal to the target's argmax, plus the target's
token at the first mismatch (or after the last draft).

Sampling (temperature > 0) is lossless in distribution: standard speculative rejection sampling
(Leviathan et al. 2023, Chen et al. 2023) against the drafter's *realized* proposal
probabilities q. Draft i is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
first rejection the token comes from the residual ``max(p - q, 0)`` (normalized); after the
last draft, from ``p``. The committed tokens are then distributed exactly as plain sampling
from the target's ``p``.

``p`` follows mlx-lm's sampler (what ``--no-draft`` runs), so plain and speculative sampling
draw from one distribution: top-p, then top-k, are applied to the temperature-1 log-probs, and
the survivors are sampled at the temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0  # 1 -> off
    top_k: int = 0  # 0 -> off
    seed: int | None = None  # None -> a fresh seed per run

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def mlx_sampler(self):
        """The equivalent mlx-lm sampler, for the plain-decoding path."""
        return make_sampler(self.temperature, top_p=self.top_p if self.top_p < 1 else 0.0, top_k=self.top_k)


def accept_greedy(drafts: Sequence[int], target_choice: Sequence[int]) -> tuple[int, int]:
    """drafts (L-1,), target argmax at each verify position (L,) -> (accepted, bonus)."""
    a = 0
    while a < len(drafts) and drafts[a] == target_choice[a]:
        a += 1
    return a, target_choice[a]


def filtered_logprobs(logits: mx.array, cfg: SamplingConfig) -> mx.array:
    """(..., V) logits -> float32 temperature-1 log-probs, -inf outside top-p then top-k.

    The same rules, in the same order, as mlx-lm's ``apply_top_p`` and ``apply_top_k``.
    """
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    V = lp.shape[-1]
    if cfg.top_p < 1.0:
        s = mx.sort(lp, axis=-1)  # ascending
        sp = mx.exp(s)
        above = mx.cumsum(sp, axis=-1, reverse=True, inclusive=False)  # mass of larger tokens
        total = above[..., :1] + sp[..., :1]
        dropped = (above >= cfg.top_p * total).sum(axis=-1, keepdims=True)
        lp = mx.where(lp < mx.take_along_axis(s, dropped, axis=-1), -mx.inf, lp)
    if 0 < cfg.top_k < V:
        kth = mx.sort(lp, axis=-1)[..., V - cfg.top_k][..., None]
        lp = mx.where(lp < kth, -mx.inf, lp)
    return lp


def target_probs(logits: mx.array, cfg: SamplingConfig) -> mx.array:
    """(..., V) logits -> float32 probabilities of the sampling rule (one-hot argmax at T=0)."""
    if cfg.greedy:
        V = logits.shape[-1]
        return (mx.argmax(logits, axis=-1)[..., None] == mx.arange(V)).astype(mx.float32)
    return mx.softmax(filtered_logprobs(logits, cfg) / cfg.temperature, axis=-1)


def sample_probs(p: mx.array, key: mx.array, n: int | None = None) -> mx.array:
    """Draw from probability rows p (..., V): (...) tokens, or (n, ...) with ``n`` draws each."""
    logp = mx.where(p > 0, mx.log(mx.maximum(p, 1e-30)), -mx.inf)
    if n is None:
        return mx.random.categorical(logp, key=key)
    return mx.random.categorical(logp, key=key, shape=(n, *p.shape[:-1]))


def sample_target(logits: mx.array, cfg: SamplingConfig, key: mx.array) -> mx.array:
    """(N, V) logits -> (N,) tokens under the target's sampling rule."""
    if cfg.greedy:
        return mx.argmax(logits, axis=-1)
    return sample_probs(target_probs(logits, cfg), key)


def sample_proposal(logits: mx.array, cfg: SamplingConfig, key: mx.array, n: int | None = None):
    """DFlash 1 drafts at T > 0: independent draws per position from the target's rule applied
    to the drafter's logits (P, V). Returns (tokens (P,) or (n, P), q (P, V)); q is exactly the
    distribution the tokens were drawn from."""
    q = target_probs(logits, cfg)
    return sample_probs(q, key, n), q


def speculative_sample(
    p: mx.array, q: mx.array, drafts: mx.array, key: mx.array, residual: bool = True
) -> tuple[mx.array, mx.array]:
    """Rejection sampling over a batch of N independent blocks, in one graph.

    Args:
        p: (N, L, V) target probabilities at the L verify positions.
        q: (N, L-1, V) the proposal distribution each draft was drawn from (given its prefix).
        drafts: (N, L-1) drafted tokens.
        key: PRNG key.
        residual: False samples the correction from ``p`` instead of ``max(p - q, 0)``; it exists
            only so tests can show that this breaks the output distribution.

    Returns:
        (accepted (N,), token (N,)): the number of drafts accepted, and the token after them
        (the correction at the first rejection, or the bonus after the last draft).
    """
    N, L, V = p.shape
    k_u, k_s = mx.random.split(key)
    n = L - 1
    if n == 0:
        return mx.zeros((N,), mx.int32), sample_probs(p[:, 0], k_s)
    d = drafts.astype(mx.int32)[..., None]  # (N, n, 1)
    pd = mx.take_along_axis(p[:, :n], d, axis=-1)[..., 0]  # (N, n)
    qd = mx.take_along_axis(q, d, axis=-1)[..., 0]
    u = mx.random.uniform(shape=(N, n), key=k_u)
    ok = (u * qd) < pd  # accept with probability min(1, p/q)
    a = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)  # (N,)
    at = mx.broadcast_to(a[:, None, None], (N, 1, V))
    pa = mx.take_along_axis(p, at, axis=1)[:, 0]  # (N, V)
    if residual:
        q_ext = mx.concatenate([q.astype(mx.float32), mx.zeros((N, 1, V), mx.float32)], axis=1)
        r = mx.maximum(pa - mx.take_along_axis(q_ext, at, axis=1)[:, 0], 0.0)  # == pa after the last draft
        s = r.sum(axis=-1, keepdims=True)
        row = mx.where(s > 0, r / mx.maximum(s, 1e-30), pa)
    else:
        row = pa
    return a, sample_probs(row, k_s)


def point_mass(tokens: mx.array, vocab: int) -> mx.array:
    """(P,) tokens -> (P, V) one-hot rows: the proposal distribution of a deterministic draft
    (a lookup draft), for which rejection sampling accepts d with probability p(d) and draws
    the correction from p with d removed."""
    return (tokens.astype(mx.int32)[:, None] == mx.arange(vocab)).astype(mx.float32)


def next_token(logits: mx.array, cfg: SamplingConfig, key: mx.array | None) -> mx.array:
    """The token after a block with no drafts, still lazy ((1,) int32): the target's argmax at
    its last row (greedy), else the draw ``accept_sampled`` makes there with ``key``."""
    sub = None if cfg.greedy else mx.random.split(key)[1]  # (as speculative_sample with no drafts splits it)
    return sample_target(logits[-1:], cfg, sub).astype(mx.int32)


def accept_sampled(
    logits: mx.array, proposal, cfg: SamplingConfig, key: mx.array, residual: bool = True
) -> tuple[int, int]:
    """One block. logits (L, V) target verify logits; proposal.tokens (L-1,) and proposal.q
    (L-1, V), the distribution the drafts were drawn from; ``q`` None means a deterministic
    proposal (q = point mass on the tokens, e.g. a lookup draft). ``proposal`` None or empty:
    no drafts. Returns (accepted, token after them)."""
    a, tok = sampled_acceptance(logits, proposal, cfg, key, residual).tolist()  # one read
    return int(a), int(tok)


def sampled_acceptance(
    logits: mx.array, proposal, cfg: SamplingConfig, key: mx.array, residual: bool = True
) -> mx.array:
    """``accept_sampled``'s answer still on the device: (2,) int32 [accepted, token after them],
    so a loop reads it with its other values in one wait."""
    if proposal is None or proposal.tokens.size == 0:
        return mx.concatenate([mx.zeros((1,), mx.int32), next_token(logits, cfg, key).reshape(1)])
    p = target_probs(logits, cfg)[None]  # (1, L, V)
    q = proposal.q if proposal.q is not None else point_mass(proposal.tokens, p.shape[-1])
    a, tok = speculative_sample(p, q[None], proposal.tokens[None], key, residual)
    return mx.stack([a.reshape(()).astype(mx.int32), tok.reshape(()).astype(mx.int32)])


__all__ = [
    "SamplingConfig",
    "accept_greedy",
    "filtered_logprobs",
    "target_probs",
    "sample_probs",
    "sample_target",
    "sample_proposal",
    "speculative_sample",
    "next_token",
    "accept_sampled",
    "sampled_acceptance",
    "point_mass",
]
