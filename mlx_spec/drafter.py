"""DFlash (v1) and DFlash 2 block drafters, in one flat module.

The drafter reads fused target features (outputs of ``target_layer_ids``) as attention context
and denoises a block ``[anchor, MASK x (L-1)]`` in one pass. It owns no embedding or LM head:
those are the target's, shared and frozen (``bind``). DFlash 2 adds a two-tap grouped dynamic
convolution around each sublayer (``DFlash2DecoderLayer``, chosen when the drafter is built) and
a candidate selector (path walk over the top-K lattice). The trainer runs the same code:
``Drafter.block_hidden`` (many blocks at once), ``Drafter.logits`` and ``CandidateSelector.scores``.
See docs/dflash.md for the maths, the checkpoint layout and our decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.rope_utils import initialize_rope

from .sampling import SamplingConfig, sample_proposal

log = logging.getLogger(__name__)

DFLASH1 = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"


def build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """The official default tap layers when a config omits them."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


@dataclass
class DrafterArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    target_hidden_size: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2
    architecture: str = DFLASH1
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.layer_types = self.layer_types or ["full_attention"] * self.num_hidden_layers

    @property
    def is_v2(self) -> bool:
        return self.architecture == DFLASH2

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_config(cls, config: dict) -> DrafterArgs:
        """Read a checkpoint config: ``dflash_config`` keys first, then top level."""
        dc = config.get("dflash_config") or {}
        archs = config.get("architectures") or [DFLASH1]

        def get(key, default=None):
            return dc.get(key, config.get(key, default))

        rope = config.get("rope_parameters") or {}
        n_target = get("num_target_layers")
        ids = get("target_layer_ids")
        if ids is None and n_target is not None:
            ids = build_target_layer_ids(n_target, config["num_hidden_layers"])
        return cls(
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_target_layers=n_target if n_target is not None else max(ids) + 1,
            target_layer_ids=list(ids),
            mask_token_id=get("mask_token_id"),
            block_size=get("block_size", 16),
            head_dim=config.get("head_dim"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 1e6)),
            rope_scaling=config.get("rope_scaling")
            or ({**rope} if rope.get("rope_type", "default") != "default" else None),
            max_position_embeddings=config.get("max_position_embeddings", 40960),
            layer_types=config.get("layer_types"),
            sliding_window=config.get("sliding_window"),
            is_causal=config.get("is_causal", dc.get("causal")),
            target_hidden_size=config.get("target_hidden_size"),
            input_embedding_scale=get("input_embedding_scale", 1.0) or 1.0,
            output_multiplier=get("output_multiplier", 1.0) or 1.0,
            final_logit_softcapping=get("final_logit_softcapping"),
            architecture=archs[0],
            conv_kernel_size=get("conv_kernel_size", 2),
            conv_group_size=get("conv_group_size", 16),
            selector_rank=get("selector_rank", 256),
            selector_top_k=get("selector_top_k", 16),
        )


class ContextCache:
    """Draft-side K/V of committed context only (block K/V are never stored).

    ``offset`` counts every context row ever added (= absolute position of the next one).
    With a trained sliding ``window``, only the last ``window - 1`` rows are kept, as in the
    reference. ``limit`` (the drafting window, ``--draft-window``, for drafters trained without
    one) keeps at most that many rows, the latest: the drafter then attends over the last
    ``limit`` target positions only (bounded memory and draft cost at long context; the drafts
    may change, the output does not: verification is the same).
    """

    def __init__(self, window: int | None = None, limit: int | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"a drafting window must keep >= 1 position (got {limit})")
        self.window = window
        self.limit = limit
        self.keys = None
        self.values = None
        self.offset = 0

    @property
    def kept(self) -> int | None:
        """The most rows this cache keeps (None: all of them)."""
        bounds = [b for b in (None if self.window is None else self.window - 1, self.limit) if b is not None]
        return min(bounds) if bounds else None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        kept = self.kept
        if kept is not None and self.keys.shape[2] > kept:
            self.keys = self.keys[:, :, -kept:]
            self.values = self.values[:, :, -kept:]
        return self.keys, self.values

    def skip(self, n: int) -> None:
        """``n`` context rows pass unkept, followed by at least ``kept`` more (``skip_rows``): their
        positions are counted, their K/V never computed, and every row held now is displaced."""
        if n > 0:
            if self.kept is None:
                raise ValueError("a cache that keeps every row cannot skip any")
            self.keys = self.values = None
            self.offset += n

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def skip_rows(caches: list[ContextCache], rows: int) -> int:
    """How many of ``rows`` new context rows no layer of ``caches`` would keep (the oldest): the
    fusion and K/V projections of those can be skipped (``ContextCache.skip``). 0 when a layer
    keeps every row."""
    kept = [c.kept for c in caches]
    if not kept or any(k is None for k in kept):
        return 0
    return max(0, rows - max(kept))


def block_mask(n_ctx_kept: int, ctx_end: int, L: int, causal: bool, window: int | None):
    """Boolean mask (L, n_ctx_kept + L): True = visible. None when everything is visible.

    Context rows are the ``n_ctx_kept`` positions ending at ``ctx_end - 1``; block row k sits at
    ``ctx_end + k``. A sliding layer sees keys with ``q_pos - k_pos < window``.
    """
    if not causal and (window is None or n_ctx_kept + L <= window):
        return None
    q = mx.arange(L)[:, None] + ctx_end
    k = mx.concatenate([mx.arange(ctx_end - n_ctx_kept, ctx_end), mx.arange(L) + ctx_end])[None]
    mask = mx.ones((L, n_ctx_kept + L), dtype=mx.bool_)
    if causal:
        mask = mask & (k <= q)
    if window is not None:
        mask = mask & (q - k < window)
    return mask


class Attention(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        H, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(hd, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings)

    def kv(self, x: mx.array, offset):
        """Keys (RoPE at ``offset``: an int, or one start per row) and values of rows ``x``."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, S, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, S, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def context_kv(self, c: mx.array, cache: ContextCache):
        """Push context rows' K/V (from fused target features ``c``) into the cache."""
        k, v = self.kv(c, cache.offset)
        return cache.update_and_fetch(k, v)

    def __call__(self, x, ctx_k, ctx_v, start, mask):
        # x: (B, L, H) block; ctx_k/v: (B, n_kv, S, hd); start: absolute position of the anchor
        # (an int, or an (B,) array of per-row starts when training).
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        kb, vb = self.kv(x, start)
        k = mx.concatenate([ctx_k, kb], axis=2) if ctx_k is not None else kb
        v = mx.concatenate([ctx_v, vb], axis=2) if ctx_v is not None else vb
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TwoTapConv(nn.Module):
    """DFlash 2 grouped dynamic causal convolution (input side and output side of a sublayer).

    Works on (N, L, H) where each row of N is one block: the shift never crosses a block, and
    block position 0 (the anchor) has no predecessor.
    """

    def __init__(self, H: int, taps: int = 2, group: int = 16):
        super().__init__()
        self.taps, self.group = taps, group
        self.base_kernel = mx.zeros((2, taps, H))
        self.kernel_projection = nn.Linear(H, 2 * taps * (H // group), bias=False)

    def _conv(self, z: mx.array, d: mx.array, b: mx.array) -> mx.array:
        # z (N, L, H); d (N, L, T, G) dynamic coefficients; b (T, H) base kernel.
        N, L, H = z.shape
        G = H // self.group
        zg = z.reshape(N, L, G, self.group)
        out = None
        for t in range(min(self.taps, L)):
            zt = zg if t == 0 else mx.pad(zg[:, : L - t], [(0, 0), (t, 0), (0, 0), (0, 0)])
            coef = b[t].reshape(1, 1, G, self.group) + d[:, :, t, :, None]
            out = coef * zt if out is None else out + coef * zt
        return out.reshape(N, L, H)

    def prepare(self, u: mx.array):
        N, L, H = u.shape
        d = self.kernel_projection(u).reshape(N, L, 2, self.taps, H // self.group)
        return self._conv(u, d[:, :, 0], self.base_kernel[0]), d[:, :, 1]

    def finish(self, y: mx.array, d_out: mx.array) -> mx.array:
        return self._conv(y, d_out, self.base_kernel[1])


class DecoderLayer(nn.Module):
    """A DFlash (v1) layer: pre-norm attention over [context; block], then a SwiGLU MLP."""

    def __init__(self, args: DrafterArgs, i: int):
        super().__init__()
        H = args.hidden_size
        self.causal = args.layer_is_causal(i)
        self.window = args.layer_window(i)
        self.self_attn = Attention(args)
        self.mlp = MLP(H, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def __call__(self, x, ctx_k, ctx_v, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlash2DecoderLayer(DecoderLayer):
    """A DFlash 2 layer: the same sublayers, each wrapped in a two-tap convolution."""

    def __init__(self, args: DrafterArgs, i: int):
        super().__init__(args, i)
        H, g, T = args.hidden_size, args.conv_group_size, args.conv_kernel_size
        self.attention_conv = TwoTapConv(H, T, g)
        self.mlp_conv = TwoTapConv(H, T, g)

    def __call__(self, x, ctx_k, ctx_v, start, mask):
        u, d_out = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, ctx_k, ctx_v, start, mask), d_out)
        u, d_out = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), d_out)


class CandidateSelector(nn.Module):
    """DFlash 2 path selection: walk the top-K lattice with bilinear transition scores."""

    def __init__(self, H: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(H, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)

    def candidates(self, unary: mx.array) -> mx.array:
        """Indices (..., K) of the top-K entries of ``unary`` (in no particular order)."""
        K = min(self.top_k, unary.shape[-1])
        return mx.argpartition(-unary, K - 1, axis=-1)[..., :K]

    def scores(self, h: mx.array, u: mx.array, pred: mx.array, cand: mx.array) -> mx.array:
        """Transition scores: unary ``u`` (..., K) of candidates ``cand`` (..., K) (target ids)
        plus the bilinear term between each predecessor in ``pred`` (..., K_prev) and each
        candidate, given final hidden ``h`` (..., H). Returns (..., K_prev, K), float32.
        Inference scores the whole lattice; training one gold predecessor per position."""
        g = self.hidden_projection(h).astype(mx.float32)  # (..., r)
        a = self.predecessor_codebook(pred).astype(mx.float32) * g[..., None, :]  # (..., K_prev, r)
        b = self.successor_codebook(cand).astype(mx.float32)  # (..., K, r)
        return u.astype(mx.float32)[..., None, :] + a @ b.swapaxes(-1, -2)

    def lattice(self, h: mx.array, unary: mx.array, anchor: mx.array, ids: mx.array | None = None):
        """Candidates and edge scores for one block (batch 1).

        h (P, H) final hidden at draft positions, unary (P, V) transformed logits (over ``ids``
        when a reduced draft vocabulary is in use), anchor (). Returns cand (P, K) target ids and
        scores (P, K_prev, K): for p=0 only row 0 is meaningful (predecessor = anchor).
        Everything in float32.
        """
        unary = unary.astype(mx.float32)
        cand = self.candidates(unary)  # (P, K)
        K = cand.shape[-1]
        u = mx.take_along_axis(unary, cand, axis=-1)  # (P, K)
        if ids is not None:
            cand = ids[cand]
        preds = mx.concatenate([mx.broadcast_to(anchor.reshape(1, 1), (1, K)), cand[:-1]], 0)
        return cand, self.scores(h, u, preds, cand)  # (P, K), (P, K, K)

    def walk_greedy(self, cand: mx.array, scores: mx.array) -> mx.array:
        j = mx.argmax(scores[0, 0])
        picks = [j]
        for p in range(1, cand.shape[0]):
            j = mx.argmax(scores[p, j])
            picks.append(j)
        idx = mx.stack(picks)
        return mx.take_along_axis(cand, idx[:, None], axis=-1)[:, 0]

    def walk_sample(self, cand, scores, temperature: float, key: mx.array, n: int | None = None):
        """Sampled walk at ``temperature`` only (no top-p/top-k: the reference's rule).

        Returns tokens (P,), the chosen slot per position (P,) and q (P, K), the distribution
        each slot was drawn from given the previous pick; with ``n``, n independent walks:
        (n, P), (n, P), (n, P, K).
        """
        P, K = cand.shape
        keys = mx.random.split(key, P)
        rows = mx.broadcast_to(scores[0, 0], (n or 1, K))  # predecessor = the anchor
        picks, qs = [], []
        for p in range(P):
            if p > 0:
                rows = scores[p][j]  # (n, K): the row of each walk's previous pick  # noqa: F821
            logits = rows / temperature
            qs.append(mx.softmax(logits, axis=-1))
            j = mx.random.categorical(logits, key=keys[p])  # (n,)
            picks.append(j)
        idx = mx.stack(picks, axis=1)  # (n, P)
        tokens = mx.take_along_axis(mx.broadcast_to(cand, (idx.shape[0], P, K)), idx[..., None], axis=-1)[..., 0]
        q = mx.stack(qs, axis=1)
        return (tokens[0], idx[0], q[0]) if n is None else (tokens, idx, q)


@dataclass(frozen=True)
class DraftVocab:
    """A reduced draft vocabulary (a d2t map, as in speculators): the draft head scores only
    ``ids`` (sorted target ids), so a draft pass multiplies by K rows of the target's head, not
    all V. Drafts are mapped back to target ids; verification is unchanged, so output stays
    the target's own. A target token outside ``ids`` can never be drafted (it is rejected and
    the target's own token commits)."""

    ids: mx.array  # (K,) int32, sorted, unique, < V
    head: Callable[[mx.array], mx.array]  # (..., H) -> (..., K) logits over ``ids``

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


class Proposal(NamedTuple):
    tokens: mx.array  # (L-1,) drafted ids
    q: mx.array | None  # (L-1, V) proposal probabilities (None when greedy)
    confidence: mx.array | None = None  # (L-1,) the drafter's top probability per position (greedy, on request)
    # () bool: every hidden state and draft logit of this pass was finite. Computed in the same
    # graph as ``tokens`` (a non-finite pass drafts the mask token everywhere), so reading the
    # tokens to the host evaluates it too: no second synchronisation (see Drafter.settle).
    finite: mx.array | None = None


@dataclass(frozen=True, slots=True)
class DraftHealth:
    """Finiteness of the drafter's passes (plain values, for the engine line, /health, /metrics)."""

    passes: int  # drafter passes whose finiteness was read
    nonfinite: int  # of them, passes with a NaN or inf hidden state or logit
    activations: str  # "float32" | "float16" | "bfloat16" | "as loaded"
    fallback: str | None  # why activations were switched to float32 (once), None: never

    def as_dict(self) -> dict:
        return {
            "passes": self.passes,
            "nonfinite": self.nonfinite,
            "activations": self.activations,
            "fallback": self.fallback,
        }


class Drafter(nn.Module):
    """A DFlash / DFlash 2 drafter. Call ``bind(embed, head)`` before use."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * args.target_hidden_size, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        layer = DFlash2DecoderLayer if args.is_v2 else DecoderLayer  # chosen once, here
        self.layers = [layer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if args.is_v2:
            self.candidate_selector = CandidateSelector(H, args.vocab_size, args.selector_rank, args.selector_top_k)
        # Shared, frozen target parts; plain callables so they are not parameters of ours.
        self._embed: Callable[[mx.array], mx.array] | None = None
        self._head: Callable[[mx.array], mx.array] | None = None
        self.vocab: DraftVocab | None = None
        # the drafting window (``--draft-window``): context rows each cache keeps (None: all)
        self.context_limit: int | None = None
        # ids of the checkpoint's reduced draft vocabulary (draft_vocab.json), if it ships one
        self.shipped_vocab = None
        # activations dtype: features and embedded blocks are cast to it (None: as they come, so
        # the widest of the weights' and the target's dtypes); float32 after a non-finite pass
        self.act_dtype = None
        self.fallback_on_nonfinite = True  # False: count non-finite passes only (measurements)
        self._pending: dict = {}  # key -> finiteness flags not read yet (see settle)
        self._passes = self._nonfinite = 0
        self._fallback: str | None = None

    def bind(self, embed: Callable, head: Callable, vocab: DraftVocab | None = None) -> Drafter:
        """Share the target's embedding and head; ``vocab`` drafts over a subset of the head."""
        self._embed, self._head, self.vocab = embed, head, vocab
        return self

    @property
    def vocab_size_drafted(self) -> int:
        """Ids the draft head scores: the reduced draft vocabulary's size, 0 for the full head."""
        return self.vocab.size if self.vocab is not None else 0

    def set_vocab(self, vocab: DraftVocab | None) -> DraftVocab | None:
        """Draft over ``vocab`` (None: the full head) from now on; returns the previous one."""
        prev, self.vocab = self.vocab, vocab
        return prev

    def make_cache(self) -> list[ContextCache]:
        """A fresh context cache per layer: its trained sliding window, and the drafting window
        (``context_limit``, ``--draft-window``) where one is set."""
        return [ContextCache(layer.window, self.context_limit) for layer in self.layers]

    def sanitize(self, weights: dict) -> dict:
        """Official files store the codebooks without ``.weight``; nn.Embedding wants it."""
        out = {}
        for k, v in weights.items():
            if k.endswith("_codebook"):
                k = k + ".weight"
            out[k] = v
        return out

    def fuse(self, features: mx.array) -> mx.array:
        """Fused context rows (B, S, H) from target features (B, S, n*H_t)."""
        if self.act_dtype is not None:
            features = features.astype(self.act_dtype)
        return self.hidden_norm(self.fc(features))

    def embed_block(self, block: mx.array) -> mx.array:
        """Input rows (B, L, H) of a block of token ids (the target's embedding, scaled)."""
        x = self._embed(block) * self.args.input_embedding_scale
        return x if self.act_dtype is None else x.astype(self.act_dtype)

    # -- finiteness of the passes ------------------------------------------------------------
    def precision(self) -> str:
        """Weights and activations as loaded, e.g. "4-bit weights, float32 activations"."""
        own = self.own_parameters()
        q = next((m for name, m in self.named_modules() if hasattr(m, "bits") and not name.startswith("_")), None)
        w = f"{q.bits}-bit weights (group {q.group_size})" if q is not None else "float weights"
        floats = {str(v.dtype).rsplit(".", 1)[-1] for _, v in own if mx.issubdtype(v.dtype, mx.floating)}
        act = self.health().activations
        act = act if act != "as loaded" else "/".join(sorted(floats)) + " (as loaded)"
        return f"{w}, {act} activations" + (" after a non-finite fallback" if self._fallback else "")

    def health(self) -> DraftHealth:
        act = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(self.act_dtype, "as loaded")
        return DraftHealth(self._passes, self._nonfinite, act, self._fallback)

    def settle(self, key=None) -> None:
        """Read the finiteness flags of earlier passes (all of them, or those of ``key``): call it
        once the caller has read those passes' tokens, so the flags are evaluated already and
        reading them waits for nothing. ``propose`` settles its own sequence's previous pass
        first (keyed by its cache). On the first non-finite pass the drafter switches to float32
        activations and weights for the rest of the session, once, with a warning."""
        keys = list(self._pending) if key is None else [key] if key in self._pending else []
        flags = [f for k in keys for f in self._pending.pop(k)]
        if not flags:
            return
        ok = mx.stack(flags).tolist() if len(flags) > 1 else [flags[0].item()]
        self._passes += len(ok)
        bad = ok.count(False)
        if not bad:
            return
        self._nonfinite += bad
        if self._fallback is None and self.fallback_on_nonfinite:
            was = self.health().activations
            self.use_float32()
            self._fallback = (
                f"a drafter pass gave non-finite hidden states or logits with {was} activations; "
                "switched to float32 activations and weights for the rest of the session"
            )
            log.warning("drafter: %s (that pass's drafts were rejected by verification)", self._fallback)

    def own_parameters(self) -> list[tuple[str, mx.array]]:
        """The drafter's own parameters, flat: not the target's embedding and head it borrows
        (``bind`` stores those modules as attributes, so ``parameters()`` lists them too)."""
        return [(k, v) for k, v in tree_flatten(self.parameters()) if not k.startswith(("_", "vocab"))]

    def use_float32(self) -> None:
        """float32 activations and float weights (quantized weights keep their bits; their scales
        become float32) from now on. The target's borrowed embedding and head are left as they are."""
        cast = [(k, v.astype(mx.float32)) for k, v in self.own_parameters() if mx.issubdtype(v.dtype, mx.floating)]
        self.update(tree_unflatten(cast))
        self.act_dtype = mx.float32

    def _check(self, h: mx.array, unary: mx.array, tokens: mx.array, key) -> tuple[mx.array, mx.array]:
        """(tokens, finite): a non-finite pass drafts the mask token at every position."""
        finite = mx.logical_and(mx.isfinite(h).all(), mx.isfinite(unary).all())
        if len(self._pending) > 64:  # flags of sequences that ended: read them (long evaluated)
            self.settle()
        self._pending.setdefault(key, []).append(finite)
        return mx.where(finite, tokens, mx.array(self.args.mask_token_id, tokens.dtype)), finite

    def add_context(self, features: mx.array, cache: list[ContextCache]):
        """Fuse target features (B, S, n*H_t) and push their K/V into every layer's cache (rows
        no layer keeps, the oldest of a long prompt under a drafting window, are skipped)."""
        n = skip_rows(cache, features.shape[1])
        if n:
            for lc in cache:
                lc.skip(n)
            features = features[:, n:]
        c = self.fuse(features)
        return [layer.self_attn.context_kv(c, lc) for layer, lc in zip(self.layers, cache)]

    def run_block(self, block: mx.array, kvs, start, masks) -> mx.array:
        """The layer stack over a block: ``kvs`` are each layer's context (K, V) (None, None for
        none), ``start`` the anchor's absolute position (int, or (B,) per row), ``masks`` each
        layer's attention mask. Returns final-normed hidden states (B, L, H)."""
        x = self.embed_block(block)
        for layer, (ck, cv), mask in zip(self.layers, kvs, masks):
            x = layer(x, ck, cv, start, mask)
        return self.norm(x)

    def hidden(self, block: mx.array, features: mx.array | None, cache: list[ContextCache]):
        """Final-normed hidden states (B, L, H) of a block; ``features`` are new context rows."""
        if features is not None and features.shape[1] > 0:
            kvs = self.add_context(features, cache)
        else:
            kvs = [lc.state for lc in cache]
        start, L = cache[0].offset, block.shape[1]
        masks = [
            block_mask(0 if ck is None else ck.shape[2], start, L, layer.causal, layer.window)
            for layer, (ck, _) in zip(self.layers, kvs)
        ]
        return self.run_block(block, kvs, start, masks)

    def block_hidden(
        self, blocks: mx.array, features: mx.array, starts: mx.array, rows: mx.array, mask: mx.array
    ) -> mx.array:
        """Many blocks at once, each against its own sequence's context (the training form of
        ``hidden``): ``features`` (Bs, S, F) are whole sequences (RoPE at positions 0..S-1),
        block n (``blocks[n]``, anchor at ``starts[n]``) reads sequence ``rows[n]`` through
        ``mask`` (N, 1, L, S + L), which must hide every context row at or after its anchor.
        Returns (N, L, H); row n equals ``hidden(blocks[n:n+1], features[rows[n], :starts[n]],
        make_cache())`` (tested)."""
        c = self.fuse(features)
        kvs = []
        for layer in self.layers:
            ck, cv = layer.self_attn.kv(c, 0)  # (Bs, n_kv, S, hd)
            kvs.append((ck[rows], cv[rows]))
        return self.run_block(blocks, kvs, starts, [mask] * len(self.layers))

    def softcap(self, out: mx.array) -> mx.array:
        """Raw head outputs -> draft logits: the output multiplier, then the softcap if any."""
        out = out * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return cap * mx.tanh(out / cap) if cap else out

    def logits(self, h: mx.array, full: bool = False, head: Callable | None = None) -> mx.array:
        """Draft logits over the draft vocabulary (all V, or ``vocab.ids``; ``full`` forces V;
        ``head`` replaces the head, e.g. rows of it when training over part of the vocabulary)."""
        if head is None:
            head = self._head if full or self.vocab is None else self.vocab.head
        return self.softcap(head(h))

    def propose(
        self,
        anchor: mx.array,
        features: mx.array | None,
        cache: list[ContextCache],
        block_size: int,
        sampling: SamplingConfig | float = 0.0,
        key: mx.array | None = None,
        confidence: bool = False,
    ) -> Proposal:
        """Draft ``block_size - 1`` tokens after ``anchor`` (a () or (1,) int array).

        ``sampling`` is the request's SamplingConfig (a float is a bare temperature). At T > 0
        the proposal carries q, the exact distribution each draft was drawn from (see sample).
        ``confidence`` (greedy): also return the drafter's top probability at each position.
        """
        cfg = sampling if isinstance(sampling, SamplingConfig) else SamplingConfig(float(sampling))
        mask_id = self.args.mask_token_id
        block = mx.concatenate([anchor.reshape(1).astype(mx.int32), mx.full((block_size - 1,), mask_id, mx.int32)])[
            None
        ]
        self.settle(id(cache))  # this sequence's previous pass: its tokens were read already
        h = self.hidden(block, features, cache)[0, 1:]  # (L-1, H)
        return self.proposal(h, self.logits(h), anchor, cfg, key, confidence, seq=id(cache))

    def proposal(
        self,
        h: mx.array,
        unary: mx.array,
        anchor: mx.array,
        cfg: SamplingConfig,
        key: mx.array | None = None,
        confidence: bool = False,
        seq=None,
    ) -> Proposal:
        """The drafts of one block from its hidden states h (L-1, H) and draft logits ``unary``
        (``propose``'s last part; batch.py runs the block pass for many sequences at once).
        ``seq`` keys the pass's finiteness flag for ``settle`` (None: settled by the next
        ``settle()``)."""
        p = self._proposal(h, unary, anchor, cfg, key, confidence)
        tokens, finite = self._check(h, unary, p.tokens, seq)
        q = p.q
        if q is not None:  # the masked drafts were drawn from a point mass on the mask token
            mass = (mx.arange(q.shape[-1]) == self.args.mask_token_id).astype(q.dtype)
            q = mx.where(finite, q, mass)
        return p._replace(tokens=tokens, q=q, finite=finite)

    def _proposal(self, h, unary, anchor, cfg, key, confidence) -> Proposal:
        if cfg.greedy:
            ids = self.vocab.ids if self.vocab is not None else None
            conf = None
            if confidence:
                u = unary.astype(mx.float32)
                conf = mx.exp(u.max(axis=-1) - mx.logsumexp(u, axis=-1))
            if "candidate_selector" in self:
                sel = self.candidate_selector
                return Proposal(sel.walk_greedy(*sel.lattice(h, unary, anchor.reshape(()), ids)), None, conf)
            best = mx.argmax(unary, axis=-1)
            return Proposal(best if ids is None else ids[best], None, conf)
        return Proposal(*self.sample(h, unary, anchor, cfg, key))

    def sample(
        self, h: mx.array, unary: mx.array, anchor: mx.array, cfg: SamplingConfig, key: mx.array, n: int | None = None
    ):
        """Sampled drafts (T > 0) and their realized proposal distribution q.

        DFlash 2: the selector's walk at the temperature only; q is sparse over the K candidates
        of each position, scattered into vocab space. DFlash 1: independent draws per position
        from the target's own rule (temperature, top-p, top-k) applied to the drafter's logits,
        as the reference does; drafts outside the target's top-p/top-k would be rejected anyway.

        h (P, H), unary (P, V) (or (P, K) over a reduced draft vocabulary). Returns tokens (P,)
        and q (P, V) in target ids; with ``n``, n independent proposals: (n, P) and (n, P, V).
        """
        V = self.args.vocab_size
        ids = self.vocab.ids if self.vocab is not None else None
        if "candidate_selector" in self:
            sel = self.candidate_selector
            cand, scores = sel.lattice(h, unary, anchor.reshape(()), ids)
            tokens, _, qk = sel.walk_sample(cand, scores, cfg.temperature, key, n or 1)
            m, (P, K) = qk.shape[0], cand.shape
            # candidates are distinct ids (argpartition), so the scatter never collides
            q = mx.put_along_axis(mx.zeros((m, P, V), mx.float32), mx.broadcast_to(cand, (m, P, K)), qk, axis=-1)
            return (tokens[0], q[0]) if n is None else (tokens, q)
        tokens, q = sample_proposal(unary, cfg, key, n)
        if ids is not None:  # back to target ids: q is 0 outside the draft vocabulary
            tokens = ids[tokens]
            q = mx.put_along_axis(mx.zeros((*q.shape[:-1], V), q.dtype), mx.broadcast_to(ids, q.shape), q, axis=-1)
        return (tokens, q) if n is None else (tokens, mx.broadcast_to(q, (n, *q.shape)))


def parameter_names(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


__all__ = [
    "DFLASH1",
    "DFLASH2",
    "DrafterArgs",
    "Drafter",
    "ContextCache",
    "skip_rows",
    "Proposal",
    "DraftHealth",
    "DraftVocab",
    "TwoTapConv",
    "DecoderLayer",
    "DFlash2DecoderLayer",
    "CandidateSelector",
    "build_target_layer_ids",
    "block_mask",
    "parameter_names",
]
