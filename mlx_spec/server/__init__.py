"""`mlx_spec serve`: OpenAI-compatible HTTP over the engine thread (see docs/server.md).

Submodules: ``app`` (routes), ``schemas`` (request/response shapes), ``errors`` (one error
table), ``process`` (detached servers). Import them directly; this package imports nothing so
``mlx_spec status`` / ``stop`` stay light.
"""
