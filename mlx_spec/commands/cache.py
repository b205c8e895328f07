"""`mlx_spec cache list|clear`: the prefix cache's disk tier (prefix_store.py).

``list`` prints every stored prefix (model, tokens, size, last use) and any file that is not a
readable entry; ``clear`` deletes them all. A running server keeps working after a clear: an
entry it cannot find any more is a miss, and its prompt is prefilled.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..prefix_store import clear, default_root, list_entries


def add_arguments(p) -> None:
    p.add_argument("action", choices=("list", "clear"), help="list the stored prefixes, or delete them all")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="the store's folder (default: the prefix folder of mlx_spec's user cache)",
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def run(args) -> int:
    root = args.dir if args.dir is not None else default_root()
    if args.action == "clear":
        n, size = clear(root)
        print(f"deleted {n} file{'s' if n != 1 else ''} ({_size(size)}) from {root}")
        return 0
    good, bad = list_entries(root)
    if not good and not bad:
        print(f"no stored prefixes in {root}")
        return 0
    print(
        f"{len(good)} stored prefix{'es' if len(good) != 1 else ''} in {root} "
        f"({_size(sum(g.nbytes for g in good))}), most recently used first:"
    )
    for g in good:
        models = " + ".join(str(g.models[k]) for k in ("target", "drafter") if g.models.get(k)) or "?"
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(g.last_used))
        what = "target + drafter" if g.drafter else "target only"
        print(
            f"  {g.path.parent.name}/{g.path.name[:12]}  {len(g.tokens):>7} tokens  {_size(g.nbytes):>10}  "
            f"{used}  {models} ({what})"
        )
    for path, why in bad:
        print(
            f"  not an entry: {path} ({why}; a server deletes it when it meets it, `mlx_spec cache clear` "
            "deletes everything now)"
        )
    return 0
