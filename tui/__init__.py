"""`mlx_spec chat`: a Textual chat UI with live speculation and memory stats.

App (tui/app.py) → Screens (tui/screens/) → one widget per file (tui/widgets/), all styles in
tui/app.tcss. The UI never touches MLX: it talks to a ``Backend`` (tui/backend.py).
"""
