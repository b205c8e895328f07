"""BLAS threads: measured, not pinned; a knob where there is one, a no-op where there is none."""

import os
import re

import mlx_spec
from mlx_spec import blas
from mlx_spec.errors import BadRequest

import pytest


def test_thread_candidates():
    assert blas.thread_candidates(1) == [1]
    assert blas.thread_candidates(2) == [1, 2]
    assert blas.thread_candidates(6) == [1, 2, 4, 6]
    assert blas.thread_candidates(16) == [1, 2, 4, 8, 16]
    assert blas.default_threads() >= 1


def test_pinned_only_when_the_user_sets_it():
    assert blas._pinned({}, "openblas") is None and blas._pinned({"OPENBLAS_NUM_THREADS": "3"}, "openblas") == 3
    assert blas._pinned({"OPENBLAS_NUM_THREADS": "x"}, "openblas") is None
    assert blas._pinned({"OPENBLAS_NUM_THREADS": "0"}, "openblas") is None


def test_no_knob_is_a_no_op():
    for info in (blas.BlasInfo("reference", None, "bundled"), blas.BlasInfo("accelerate", None, "metal")):
        assert blas.set_threads(info, 2) is None and blas.get_threads(info) is None
        assert "threads" not in info.describe()


@pytest.mark.skipif(not mlx_spec.BLAS.settable, reason="no BLAS thread setter on this machine")
def test_set_threads_round_trip_and_bad_input():
    info = mlx_spec.BLAS
    before = blas.get_threads(info)
    try:
        assert blas.set_threads(info, 1) == 1 and blas.get_threads(info) == 1
        assert "threads=1" in info.describe()
        assert blas.set_threads(info, None) == blas.default_threads()  # the default: all cores
        with pytest.raises(BadRequest, match="thread count"):
            blas.set_threads(info, 0)
    finally:
        blas.set_threads(info, before)


def test_which_library_is_tried_first():
    mkl = ("/site/lib/libmkl_rt.so.3",)
    assert blas.candidates("auto", mkl, intel=True) == mkl + blas._CANDIDATES  # measured faster there
    assert blas.candidates("auto", mkl, intel=False) == blas._CANDIDATES + mkl  # unmeasured: OpenBLAS first
    assert blas.candidates("auto", (), intel=True) == blas._CANDIDATES  # no mkl wheel: as before
    assert blas.candidates("mkl", mkl, intel=False) == mkl and blas.candidates("mkl", (), intel=True) == ()
    assert blas.candidates("openblas", mkl, intel=True) == blas._CANDIDATES
    assert blas.candidates("/opt/my/libblas.so", mkl, intel=True) == ("/opt/my/libblas.so",)
    assert blas._kind(mkl[0]) == "mkl" and blas._kind(blas._CANDIDATES[0]) == "openblas"
    assert blas._kind("/opt/my/libblas.so") == "custom"
    cpu = blas.cpuinfo()  # one read gives both the vendor (MKL first on Intel) and the flags (OpenBLAS's core)
    text = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert ("vendor_id" in cpu) == ("vendor_id" in text) and ("flags" in cpu) == ("\nflags" in text)
    if cpu.get("vendor_id") == "GenuineIntel" and blas._mkl_paths():
        assert blas.load_blas({}).name == "mkl"  # auto on this Intel CPU


def test_each_library_is_pinned_by_its_own_variable():
    assert blas._pinned({"MKL_NUM_THREADS": "3"}, "mkl") == 3
    assert blas._pinned({"OPENBLAS_NUM_THREADS": "3"}, "mkl") is None
    assert blas._pinned({"MKL_NUM_THREADS": "3"}, "openblas") is None


def _load_in_child(choice: str) -> dict:
    import json
    import subprocess
    import sys

    code = (
        "import json, mlx_spec, mlx.core as mx; from mlx_spec import blas; b = mlx_spec.BLAS; "
        "a = mx.arange(12, dtype=mx.float32).reshape(3, 4); "
        "print(json.dumps({'name': b.name, 'pinned': b.pinned, 'threads': blas.get_threads(b), "
        "'mm': (a @ a.T).tolist()}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env["MLX_SPEC_BLAS"] = choice
    env[{"mkl": "MKL_NUM_THREADS", "openblas": "OPENBLAS_NUM_THREADS"}[choice]] = "1"  # its own variable alone
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("choice", ["mkl", "openblas"])
def test_each_library_loads_multiplies_and_takes_its_pin(choice):
    present = blas._mkl_paths() if choice == "mkl" else [p for p in blas._CANDIDATES if os.path.exists(p)]
    if not present:
        pytest.skip(f"{choice} is not installed here")
    got = _load_in_child(choice)
    assert got["name"] == choice and got["pinned"] == 1 and got["threads"] == 1
    assert got["mm"] == [[14.0, 38.0, 62.0], [38.0, 126.0, 214.0], [62.0, 214.0, 366.0]]


def test_a_library_is_known_by_its_thread_knob_not_its_file_name():
    """A path such as /usr/lib/x86_64-linux-gnu/libblas.so.3 (Debian's alternatives link to
    OpenBLAS) keeps its thread knob and its pin; a library without a knob is never pinned."""
    from types import SimpleNamespace

    openblas = SimpleNamespace(openblas_set_num_threads=None, openblas_get_num_threads=None)
    mkl = SimpleNamespace(MKL_Set_Num_Threads=None, MKL_Get_Max_Threads=None)
    assert blas._identify(openblas, "/usr/lib/x86_64-linux-gnu/libblas.so.3") == ("openblas", True)
    assert blas._identify(mkl, "/opt/lib/libblas.so") == ("mkl", True)
    assert blas._identify(SimpleNamespace(), "/opt/lib/libmkl_rt.so.2") == ("mkl", False)  # no knob: named, not set
    assert blas._identify(SimpleNamespace(), "/opt/my/libblas.so") == ("custom", False)
    assert blas._pinned({"OPENBLAS_NUM_THREADS": "3"}, "custom") is None


def test_the_pin_is_named_by_the_librarys_own_variable(monkeypatch):
    from types import SimpleNamespace

    info = blas.BlasInfo("mkl", "/x/libmkl_rt.so.3", "version 2026.2", settable=True, pinned=1)
    monkeypatch.setattr(blas, "_lib", lambda info: SimpleNamespace(MKL_Get_Max_Threads=lambda: 1))
    assert info.describe().endswith("threads=1 (pinned by MKL_NUM_THREADS)")


def test_the_tuners_key_changes_with_the_library_and_its_version(monkeypatch):
    from mlx_spec import tuning

    keys = []
    for info in (
        blas.BlasInfo("openblas", "/usr/lib/libopenblas.so.0", "core=auto-detected"),
        blas.BlasInfo("mkl", "/site/lib/libmkl_rt.so.3", "version 2026.2", version="2026.2"),
        blas.BlasInfo("mkl", "/site/lib/libmkl_rt.so.3", "version 2026.3", version="2026.3"),
    ):
        monkeypatch.setattr(tuning.store, "BLAS", info)  # the name machine_info reads
        keys.append(tuning.machine_info()["blas"])
    assert keys[0] == "openblas /usr/lib/libopenblas.so.0"  # as stored before (no version: unchanged)
    assert len(set(keys)) == 3 and keys[2] == "mkl /site/lib/libmkl_rt.so.3 2026.3"


@pytest.mark.skipif(not blas._mkl_paths(), reason="the mkl wheel is not installed here")
def test_the_mkl_version_is_read():
    import ctypes

    assert re.fullmatch(r"\d+(\.\d+)+", blas._mkl_version(ctypes.CDLL(blas._mkl_paths()[0])))  # "2026.2"
    assert blas._mkl_version(object()) is None


def test_mlx_spec_blas_names_any_case_and_a_missing_path_is_named(caplog):
    assert blas.load_blas({"MLX_SPEC_BLAS": "None"}).detail.startswith("MLX_SPEC_BLAS=none")
    info = blas.load_blas({"MLX_SPEC_BLAS": "/nope/libblas.so"})
    assert info.name == "reference" and "MLX_SPEC_BLAS='/nope/libblas.so': no such file" in info.detail
    assert "auto|mkl|openblas|none" in info.detail and "no such file" in caplog.text


def test_a_library_that_fails_to_load_is_said_not_silently_dropped(tmp_path, monkeypatch, caplog):
    junk = tmp_path / "libblas.so"
    junk.write_bytes(b"not a shared library")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SKYLAKEX")  # (load_blas would set it for the process)
    info = blas.load_blas({"MLX_SPEC_BLAS": str(junk)})
    assert info.name == "reference" and info.detail.startswith(f"could not load {junk}")
    assert f"could not load {junk}" in caplog.text and "will not pay" in caplog.text
    # a candidate that fails to load does not end the search: the next one is tried (and both named)
    other = tmp_path / "libother.so"
    other.write_bytes(b"not one either")
    monkeypatch.setattr(blas, "candidates", lambda choice, mkl, intel: (str(junk), str(other)))
    info = blas.load_blas({"MLX_SPEC_BLAS": "auto"})
    assert (
        info.name == "reference"
        and f"could not load {junk}" in info.detail
        and f"could not load {other}" in info.detail
    )
