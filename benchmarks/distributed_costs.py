"""Pass costs with the target sharded over a group, next to one process (docs/distributed.md).

`mlx_spec bench --costs-only --ranks 2` reports T1, Td(B), Tt(B), the all-reduce chain and the
per-step message side by side; this script adds the two ways a group can draft (below).

    python benchmarks/distributed_costs.py                      # one process
    mlx.launch --backend ring -n 2 --hosts 127.0.0.1 python benchmarks/distributed_costs.py
    (add --target DIR --drafter DIR for a real pair; default: a synthetic qwen3 target, random
    weights, hidden 512 x 12 layers, vocab 32000, and a 1-layer DFlash 2 drafter for it)

Every rank runs the same passes in the same order; rank 0 prints one JSON line:
- T1, Td(B), Tt(B): costs.measure_costs (plain decode step, draft pass, B-token verify pass);
- allreduce_ms[B]: a chain of 2 x layers all_sums of (1, B, hidden) float32 alone, i.e. the
  traffic one verify pass of B positions adds (0 on one process);
- message_ms: one all_sum of one int32 (the per-step "go on" flag rank 0 sends);
- draft_replicated_ms / draft_broadcast_ms: a draft pass on every rank vs on rank 0 followed by
  an all_sum of its B-1 ids (the other ranks wait), the two ways a group can draft.
"""

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import mlx_spec  # noqa: F401  (loads the BLAS before MLX)
from mlx_spec import distributed
from mlx_spec.costs import measure_costs
from mlx_spec.loading import check_pair, load_drafter, load_target_model
from mlx_spec.target import Target

import mlx.core as mx

SYNTH = dict(
    model_type="qwen3",
    hidden_size=512,
    num_hidden_layers=12,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    vocab_size=32000,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def synthetic(root: Path) -> tuple[str, str]:
    """Write the synthetic pair once (rank 0 of a group and a lone process alike)."""
    from mlx_spec.drafter import DFLASH2, Drafter, DrafterArgs
    from mlx_spec.loading import save_drafter

    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model

    t, d = root / "target", root / "drafter"
    if (d / "config.json").exists():
        return str(t), str(d)
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(SYNTH))
    mx.eval(model.parameters())
    save_model(t, model)
    save_config(dict(SYNTH), t / "config.json")
    cfg = {
        "architectures": [DFLASH2],
        "model_type": "qwen3",
        "hidden_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "num_target_layers": 12,
        "block_size": 8,
        "dflash_config": {
            "mask_token_id": 31999,
            "target_layer_ids": [1, 5, 10],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 32,
            "selector_top_k": 8,
        },
    }
    mx.random.seed(1)
    drafter = Drafter(DrafterArgs.from_config(cfg))
    mx.eval(drafter.parameters())
    save_drafter(drafter, d, cfg)
    return str(t), str(d)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--root", default="/tmp/mlx_spec_distributed_costs")
    args = ap.parse_args()
    group = distributed.init_group()
    rank = group.rank() if group else 0
    tpath, dpath = args.target, args.drafter
    if tpath is None:
        root = Path(args.root)
        if rank == 0:
            synthetic(root)
        if group is not None:  # the others wait until rank 0 has written it
            mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group, stream=mx.cpu))
        tpath, dpath = synthetic(root)
    shard = partial(distributed.shard_target, group=group) if group else None
    model, _ = load_target_model(tpath, shard=shard)
    drafter, _ = load_drafter(dpath)
    target = Target(model, drafter.args.target_layer_ids)
    check_pair(target, drafter)
    drafter.bind(target.embed, target.head)
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = [(i * 7919) % (target.vocab_size - 2) + 1 for i in range(args.context)]
    costs = measure_costs(model, target, drafter, sizes, ctx, reps=args.reps)

    H, L = target.hidden_size, target.num_layers
    link = distributed.link_costs(group, L, H, sizes, args.reps) if group is not None else {}
    allreduce = link.get("allreduce_ms", {B: 0.0 for B in [1, *sizes]})
    message = link.get("message_ms", 0.0)

    dcache = drafter.make_cache()
    feats = target(mx.array([ctx]), target.make_cache()).hidden
    drafter.add_context(feats, dcache)
    anchor = mx.array(ctx[-1], mx.int32)
    B = max(sizes)
    replicated = distributed.timed_ms(lambda: mx.eval(drafter.propose(anchor, None, dcache, B).tokens), args.reps)

    def broadcast():
        if rank == 0:
            toks = drafter.propose(anchor, None, dcache, B).tokens.astype(mx.int32)
        else:
            toks = mx.zeros((B - 1,), mx.int32)
        if group is not None:
            toks = mx.distributed.all_sum(toks, group=group, stream=mx.cpu)
        mx.eval(toks)

    bcast = distributed.timed_ms(broadcast, args.reps)
    if rank == 0:
        print(
            json.dumps(
                {
                    "group": distributed.group_info(group).as_dict(),
                    "target": tpath,
                    "drafter": dpath,
                    "context": args.context,
                    "layers": L,
                    "hidden": H,
                    "t1_ms": costs.t1_ms,
                    "td_ms": costs.td_ms,
                    "tt_ms": costs.tt_ms,
                    "allreduce_ms": allreduce,
                    "message_ms": message,
                    "draft_block": B,
                    "draft_replicated_ms": replicated,
                    "draft_broadcast_ms": bcast,
                }
            )
        )
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
