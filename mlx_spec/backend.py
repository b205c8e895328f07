"""The backend seam: every question the package asks about the machine MLX runs on.

``current()`` answers once per process from MLX (``mx.metal.is_available()``,
``mx.cuda.is_available()``, ``mx.device_info()``, ``mx.default_device()``) and returns a frozen
``Backend``. Nothing else in the package asks MLX which backend it is on: code that branches on
the backend calls ``current()``.

Tests (and people reproducing a Mac report on another machine) replace the answer:

- ``with backend.use(backend.as_kind("metal")): ...`` makes ``current()`` answer that value on
  every thread for the duration of the block (a context manager, restored on exit);
- ``MLX_SPEC_BACKEND_AS=metal|gpu|cpu`` in the environment, read once at the first
  ``current()``, does the same for the whole process: MLX's real kernels still run on the
  machine's device, but every branch the package takes is the one of that backend (the file's
  dtype kept, the default target's 4-bit weights kept, the drafter quantized as the target,
  a Metal-style budget and wired limit, verify's tolerance for that backend).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Literal

from .errors import MlxSpecError

Kind = Literal["metal", "gpu", "cpu"]
KINDS = ("metal", "gpu", "cpu")
ENV = "MLX_SPEC_BACKEND_AS"
GiB = 2**30
# the budget a faked Metal backend reports when the machine has no Metal working set to read:
# three quarters of physical memory, as macOS recommends on Apple Silicon
FAKE_WORKING_SET_FRACTION = 0.75


@dataclass(frozen=True, slots=True)
class Backend:
    """What the package needs to know about the backend (plain values)."""

    kind: Kind  # "metal" (Apple GPU), "gpu" (another GPU backend, e.g. CUDA), "cpu"
    device: str  # device name, e.g. "Apple M2 Max", "NVIDIA H200", "AMD EPYC"
    budget: int  # bytes the memory plan may use
    budget_source: str  # where ``budget`` comes from, said in the plan
    wired_limit: int | None  # bytes to wire (Metal), None: nothing to wire
    faked: bool = False  # True: the kind was replaced (MLX_SPEC_BACKEND_AS or use()); kernels are the real device's

    @property
    def metal(self) -> bool:
        return self.kind == "metal"

    @property
    def gpu(self) -> bool:
        """Any GPU backend (Metal or another): kernels that keep 16-bit and quantized weights fast."""
        return self.kind in ("metal", "gpu")

    @property
    def cast_float32(self) -> bool:
        """Load float weights as float32: a CPU-kernel workaround (MLX's 16-bit CPU kernels are
        slow); Metal and CUDA keep the file's dtype."""
        return self.kind == "cpu"

    @property
    def fast_quantized(self) -> bool:
        """Quantized matmuls amortize over a verify block's rows (GPU kernels); on the CPU
        backend they cost ~linear in rows, so float32 + BLAS is kept there."""
        return self.gpu

    def default_dtype(self):
        """The dtype float weights load in: float32 on the CPU backend, None (keep) elsewhere."""
        import mlx.core as mx  # (optional: no MLX on an Intel Mac, which cli checks first; startup: --help)

        return mx.float32 if self.cast_float32 else None

    def describe(self) -> str:
        fake = f" (faked by {ENV} or a test; kernels run on the real device)" if self.faked else ""
        return f"{self.kind} on {self.device}{fake}"

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "device": self.device,
            "budget": self.budget,
            "budget_source": self.budget_source,
            "wired_limit": self.wired_limit,
            "faked": self.faked,
        }


def unsupported_platform(system: str | None = None, machine: str | None = None) -> str | None:
    """Why this machine cannot run mlx_spec, or None. MLX has no build for Intel Macs (nor for a
    Python running under Rosetta on an Apple Silicon Mac, which reports x86_64)."""
    system = system or sys.platform
    machine = machine or platform.machine()
    if system == "darwin" and machine != "arm64":
        return (
            f"mlx_spec needs Apple Silicon (arm64): this Python runs on macOS {machine}, and MLX has no "
            "build for Intel Macs. On an Apple Silicon Mac, use an arm64 Python (not one under Rosetta: "
            "`python3 -c 'import platform; print(platform.machine())'` must say arm64) and reinstall."
        )
    return None


def _physical_memory() -> int:
    import psutil  # (startup: --help loads this module)

    return int(psutil.virtual_memory().total)


def detect() -> Backend:
    """The real backend, read from MLX (no override)."""
    import mlx.core as mx  # (optional: no MLX on an Intel Mac, which cli checks first; startup: --help)

    info = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # an MLX without device_info on this backend
        pass
    name = str(info.get("device_name") or info.get("architecture") or mx.default_device())
    if mx.metal.is_available():
        ws = info.get("max_recommended_working_set_size")
        if ws:
            return Backend("metal", name, int(ws), "Metal recommended working set", int(ws))
        return Backend("metal", name, _physical_memory(), "physical memory", None)
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        total = info.get("memory_size") or info.get("total_memory")
        if total:
            return Backend("gpu", name, int(total), "GPU memory", None)
        return Backend("gpu", name, _physical_memory(), "physical memory", None)
    return Backend("cpu", name, _physical_memory(), "physical memory", None)


def as_kind(kind: str, real: Backend | None = None) -> Backend:
    """The real backend with its kind replaced (``faked``): a Metal backend gets a faked working
    set (3/4 of the real budget) as budget and wired limit, as on an Apple Silicon Mac."""
    if kind not in KINDS:
        raise MlxSpecError(f"{ENV}={kind!r}: must be one of {', '.join(KINDS)}")
    real = real or detect()
    if kind == real.kind and not real.faked:
        return real
    if kind == "metal":
        ws = int(real.budget * FAKE_WORKING_SET_FRACTION)
        return replace(
            real,
            kind="metal",
            budget=ws,
            budget_source="Metal recommended working set (faked)",
            wired_limit=ws,
            faked=True,
        )
    return replace(
        real, kind=kind, wired_limit=None, faked=True, budget_source=real.budget_source.replace(" (faked)", "")
    )


_lock = threading.Lock()
_detected: list[Backend] = []  # the process's answer, computed once (environment read once)
_override: list[Backend] = []  # use() blocks in force, innermost last


def current() -> Backend:
    """The backend the package runs on: a ``use()`` block's value, else the process's answer
    (MLX, with ``MLX_SPEC_BACKEND_AS`` applied), computed once."""
    with _lock:
        if _override:
            return _override[-1]
        if not _detected:
            kind = os.environ.get(ENV, "").strip().lower()
            _detected.append(as_kind(kind) if kind else detect())
        return _detected[0]


@contextmanager
def use(value: Backend | str) -> Iterator[Backend]:
    """Within the block, ``current()`` answers ``value`` (a Backend, or a kind for ``as_kind``)."""
    b = as_kind(value) if isinstance(value, str) else value
    with _lock:
        _override.append(b)
    try:
        yield b
    finally:
        with _lock:
            _override.remove(b)


def set_wired_limit(b: Backend | None = None) -> int | None:
    """Wire up to the backend's wired limit (Metal), as mlx-lm's ``wired_limit`` does. Returns the
    previous limit, or None where there is nothing to set (CPU, CUDA, a faked Metal)."""
    import mlx.core as mx  # (optional: no MLX on an Intel Mac, which cli checks first; startup: --help)

    b = b or current()
    if b.wired_limit is None or b.faked:  # a faked Metal has no Metal allocator to wire
        return None
    try:
        return mx.set_wired_limit(int(b.wired_limit))
    except Exception as e:  # macOS < 15 or a limit above the sysctl: keep running unwired
        logging.getLogger(__name__).warning("could not set the wired limit: %s", e)
        return None


__all__ = [
    "Backend",
    "Kind",
    "KINDS",
    "ENV",
    "current",
    "detect",
    "as_kind",
    "use",
    "set_wired_limit",
    "unsupported_platform",
]
