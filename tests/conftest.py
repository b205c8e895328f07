import sys
from pathlib import Path

# Import mlx_spec before anything imports mlx, so the process gets the same BLAS the CLI gets
# (mlx_spec/blas.py must run before the first `import mlx`).
import mlx_spec  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent))
