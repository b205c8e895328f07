"""The backend seam: one place answers every backend question; tests and MLX_SPEC_BACKEND_AS replace it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlx_spec import backend, loading, memory, quantize
from mlx_spec.errors import MlxSpecError

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_only_the_seam_asks_mlx_which_backend_it_is():
    hits = [
        f"{p}:{n}"
        for d in ("mlx_spec", "tui")
        for p in (ROOT / d).rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "metal.is_available" in line
    ]
    assert hits and all(h.startswith(str(ROOT / "mlx_spec" / "backend.py")) for h in hits), hits


def test_this_machine_is_the_cpu_backend_with_physical_memory_as_budget():
    b = backend.detect()
    assert b.kind == "cpu" and not b.faked and b.cast_float32 and not b.fast_quantized
    assert b.default_dtype() == mx.float32 and b.wired_limit is None
    assert memory.device_budget() == (b.budget, "physical memory")


def test_a_faked_metal_backend_has_a_working_set_and_a_wired_limit():
    m = backend.as_kind("metal", backend.detect())
    assert m.kind == "metal" and m.faked and m.default_dtype() is None and m.fast_quantized
    assert m.wired_limit == m.budget < backend.detect().budget and "Metal" in m.budget_source
    assert backend.set_wired_limit(m) is None  # nothing to wire without a Metal allocator


def test_a_cuda_gpu_is_a_gpu_not_the_cpu():
    g = backend.Backend("gpu", "NVIDIA H200", 140 * 2**30, "GPU memory", None)
    assert g.gpu and not g.metal and g.default_dtype() is None and g.fast_quantized
    with backend.use(g):
        assert loading.default_dtype() is None  # the file's dtype: float32 is a CPU-kernel workaround
        assert memory.device_budget() == (140 * 2**30, "GPU memory")
        qc = quantize.choose(None, None, None, metal=backend.current().gpu, checkpoint=None)
        assert qc.drafter_activations == quantize.GPU_DRAFTER_ACTIVATIONS


def test_use_replaces_the_answer_for_its_block_only_and_nests():
    real = backend.current()
    with backend.use("metal") as m:
        assert backend.current() is m
        with backend.use("gpu") as g:
            assert backend.current() is g
        assert backend.current() is m
    assert backend.current() == real


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(MlxSpecError, match="MLX_SPEC_BACKEND_AS='tpu'"):
        backend.as_kind("tpu")


def _probe(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), backend.ENV: value}
    code = (
        "from mlx_spec import backend, loading; b = backend.current(); print(b.kind, b.faked, loading.default_dtype())"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_environment_switch_makes_a_process_take_the_metal_branches():
    r = _probe("metal")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["metal", "True", "None"]


def test_an_intel_mac_gets_a_clear_message_not_a_resolver_error():
    why = backend.unsupported_platform("darwin", "x86_64")
    assert "Apple Silicon (arm64)" in why and "Rosetta" in why
    assert backend.unsupported_platform("darwin", "arm64") is None
    assert backend.unsupported_platform("linux", "x86_64") is None
    text = (ROOT / "pyproject.toml").read_text()
    assert "platform_machine == 'arm64'" in text and "mlx>=0.32,<0.33" in text
