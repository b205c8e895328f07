"""`mlx_spec convert FILE.gguf OUT/`: a llama GGUF to an MLX model directory."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import BadRequest
from ..gguf import convert_gguf
from ..progress import Bar


def add_arguments(p) -> None:
    p.add_argument("gguf", type=Path, help="the .gguf file (Q4_0/Q4_1/Q8_0/F16/BF16/F32 llama)")
    p.add_argument("out", type=Path, help="output folder (loadable with mlx_lm.load and --target)")
    p.add_argument(
        "--dtype",
        choices=("float32", "keep"),
        default="float32",
        help="float32: dequantize everything (best on the CPU backend); keep: keep 4/8-bit weights",
    )


def run(args) -> int:
    if not args.gguf.is_file():
        raise BadRequest(f"{args.gguf}: no such file")
    t = time.perf_counter()
    with Bar(sys.stderr, f"Converting {args.gguf.name} ({args.dtype})") as bar:
        out = convert_gguf(args.gguf, args.out, dtype=args.dtype, progress=bar)
    print(f"converted {args.gguf} -> {out} ({args.dtype}) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return 0
