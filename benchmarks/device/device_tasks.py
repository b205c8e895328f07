"""The Python steps of benchmarks/device/device_run.sh (a GPU session's one prepared run; docs/training.md).

    python3 benchmarks/device/device_tasks.py probe [--n 4096]      # backend, device, a timed matmul
    python3 benchmarks/device/device_tasks.py target                # the default target, converted once
    python3 benchmarks/device/device_tasks.py costs --out DIR [--max-block 32] [--reps 5] [--drafter DIR]
    python3 benchmarks/device/device_tasks.py summary --out DIR --run RUN

``costs`` writes DIR/costs.json and DIR/costs.md: T1 (one plain decode step of the target),
Td(B) (one draft pass) and Tt(B) (one B-token verify pass, taps included) for B = 1..max-block,
medians over ``reps`` rounds after a warm-up round, at the context of the longest built-in prompt.
``summary`` writes DIR/summary.md from the run's summary.json, the cost curve and the evals.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "smollm2-135m-dflash2"


def backend() -> dict:
    import mlx.core as mx

    info = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "python": platform.python_version(),
        "metal": bool(mx.metal.is_available()) if hasattr(mx, "metal") else False,
    }
    cuda = getattr(mx, "cuda", None)
    info["cuda"] = bool(cuda.is_available()) if cuda is not None and hasattr(cuda, "is_available") else False
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception as e:  # older MLX: no device_info
        info["device_info"] = f"unavailable ({e})"
    return info


def probe(args) -> None:
    import mlx.core as mx

    print(json.dumps(backend()))
    n = args.n
    a = mx.random.normal((n, n))
    mx.eval(a @ a)  # first use: kernels compiled
    t = time.perf_counter()
    for _ in range(10):
        mx.eval(a @ a)
    dt = (time.perf_counter() - t) / 10
    print(f"probe: {n}^3 float32 matmul {dt * 1e3:.2f} ms ({2 * n**3 / dt / 1e12:.2f} TFLOP/s)")


def target(args) -> None:
    from mlx_spec.default_target import DEFAULT_TARGET_ID, resolve_target_id

    t = time.perf_counter()
    path = resolve_target_id(DEFAULT_TARGET_ID)
    print(f"target: {DEFAULT_TARGET_ID} at {path} ({time.perf_counter() - t:.1f} s)")


def costs(args) -> None:
    from mlx_spec.costs import measure_costs
    from mlx_spec.default_target import DEFAULT_TARGET_ID
    from mlx_spec.loading import load_pair
    from mlx_spec.prompts import builtin_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    pair = load_pair(DEFAULT_TARGET_ID, args.drafter)
    context = max((p.encode(pair.tokenizer) for p in builtin_prompts()), key=len)
    sizes = list(range(2, args.max_block + 1))
    if not sizes:
        raise SystemExit("--max-block must be >= 2")
    where = backend()
    t1s, td, tt = [], {}, {}
    for i, B in enumerate(sizes):  # one block size at a time, the files rewritten after each:
        # a step stopped at its time limit (first compiles of each shape) still leaves the sizes done
        c = measure_costs(pair.model, pair.target, pair.drafter, [B], context, reps=args.reps).as_dict()
        t1s.append(c["t1_ms"])
        td.update(c["td_ms"])
        tt.update(c["tt_ms"])
        d = {
            **c,
            "t1_ms": round(statistics.median(t1s), 3),
            "td_ms": td,
            "tt_ms": tt,
            "sizes": [1, *sizes[: i + 1]],
            "reps": args.reps,
            "drafter": str(args.drafter),
            "draft_vocab": pair.drafter.vocab_size_drafted or "full",
            "backend": where,
            "seconds": round(time.perf_counter() - t, 1),
        }
        (out / "costs.json").write_text(json.dumps(d, indent=2))
        (out / "costs.md").write_text(costs_markdown(d))
    print(costs_markdown(d))


def costs_markdown(d: dict) -> str:
    lines = [
        f"Pass costs ({d['backend']['device']}, MLX {d['backend']['mlx']}; context {d['context']} tokens; "
        f"median of {d['reps']} rounds; draft vocabulary {d['draft_vocab']}): T1 = {d['t1_ms']:.3f} ms",
        "",
        "| B | Tt(B) ms | Tt(B)/T1 | Td(B) ms |",
        "|---|---|---|---|",
    ]
    for B in d["sizes"]:
        tt, td = d["tt_ms"].get(str(B)), d["td_ms"].get(str(B))
        lines.append(f"| {B} | {tt:.3f} | {tt / d['t1_ms']:.2f} | " + ("-" if td is None else f"{td:.3f}") + " |")
    return "\n".join(lines) + "\n"


def summary(args) -> None:
    out, run = Path(args.out), Path(args.run)
    parts = ["# Device run", ""]
    if (out / "backend.json").exists():
        parts += ["Backend: `" + (out / "backend.json").read_text().strip() + "`", ""]
    if (run / "summary.json").exists():
        s = json.loads((run / "summary.json").read_text())
        cfg = json.loads((run / "run_config.json").read_text())
        parts += [
            f"`train run`: {s['tokens']} generated tokens in {s['seconds']} s, {s['batches']} batches, "
            f"{s['step']} optimizer steps; generation {s['gen_tok_s']} tok/s, training {s['steps_s']} "
            f"steps/s (each alone); stopped early: {s['stopped']}; replay {s['replay_bytes'] / 2**20:.0f} MiB, "
            f"{s['replay_evicted']} sequences evicted.",
            "",
            "Settings: `" + json.dumps({k: v for k, v in cfg.items() if k != "recipe"}) + "`",
            "",
            "Recipe: `" + json.dumps(cfg.get("recipe")) + "`",
            "",
        ]
    else:
        parts += ["`train run`: no summary.json (the run did not finish a checkpoint)", ""]
    for name in ("eval_new", "eval_shipped"):
        f = out / f"{name}.json"
        try:
            e = json.loads(f.read_text())
        except (OSError, ValueError):  # the step did not run, failed or timed out
            parts += [f"{name}: no result (see log.txt)", ""]
            continue
        parts += [
            f"Held-out tau, {name.split('_')[1]} drafter ({e['drafter']}; {e['prompts']} prompts x "
            f"{e['max_tokens']} tokens, draft vocabulary {e['draft_vocab']}):",
            "",
        ]
        kinds = sorted({k for r in e["rows"] for k in r["tau_by_kind"]})
        parts += ["| block | tau | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
        parts += [
            f"| {r['block']} | {r['tau']:.2f} | "
            + " | ".join(f"{r['tau_by_kind'].get(k, 0):.2f}" for k in kinds)
            + " |"
            for r in e["rows"]
        ]
        parts.append("")
    if (out / "costs.md").exists():
        parts += [(out / "costs.md").read_text()]
    (out / "summary.md").write_text("\n".join(parts))
    print("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    sub.add_parser("probe").add_argument("--n", type=int, default=4096, help="matmul size")
    sub.add_parser("target")
    c = sub.add_parser("costs")
    c.add_argument("--out", required=True)
    c.add_argument("--max-block", type=int, default=32)
    c.add_argument("--reps", type=int, default=5)
    c.add_argument("--drafter", default=str(SHIPPED))
    s = sub.add_parser("summary")
    s.add_argument("--out", required=True)
    s.add_argument("--run", required=True)
    args = p.parse_args(argv)
    {"probe": probe, "target": target, "costs": costs, "summary": summary}[args.task](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
