"""BLAS threads: measured, not pinned; a knob where there is one, a no-op where there is none."""

import pytest

import mlx_spec
from mlx_spec import blas
from mlx_spec.errors import BadRequest


def test_thread_candidates():
    assert blas.thread_candidates(1) == [1]
    assert blas.thread_candidates(2) == [1, 2]
    assert blas.thread_candidates(6) == [1, 2, 4, 6]
    assert blas.thread_candidates(16) == [1, 2, 4, 8, 16]
    assert blas.default_threads() >= 1


def test_pinned_only_when_the_user_sets_it():
    assert blas._pinned({}) is None and blas._pinned({"OPENBLAS_NUM_THREADS": "3"}) == 3
    assert blas._pinned({"OPENBLAS_NUM_THREADS": "x"}) is None and blas._pinned({"OPENBLAS_NUM_THREADS": "0"}) is None


def test_no_knob_is_a_no_op():
    for info in (blas.BlasInfo("reference", None, "bundled"), blas.BlasInfo("accelerate", None, "metal")):
        assert blas.set_threads(info, 2) is None and blas.get_threads(info) is None
        assert "threads" not in info.describe()


@pytest.mark.skipif(not mlx_spec.BLAS.settable, reason="no OpenBLAS thread setter on this machine")
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
