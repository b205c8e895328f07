"""The memory plan: every byte a pair will use, counted from configs before anything loads.

``make_plan`` is pure arithmetic over ``ModelDims`` / ``DrafterDims`` (read from config dicts)
and weight byte counts (from safetensors headers or lazily built modules, see quantize.py), so it
is testable on synthetic configs. ``plan_for`` is the glue that reads a pair's files;
``check`` refuses a plan over budget; ``live`` reports what MLX really holds.

Activation coefficients are measured on mlx 0.32 (benchmarks/plan_accuracy.py, docs/memory.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass, replace

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten

from . import backend, default_target, hub
from . import quantize as q
from .drafter import DrafterArgs
from .errors import CheckpointError, IncompatiblePair, PlanError, UnsupportedModel
from .loading import draft_window, read_draft_vocab, resolve
from .modelfiles import read_json
from .quantize import DTYPE_BYTES, Tensor, loaded_nbytes, module_tensors, safetensors_tensors
from .target import SUPPORTED

log = logging.getLogger(__name__)

MiB, GiB = 2**20, 2**30
KV_STEP = 256  # mlx-lm's KVCache grows in steps of 256 positions
WARN_FRACTION = 0.9  # as mlx-lm's wired_limit warning
CPU_CACHE_LIMIT = 32 * MiB  # MLX's default allocator cache limit on the CPU backend
# Live activation floats per token during a forward pass (one layer's temporaries at a time),
# per unit of hidden size, MLP width, query width and key/value width. Measured on mlx 0.32 CPU.
ACT_HIDDEN, ACT_MLP, ACT_Q, ACT_KV = 7.0, 2.0, 6.5, 3.7
FUSED_SDPA_HEAD_DIMS = (64, 80, 128)  # Metal's fused attention: no (heads, T, S) score matrix
NON_PEAK = ("prefix cache", "MLX cache allowance")  # budgeted, but not in get_peak_memory()


@dataclass(frozen=True, slots=True)
class ModelDims:
    """What the plan needs from a target config."""

    layers: int
    hidden: int
    intermediate: int  # MLP width active per token (MoE: experts per token x expert width)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    kinds: tuple[str, ...]  # per layer: "full" | "sliding" | "linear" (recurrent)
    window: int | None = None
    conv_dim: int = 0  # recurrent layers: conv channels, kernel, recurrent state shape
    conv_kernel: int = 4
    linear_qk: int = 0  # Hk * Dk
    linear_v: int = 0  # Hv * Dv
    ssm_state: int = 0  # Hv * Dv * Dk (float32)
    max_position: int | None = None


@dataclass(frozen=True, slots=True)
class DrafterDims:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    taps: int  # fused target features per position: taps x target_hidden
    target_hidden: int
    windows: tuple[int | None, ...]  # per layer: sliding window or None (full)
    block_size: int


def target_dims(config: dict) -> ModelDims:
    c = {**config, **(config.get("text_config") or {})}
    L, H = c["num_hidden_layers"], c["hidden_size"]
    heads = c.get("num_attention_heads") or 1
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or H // heads
    inter = c.get("intermediate_size") or 4 * H
    if c.get("num_experts_per_tok") and c.get("moe_intermediate_size"):
        inter = c["num_experts_per_tok"] * c["moe_intermediate_size"] + c.get("shared_expert_intermediate_size", 0)
    names = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
    if c.get("layer_types"):
        kinds = tuple(names.get(t, "linear") for t in c["layer_types"][:L])
    elif c.get("full_attention_interval"):
        kinds = tuple("full" if (i + 1) % c["full_attention_interval"] == 0 else "linear" for i in range(L))
    elif c.get("sliding_window_pattern") and c.get("sliding_window"):
        p = c["sliding_window_pattern"]
        kinds = tuple("full" if (i + 1) % p == 0 else "sliding" for i in range(L))
    else:
        kinds = ("full",) * L
    qk = c.get("linear_num_key_heads", 0) * c.get("linear_key_head_dim", 0)
    v = c.get("linear_num_value_heads", 0) * c.get("linear_value_head_dim", 0)
    return ModelDims(
        layers=L,
        hidden=H,
        intermediate=inter,
        heads=heads,
        kv_heads=kv,
        head_dim=hd,
        vocab=c["vocab_size"],
        kinds=kinds,
        window=c.get("sliding_window"),
        conv_dim=2 * qk + v,
        conv_kernel=c.get("linear_conv_kernel_dim", 4),
        linear_qk=qk,
        linear_v=v,
        ssm_state=v * c.get("linear_key_head_dim", 0),
        max_position=c.get("max_position_embeddings"),
    )


def drafter_dims(config: dict) -> DrafterDims:
    a = DrafterArgs.from_config(config)
    return DrafterDims(
        layers=a.num_hidden_layers,
        hidden=a.hidden_size,
        intermediate=a.intermediate_size,
        heads=a.num_attention_heads,
        kv_heads=a.num_key_value_heads,
        head_dim=a.head_dim,
        taps=len(a.target_layer_ids),
        target_hidden=a.target_hidden_size,
        windows=tuple(a.layer_window(i) for i in range(a.num_hidden_layers)),
        block_size=a.block_size,
    )


@dataclass(frozen=True, slots=True)
class Item:
    name: str
    bytes: int
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ChainDims:
    """What the plan needs from a loaded chain drafter (``chain_dims``): an MTP head or an
    EAGLE-3 layer."""

    kind: str  # "mtp" | "eagle"
    weights: int  # its own weights (the embedding and head are the target's, except EAGLE-3's lm_head)
    kv_heads: int
    head_dim: int
    target_hidden: int
    depth: int = 4  # chain passes past the context whose K/V rows it holds before rollback
    bits: int | None = None

    @property
    def label(self) -> str:
        return "MTP head" if self.kind == "mtp" else "EAGLE-3"

    def kv_bytes(self, act_bytes: int) -> int:
        """K/V bytes per position of its one layer."""
        return 2 * self.kv_heads * self.head_dim * act_bytes

    def feature_bytes(self, act_bytes: int) -> int:
        """Bytes per prompt position of the target features it waits for (EAGLE-3: 3 taps)."""
        return 3 * self.target_hidden * act_bytes if self.kind == "eagle" else 0


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Everything but the context: model shapes, loaded weight bytes, backend facts."""

    target: ModelDims
    target_weights: int
    drafter: DrafterDims | None = None
    drafter_weights: int = 0
    draft_head: int = 0  # bytes of the head rows a reduced draft vocabulary copies (0: full head)
    act_bytes: int = 4  # activation / KV dtype size: float32 on CPU, the model's dtype on Metal
    metal: bool = False
    prefill_step: int = 2048
    prefix_cache: int = 0
    cache_limit: int | None = CPU_CACHE_LIMIT  # MLX allocator cache limit; None: unbounded
    labels: dict = field(default_factory=dict)  # descriptions for the weight rows
    ranks: int = 1  # > 1: the plan of one rank of a group the target is sharded over (distributed.py)
    replicated_weights: int = 0  # target bytes every rank holds whole (embedding, head, norms)
    kv_bits: int | None = None  # --kv-bits: the target's K/V quantized (QuantizedKVCache); None: as computed
    kv_group_size: int = 64
    draft_window: int | None = None  # --draft-window: drafter context rows kept (None: every position)
    chain: tuple[ChainDims, ...] = ()  # loaded chain drafters (MTP head, EAGLE-3 layer)


def act_bytes(tensors, *, cast_float32: bool) -> int:
    """Bytes of one activation, and so of one K/V element, of a target with these (loaded)
    tensors: 4 where float weights are cast to float32 (the CPU backend); else MLX's type
    promotion over what the activations meet on their way to the cache: the embedding (its
    scales when quantized) and every norm weight. A kept GGUF target holds float16 scales but
    float32 norms, and those promote the activations, and its cache, to float32."""
    if cast_float32:
        return 4

    seen = {
        t.dtype
        for t in tensors
        if t.dtype in ("F32", "F16", "BF16", "F64")
        and ("embed_tokens" in t.name or (len(t.shape) == 1 and "norm" in t.name.rsplit(".", 2)[-2]))
    }
    if not seen:
        return 4
    if {"F16", "BF16"} <= seen:  # float16 with bfloat16 promotes to float32
        return 4
    return max(DTYPE_BYTES[d] for d in seen)


def kv_bytes(d: ModelDims | DrafterDims, act_bytes: int, bits: int | None = None, group_size: int = 64) -> int:
    """Keys + values of one position in one attention layer; with ``bits``, as mlx-lm's
    ``QuantizedKVCache`` holds them: ``bits`` per element packed in uint32 words, plus a scale and
    a bias per ``group_size`` elements in the activations' dtype."""
    if bits is None:
        return 2 * d.kv_heads * d.head_dim * act_bytes
    return 2 * d.kv_heads * (d.head_dim * bits // 8 + 2 * (d.head_dim // group_size) * act_bytes)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _act(d, tokens: int, ab: int) -> int:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    return int(tokens * ab * (ACT_HIDDEN * d.hidden + ACT_MLP * d.intermediate + ACT_Q * q + ACT_KV * kv))


def items(p: PlanInputs, context: int, block: int, prompt: int | None = None) -> list[Item]:
    """The plan's rows for ``context`` positions, verify blocks of ``block`` and a prompt of
    ``prompt`` positions (default: the whole context arrives as one prompt, the worst case)."""
    t, d, ab = per_rank(p.target, p.ranks), p.drafter, p.act_bytes
    prompt = context if prompt is None else min(prompt, context)
    B = block if d is not None else 1
    if p.ranks > 1:
        w = p.replicated_weights + (p.target_weights - p.replicated_weights) // p.ranks
        rows = [
            Item(
                "target weights",
                w,
                f"this rank's 1/{p.ranks} shard + {_gib(p.replicated_weights)} "
                "replicated (embedding, head, norms); " + p.labels.get("target", ""),
            )
        ]
    else:
        rows = [Item("target weights", p.target_weights, p.labels.get("target", ""))]
    if d is not None:
        rows.append(
            Item(
                "drafter weights",
                p.drafter_weights,
                p.labels.get("drafter", "") + "embedding and head shared: counted in the target",
            )
        )
        if p.draft_head:
            rows.append(Item("draft head rows", p.draft_head, p.labels.get("draft_head", "")))
    # Target KV: keys + values per attention layer, allocated in 256-position steps.
    kv_tok = kv_bytes(t, ab, p.kv_bits, p.kv_group_size)
    n_full, n_swa, n_lin = (t.kinds.count(k) for k in ("full", "sliding", "linear"))
    alloc = _round_up(context + B, KV_STEP)
    swa = min(alloc, (t.window or alloc) + B)
    rows.append(
        Item(
            "target KV cache",
            kv_tok * (n_full * alloc + n_swa * swa),
            f"{kv_tok * (n_full + n_swa) / 1024:.0f} KiB/token x {alloc} positions"
            + (f" ({n_full} full, {n_swa} sliding window {t.window})" if n_swa else "")
            + (f", {p.kv_bits}-bit K/V (group {p.kv_group_size}, --kv-bits)" if p.kv_bits else ""),
        )
    )
    if n_lin:  # GDN layers: conv + recurrent state; a verify pass also records its inputs
        state = (t.conv_kernel - 1) * t.conv_dim * ab + 4 * t.ssm_state
        record = (
            0
            if d is None
            else ((t.conv_kernel - 1 + B) * t.conv_dim + B * (2 * t.linear_qk + t.linear_v)) * ab + 4 * t.ssm_state
        )
        rows.append(
            Item(
                "recurrent state",
                n_lin * (state + record),
                f"{n_lin} linear-attention layers x (state "
                f"{state / 1024:.0f} KiB + verify record {record / 1024:.0f} KiB); independent of context",
            )
        )
    if d is not None:
        cap = context if p.draft_window is None else min(context, p.draft_window)
        kept = sum(cap if w is None else min(cap, w - 1) for w in d.windows)
        kinds = ", ".join(sorted({"full" if w is None else f"window {w}" for w in d.windows}))
        if p.draft_window is not None:
            kinds += f"; the last {p.draft_window} positions (--draft-window)"
        rows.append(Item("drafter context cache", kv_bytes(d, ab) * kept, f"{d.layers} layers, {kinds}"))
        rows.append(
            Item(
                "target features for the drafter",
                d.taps * d.target_hidden * ab * prompt,
                f"{d.taps} taps x {d.target_hidden} x {prompt} prompt positions (held until the first draft)",
            )
        )
    for c in p.chain:
        rows += chain_rows(c, context, prompt, ab)
    C = min(prompt, p.prefill_step)
    prefill, verify = _phases(p, context, B, prompt, C)
    rows.append(
        Item(
            "verify / prefill scratch",
            max(prefill, verify),
            f"max(prefill chunk {C}: {prefill / MiB:.0f} MiB, "
            f"verify block {B} with {t.vocab}-vocab logits: {verify / MiB:.0f} MiB)",
        )
    )
    if p.prefix_cache:
        rows.append(Item("prefix cache", p.prefix_cache, "budget for reused prompt caches"))
    allowance = max(prefill, verify) + kv_tok * t.layers * KV_STEP
    rows.append(
        Item(
            "MLX cache allowance",
            allowance if p.cache_limit is None else min(allowance, p.cache_limit),
            "freed buffers MLX keeps for reuse",
        )
    )
    return rows


def per_rank(t: ModelDims, ranks: int) -> ModelDims:
    """One rank's share of a target split tensor-parallel over ``ranks`` (mlx-lm's ``shard``):
    attention and linear-attention heads, MLP width; hidden size and vocabulary stay whole."""
    if ranks <= 1:
        return t

    return replace(
        t,
        heads=max(1, t.heads // ranks),
        kv_heads=max(1, t.kv_heads // ranks),
        intermediate=t.intermediate // ranks,
        conv_dim=t.conv_dim // ranks,
        linear_qk=t.linear_qk // ranks,
        linear_v=t.linear_v // ranks,
        ssm_state=t.ssm_state // ranks,
    )


def ranks_needed(
    p: PlanInputs, *, context: int, block_size: int, budget: int, prompt: int | None = None, limit: int = 16
) -> int | None:
    """The fewest machines of ``budget`` bytes each that hold the pair at ``context`` with the
    target sharded over them (the head count must split evenly); None if more than ``limit``."""
    for n in range(1, limit + 1):
        if n > 1 and (p.target.heads % n or p.target.intermediate % n):
            continue
        if sum(i.bytes for i in items(replace(p, ranks=n), context, block_size, prompt)) <= budget:
            return n
    return None


def _attn_scores(p: PlanInputs, heads: int, head_dim: int, q: int, s: int) -> int:
    """The (heads, q, s) score matrix an unfused attention materializes."""
    fused = p.metal and head_dim in FUSED_SDPA_HEAD_DIMS
    return 0 if fused else heads * q * s * p.act_bytes


def _phases(p: PlanInputs, context: int, B: int, prompt: int, C: int) -> tuple[int, int]:
    """Transient bytes of the worst prefill chunk (C rows over the prompt) and of one verify."""
    t, d, ab = per_rank(p.target, p.ranks), p.drafter, p.act_bytes
    prefill = _act(t, C, ab) + _attn_scores(p, t.heads, t.head_dim, C, prompt) + 4 * t.vocab
    verify = _act(t, B, ab) + _attn_scores(p, t.heads, t.head_dim, B, context) + 2 * B * t.vocab * 4
    if d is not None:  # the drafter's first pass fuses every prompt position; then its own block
        prefill += 2 * prompt * d.hidden * ab
        verify += _act(d, B, ab) + _attn_scores(p, d.heads, d.head_dim, B, context + B) + 2 * B * t.vocab * 4
    return prefill, verify


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    items: tuple[Item, ...]
    context: int
    block_size: int
    prompt: int
    budget: int
    budget_source: str
    max_context: int  # the largest context whose plan fits the budget
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def peak(self) -> int:
        """Predicted peak of active MLX memory (what ``mx.get_peak_memory()`` reports)."""
        return sum(i.bytes for i in self.items if i.name not in NON_PEAK)

    headroom = property(lambda self: self.budget - self.total)
    fraction = property(lambda self: self.total / self.budget if self.budget else math.inf)
    fits = property(lambda self: self.total <= self.budget)

    def biggest(self, n: int = 3) -> list[Item]:
        return sorted(self.items, key=lambda i: -i.bytes)[:n]

    def summary(self) -> str:
        top = ", ".join(f"{i.name} {_gib(i.bytes)}" for i in self.biggest())
        return (
            f"memory plan: {_gib(self.total)} of {_gib(self.budget)} ({self.fraction:.0%}, "
            f"{self.budget_source}) at context {self.context}: {top}; max context {self.max_context}"
        )

    def table(self) -> str:
        w = max(len(i.name) for i in self.items)
        lines = [f"memory plan: context {self.context} (prompt {self.prompt}), block {self.block_size}", ""]
        lines += [f"  {i.name:<{w}}  {i.bytes / MiB:>10.1f} MiB  {i.detail}" for i in self.items]
        lines += [
            "",
            f"  {'total':<{w}}  {self.total / MiB:>10.1f} MiB  (predicted peak of active memory "
            f"{self.peak / MiB:.1f} MiB)",
            f"  {'budget':<{w}}  {self.budget / MiB:>10.1f} MiB  {self.budget_source}",
            f"  {'headroom':<{w}}  {self.headroom / MiB:>10.1f} MiB  ({self.fraction:.1%} used)",
            f"  largest context that fits: {self.max_context}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        names = (
            "context",
            "prompt",
            "block_size",
            "total",
            "peak",
            "budget",
            "budget_source",
            "headroom",
            "fraction",
            "fits",
            "max_context",
        )
        return {
            **{k: getattr(self, k) for k in names},
            "notes": list(self.notes),
            "items": [{"name": i.name, "bytes": i.bytes, "detail": i.detail} for i in self.items],
        }


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def make_plan(
    p: PlanInputs,
    *,
    context: int,
    block_size: int,
    budget: int,
    budget_source: str,
    prompt: int | None = None,
    notes: tuple[str, ...] = (),
) -> MemoryPlan:
    """Pure: the plan for ``context`` positions, and the largest context that fits ``budget``."""

    def total(n: int) -> int:
        return sum(i.bytes for i in items(p, n, block_size))

    lo, hi = 0, p.target.max_position or 1 << 24
    if total(hi) <= budget:
        lo = hi
    while lo < hi:  # largest n with total(n) <= budget (total grows with n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid - 1)
    rows = tuple(items(p, context, block_size, prompt))
    return MemoryPlan(
        rows, context, block_size, context if prompt is None else min(prompt, context), budget, budget_source, lo, notes
    )


# -- continuous batching: what each sequence of a batch adds --------------------------------------

PER_SEQUENCE = (
    "target KV cache",
    "recurrent state",
    "drafter context cache",
    "target features for the drafter",
    "verify / prefill scratch",
    "MTP head draft KV cache",
    "EAGLE-3 draft KV cache",
    "target features for EAGLE-3",
)
DEFAULT_MAX_BATCH = 8  # the default --max-batch where memory allows more


@dataclass(frozen=True)
class BatchRoom:
    """Memory for a batch of sequences, from a plan: each sequence holds its own K/V (and
    recurrent state, drafter context, verify rows); weights and the prefix cache are shared."""

    per_token: float  # bytes a sequence's caches grow per position (target K/V + drafter context)
    per_sequence: int  # bytes a sequence holds whatever its length (recurrent state, verify scratch)
    room: int  # the budget left for sequences once the shared items are counted
    block: int = 1  # verify rows past the last position (the K/V grows by them before rollback)

    def need(self, positions: int) -> int:
        """Bytes one sequence of ``positions`` (prompt + max tokens) may hold."""
        return int(self.per_sequence + self.per_token * _round_up(positions + self.block, KV_STEP))

    def max_batch(self, context: int, cap: int = DEFAULT_MAX_BATCH) -> int:
        """Sequences of ``context`` positions that fit at once (at least 1, at most ``cap``)."""
        return max(1, min(cap, self.room // max(1, self.need(context))))


def batch_room(plan: MemoryPlan) -> BatchRoom:
    """The per-sequence share of ``plan`` (planned for one sequence of ``plan.context``)."""
    by: dict[str, int] = {}
    for i in plan.items:  # (several chain drafters: rows of one name)
        by[i.name] = by.get(i.name, 0) + i.bytes
    per_pos = by.get("target KV cache", 0) + by.get("drafter context cache", 0)
    positions = _round_up(plan.context + plan.block_size, KV_STEP)
    fixed = (
        by.get("recurrent state", 0)
        + by.get("verify / prefill scratch", 0)
        + by.get("target features for the drafter", 0)
        + by.get("target features for EAGLE-3", 0)
        # a chain cache holds context + depth rows; counted per sequence at its planned size
        + by.get("MTP head draft KV cache", 0)
        + by.get("EAGLE-3 draft KV cache", 0)
    )
    shared = plan.total - sum(by.get(n, 0) for n in PER_SEQUENCE)
    return BatchRoom(per_pos / max(1, positions), fixed, plan.budget - shared, plan.block_size)


# -- a serving process's resident memory: measured at start + planned growth + allowance ---------

# What the process's own heaps may add over a server's life, beyond what the plan counts: Python
# objects of requests in flight, the HTTP stack's buffers, the tokenizer's caches. A stated
# allowance, checked by benchmarks/soak.py (docs/memory.md, "A server's resident memory"). Freed
# MLX buffers that malloc holds until the engine releases them are scratch the plan counts.
HEAP_ALLOWANCE = 64 * MiB


@dataclass(frozen=True, slots=True)
class RssBound:
    """The resident memory a serving process may reach: what it holds once the pair has loaded
    (measured), what the memory plan lets it add (the sequences' K/V, drafter context, features
    and scratch, for the batch the engine admits; the prefix cache; MLX's bounded buffer cache)
    and ``heap`` for its own heaps' growth. The terms add up to ``total``."""

    rss_loaded: int  # the process's RSS once the pair had loaded (measured)
    mlx_active: int  # MLX's active bytes then: the weights (measured)
    mlx_cache_loaded: int  # MLX's buffer cache then (measured; counted in mlx_cache below)
    sequences: int  # the plan's per-sequence rows x the sequences the engine admits at once
    prefix_cache: int  # the plan's prefix cache budget
    mlx_cache: int  # the plan's MLX cache allowance (the buffer cache's bound)
    heap: int = HEAP_ALLOWANCE  # stated allowance for the process's own heaps

    @property
    def runtime(self) -> int:
        """RSS outside MLX once loaded: the interpreter, the libraries (BLAS, tokenizer, HTTP
        stack), the tokenizer's vocabulary and the Python objects loading left."""
        return self.rss_loaded - self.mlx_active - self.mlx_cache_loaded

    @property
    def total(self) -> int:
        return self.runtime + self.mlx_active + self.sequences + self.prefix_cache + self.mlx_cache + self.heap

    def terms(self) -> dict[str, int]:
        """The terms of ``total`` by name (measured: runtime, weights; planned: sequences,
        prefix_cache, mlx_cache; stated: heap)."""
        return {
            "runtime": self.runtime,
            "weights": self.mlx_active,
            "sequences": self.sequences,
            "prefix_cache": self.prefix_cache,
            "mlx_cache": self.mlx_cache,
            "heap": self.heap,
        }

    def describe(self) -> str:
        t = ", ".join(f"{k} {_gib(v)}" for k, v in self.terms().items())
        return f"resident memory bound {_gib(self.total)} ({t})"


def rss_bound(
    plan: MemoryPlan, *, rss: int, mlx_active: int, mlx_cache: int = 0, batch: int = 1, heap: int = HEAP_ALLOWANCE
) -> RssBound:
    """Pure: the ``RssBound`` of a process that measured ``rss`` and MLX's ``mlx_active`` and
    ``mlx_cache`` bytes once it had loaded the pair of ``plan``, serving up to ``batch``
    sequences at once. Each sequence counts the plan's per-sequence rows at the plan's context
    (what the engine's admission counts, ``BatchRoom.need``), never more in all than the room
    admission leaves them."""
    by = {i.name: i.bytes for i in plan.items}
    one = sum(by.get(n, 0) for n in PER_SEQUENCE)
    seqs = one * max(1, batch)
    if batch > 1:
        seqs = min(seqs, max(one, batch_room(plan).room))
    return RssBound(
        rss_loaded=rss,
        mlx_active=mlx_active,
        mlx_cache_loaded=mlx_cache,
        sequences=seqs,
        prefix_cache=by.get("prefix cache", 0),
        mlx_cache=by.get("MLX cache allowance", 0),
        heap=heap,
    )


def rss() -> int:
    """This process's resident set size in bytes (psutil; any thread)."""
    return psutil.Process().memory_info().rss


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None), "malloc_trim", None)
    except OSError:
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``). MLX's CPU
    buffers come from malloc, and glibc keeps what is freed in its arenas (a freed large buffer
    raises its mmap threshold, so later ones come from the arenas too): without this a server's
    RSS climbs to its largest working set plus the arenas' fragmentation and stays there, far
    above what MLX holds. Returns False where there is nothing to call (not glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


# -- serving: the context and prefix cache `serve` runs with by default ----------------------------

PREFIX_CONTEXTS = 2  # the default prefix cache keeps this many whole contexts of K/V ...
PREFIX_HEADROOM = 0.5  # ... when this share of the plan's headroom holds them (at least one, always)
SIZING_STEP = KV_STEP  # a context capped by memory is a multiple of this


@dataclass(frozen=True, slots=True)
class Sizing:
    """The context and prefix-cache bytes a server runs with, and why (``serve_sizing``)."""

    context: int
    prefix_cache: int
    why: str


def entry_bytes(plan: MemoryPlan) -> int:
    """What a prefix-cache entry of the plan's whole context holds: the target's K/V (and
    recurrent state) and the drafter's context rows."""
    by = {i.name: i.bytes for i in plan.items}
    return by.get("target KV cache", 0) + by.get("recurrent state", 0) + by.get("drafter context cache", 0)


def serve_sizing(
    plan_at: Callable[[int, int], MemoryPlan],
    trained: int | None,
    *,
    context: int | None = None,
    prefix_cache: int | None = None,
    fallback: int = 4096,
) -> Sizing:
    """Pure over ``plan_at(context, prefix_cache_bytes)``: the context (``context`` when given,
    else the target's ``trained`` one, capped by the memory plan so that one whole context of
    K/V still fits beside it for the prefix cache) and the prefix cache (``prefix_cache`` when
    given, else ``PREFIX_CONTEXTS`` whole contexts of K/V, fewer when ``PREFIX_HEADROOM`` of the
    plan's headroom cannot hold them, never less than one when the headroom holds one)."""

    def spare(n: int) -> int:  # the budget left at context n with no prefix cache, minus what it keeps
        p = plan_at(n, 0)
        return p.budget - p.total - (entry_bytes(p) if prefix_cache is None else prefix_cache)

    whys = []
    if context is not None:
        n = context
        whys.append(f"context {n} tokens (--context)")
    else:
        want = trained or fallback
        src = (
            f"the target's trained context (max_position_embeddings {trained})"
            if trained
            else f"the target's config names no trained context: {fallback}"
        )
        if spare(want) >= 0:
            n = want
            whys.append(f"context {n} tokens: {src}, which fits the memory plan")
        else:
            lo, hi = 0, want // SIZING_STEP  # largest multiple of the step that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if spare(mid * SIZING_STEP) >= 0 else (lo, mid - 1)
            p = plan_at(want, 0)
            if lo == 0:  # nothing fits: plan the trained context, and let the plan's check say why
                n = want
                whys.append(
                    f"context {n} tokens: {src}; it does not fit the memory plan ({_gib(p.total)} of "
                    f"{_gib(p.budget)}) at any context"
                )
            else:
                n = lo * SIZING_STEP
                whys.append(
                    f"context {n} tokens: capped by the memory plan (the target's trained {want} needs "
                    f"{_gib(p.total)} + {_gib(entry_bytes(p))} of prefix cache; budget {_gib(p.budget)}, "
                    f"{p.budget_source}); --context N asks for another"
                )
    if prefix_cache is not None:
        whys.append(f"prefix cache {_gib(prefix_cache)} (--prefix-cache-mb)")
        return Sizing(n, prefix_cache, "; ".join(whys))
    p = plan_at(n, 0)
    one, headroom = entry_bytes(p), max(0, p.budget - p.total)
    pc = min(PREFIX_CONTEXTS * one, max(one, int(headroom * PREFIX_HEADROOM)), headroom)
    whole = pc // one if one else 0
    whys.append(
        f"prefix cache {_gib(pc)}: "
        + (
            f"{whole} whole context{'s' if whole != 1 else ''} of K/V ({_gib(one)} "
            f"a context) in the plan's {_gib(headroom)} headroom"
            if whole
            else f"all of the plan's {_gib(headroom)} headroom (one whole context of K/V needs {_gib(one)})"
        )
    )
    return Sizing(n, pc, "; ".join(whys))


def check(plan: MemoryPlan, *, force: bool = False, warn: Callable[[str], None] = log.warning) -> None:
    """Raise PlanError when the plan exceeds the budget (unless ``force``); warn above 90 %."""
    if not plan.fits:
        top = ", ".join(f"{i.name} {_gib(i.bytes)}" for i in plan.biggest())
        msg = (
            f"the memory plan needs {_gib(plan.total)} but the budget is {_gib(plan.budget)} "
            f"({plan.budget_source}); biggest items: {top}. Lower --context (max that fits: "
            f"{plan.max_context}), quantize (--target-bits/--drafter-bits 4), or pass --force"
        )
        if not force:
            raise PlanError(msg)
        warn("--force: " + msg)
    elif plan.fraction > WARN_FRACTION:
        warn(
            f"the memory plan uses {plan.fraction:.0%} of the budget ({_gib(plan.total)} of "
            f"{_gib(plan.budget)}, {plan.budget_source}); expect swapping or slowdowns"
        )


# -- the machine (MLX / psutil) -------------------------------------------------------------------


def device_budget() -> tuple[int, str]:
    """Metal's recommended working set on Apple Silicon, a GPU's memory, else physical memory
    (backend.current())."""
    b = backend.current()
    return b.budget, b.budget_source


def set_wired_limit() -> int | None:
    """Wire up to the recommended working set, as mlx-lm's ``wired_limit`` does (Metal only).
    Returns the previous limit, or None where there is nothing to set (CPU)."""
    return backend.set_wired_limit()


def live(plan: MemoryPlan | None = None) -> dict:
    """Live memory numbers for the UI and the server, as plain values.

    Call it on the engine thread (``engine.call(lambda pair: memory.live(plan))``): the MLX
    counters belong to the thread that runs the models. Swap and RAM come from psutil.
    """
    budget, source = (plan.budget, plan.budget_source) if plan else device_budget()
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    active, cache = mx.get_active_memory(), mx.get_cache_memory()
    return {
        "active": active,
        "peak": mx.get_peak_memory(),
        "cache": cache,
        "used": active + cache,
        "budget": budget,
        "budget_source": source,
        "fraction": (active + cache) / budget if budget else None,
        "ram_total": vm.total,
        "ram_available": vm.available,
        "swap_used": sw.used,
        "swap_total": sw.total,
        "plan": plan.as_dict() if plan else None,
    }


@dataclass(frozen=True, slots=True)
class LoadedSizes:
    """Bytes of a loaded pair: weights as they sit in memory, K/V per context token."""

    target: int
    drafter: int
    target_kv_per_token: int  # every full / sliding attention layer (recurrent state excluded)
    drafter_kv_per_token: int


def loaded_sizes(pair) -> LoadedSizes:
    """Weights and K/V per token of a loaded ``loading.Pair``, by the plan's own arithmetic (the
    K/V element size is the weights' float size, as the plan's activation bytes). Call it on the
    engine thread."""

    def nbytes(module) -> int:
        return sum(v.nbytes for _, v in tree_flatten(module.parameters()))

    ab = act_bytes(module_tensors(pair.model), cast_float32=False)  # the loaded dtypes, whatever the backend
    args = getattr(pair.model, "args", None)
    config = asdict(args) if is_dataclass(args) else dict(vars(args)) if args is not None else {}
    t = target_dims(config)
    kv = getattr(pair, "kv", None)
    target_kv = kv_bytes(t, ab, kv and kv.bits, kv.group_size if kv else 64) * (
        t.kinds.count("full") + t.kinds.count("sliding")
    )
    drafter_kv = drafter = 0
    if pair.drafter is not None:
        d = drafter_dims(pair.drafter_config)
        drafter = sum(v.nbytes for _, v in pair.drafter.own_parameters())  # (not the borrowed head)
        drafter_kv = kv_bytes(d, ab) * d.layers
    return LoadedSizes(nbytes(pair.model), drafter, target_kv, drafter_kv)


def _float_dtypes():
    return (mx.float32, mx.float16, mx.bfloat16)


# -- glue: a plan for a pair on disk -----------------------------------------------------------------


def _target_path(target_id: str):
    if target_id == default_target.DEFAULT_TARGET_ID:
        return default_target.ensure_default_target().path
    return resolve(target_id, "target")


def _read_json(path) -> dict:
    return read_json(path / "config.json")


def model_source(ref: str, what: str):
    """(config, tensors, folder) of a target or drafter for the plan, without loading or
    downloading weights: from its files when it is on disk (a path, a bundled model, the default
    target, a hub repo downloaded before), else from the hub's metadata (hub.fetch_meta: config,
    small files and safetensors headers only; the folder then holds just the small files)."""
    if ref != default_target.DEFAULT_TARGET_ID and hub.is_repo_id(ref):
        local = hub.local_snapshot(ref)
        if local is None:
            meta = hub.fetch_meta(ref)
            return meta.config, list(meta.tensors), meta.path
    path = _target_path(ref) if what == "target" else resolve(str(ref), what)
    return _read_json(path), safetensors_tensors(path), path


def inputs_for(
    tcfg: dict,
    ttensors,
    dcfg: dict | None,
    dtensors,
    quant,
    *,
    metal: bool,
    prefix_cache: int = 0,
    draft_vocab: int = 0,
) -> PlanInputs:
    """Plan inputs from configs and tensor lists (``quantize.safetensors_tensors`` of the files,
    or ``quantize.module_tensors`` of unevaluated modules). ``quant`` is a ``QuantChoice``;
    ``draft_vocab`` the size of a reduced draft vocabulary (its head rows are a copy)."""
    float_bytes = None if metal else 4  # float32 on the CPU backend; as stored on Metal
    ttensors = list(ttensors)
    tw = q.loaded_nbytes(ttensors, bits=quant.target_bits, group_size=quant.group_size, float_bytes=float_bytes)
    ab = act_bytes(ttensors, cast_float32=not metal)
    n = sum(t.numel for t in ttensors if not t.name.endswith((".scales", ".biases")))
    prec = f"{quant.target_bits}-bit" if quant.target_bits else ("float32" if not metal else "as stored")
    labels = {"target": f"{n / 1e6:.0f}M stored params, {prec}"}
    d, dw = None, 0
    if dcfg is not None:
        dtensors = list(dtensors)
        d = drafter_dims(dcfg)
        dw = q.loaded_nbytes(dtensors, bits=quant.drafter_bits, group_size=quant.group_size, float_bytes=float_bytes)
        prec = f"{quant.drafter_bits}-bit" if quant.drafter_bits else "float"
        labels["drafter"] = f"{sum(t.numel for t in dtensors) / 1e6:.0f}M params, {prec}; "
    dh = 0
    if dcfg is not None and draft_vocab:
        # the head's rows for the draft vocabulary are sliced into their own buffers
        tied = tcfg.get("tie_word_embeddings", (tcfg.get("text_config") or {}).get("tie_word_embeddings", False))
        stem = "embed_tokens." if tied else "lm_head."
        head = [t for t in ttensors if stem in t.name and t.name.rsplit(".", 1)[-1] in ("weight", "scales", "biases")]
        vocab = target_dims(tcfg).vocab
        hb = q.loaded_nbytes(head, bits=quant.target_bits, group_size=quant.group_size, float_bytes=float_bytes)
        dh = hb * draft_vocab // max(1, vocab)
        labels["draft_head"] = f"{draft_vocab} of {vocab} head rows (reduced draft vocabulary)"
    whole = [t for t in ttensors if any(k in t.name for k in ("embed_tokens.", "lm_head.", "norm."))]
    rep = q.loaded_nbytes(whole, bits=quant.target_bits, group_size=quant.group_size, float_bytes=float_bytes)
    return PlanInputs(
        target_dims(tcfg),
        tw,
        d,
        dw,
        draft_head=dh,
        act_bytes=ab,
        metal=metal,
        prefix_cache=prefix_cache,
        cache_limit=None if metal else CPU_CACHE_LIMIT,
        labels=labels,
        replicated_weights=rep,
    )


def plan_for(
    target_id: str,
    drafter_id: str | None,
    quant,
    *,
    context: int,
    block_size: int | None = None,
    prompt: int | None = None,
    prefix_cache: int = 0,
    budget: tuple[int, str] | None = None,
    metal: bool | None = None,
    draft_vocab: str = "auto",
    ranks: int = 1,
    sources: tuple | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    draft_window: int | None = None,
    chains: dict | None = None,
) -> MemoryPlan:
    """The plan of a pair, from its configs and safetensors headers (nothing loads; a hub repo
    not downloaded yet is planned from the hub's metadata, see ``model_source``). ``sources``:
    the ``model_source`` of the target and drafter when the caller has them already. ``chains``:
    the chain drafters loaded beside it (kind -> folder or reference, ``chain_inputs``).

    ``quant`` is a ``quantize.QuantChoice``; ``budget`` overrides ``device_budget()``; ``ranks``
    > 1: one rank's plan with the target sharded over that many machines (notes say how many
    machines of this budget the pair needs at this context).
    """
    metal = backend.current().gpu if metal is None else metal
    tcfg, ttensors, _ = sources[0] if sources else model_source(target_id, "target")
    dcfg, dtensors, dpath = (
        (sources[1] if sources else model_source(str(drafter_id), "drafter"))
        if drafter_id is not None
        else (None, (), None)
    )
    ids = None
    if dpath and draft_vocab == "auto":
        ids = read_draft_vocab(dpath, DrafterArgs.from_config(dcfg).vocab_size)
    inputs = inputs_for(
        tcfg,
        ttensors,
        dcfg,
        dtensors,
        quant,
        metal=metal,
        prefix_cache=prefix_cache,
        draft_vocab=0 if ids is None else len(ids),
    )
    inputs = replace(inputs, kv_bits=kv_bits, kv_group_size=kv_group_size, draft_window=draft_window)
    if chains:
        inputs = replace(inputs, chain=chain_inputs(chains, tcfg, quant, metal=metal))
    block = (block_size or inputs.drafter.block_size) if inputs.drafter else 1
    budget = budget or device_budget()
    notes = (quant.describe() + (f" ({quant.reason})" if quant.reason else ""),)
    need = ranks_needed(inputs, context=context, block_size=block, budget=budget[0], prompt=prompt)
    if ranks > 1:
        inputs = replace(inputs, ranks=ranks)
        notes += (f"per rank of {ranks} (target sharded with mlx-lm's shard; drafter, embedding and head replicated)",)
    if ranks > 1 or need != 1:
        notes += (
            f"machines of this budget needed at context {context}, target sharded over them: "
            + (str(need) if need else "more than 16")
            + " (docs/distributed.md)",
        )
    if inputs.target.max_position and context > inputs.target.max_position:
        notes += (f"context {context} exceeds the target's max_position_embeddings {inputs.target.max_position}",)
    return make_plan(
        inputs, context=context, block_size=block, budget=budget[0], budget_source=budget[1], prompt=prompt, notes=notes
    )


def quant_for(cfg, drafter_id: str | None, target_config: dict | None):
    """The ``QuantChoice`` for a ``config.LoadConfig``'s target bits, drafter bits and group size."""
    return q.choose(
        cfg.target_bits,
        cfg.drafter_bits,
        cfg.group_size,
        metal=backend.current().gpu,
        checkpoint=q.checkpoint_quantization(target_config or {}),
        drafter=drafter_id is not None,
    )


def _check_remote_architecture(ref: str, config: dict) -> None:
    """A hub target not downloaded yet whose architecture cannot be drafted for is refused by name
    from its config, before its weights are fetched (a downloaded one is refused at load)."""
    if not hub.is_repo_id(ref) or hub.local_snapshot(ref) is not None:
        return
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise UnsupportedModel(
            f"target {ref}: architecture '{kind}' is not supported for speculative decoding "
            f"(supported: {', '.join(sorted(SUPPORTED))}); nothing was downloaded "
            "(--no-draft runs it without speculation)"
        )


def _check_remote_fit(tref: str, dref: str, tcfg: dict, dcfg: dict) -> None:
    """When either side is a hub repo not downloaded yet: refuse a drafter whose hidden size,
    vocabulary or target depth does not fit the target, from the configs (loading.check_pair
    makes the same checks on loaded models)."""
    if not any(hub.is_repo_id(r) and hub.local_snapshot(r) is None for r in (tref, dref)):
        return
    try:
        a, t = DrafterArgs.from_config(dcfg), target_dims(tcfg)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"drafter {dref}: config.json is not a DFlash drafter config ({type(e).__name__}: {e})"
        ) from None
    problems = [
        f"{name} {x} != target's {y}"
        for name, x, y in (
            ("hidden_size", a.hidden_size, t.hidden),
            ("target_hidden_size", a.target_hidden_size, t.hidden),
            ("vocab_size", a.vocab_size, t.vocab),
            ("num_target_layers", a.num_target_layers, t.layers),
        )
        if x != y
    ]
    if problems:
        raise IncompatiblePair(
            f"drafter {dref} does not fit target {tref}: " + "; ".join(problems) + "; nothing was downloaded"
        )


def plan_for_config(
    cfg, drafter_id: str | None, block_size: int | None = None, sources: tuple | None = None, chains: dict | None = None
):
    """(QuantChoice, MemoryPlan) for a ``config.LoadConfig`` and the drafter it resolved to, at
    ``block_size`` (None: the drafter checkpoint's). ``sources``: ``config_sources``' answer, when
    the caller plans the same pair more than once; ``chains``: the chain drafters loaded beside it
    (kind -> folder or reference; None for an MTP head in the target's own folder)."""
    sources = sources or config_sources(cfg, drafter_id)
    if drafter_id is not None:
        _check_remote_architecture(cfg.target, sources[0][0])
        _check_remote_fit(cfg.target, str(drafter_id), sources[0][0], sources[1][0])
    quant = quant_for(cfg, drafter_id, sources[0][0])
    plan = plan_for(
        cfg.target,
        drafter_id,
        quant,
        sources=sources,
        context=cfg.context,
        block_size=block_size,
        prompt=cfg.prompt_tokens,
        prefix_cache=cfg.prefix_cache,
        budget=(cfg.budget, "--budget-gb") if cfg.budget else None,
        draft_vocab=cfg.draft_vocab,
        ranks=cfg.ranks,
        kv_bits=cfg.kv_bits,
        kv_group_size=cfg.kv_group_size,
        draft_window=draft_window(cfg.draft_window, drafter_id),
        chains=chains,
    )
    return quant, plan


def config_sources(cfg, drafter_id: str | None) -> tuple:
    """The ``model_source`` of a ``config.LoadConfig``'s target and of its drafter (None without)."""
    return (
        model_source(cfg.target, "target"),
        model_source(str(drafter_id), "drafter") if drafter_id is not None else None,
    )


# -- chain drafters (MTP heads, EAGLE-3) -------------------------------------------------------


def chain_head(kind: str, target_config: dict, drafter_config: dict | None = None):
    """A lazily built chain head (nothing is allocated until evaluated): for counting its tensors."""
    if kind == "mtp":
        from .mtp import MTPHead, text_config  # (startup: models)

        c = text_config(target_config)
        return MTPHead(c["model_type"], target_config)
    from .eagle import Eagle3, Eagle3Args  # (startup: models)

    return Eagle3(Eagle3Args.from_config(drafter_config or {}))


def chain_inputs(chains: dict, target_config: dict, quant, *, metal: bool, depth: int = 4) -> tuple[ChainDims, ...]:
    """``ChainDims`` of each chain drafter (kind -> reference): an EAGLE-3 checkpoint (a folder,
    or a hub repo planned from its metadata; its config.json), or an MTP head (a folder with its
    config.json; None: the target's own checkpoint, whose config is ``target_config``).
    Quantized like the target, as ``load_mtp`` quantizes a float head; float weights count 4
    bytes on the CPU backend (cast to float32), as stored (float16) on Metal."""
    out = []
    for kind, ref in chains.items():
        if kind not in ("mtp", "eagle"):
            raise CheckpointError(f"chain drafter kind must be mtp or eagle, not {kind!r}")
        if ref is None and kind == "eagle":
            raise CheckpointError("an EAGLE-3 drafter is planned from its checkpoint: none given")
        dcfg = model_source(str(ref), "EAGLE-3 drafter" if kind == "eagle" else "MTP head")[0] if ref else None
        out.append(
            chain_dims(
                kind,
                dcfg if kind == "mtp" and dcfg is not None else target_config,
                dcfg if kind == "eagle" else None,
                depth=depth,
                bits=quant.target_bits,
                group_size=quant.group_size,
                float_bytes=2 if metal else 4,
            )
        )
    return tuple(out)


def chain_dims(
    kind: str,
    target_config: dict,
    drafter_config: dict | None = None,
    *,
    depth: int = 4,
    bits: int | None = None,
    group_size: int = 64,
    float_bytes: int = 2,
) -> ChainDims:
    """A chain drafter's plan inputs, from configs (its tensors counted on a lazily built head:
    nothing is allocated)."""
    head = chain_head(kind, target_config, drafter_config)
    tensors = [Tensor(k, tuple(v.shape), "BF16") for k, v in tree_flatten(head.parameters())]
    w = loaded_nbytes(tensors, bits=bits, group_size=group_size, float_bytes=float_bytes)
    if kind == "mtp":
        attn = head.layers[0].self_attn
        n_kv = getattr(attn, "num_key_value_heads", None) or getattr(attn, "n_kv_heads", None)
        hd = getattr(attn, "head_dim", None) or target_config.get("head_dim")
        if hd is None:
            hd = target_config["hidden_size"] // target_config["num_attention_heads"]
        th = target_config["hidden_size"]
    else:
        n_kv, hd, th = head.args.num_key_value_heads, head.args.hd, head.args.target_hidden_size
    return ChainDims(kind, w, int(n_kv), int(hd), int(th), depth, bits)


def chain_rows(c: ChainDims, context: int, prompt: int | None, act_bytes: int) -> list[Item]:
    """The plan's rows for one chain drafter at ``context`` (a ``prompt``-long prefill)."""
    detail = (
        "mtp.* tensors beside the target; embedding and head shared"
        if c.kind == "mtp"
        else "fc, one layer, norm, lm_head over the draft vocabulary; embedding shared"
    )
    rows = [
        Item(f"{c.label} weights", c.weights, detail + (f"; {c.bits}-bit like the target" if c.bits else "")),
        Item(
            f"{c.label} draft KV cache",
            c.kv_bytes(act_bytes) * _round_up(context + c.depth, KV_STEP),
            f"1 layer x {c.kv_heads} kv heads x {c.head_dim} x {context + c.depth} positions",
        ),
    ]
    if c.kind == "eagle":
        prompt = context if prompt is None else min(prompt, context)
        rows.append(
            Item(
                "target features for EAGLE-3",
                c.feature_bytes(act_bytes) * prompt,
                f"3 taps x {c.target_hidden} x {prompt} prompt positions (held until the first draft)",
            )
        )
    return rows


def chain_items(
    kind: str,
    target_config: dict,
    drafter_config: dict | None = None,
    *,
    context: int,
    depth: int = 4,
    prompt: int | None = None,
    bits: int | None = None,
    group_size: int = 64,
    float_bytes: int = 2,
    act_bytes: int = 4,
) -> list[Item]:
    """The plan's rows for a chain drafter: its own weights (the embedding and head are the
    target's, except an EAGLE-3 drafter's lm_head over its draft vocabulary), its one-layer K/V
    cache over ``context`` + ``depth`` positions and, for EAGLE-3, the three tapped target
    layers of a ``prompt``-long prefill."""
    c = chain_dims(
        kind, target_config, drafter_config, depth=depth, bits=bits, group_size=group_size, float_bytes=float_bytes
    )
    return chain_rows(c, context, prompt, act_bytes)
