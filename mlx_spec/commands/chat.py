"""`mlx_spec chat`: the Textual chat UI (tui/) over the engine thread."""

from __future__ import annotations

import sys

from tui.app import SpecChatApp
from tui.backend import LocalBackend, Settings

from ..cli import add_model_args, add_prefix_cache_arg, add_sampling_args, load_config
from ..default_target import DEFAULT_TARGET_ID, ensure_default_target
from ..errors import BadRequest
from ..sampling import SamplingConfig
from ..session import check


def add_arguments(p) -> None:
    add_model_args(p)
    add_prefix_cache_arg(p)
    add_sampling_args(p, max_tokens=512, what="each reply")
    p.add_argument("--system", default=None, help="system prompt for the conversation")
    p.add_argument("--export-dir", default=".", help="where F4 writes the chat as markdown (default: .)")


def run(args) -> int:
    cfg = load_config(args)
    check(cfg)  # flags and names are checked before the UI starts or anything loads
    if args.max_tokens < 1:
        raise BadRequest(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    try:
        SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as e:
        raise BadRequest(str(e)) from None

    if cfg.target == DEFAULT_TARGET_ID:  # first launch: fetch + convert with progress bars, before the UI
        ensure_default_target()

    settings = Settings(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        think=args.think,
    )
    backend = LocalBackend.from_config(cfg)
    app = SpecChatApp(backend, settings, system=args.system, export_dir=args.export_dir)
    try:
        app.run()
    finally:
        backend.close()
    rc = app.return_code
    if rc is None:  # the app never started or crashed before exiting
        print("mlx_spec chat: error: the UI stopped unexpectedly", file=sys.stderr)
        return 1
    return rc
