"""Load an optimized BLAS into the process before MLX, on Linux.

MLX's Linux CPU wheel links the reference Netlib BLAS: a 16-row float32 matmul costs ~20x a
1-row one, which makes block verification (the thing speculation relies on) look expensive.
Loading OpenBLAS with RTLD_GLOBAL before ``import mlx`` makes MLX's ``sgemm`` calls resolve to
it. This must run before the first ``import mlx``; ``mlx_spec/__init__.py`` calls it.

Controlled by ``MLX_SPEC_BLAS``: unset/``auto`` (find the system OpenBLAS), ``none`` (keep the
bundled one), or a path to a BLAS shared library.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "accelerate" | "openblas" | "reference" | "custom"
    path: str | None
    detail: str

    def describe(self) -> str:
        return f"{self.name}" + (f" ({self.path})" if self.path else "") + f": {self.detail}"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _coretype(flags: set[str]) -> str | None:
    """A core type the CPU really has, for OpenBLAS builds that misdetect AVX-512 machines."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "SKYLAKEX"
    return None  # leave OpenBLAS's own detection (it is right for AVX2 Zen/Haswell here)


def load_blas(env: dict | None = None) -> BlasInfo:
    """Load an optimized BLAS (idempotent per process). Returns what is active."""
    env = os.environ if env is None else env
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, "MLX uses Metal/Accelerate on macOS")
    if not sys.platform.startswith("linux"):
        return BlasInfo("reference", None, f"no BLAS loading on {sys.platform}")
    choice = env.get("MLX_SPEC_BLAS", "auto")
    if choice == "none":
        return BlasInfo("reference", None, "MLX_SPEC_BLAS=none: MLX's bundled reference BLAS")
    paths = _CANDIDATES if choice == "auto" else (choice,)
    for path in paths:
        if not os.path.exists(path):
            continue
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        if "OPENBLAS_CORETYPE" not in os.environ:
            core = _coretype(_cpu_flags())
            if core:
                os.environ["OPENBLAS_CORETYPE"] = core
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return BlasInfo("reference", None, f"could not load {path}: {e}")
        core = os.environ.get("OPENBLAS_CORETYPE", "auto-detected")
        name = "openblas" if "openblas" in path else "custom"
        return BlasInfo(name, path, f"threads={os.environ['OPENBLAS_NUM_THREADS']} core={core}")
    hint = "apt-get install libopenblas0-pthread" if choice == "auto" else f"{choice} not found"
    info = BlasInfo("reference", None, f"no optimized BLAS found ({hint}); block verify is slow")
    # Once per process (mlx_spec/__init__ calls this once), before any command runs.
    logging.getLogger(__name__).warning("mlx_spec: %s; speculative decoding will not pay on this "
                                        "CPU (set MLX_SPEC_BLAS=none to silence)", info.detail)
    return info
