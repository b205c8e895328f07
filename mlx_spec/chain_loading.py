"""Loading a chain drafter with the target view it needs: the one call the decode loop's
wiring makes for ``--draft mtp`` / ``--draft eagle``.

``load_chain("mtp", model, target_dir)`` reads the MTP head from the target's own checkpoint
folder and returns a ``Target`` that returns its final-normed hidden; ``load_chain("eagle",
model, drafter=path)`` loads an EAGLE-3 checkpoint and returns a ``Target`` tapping its three
layers. Both check the fit and bind the drafter to the target's embedding and head.
"""

from __future__ import annotations

from pathlib import Path

from .chain import ChainDrafter
from .eagle import load_eagle
from .errors import MlxSpecError
from .mtp import load_mtp
from .target import Target


def load_chain(
    kind: str,
    model,
    target_dir: str | Path | None = None,
    drafter: str | Path | None = None,
    *,
    hint: str | None = None,
    dtype=None,
) -> tuple[Target, ChainDrafter]:
    """(target view, chain drafter) for ``kind`` "mtp" (the head in ``target_dir``) or "eagle"
    (the checkpoint folder ``drafter``). ``hint``: where the original MTP checkpoint is, for
    the refusal of a conversion that stripped it."""
    if kind == "mtp":
        if target_dir is None:
            raise MlxSpecError("--draft mtp: the target's checkpoint folder is needed (the head is in it)")
        target = Target(model, (), final_hidden=True)
        return target, load_mtp(target_dir, target, dtype=dtype, hint=hint)
    if kind == "eagle":
        if drafter is None:
            raise MlxSpecError("--draft eagle needs an EAGLE-3 drafter (--drafter PATH or a catalog name)")
        d, _ = load_eagle(drafter, dtype=dtype)
        d.bind(Target(model, ()))
        return Target(model, d.taps), d
    raise MlxSpecError(f"chain drafter kind must be mtp or eagle, not {kind!r}")


__all__ = ["load_chain"]
