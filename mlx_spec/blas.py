"""Load an optimized BLAS into the process before MLX, on Linux.

MLX's Linux CPU wheel links the reference Netlib BLAS: a 16-row float32 matmul costs ~20x a
1-row one, which makes block verification (the thing speculation relies on) look expensive.
Loading OpenBLAS with RTLD_GLOBAL before ``import mlx`` makes MLX's ``sgemm`` calls resolve to
it. This must run before the first ``import mlx``; ``mlx_spec/__init__.py`` calls it.

Controlled by ``MLX_SPEC_BLAS``: unset/``auto`` (find the system OpenBLAS), ``none`` (keep the
bundled one), or a path to a BLAS shared library.

Threads: measured, not pinned. OpenBLAS starts at its own default (all cores), which is what
mlx-lm gets too; the tuner times the thread count together with the block size and the engine
applies the stored choice at load (``set_threads``, through ``openblas_set_num_threads``). A user
who sets ``OPENBLAS_NUM_THREADS`` pins it (``BlasInfo.pinned``; the tuner then leaves it alone).
MLX itself has no CPU thread setting (its other CPU kernels run on the stream's thread), and on
Metal or a BLAS without the setter there is no knob: ``set_threads`` does nothing there.
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
    settable: bool = False  # the library has openblas_set_num_threads (a thread knob exists)
    pinned: int | None = None  # OPENBLAS_NUM_THREADS as the user set it before start

    def describe(self) -> str:
        threads = get_threads(self)
        pin = " (pinned by OPENBLAS_NUM_THREADS)" if self.pinned else ""
        return (f"{self.name}" + (f" ({self.path})" if self.path else "") + f": {self.detail}"
                + (f" threads={threads}{pin}" if threads else ""))


def default_threads() -> int:
    """OpenBLAS's own default: every core this process may run on (the faster choice on typical
    hardware; what mlx-lm runs with)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_candidates(cores: int | None = None) -> list[int]:
    """Thread counts worth timing: 1, powers of two below the core count, and all cores."""
    cores = cores or default_threads()
    out, n = {1, cores}, 2
    while n < cores:
        out.add(n)
        n *= 2
    return sorted(out)


def _lib(info: BlasInfo):
    return ctypes.CDLL(info.path, mode=ctypes.RTLD_GLOBAL) if info.settable and info.path else None


def get_threads(info: BlasInfo) -> int | None:
    """The BLAS's current thread count; None where there is no knob (Metal, reference BLAS)."""
    lib = _lib(info)
    return int(lib.openblas_get_num_threads()) if lib is not None else None


def set_threads(info: BlasInfo, n: int | None) -> int | None:
    """Set the BLAS thread count (process-wide: the BLAS's own state); returns the count now in
    effect. ``None`` means the default (all cores). No knob (Metal, reference BLAS): no-op, None."""
    lib = _lib(info)
    if lib is None:
        return None
    if n is None:
        n = default_threads()
    if not isinstance(n, int) or n < 1:
        from .errors import BadRequest

        raise BadRequest(f"BLAS thread count must be an integer >= 1 (got {n!r})")
    lib.openblas_set_num_threads(ctypes.c_int(n))
    return int(lib.openblas_get_num_threads())


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


def _pinned(env) -> int | None:
    raw = env.get("OPENBLAS_NUM_THREADS")
    try:
        n = int(raw) if raw else None
    except ValueError:
        logging.getLogger(__name__).warning("mlx_spec: ignoring OPENBLAS_NUM_THREADS=%r (not an integer)", raw)
        return None
    return n if n and n >= 1 else None


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
        pinned = _pinned(env)
        if "OPENBLAS_CORETYPE" not in os.environ:
            core = _coretype(_cpu_flags())
            if core:
                os.environ["OPENBLAS_CORETYPE"] = core
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return BlasInfo("reference", None, f"could not load {path}: {e}")
        core = os.environ.get("OPENBLAS_CORETYPE", "auto-detected")
        name = "openblas" if "openblas" in path else "custom"
        settable = hasattr(lib, "openblas_set_num_threads") and hasattr(lib, "openblas_get_num_threads")
        return BlasInfo(name, path, f"core={core}", settable, pinned)
    hint = "apt-get install libopenblas0-pthread" if choice == "auto" else f"{choice} not found"
    info = BlasInfo("reference", None, f"no optimized BLAS found ({hint}); block verify is slow")
    # Once per process (mlx_spec/__init__ calls this once), before any command runs.
    logging.getLogger(__name__).warning("mlx_spec: %s; speculative decoding will not pay on this "
                                        "CPU (set MLX_SPEC_BLAS=none to silence)", info.detail)
    return info
