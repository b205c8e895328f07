"""How close is the memory plan's predicted peak to what MLX really reaches?

For each case: load or build a target (and a random DFlash 2 drafter of a fitting shape), reset
MLX's peak counter, run speculative decoding (block 8) over a prompt of --prompt tokens plus
--generate tokens, and compare ``mx.get_peak_memory()`` with ``MemoryPlan.peak`` for
context = prompt + generate. Nothing is saved; the larger model is built in-process.

    python benchmarks/plan_accuracy.py                       # all cases
    python benchmarks/plan_accuracy.py --cases smollm2 big-f32 big-4bit --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx_spec  # noqa: F401  (loads the optimized BLAS before mlx)
from mlx_spec import memory, quantize
from mlx_spec.decode import spec_steps
from mlx_spec.default_target import DEFAULT_TARGET_ID, ensure_default_target
from mlx_spec.drafter import DFLASH2, Drafter, DrafterArgs, build_target_layer_ids
from mlx_spec.loading import load_target_model
from mlx_spec.target import Target

import mlx.core as mx
from mlx_lm.models import qwen3

BIG = dict(
    model_type="qwen3",
    hidden_size=1024,
    num_hidden_layers=12,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-6,
    vocab_size=32768,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def drafter_config(t: dict, *, layers: int = 2, block: int = 8) -> dict:
    """A DFlash 2 drafter shaped for target config ``t`` (5 taps, the target's widths)."""
    heads = t["num_attention_heads"]
    return {
        "architectures": [DFLASH2],
        "model_type": "qwen3",
        "hidden_size": t["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": t.get("num_key_value_heads", heads),
        "head_dim": t.get("head_dim") or t["hidden_size"] // heads,
        "intermediate_size": t["intermediate_size"],
        "vocab_size": t["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "num_target_layers": t["num_hidden_layers"],
        "block_size": block,
        "is_causal": False,
        "dflash_config": {
            "mask_token_id": t["vocab_size"] - 1,
            "target_layer_ids": build_target_layer_ids(t["num_hidden_layers"], 5),
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 256,
            "selector_top_k": 16,
        },
    }


def random_model(cfg: dict, seed: int = 0):
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def measure(name, model, tcfg, ttensors, bits, group, prompt_len, generate, block) -> dict:
    """Build a random drafter, plan, run, measure. ``ttensors``: the target as planned."""
    dcfg = drafter_config(tcfg, block=block)
    mx.random.seed(1)
    drafter = Drafter(DrafterArgs.from_config(dcfg))
    dtensors = quantize.module_tensors(drafter)
    quantize.prepare(drafter, bits=bits, group_size=group, what="drafter")
    target = Target(model, drafter.args.target_layer_ids)
    drafter.bind(target.embed, target.head)
    quant = quantize.QuantChoice(bits, bits, group, False, "")
    inputs = memory.inputs_for(tcfg, ttensors, dcfg, dtensors, quant, metal=False)
    context = prompt_len + generate
    plan = memory.make_plan(
        inputs,
        context=context,
        block_size=block,
        prompt=prompt_len,
        budget=memory.device_budget()[0],
        budget_source="physical memory",
    )
    weights = mx.get_active_memory()
    prompt = [(7 * i + 3) % (tcfg["vocab_size"] - 2) + 1 for i in range(prompt_len)]
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    n, prefill_peak = 0, None
    for s in spec_steps(target, drafter, prompt, block_size=block, max_tokens=generate):
        n += len(s.tokens)
        if s.prefill:
            prefill_peak = mx.get_peak_memory()
    peak = mx.get_peak_memory()
    err = plan.peak / peak - 1
    row = {
        "case": name,
        "bits": bits or "float32",
        "prompt": prompt_len,
        "generated": n,
        "block": block,
        "weights_loaded": weights,
        "weights_planned": plan.items[0].bytes + plan.items[1].bytes,
        "measured_peak": peak,
        "measured_prefill_peak": prefill_peak,
        "planned_peak": plan.peak,
        "error": err,
        "seconds": round(time.perf_counter() - t0, 1),
        "items": {i.name: i.bytes for i in plan.items},
    }
    print(
        f"{name:10s} {str(bits or 'f32'):>4s}  weights loaded {weights / 2**20:8.1f} MiB planned "
        f"{row['weights_planned'] / 2**20:8.1f} | peak measured {peak / 2**20:8.1f} MiB planned "
        f"{plan.peak / 2**20:8.1f} MiB  error {err:+.1%}  ({n} tokens, {row['seconds']} s)",
        flush=True,
    )
    return row


def case_smollm2(args):
    path = ensure_default_target().path
    model, _ = load_target_model(DEFAULT_TARGET_ID)
    tcfg = json.loads((path / "config.json").read_text())
    return measure(
        "smollm2",
        model,
        tcfg,
        quantize.safetensors_tensors(path),
        None,
        args.group_size,
        args.prompt,
        args.generate,
        args.block,
    )


def case_big(bits):
    def run(args):
        model = random_model(BIG)
        ttensors = quantize.module_tensors(model)  # planned from parameter shapes, before quantizing
        n = sum(t.numel for t in ttensors)
        assert n >= 200e6, n
        quantize.prepare(model, bits=bits, group_size=args.group_size, what="target")
        mx.clear_cache()
        return measure(
            f"big-{n / 1e6:.0f}M", model, BIG, ttensors, bits, args.group_size, args.prompt, args.generate, args.block
        )

    return run


CASES = {"smollm2": case_smollm2, "big-f32": case_big(None), "big-4bit": case_big(4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--generate", type=int, default=256)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    rows = [CASES[c](args) for c in args.cases]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {worst:.1%} (target: within 15%)")
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
