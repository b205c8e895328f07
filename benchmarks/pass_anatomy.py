"""Where a target pass's time goes as its rows grow: attention (norm, projections, RoPE, the
softmax over the context), the MLP (norm, projections, SiLU), the output head, per decoder
layer stack, at 1..32 rows; plus what one elementwise transcendental op (sigmoid) and one
matmul cost per row on this backend, and one exp / sigmoid per element against numpy's exp;
then the tau a cycle must commit per sequence to pay for its rows, alone and for 2, 4, 8
sequences at once (``Costs.reach``). It explains the verify-cost curve Tt(L) that decides
whether drafting pays: on a GPU rows are nearly free up to the compute bound; on MLX's CPU
backend the matmuls stay nearly flat (memory bound) but elementwise work grows with the rows.

    python benchmarks/pass_anatomy.py [--target ID] [--context 240] [--rows 1,2,4,8,16,32] [--rounds 8]

Rows are timed interleaved (every row count once per round, rounds rotated), medians printed.
Llama-style decoder layers (self_attn / mlp / input_layernorm / post_attention_layernorm), as
the default target's; other layouts are refused.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx_spec  # noqa: F401  (first: it loads the system BLAS before MLX)
from mlx_spec.config import LoadConfig
from mlx_spec.costs import Costs
from mlx_spec.default_target import DEFAULT_TARGET_ID
from mlx_spec.session import open_session
from mlx_spec.target import Target

import mlx.core as mx
import mlx.nn as nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_ID)
    ap.add_argument("--context", type=int, default=240, help="tokens already in the cache")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    if a.context < 1 or a.rounds < 2 or not rows or min(rows) < 1:
        raise SystemExit("--context >= 1, --rounds >= 2 and --rows >= 1 please")
    pair = open_session(LoadConfig(target=a.target, no_draft=True), tuning="none").pair
    target = Target(pair.model)  # (no taps: the target alone)
    layers = target.layers
    need = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if not all(hasattr(layers[0], n) for n in need):
        raise SystemExit(f"{target.model_type}: not a llama-style layer stack ({', '.join(need)})")
    from mlx_lm.models.base import create_attention_mask

    cache = target.make_cache()
    ctx = mx.array([[(7 * i) % 1000 + 10 for i in range(a.context)]], mx.int32)
    mx.eval(target(ctx, cache, taps=False).logits)
    H = target.hidden_size
    gate = getattr(layers[0].mlp, "gate_proj", None)
    I = int(gate.weight.shape[0]) if gate is not None and hasattr(gate, "weight") else 4 * H  # the MLP's width
    W = mx.random.normal((I, H)) * 0.02  # one MLP-sized matmul
    mx.eval(W)

    tasks = {}
    for R in rows:
        h = mx.random.normal((1, R, H)).astype(target.embed.weight.dtype)
        mx.eval(h)

        def attn(h=h, R=R):
            mask = create_attention_mask(h, cache[0])
            mx.eval([l.self_attn(l.input_layernorm(h), mask, c) for l, c in zip(layers, cache)])
            for c in cache:
                c.trim(R)

        def mlp(h=h):
            mx.eval([l.mlp(l.post_attention_layernorm(h)) for l in layers])

        def head(h=h):
            mx.eval(mx.argmax(target.head(target.inner.norm(h)), axis=-1))

        def whole(R=R):
            out = target(mx.array([[11] * R], mx.int32), cache, taps=False)
            mx.eval(mx.argmax(out.logits[0], axis=-1))
            for c in cache:
                c.trim(R)

        x = mx.random.normal((R, I))
        y = mx.random.normal((R, H))
        mx.eval(x, y)

        def sig(x=x):
            mx.eval([nn.sigmoid(x + i) for i in range(len(layers))])

        def mm(y=y):
            mx.eval([y @ W.T for _ in range(len(layers))])

        for name, f in (
            ("pass", whole),
            ("attention", attn),
            ("mlp", mlp),
            ("head", head),
            ("sigmoid", sig),
            ("matmul", mm),
        ):
            tasks[(name, R)] = f
    times = {k: [] for k in tasks}
    keys = list(tasks)
    for r in range(a.rounds + 1):
        k0 = r % len(keys)
        for key in keys[k0:] + keys[:k0]:
            t = time.perf_counter()
            tasks[key]()
            if r:
                times[key].append((time.perf_counter() - t) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = len(layers)
    print(
        f"target {pair.target_id} ({target.model_type}, {n} layers, hidden {H}, {target.embed.weight.dtype}), "
        f"context {a.context}, backend {'gpu' if mx.default_device() == mx.gpu else 'cpu'}; medians of {a.rounds} "
        f"interleaved rounds, ms"
    )
    cols = ("pass", "attention", "mlp", "head", "sigmoid", "matmul")
    print(f"{'rows':>5} " + " ".join(f"{c:>10}" for c in cols) + "   pass/pass(1)  sigmoid ns/elem")
    for R in rows:
        ns = med[("sigmoid", R)] * 1e6 / (n * R * I)
        print(
            f"{R:>5} "
            + " ".join(f"{med[(c, R)]:>10.1f}" for c in cols)
            + f"   {med[('pass', R)] / med[('pass', rows[0])]:>12.2f}  {ns:>15.1f}"
        )
    print(f"(sigmoid: {n} ops over rows x {I}, the SiLU's shape; matmul: {n} of rows x {H} @ {H} x {I})")
    print(elementwise_line())
    if 1 in rows:
        reach(Costs(med[("pass", 1)], {}, {R: med[("pass", R)] for R in rows}, a.context), rows)


def elementwise_line(n: int = 1 << 20, reps: int = 9) -> str:
    """One exp and one sigmoid over ``n`` float32 elements, MLX on this backend against numpy's
    exp (the same machine, the same elements): what a transcendental costs per element here."""
    import numpy as np

    x = mx.random.normal((n,))
    mx.eval(x)
    xn = np.array(x)

    def ns(f) -> float:
        f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e9 / n

    return (
        f"per element over {n} float32: MLX exp {ns(lambda: mx.eval(mx.exp(x))):.1f} ns, "
        f"sigmoid {ns(lambda: mx.eval(mx.sigmoid(x))):.1f} ns, add {ns(lambda: mx.eval(x + 1)):.2f} ns; "
        f"numpy exp {ns(lambda: np.exp(xn)):.2f} ns"
    )


def reach(curve: Costs, rows: list[int]) -> None:
    """Break-even tau per sequence of drafting B rows for n sequences at once (costs.Costs.reach,
    the target's passes alone: no draft pass, no taps, so a lower bound for DFlash): n sequences'
    plain step is one pass of n rows, their cycle one pass of n * B rows."""
    seqs = [s for s in (1, 2, 4, 8) if s in rows]
    blocks = [B for B in (2, 3, 4, 6, 8) if any(s * B in rows for s in seqs)]
    print(
        "\nbreak-even tau per sequence (tokens a cycle must commit to pay for its rows; only the "
        "row counts measured above):"
    )
    print(f"{'block':>5} " + " ".join(f"{f'{s} seq':>8}" for s in seqs))
    for B in blocks:
        cells = [
            f"{curve.reach(B, seqs=s, source='lookup').break_even:>8.2f}" if s * B in rows else f"{'-':>8}"
            for s in seqs
        ]
        print(f"{B:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
