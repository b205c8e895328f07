"""Profile one speculative cycle on the real default target: where does the time go?

Measures, at a realistic context:
  - the two model passes alone (T1 plain decode step, Td(B) draft pass, Tt(B) verify pass);
  - the phases of a cycle run by hand with a sync after each (draft graph, draft compute,
    verify graph, verify compute, host accept, rollback);
  - the real loop (`spec_steps`) end to end: cycle time vs the passes' sum = loop overhead;
  - optionally a cProfile of the loop's Python (--cprofile).

Uses models/smollm2-135m-dflash2 if it exists (or --drafter), else a randomly initialised
DFlash 2 drafter of the shipped shape (acceptance is then ~0, which does not matter here: the
cost of a cycle does not depend on what was accepted, except for the rollback length).

    nice -n 10 python benchmarks/profile_cycle.py --block-sizes 4,8,16 --cycles 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # loads OpenBLAS before mlx

RANDOM_DRAFTER = {  # the shipped drafter's shape (models/smollm2-135m-dflash2)
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "hidden_size": 576,
    "num_hidden_layers": 2,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "num_target_layers": 30,
    "block_size": 8,
    "is_causal": False,
    "dflash_config": {
        "mask_token_id": 16,
        "target_layer_ids": [1, 8, 14, 20, 27],
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 64,
        "selector_top_k": 8,
    },
}


def load(args):
    from mlx_spec.drafter import Drafter, DrafterArgs
    from mlx_spec.loading import DEFAULT_DRAFTER, MODELS_DIR, load_drafter, load_target_model
    from mlx_spec.target import Target

    import mlx.core as mx

    model, tok = load_target_model(args.target)
    path = args.drafter or (
        MODELS_DIR / DEFAULT_DRAFTER if (MODELS_DIR / DEFAULT_DRAFTER / "config.json").exists() else None
    )
    if path:
        drafter, _ = load_drafter(str(path))
        what = str(path)
    else:
        mx.random.seed(0)
        drafter = Drafter(DrafterArgs.from_config(RANDOM_DRAFTER))
        drafter.set_dtype(mx.float32)
        mx.eval(drafter.parameters())
        what = "random DFlash 2 drafter of the shipped shape"
    target = Target(model, drafter.args.target_layer_ids)
    drafter.bind(target.embed, target.head)
    return model, tok, target, drafter, what


def phases(target, drafter, ids, B: int, cycles: int) -> dict[str, float]:
    """One cycle by hand with a sync after every phase; median ms per phase."""
    from mlx_spec.sampling import accept_greedy

    import mlx.core as mx

    cache, dcache = target.make_cache(), drafter.make_cache()
    out = target(mx.array([ids]), cache)
    mx.eval(out.logits, out.hidden)
    features, anchor = out.hidden, mx.argmax(out.logits[0, -1])
    rows: dict[str, list[float]] = {
        k: [] for k in ("draft_graph", "draft_eval", "verify_graph", "verify_eval", "accept", "rollback")
    }
    for i in range(cycles + 1):
        t0 = time.perf_counter()
        prop = drafter.propose(anchor, features, dcache, B)
        t1 = time.perf_counter()
        mx.eval(prop.tokens)
        t2 = time.perf_counter()
        o = target(mx.concatenate([anchor.reshape(1), prop.tokens.astype(mx.int32)])[None], cache, record=True)
        choice = mx.argmax(o.logits[0], axis=-1)
        t3 = time.perf_counter()
        mx.eval(choice, o.hidden)
        t4 = time.perf_counter()
        a, bonus = accept_greedy(prop.tokens.tolist(), choice.tolist())
        t5 = time.perf_counter()
        target.rollback(cache, B, a + 1)
        features, anchor = o.hidden[:, : a + 1], mx.array(bonus, mx.int32)
        t6 = time.perf_counter()
        if i:  # the first cycle is a warm-up
            for k, v in zip(rows, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                rows[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in rows.items()}


def loop(target, drafter, ids, B: int, tokens: int) -> dict[str, float]:
    from mlx_spec.decode import spec_steps

    steps = list(spec_steps(target, drafter, ids, block_size=B, max_tokens=tokens))
    cyc = [s for s in steps[2:] if s.block_size == B and not s.finish_reason]  # drop prefill + 1st cycle
    return {
        "cycle_ms": statistics.median(s.elapsed_ms for s in cyc),
        "cycles": len(cyc),
        "tau": sum(len(s.tokens) for s in steps[1:]) / max(1, len(steps) - 1),
    }


def ab(target, drafter, ids, B: int, tokens: int, ref: str, rounds: int) -> dict[str, float]:
    """Interleaved A/B of the loop against decode.py at git revision ``ref`` (median cycle ms)."""
    import importlib.util
    import subprocess
    import tempfile

    src = subprocess.run(
        ["git", "show", f"{ref}:mlx_spec/decode.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("mlx_spec._decode_ref", f.name, submodule_search_locations=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "mlx_spec"
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    from mlx_spec.decode import spec_steps

    times: dict[str, list[float]] = {"ref": [], "now": []}
    for r in range(rounds):
        for name, fn in (("ref", mod.spec_steps), ("now", spec_steps))[:: 1 if r % 2 else -1]:
            steps = list(fn(target, drafter, ids, block_size=B, max_tokens=tokens))
            times[name] += [s.elapsed_ms for s in steps[2:] if s.block_size == B and not s.finish_reason]
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default=None)
    p.add_argument("--block-sizes", default="4,8,16")
    p.add_argument("--cycles", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cprofile", action="store_true", help="cProfile the loop at the largest block size")
    p.add_argument("--ab", default=None, metavar="REV", help="also A/B the loop against decode.py at git REV")
    p.add_argument("--ab-rounds", type=int, default=6)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from mlx_spec.costs import measure_costs
    from mlx_spec.prompts import BUILTIN

    model, tok, target, drafter, what = load(args)
    sizes = [int(x) for x in args.block_sizes.split(",")]
    ids = BUILTIN[0].encode(tok)
    context = ids + [tok.encode(" the")[-1]] * 64  # a context like mid-generation
    costs = measure_costs(model, target, drafter, sizes, context, reps=args.reps)
    report = {
        "blas": mlx_spec.BLAS.describe(),
        "drafter": what,
        "context": len(context),
        "t1_ms": costs.t1_ms,
        "sizes": {},
    }
    print(
        f"BLAS: {report['blas']}\ndrafter: {what}\ncontext {len(context)} tokens; "
        f"T1 (plain decode step) {costs.t1_ms:.1f} ms",
        file=sys.stderr,
    )
    for B in sizes:
        ph = phases(target, drafter, context, B, args.cycles)
        lp = loop(target, drafter, context, B, args.cycles * 2)
        passes = costs.td_ms[B] + costs.tt_ms[B]
        row = {
            "td_ms": costs.td_ms[B],
            "tt_ms": costs.tt_ms[B],
            "passes_ms": passes,
            "phases_ms": ph,
            "loop_cycle_ms": lp["cycle_ms"],
            "overhead_ms": lp["cycle_ms"] - passes,
            "overhead_pct": 100 * (lp["cycle_ms"] - passes) / lp["cycle_ms"],
            "tau": lp["tau"],
        }
        report["sizes"][B] = row
        print(
            f"B={B:2d}  Td {row['td_ms']:6.1f}  Tt {row['tt_ms']:6.1f}  passes {passes:6.1f} | loop cycle "
            f"{lp['cycle_ms']:6.1f} ms  overhead {row['overhead_ms']:5.1f} ms ({row['overhead_pct']:.1f}%) | "
            + "  ".join(f"{k} {v:.1f}" for k, v in ph.items()),
            file=sys.stderr,
        )
    if args.ab:
        for B in sizes:
            res = ab(target, drafter, context, B, args.cycles, args.ab, args.ab_rounds)
            report["sizes"][B]["ab"] = res
            print(
                f"B={B:2d}  A/B median cycle: {args.ab} {res['ref']:.1f} ms, now {res['now']:.1f} ms "
                f"({100 * (res['now'] / res['ref'] - 1):+.1f}%)",
                file=sys.stderr,
            )
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        loop(target, drafter, context, max(sizes), args.cycles * 2)
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(18)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
