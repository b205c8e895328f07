"""Verify cost vs block size for hybrid and MoE targets, plus the GDN rollback cost.

Builds random float32 models in-process (nothing is downloaded), prefills a context, then for each
block size T times one ``record=True`` verify pass of T tokens (wall and process CPU time, as the
machine may be shared) and the rollback that keeps T-1 of them (the most recurrence steps a partial
acceptance can replay). For MoE targets it also counts
the distinct experts the T tokens wake per MoE layer (random routers route near-uniformly, so real
models, whose routing is correlated across neighbouring tokens, wake fewer).

    python benchmarks/gdn_cost.py --arch qwen3_5_moe qwen3_5 qwen3_moe --sizes 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import mlx_spec  # noqa: F401  (first: loads the optimized BLAS before mlx)
from mlx_spec.target import Target  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import ArraysCache  # noqa: E402

H, LAYERS, EXPERTS, TOP_K = 256, 8, 64, 8
_ROPE = {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
_GDN = dict(
    linear_num_value_heads=8,
    linear_num_key_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
)
_MOE = dict(
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
_BASE = dict(
    hidden_size=H,
    num_hidden_layers=LAYERS,
    intermediate_size=4 * H,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    vocab_size=4096,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
CONFIGS = {
    "qwen3": dict(_BASE, model_type="qwen3", rope_theta=10000.0),
    "qwen3_moe": dict(_BASE, **_MOE, model_type="qwen3_moe", rope_theta=10000.0),
    "qwen3_5": dict(_BASE, **_GDN, model_type="qwen3_5", rope_parameters=_ROPE),
    "qwen3_5_moe": dict(_BASE, **_GDN, **_MOE, model_type="qwen3_5_moe", rope_parameters=_ROPE),
    "qwen3_next": dict(_BASE, **_GDN, **_MOE, model_type="qwen3_next", rope_theta=10000.0, partial_rotary_factor=0.25),
}


def build(kind: str):
    cfg = CONFIGS[kind]
    mod = importlib.import_module(f"mlx_lm.models.{kind}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def experts_woken(target: Target, ids: mx.array, T: int) -> float | None:
    """Mean over MoE layers of the distinct experts chosen by the last T positions of ``ids``."""
    from mlx_lm.models.base import create_attention_mask

    h = target.embed(ids)
    mask = create_attention_mask(h, None)
    counts = []
    for layer in target.layers:
        mixer = layer.linear_attn if getattr(layer, "is_linear", False) else layer.self_attn
        h = h + mixer(layer.input_layernorm(h), None if getattr(layer, "is_linear", False) else mask, None)
        x = layer.post_attention_layernorm(h)
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            k = layer.mlp.top_k
            inds = mx.argpartition(gate(x[:, -T:]), kth=-k, axis=-1)[..., -k:]
            counts.append(len(set(inds.reshape(-1).tolist())))
        h = h + layer.mlp(x)
    return statistics.mean(counts) if counts else None


def measure(kind: str, sizes: list[int], context: int, repeats: int) -> list[dict]:
    model = build(kind)
    target = Target(model)
    cache = target.make_cache()
    ctx = mx.random.randint(0, 4096, (1, context), key=mx.random.key(1))
    out = target(ctx, cache, last_only=True)
    mx.eval(out.logits, [c.state for c in cache])
    rows = []
    for T in sizes:
        block = mx.random.randint(0, 4096, (1, T), key=mx.random.key(T))
        verify, cpu, rollback, rcpu = [], [], [], []
        for r in range(repeats + 1):  # the first round warms up
            snap = [list(c.cache) if isinstance(c, ArraysCache) else c.offset for c in cache]
            t0, c0 = time.perf_counter(), time.process_time()
            out = target(block, cache, record=True)
            mx.eval(out.logits, [c.state for c in cache])
            t1, c1 = time.perf_counter(), time.process_time()
            target.rollback(cache, T, max(T - 1, 1))
            t2, c2 = time.perf_counter(), time.process_time()
            for c, s in zip(cache, snap):  # back to the context alone for the next round
                if isinstance(c, ArraysCache):
                    c.cache = s
                else:
                    c.trim(c.offset - s)
            if r:
                verify.append((t1 - t0) * 1e3)
                cpu.append((c1 - c0) * 1e3)
                rollback.append((t2 - t1) * 1e3)
                rcpu.append((c2 - c1) * 1e3)
        rows.append(
            dict(
                T=T,
                verify_ms=statistics.median(verify),
                cpu_ms=statistics.median(cpu),
                rollback_ms=statistics.median(rollback),
                rollback_cpu_ms=statistics.median(rcpu),
                experts=experts_woken(target, mx.concatenate([ctx, block], axis=1), T),
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--arch", nargs="+", default=["qwen3_5_moe", "qwen3_5", "qwen3_moe", "qwen3"], choices=sorted(CONFIGS)
    )
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(
        f"hidden {H}, {LAYERS} layers, MoE: {EXPERTS} experts top-{TOP_K}; float32, context {args.context}; median of",
        args.repeats,
    )
    print(
        f"{'arch':12} {'T':>3} {'verify ms':>10} {'x T=1':>6} {'verify cpu ms':>14} {'x T=1':>6} "
        f"{'rollback ms':>12} {'cpu ms':>7} {'experts/layer':>14}"
    )
    for kind in args.arch:
        rows = measure(kind, args.sizes, args.context, args.repeats)
        base, cbase = rows[0]["verify_ms"], rows[0]["cpu_ms"]
        for row in rows:
            ex = "" if row["experts"] is None else f"{row['experts']:.1f}"
            print(
                f"{kind:12} {row['T']:>3} {row['verify_ms']:>10.1f} {row['verify_ms'] / base:>6.2f} "
                f"{row['cpu_ms']:>14.1f} {row['cpu_ms'] / cbase:>6.2f} {row['rollback_ms']:>12.2f} "
                f"{row['rollback_cpu_ms']:>7.2f} {ex:>14}"
            )


if __name__ == "__main__":
    main()
