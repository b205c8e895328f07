import sys
from pathlib import Path

# Import mlx_spec before anything imports mlx, so the process gets the same BLAS the CLI gets
# (mlx_spec/blas.py must run before the first `import mlx`).
import mlx_spec  # noqa: F401

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _isolated_user_dirs(request, tmp_path_factory, monkeypatch):
    """Fast tests never read or write the user's cache (tuner results, converted models) or
    state (detached servers). Slow tests use the real ones: they need the converted target."""
    if request.node.get_closest_marker("slow"):
        return
    root = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(root / "user-cache"))
    monkeypatch.setenv("MLX_SPEC_STATE_DIR", str(root / "user-state"))
