"""Exact rollback for hybrid GatedDeltaNet (GDN) + attention targets: qwen3_5, qwen3_5_moe, qwen3_next.

A GDN layer keeps an ``ArraysCache`` ``[conv_state (B, K-1, C), recurrent_state (B, Hv, Dv, Dk)]``
that cannot be trimmed. During a verify pass ``gdn_block`` runs the decoder layer itself, mirroring
mlx-lm's ``DecoderLayer`` / ``GatedDeltaNet.__call__`` with the layer's own submodules, and records
the recurrence inputs. ``restore`` then rebuilds the state after the first ``n_keep`` positions:

- conv state = the last K-1 conv inputs ending at position ``n_keep - 1`` (a slice);
- recurrent state = ``gated_delta_update`` re-run from the pre-verify state over the first ``n_keep``
  recorded steps (the recurrence only: no projections, no matmuls, no extra target forward), for
  all GDN layers at once.

The mirror is checked against the real layer when a ``Target`` is built (``check_mirror``), so a
change in mlx-lm's layer code refuses to run instead of rolling back wrongly.
Nothing here patches mlx-lm; the unmodified layers still run every non-verify pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from .errors import UnsupportedModel

HYBRID = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next"})

# Why a cache type cannot be rolled back, for the capability check's message.
WHY = {
    "RotatingKVCache": "sliding-window ring buffer",
    "ArraysCache": "recurrent state",
    "ChunkedKVCache": "chunked attention",
    "CacheList": "composite cache",
    "ConcatenateKVCache": "unsupported KV layout",
    "BatchKVCache": "batched cache",
}


class GDNRecord(NamedTuple):
    """What one GDN layer saw in a verify pass of T positions."""

    conv_input: mx.array  # (B, K-1+T, C): conv state before the pass, then the T new conv inputs
    q: mx.array  # (B, T, Hk, Dk) normalized, readout scale folded in
    k: mx.array  # (B, T, Hk, Dk)
    v: mx.array  # (B, T, Hv, Dv)
    a: mx.array  # (B, T, Hv)
    b: mx.array  # (B, T, Hv)
    state: mx.array | None  # (B, Hv, Dv, Dk) recurrent state before the pass
    mask: mx.array | None  # (B, T)


def is_gdn(layer: Any) -> bool:
    """A decoder layer whose mixer we can mirror (qwen3_5 and qwen3_next flavours)."""
    attn = getattr(layer, "linear_attn", None)
    if not getattr(layer, "is_linear", False) or attn is None:
        return False
    return hasattr(attn, "in_proj_qkv") or hasattr(attn, "in_proj_qkvz")


def _project(attn: nn.Module, x: mx.array):
    """Input projections -> (qkv (B,S,C), z (B,S,Hv,Dv), b (B,S,Hv), a (B,S,Hv))."""
    B, S, _ = x.shape
    if hasattr(attn, "in_proj_qkvz"):  # qwen3_next: fused, head-interleaved projections
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a
    qkv = attn.in_proj_qkv(x)
    z = attn.in_proj_z(x).reshape(B, S, attn.num_v_heads, attn.head_v_dim)
    return qkv, z, attn.in_proj_b(x), attn.in_proj_a(x)


def gdn_forward(attn: nn.Module, x: mx.array, mask, cache: ArraysCache, records: list) -> mx.array:
    """``GatedDeltaNet.__call__`` of mlx-lm 0.32 (with a cache), appending a ``GDNRecord``.

    On a target sharded with mlx-lm's ``shard`` the layer holds this rank's heads (projections,
    conv channels, ``A_log``/``dt_bias``), so the record, the state and its rollback are this
    rank's slice; the output is all-reduced as in mlx-lm."""
    B, S, _ = x.shape
    if cache.lengths is not None:
        raise UnsupportedModel("GDN rollback does not support ArraysCache.lengths (batched prefill)")
    qkv, z, b, a = _project(attn, x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, attn.conv_kernel_size - 1, attn.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # (B, K-1+S, C)
    cache[0] = mx.contiguous(conv_input[:, -(attn.conv_kernel_size - 1) :, :])
    conv_out = nn.silu(attn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
            [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
            [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim],
        )
    ]
    state = cache[1]
    q, k = normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6)
    records.append(GDNRecord(conv_input, q, k, v, a, b, state, mask))
    out, state = gated_delta_update(q, k, v, a, b, attn.A_log, attn.dt_bias, state, mask, use_kernel=not attn.training)
    cache[1] = state
    cache.advance(S)
    out = attn.out_proj(attn.norm(out, z).reshape(B, S, -1))
    group = getattr(attn, "sharding_group", None)  # sharded over a group: this rank's heads only
    return out if group is None else mx.distributed.all_sum(out, group=group)


def gdn_block(layer: nn.Module, h: mx.array, mask, cache: ArraysCache, records: list) -> mx.array:
    """A linear decoder layer (``DecoderLayer.__call__``), recording its GDN inputs."""
    h = h + gdn_forward(layer.linear_attn, layer.input_layernorm(h), mask, cache, records)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def restore(
    caches: list[ArraysCache],
    records: list[GDNRecord],
    attns: list[nn.Module],
    n_keep: int,
    *,
    conv: bool = True,
    state: bool = True,
) -> None:
    """Set each GDN cache to its state after the first ``n_keep`` positions of the recorded pass.

    The recurrences of all layers are replayed in one batched ``gated_delta_update`` (layers
    stacked on the batch axis: one kernel launch, or one op loop, instead of one per layer).
    ``conv``/``state`` exist so tests can inject a broken rollback; both are True in use.
    """
    if conv:
        for c, rec, attn in zip(caches, records, attns):
            c[0] = mx.contiguous(rec.conv_input[:, n_keep : n_keep + attn.conv_kernel_size - 1])
    if not state:
        return
    if n_keep == 0:  # back to before the pass
        for c, rec in zip(caches, records):
            c[1] = rec.state
        return
    groups: dict[tuple, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault((rec.q.shape, rec.v.shape, rec.mask is None), []).append(i)
    n = n_keep
    for idx in groups.values():
        recs = [records[i] for i in idx]
        B, _, _, Dk = recs[0].q.shape
        Hv, Dv = recs[0].v.shape[-2:]

        def cat(f):
            return mx.concatenate([f(r) for r in recs], axis=0)  # layers on the batch axis  # noqa: B023

        per_layer = [attns[i] for i in idx]
        A_log = mx.repeat(mx.stack([m.A_log for m in per_layer])[:, None], B, axis=0)  # (L*B, 1, Hv)
        dt_bias = mx.repeat(mx.stack([m.dt_bias for m in per_layer])[:, None], B, axis=0)
        zeros = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        state0 = cat(lambda r: zeros if r.state is None else r.state)  # (L*B, Hv, Dv, Dk)  # noqa: B023
        mask = None if recs[0].mask is None else cat(lambda r: r.mask[:, :n])
        _, new = gated_delta_update(
            cat(lambda r: r.q[:, :n]),
            cat(lambda r: r.k[:, :n]),
            cat(lambda r: r.v[:, :n]),
            cat(lambda r: r.a[:, :n]),
            cat(lambda r: r.b[:, :n]),
            A_log,
            dt_bias,
            state0,
            mask,
            use_kernel=not per_layer[0].training,
        )
        for j, i in enumerate(idx):
            caches[i][1] = new[j * B : (j + 1) * B]


def rollback_problems(layers: list, cache: list) -> list[str]:
    """Each cache type this package cannot roll back exactly, with the layers using it."""
    bad: dict[str, list[int]] = {}
    for i, (layer, c) in enumerate(zip(layers, cache)):
        if type(c) is KVCache or (type(c) is ArraysCache and is_gdn(layer)):
            continue
        bad.setdefault(type(c).__name__, []).append(i)
    out = []
    for name, idx in bad.items():
        why = WHY.get(name, "not trimmable")
        which = "layer {} uses" if len(idx) == 1 else "layers {} use"
        out.append(f"{which.format(_ranges(idx))} {name} ({why}), which cannot be rolled back exactly")
    return out


def _ranges(idx: list[int]) -> str:
    parts, start = [], idx[0]
    for prev, cur in zip(idx, idx[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def check_mirror(layer: nn.Module, model_type: str, steps: int = 3) -> None:
    """Compare ``gdn_block`` with the real layer on a small input (output, conv and recurrent
    state, over two consecutive calls). Raises ``UnsupportedModel`` on any difference."""
    attn = layer.linear_attn  # noqa: F841
    H = layer.input_layernorm.weight.shape[0]
    dtype = layer.input_layernorm.weight.dtype
    key = mx.random.key(0)
    x = (mx.random.normal((2, 1, steps, H), key=key) * 4).astype(dtype)
    x1, x2 = x[0], x[1]
    real, mine = ArraysCache(2), ArraysCache(2)
    try:
        want = [layer(x1, None, real)]
        want_state = [list(real.cache)]
        want.append(layer(x2, None, real))
        want_state.append(list(real.cache))
        got = [gdn_block(layer, x1, None, mine, [])]
        got_state = [list(mine.cache)]
        got.append(gdn_block(layer, x2, None, mine, []))
        got_state.append(list(mine.cache))
        ok = all(_same(w, g) for w, g in zip(want, got)) and all(
            _same(w, g) for ws, gs in zip(want_state, got_state) for w, g in zip(ws, gs)
        )
    except (AttributeError, TypeError, ValueError) as e:
        raise UnsupportedModel(
            f"the installed mlx-lm's {model_type} GatedDeltaNet differs from the one mlx_spec mirrors "
            f"for exact rollback ({type(e).__name__}: {e}); use mlx-lm 0.32.x"
        ) from e
    if not ok:
        raise UnsupportedModel(
            f"the installed mlx-lm's {model_type} GatedDeltaNet computes something other than the "
            "mirror mlx_spec uses for exact rollback; refusing to run (use mlx-lm 0.32.x)"
        )


def _same(a: mx.array, b: mx.array) -> bool:
    if a.shape != b.shape:
        return False
    tol = 1e-5 if a.dtype == mx.float32 else 1e-2
    return bool(mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=tol, atol=tol))
