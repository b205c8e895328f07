"""Time one ``cblas_sgemm`` per library at 1..32 rows, the call MLX's CPU backend makes for a
matmul: rows x K activations times a weight matrix stored (N, K), as a Linear layer's.

    python benchmarks/blas_sgemm.py [--n 46080] [--k 576] [--rows 1,2,4,8,16,32] [--repeats 15]

The default weight is 30 MLP projections of the default target stacked (46080 x 576 float32,
106 MB, larger than any cache), so a row count's time is what reading the weights costs there.
Libraries: the ones ``mlx_spec.blas`` can load on this machine (MKL from the ``mkl`` wheel, the
system OpenBLAS), each through its own handle in this process, at its own default threads,
interleaved; medians in ms. Independent of MLX: it explains the target pass costs of
``benchmarks/pass_anatomy.py`` under each library (docs/bench.md, "BLAS").
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np

os.environ["MLX_SPEC_BLAS"] = "none"  # load neither into the global scope: each keeps its own symbols
from mlx_spec import blas  # noqa: E402

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def libraries() -> dict[str, ctypes.CDLL]:
    found = {}
    for name, paths in (("mkl", blas._mkl_paths()), ("openblas", blas._CANDIDATES)):
        path = next((p for p in paths if os.path.exists(p)), None)
        if path:
            found[name] = ctypes.CDLL(path)
    if not found:
        raise SystemExit("no MKL or OpenBLAS on this machine")
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30 * 1536)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    libs = libraries()
    w = np.random.default_rng(0).standard_normal((args.n, args.k), dtype=np.float32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    times = {(lib, m): [] for lib in libs for m in rows}
    for rep in range(args.repeats + 2):  # two warm-up rounds, discarded
        for m in rows:
            x = np.ones((m, args.k), np.float32)
            y = np.empty((m, args.n), np.float32)
            for name, lib in libs.items():
                t = time.perf_counter()
                lib.cblas_sgemm(
                    ROW_MAJOR,
                    NO_TRANS,
                    TRANS,
                    m,
                    args.n,
                    args.k,
                    ctypes.c_float(1.0),
                    ptr(x),
                    args.k,
                    ptr(w),
                    args.k,
                    ctypes.c_float(0.0),
                    ptr(y),
                    args.n,
                )
                if rep >= 2:
                    times[(name, m)].append((time.perf_counter() - t) * 1e3)
    mb = w.nbytes / 2**20
    print(
        f"cblas_sgemm: rows x {args.k} times ({args.n} x {args.k})^T float32 ({mb:.0f} MiB of weights); "
        f"medians of {args.repeats}, ms"
    )
    print(f"{'rows':>5} " + " ".join(f"{n:>10}" for n in libs))
    for m in rows:
        print(f"{m:>5} " + " ".join(f"{statistics.median(times[(n, m)]):>10.1f}" for n in libs))


if __name__ == "__main__":
    main()
