"""Drafter precision by measured acceptance: tau and finiteness per activation dtype and weight bits.

For every activation dtype (float32, bfloat16, float16) and drafter weights (float, 8-bit and
4-bit at group sizes 32 and 64) this loads the shipped drafter at that precision, binds it to the
embedded target and replays greedy speculative decoding on bench's held-out prompts: the target's
greedy reply is computed once (greedy speculative decoding commits exactly it), and each
setting's drafter proposes a block at every anchor the decode loop would reach, fed the target's
features of the committed tokens. It records tau (tokens per drafter cycle) and whether every
drafter hidden state and logit of every pass was finite (the drafter's own per-pass check, with
its float32 fallback turned off so the setting is measured as it is). The target is the same in
every row, so tau differences are the drafter's.

    python benchmarks/precision.py --prompts 6 --max-tokens 48 --out benchmarks/results/DIR/precision.json

``--rows float16/4-bit-g64`` (repeatable; ``ACTIVATIONS/WEIGHTS`` with the weights written
``float``, ``8-bit-g32``, ``4-bit-g64``, ...) measures only those settings; the float32 / float row
is always measured too, since every tau is read against it.

The table (markdown) goes to stdout; the JSON holds every row and the setting chosen: the cheapest
(fewest drafter weight bytes, then bfloat16, float16, float32 activations) whose tau is within 2 %
of float32-float and with no non-finite pass.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ACTS = ("float32", "bfloat16", "float16")
WEIGHTS = ((None, 0), (8, 32), (8, 64), (4, 32), (4, 64))  # (bits, group size); None: float
TOLERANCE = 0.02


def cost(row: dict) -> tuple:
    """Cheaper first: fewer drafter bytes, then (at equal bytes) bfloat16 activations, float16,
    float32. bfloat16 has float32's exponent range; float16's overflow is how other DFlash ports
    produced NaN drafts on M1/M2 GPUs, so at equal cost the range wins."""
    return row["drafter_bytes"], ("bfloat16", "float16", "float32").index(row["activations"])


def weight_name(bits, group) -> str:
    return "float" if bits is None else f"{bits}-bit g{group}"


def row_key(act: str, bits, group) -> str:
    """The ``--rows`` spelling of a setting: ``float16/4-bit-g64``, ``float32/float``."""
    return f"{act}/{weight_name(bits, group).replace(' ', '-')}"


def settings(rows: list[str] | None) -> list[tuple[str, int | None, int]]:
    """Every (activations, bits, group) to measure, in table order: all of them, or the float32 /
    float baseline plus the ``--rows`` named. An unknown name is an error naming the known ones."""
    every = [(act, bits, group) for act in ACTS for bits, group in WEIGHTS]
    if not rows:
        return every
    known = {row_key(*s): s for s in every}
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise ValueError(f"unknown --rows {', '.join(unknown)}; known: {', '.join(known)}")
    wanted = {row_key("float32", None, 0), *rows}
    return [s for s in every if row_key(*s) in wanted]


def run(prompts: int, max_tokens: int, block_size: int | None, only: list[str] | None = None) -> dict:
    from mlx_spec import loading
    from mlx_spec import prompts as P
    from mlx_spec.default_target import DEFAULT_TARGET_ID
    from mlx_spec.drafter import DraftVocab

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    pair = loading.load_pair(DEFAULT_TARGET_ID, loading.DEFAULT_DRAFTER)
    target, tok = pair.target, pair.tokenizer
    chosen = P.interleave(P.builtin_prompts())[:prompts]
    eos = set(tok.eos_token_ids)
    # The target's greedy reply to each prompt (plain decoding, once), and its tapped features over
    # prompt + reply in one pass: greedy speculative decoding commits exactly these tokens, so each
    # setting's drafter is replayed over them (what the decode loop feeds it, up to the rounding of
    # a chunked verify against one pass) and tau is read without running the target again.
    runs = []
    for p in chosen:
        ids = p.encode(tok)
        reply = []
        for t, _ in generate_step(mx.array(ids), pair.model, max_tokens=max_tokens):
            reply.append(int(t))
            if int(t) in eos:
                break
        full = ids + reply
        out = target(mx.array([full]), target.make_cache())
        mx.eval(out.hidden)
        runs.append((p.id, full, len(ids), out.hidden))
        print(f"  reference {p.id}: {len(reply)} tokens", file=sys.stderr, flush=True)
    rows = []
    for act, bits, group in settings(only):
        dt = getattr(mx, act)
        drafter, _ = loading.load_drafter(loading.DEFAULT_DRAFTER, dtype=dt, bits=bits, group_size=group or 64)
        vocab = None
        if drafter.shipped_vocab is not None:
            v = mx.array(drafter.shipped_vocab)
            vocab = DraftVocab(v, target.head_rows(v))
        drafter.bind(target.embed, target.head, vocab)
        drafter.act_dtype = dt
        drafter.fallback_on_nonfinite = False
        L = block_size or drafter.args.block_size
        tokens = cycles = 0
        t0 = time.perf_counter()
        for _, full, n, hidden in runs:
            cache, fed, pos = drafter.make_cache(), 0, n  # pos: the anchor (first reply token)
            while pos < len(full) - 1:
                prop = drafter.propose(mx.array(full[pos], mx.int32), hidden[:, fed:pos], cache, L)
                drafts, fed = prop.tokens.tolist(), pos
                a = 0
                while a < len(drafts) and pos + 1 + a < len(full) and drafts[a] == full[pos + 1 + a]:
                    a += 1
                cycles += 1
                tokens += min(a + 1, len(full) - pos - 1)
                pos += a + 1
            drafter.settle()
        h = drafter.health()
        nbytes = sum(v.nbytes for _, v in drafter.own_parameters())
        row = {
            "activations": act,
            "weights": weight_name(bits, group),
            "bits": bits,
            "group_size": group or None,
            "tau": round(tokens / cycles, 3) if cycles else None,
            "cycles": cycles,
            "passes": h.passes,
            "nonfinite_passes": h.nonfinite,
            "drafter_bytes": nbytes,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    base = next(r for r in rows if r["activations"] == "float32" and r["bits"] is None)["tau"]
    ok = [r for r in rows if r["nonfinite_passes"] == 0 and r["tau"] is not None and r["tau"] >= base * (1 - TOLERANCE)]
    cheapest = min(ok, key=cost)
    return {
        "command": " ".join(["python", *sys.argv]),
        # A --rows run: the setting chosen is the cheapest of the rows measured, not of every row.
        "rows_selected": sorted(only) if only else "all",
        "prompts": [r[0] for r in runs],
        "max_tokens": max_tokens,
        "greedy": True,
        "method": "greedy replay of the target's reply (teacher-forced drafter passes)",
        "backend": _backend(),
        "machine": platform.machine(),
        "rows": rows,
        "float32_tau": base,
        "tolerance": TOLERANCE,
        "cheapest_within_tolerance": {k: cheapest[k] for k in ("activations", "weights", "tau")},
    }


def _backend() -> str:
    from mlx_spec import backend

    return backend.current().describe()


def table(result: dict) -> str:
    base = result["float32_tau"]
    out = [
        "| activations | drafter weights | tau | vs float32 | non-finite passes | drafter bytes |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        rel = f"{(r['tau'] / base - 1) * 100:+.1f} %" if r["tau"] and base else "-"
        out.append(
            f"| {r['activations']} | {r['weights']} | {r['tau']} | {rel} | {r['nonfinite_passes']} of "
            f"{r['passes']} | {r['drafter_bytes'] / 1e6:.1f} MB |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts (bench's built-in set, interleaved)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter checkpoint's")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument(
        "--rows",
        action="append",
        default=None,
        metavar="ACTIVATIONS/WEIGHTS",
        help="measure only this setting (repeatable), e.g. float16/4-bit-g64; float32/float is always measured",
    )
    a = ap.parse_args(argv)
    try:
        settings(a.rows)
    except ValueError as e:
        ap.error(str(e))
    result = run(a.prompts, a.max_tokens, a.block_size, a.rows)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\ncheapest within {TOLERANCE:.0%} of float32 with every pass finite: {result['cheapest_within_tolerance']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
