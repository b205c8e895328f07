"""Load an optimized BLAS into the process before MLX, on Linux.

MLX's Linux CPU wheel links the reference Netlib BLAS: a 16-row float32 matmul costs ~20x a
1-row one, which makes block verification (the thing speculation relies on) look expensive.
Loading an optimized BLAS with RTLD_GLOBAL before ``import mlx`` makes MLX's ``sgemm`` calls
resolve to it. This must run before the first ``import mlx``; ``mlx_spec/__init__.py`` calls it.

Which one (``MLX_SPEC_BLAS``): unset/``auto`` picks Intel MKL (the ``mkl`` wheel, a dependency on
Linux x86-64) on an Intel CPU and the system OpenBLAS elsewhere, each falling back to the other;
``mkl`` or ``openblas`` asks for one; ``none`` keeps the bundled reference BLAS; a path loads that
library. MKL first on Intel because it was measured faster here: its small-row ``sgemm`` reads
the weights once, where OpenBLAS 0.3.21 packs them first (a 1-row target pass of the default pair
~35 % cheaper: docs/bench.md, "Why MKL").

Threads: measured, not pinned. The library starts at its own default (all cores), which is what
mlx-lm gets too; the tuner times the thread count together with the block size and the engine
applies the stored choice at load (``set_threads``, through ``openblas_set_num_threads`` or
``MKL_Set_Num_Threads``). A user who sets ``OPENBLAS_NUM_THREADS`` (OpenBLAS) or
``MKL_NUM_THREADS`` (MKL) pins it (``BlasInfo.pinned``; the tuner then leaves it alone).
MLX itself has no CPU thread setting (its other CPU kernels run on the stream's thread), and on
Metal or a BLAS without the setter there is no knob: ``set_threads`` does nothing there.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .errors import BadRequest

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


CHOICES = ("auto", "mkl", "openblas", "none")  # MLX_SPEC_BLAS's names (else a library's path)

# Each library's thread knob (setter, getter) and the variable a user pins it with.
_KNOBS = {
    "openblas": ("openblas_set_num_threads", "openblas_get_num_threads", "OPENBLAS_NUM_THREADS"),
    "mkl": ("MKL_Set_Num_Threads", "MKL_Get_Max_Threads", "MKL_NUM_THREADS"),
}


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "accelerate" | "openblas" | "mkl" | "reference" | "custom"
    path: str | None
    detail: str
    settable: bool = False  # the library has its thread setter (a thread knob exists)
    pinned: int | None = None  # OPENBLAS_NUM_THREADS / MKL_NUM_THREADS as the user set it before start
    version: str | None = None  # where the library reports it (MKL); part of the tuner's key

    def describe(self) -> str:
        threads = get_threads(self)
        pin = f" (pinned by {_KNOBS[self.name][2]})" if self.pinned and self.name in _KNOBS else ""
        return (
            f"{self.name}"
            + (f" ({self.path})" if self.path else "")
            + f": {self.detail}"
            + (f" threads={threads}{pin}" if threads else "")
        )


def default_threads() -> int:
    """Every core this process may run on: OpenBLAS's own default (the faster choice on typical
    hardware; what mlx-lm runs with). MKL's own default is the physical cores: the same count
    without SMT (as measured here), half of this with it."""
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
    return int(getattr(lib, _KNOBS[info.name][1])()) if lib is not None else None


def set_threads(info: BlasInfo, n: int | None) -> int | None:
    """Set the BLAS thread count (process-wide: the BLAS's own state); returns the count now in
    effect. ``None`` means the default (all cores). No knob (Metal, reference BLAS): no-op, None."""
    lib = _lib(info)
    if lib is None:
        return None
    if n is None:
        n = default_threads()
    if not isinstance(n, int) or n < 1:
        raise BadRequest(f"BLAS thread count must be an integer >= 1 (got {n!r})")
    getattr(lib, _KNOBS[info.name][0])(ctypes.c_int(n))
    return get_threads(info)


@functools.cache
def cpuinfo(path: str = "/proc/cpuinfo") -> Mapping[str, str]:
    """The first CPU's fields in /proc/cpuinfo, read once per path (``vendor_id``: MKL first on
    Intel; ``flags``: OpenBLAS's core type; ``model name``: the tuner's machine key); empty where
    there is none. Shared between callers, so read-only."""
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():  # the first CPU's block ends
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return MappingProxyType(out)


def _coretype(flags: set[str]) -> str | None:
    """A core type the CPU really has, for OpenBLAS builds that misdetect AVX-512 machines."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "SKYLAKEX"
    return None  # leave OpenBLAS's own detection (it is right for AVX2 Zen/Haswell here)


def _pinned(env, name: str) -> int | None:
    if name not in _KNOBS:  # no thread knob: nothing to pin
        return None
    var = _KNOBS[name][2]
    raw = env.get(var)
    try:
        n = int(raw) if raw else None
    except ValueError:
        logging.getLogger(__name__).warning("mlx_spec: ignoring %s=%r (not an integer)", var, raw)
        return None
    return n if n and n >= 1 else None


def _mkl_paths() -> tuple[str, ...]:
    """libmkl_rt from the installed ``mkl`` wheel (it finds its sibling libraries itself)."""
    try:
        files = importlib.metadata.files("mkl") or ()
    except importlib.metadata.PackageNotFoundError:
        return ()
    found = (os.path.realpath(f.locate()) for f in files if f.name.startswith("libmkl_rt.so"))
    return tuple(sorted(p for p in found if os.path.exists(p)))


def _mkl_version(lib) -> str | None:
    buf = ctypes.create_string_buffer(256)
    try:
        lib.MKL_Get_Version_String(buf, len(buf))
    except AttributeError:
        return None
    text = buf.value.decode(errors="replace")  # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product ..."
    version = text.split("Version", 1)[1].split()[0].split("-")[0] if "Version" in text else ""
    return version or None


def _kind(path: str) -> str:
    """What a library file is, guessed from its name (before loading it)."""
    base = os.path.basename(path)
    return "mkl" if "mkl" in base else "openblas" if "openblas" in path else "custom"


def _has_knob(lib, name: str) -> bool:
    return name in _KNOBS and all(hasattr(lib, f) for f in _KNOBS[name][:2])


def _identify(lib, path: str) -> tuple[str, bool]:
    """(name, settable) of a loaded library: by the thread knob it exports (a path such as
    /usr/lib/x86_64-linux-gnu/libblas.so.3 may be OpenBLAS under another name), else by its
    file name, without a knob."""
    name = next((n for n in _KNOBS if _has_knob(lib, n)), None)
    return (name, True) if name else (_kind(path), False)


def candidates(choice: str, mkl: tuple[str, ...], intel: bool) -> tuple[str, ...]:
    """Library paths to try, in order, for an ``MLX_SPEC_BLAS`` value (not ``none``)."""
    if choice == "mkl":
        return mkl
    if choice == "openblas":
        return _CANDIDATES
    if choice == "auto":
        return mkl + _CANDIDATES if intel else _CANDIDATES + mkl
    return (choice,)


def load_blas(env: dict | None = None) -> BlasInfo:
    """Load an optimized BLAS (idempotent per process). Returns what is active."""
    env = os.environ if env is None else env
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, "MLX uses Metal/Accelerate on macOS")
    if not sys.platform.startswith("linux"):
        return BlasInfo("reference", None, f"no BLAS loading on {sys.platform}")
    choice = env.get("MLX_SPEC_BLAS", "").strip() or "auto"
    if choice.lower() in CHOICES:  # (a path keeps its case)
        choice = choice.lower()
    if choice == "none":
        return BlasInfo("reference", None, "MLX_SPEC_BLAS=none: MLX's bundled reference BLAS")
    cpu = cpuinfo()
    mkl = _mkl_paths() if choice in ("auto", "mkl") else ()
    failed = []  # "could not load PATH: why", for the warning if nothing loads
    for path in candidates(choice, mkl, intel=cpu.get("vendor_id") == "GenuineIntel"):
        if not os.path.exists(path):
            continue
        if _kind(path) != "mkl" and "OPENBLAS_CORETYPE" not in os.environ:  # (OpenBLAS reads it at load)
            core = _coretype(set(cpu.get("flags", "").split()))
            if core:
                os.environ["OPENBLAS_CORETYPE"] = core
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:  # (the next candidate is tried)
            failed.append(f"could not load {path}: {e}")
            continue
        name, settable = _identify(lib, path)
        version = _mkl_version(lib) if name == "mkl" else None
        detail = (
            f"core={os.environ.get('OPENBLAS_CORETYPE', 'auto-detected')}"
            if name == "openblas"
            else f"version {version or 'unknown'}"
            if name == "mkl"
            else "loaded"
        )
        return BlasInfo(name, path, detail, settable, _pinned(env, name), version)
    hint = {
        "auto": "pip install mkl, or apt-get install libopenblas0-pthread",
        "mkl": "pip install mkl",
        "openblas": "apt-get install libopenblas0-pthread",
    }.get(choice, f"MLX_SPEC_BLAS={choice!r}: no such file; it takes {'|'.join(CHOICES)} or a library's path")
    if failed:
        return _reference("; ".join(failed))
    return _reference(f"no optimized BLAS found ({hint}); block verify is slow")


def _reference(detail: str) -> BlasInfo:
    """MLX's bundled reference BLAS, where an optimized one was wanted but is not loaded: said
    once per process (mlx_spec/__init__ calls ``load_blas`` once), before any command runs."""
    logging.getLogger(__name__).warning(
        "mlx_spec: %s; speculative decoding will not pay on this CPU (set MLX_SPEC_BLAS=none to silence)", detail
    )
    return BlasInfo("reference", None, detail)
