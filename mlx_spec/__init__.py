"""mlx_spec: lossless DFlash / DFlash 2 speculative decoding on MLX."""

__version__ = "0.1.0"
