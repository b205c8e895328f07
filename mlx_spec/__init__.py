"""mlx_spec: lossless DFlash / DFlash 2 speculative decoding on MLX."""

from .blas import load_blas

# Must happen before the first `import mlx` anywhere in the process (see blas.py).
BLAS = load_blas()

__version__ = "0.1.0"
