"""Known pairs by name: the catalog of target + DFlash drafter pairs (``catalog.json``, data shipped
in the package). ``--model NAME`` fills ``--target`` and ``--drafter`` from it.

An entry records what its authors published (repos, license) and what we know without reading the
checkpoints; fields we could not read from a checkpoint are listed in its ``approximate`` and shown
as such. The checkpoint's own config.json is what loads.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from importlib import resources

from .errors import BadRequest, CheckpointError, UnsupportedModel
from .target import SUPPORTED

FILE = "catalog.json"
FIELDS = ("target", "drafter", "architecture", "dflash", "block_size", "thinks", "think_switch", "license", "params_b")


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    target: str  # HF repo id (or the embedded default target's id)
    drafter: str  # HF repo id (or a bundled drafter under models/)
    architecture: str  # the target's model_type
    dflash: int  # 1 or 2
    block_size: int  # the drafter's trained block size (incl. the anchor)
    thinks: bool  # the model writes reasoning by default (as served: with the switch below)
    think_switch: str | None  # the chat template's variable that turns thinking on/off
    license: str  # the target's license
    params_b: float  # total parameters, billions
    active_params_b: float | None = None  # MoE: parameters active per token
    approximate: tuple[str, ...] = ()  # fields not read from the checkpoints
    bundled: bool = False  # ships with mlx_spec (no download)
    source: str = ""
    notes: str = ""

    @property
    def supported(self) -> bool:
        return self.architecture in SUPPORTED

    def weight_bytes(self, bits: int | None) -> int:
        """Approximate bytes of the target's weights at ``bits`` (None: 16-bit), with one scale and
        one bias per 64 weights when quantized. An estimate from ``params_b``, not a plan."""
        per_weight = 16 if not bits else bits + 0.5
        return int(self.params_b * 1e9 * per_weight / 8)


def load() -> dict[str, Entry]:
    """Every entry, by name. A malformed catalog is refused by name (it ships with the package)."""
    try:
        data = json.loads(resources.files("mlx_spec").joinpath(FILE).read_text())
        pairs = data["pairs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"mlx_spec/{FILE} is missing or malformed: {type(e).__name__}: {e}") from None
    out = {}
    for name, d in pairs.items():
        missing = [k for k in FIELDS if k not in d]
        if missing:
            raise CheckpointError(f"mlx_spec/{FILE}: entry '{name}' lacks {', '.join(missing)}")
        known = {k: d[k] for k in Entry.__dataclass_fields__ if k in d and k != "name"}
        known["approximate"] = tuple(d.get("approximate", ()))
        out[name] = Entry(name=name, **known)
    return out


def get(name: str, entries: dict | None = None) -> Entry:
    """The entry called ``name`` (case-insensitive); an unknown name is refused with the closest."""
    entries = load() if entries is None else entries
    by_lower = {k.lower(): e for k, e in entries.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    raise BadRequest(
        f"unknown model '{name}'{hint}. `mlx_spec models` lists the known pairs and chain drafters; or pass "
        "--target and --drafter"
    )


def find(name: str) -> Entry | ChainEntry:
    """The entry called ``name`` in either table (a DFlash pair or a chain drafter; case-insensitive);
    an unknown name is refused with the closest of both."""
    return get(name, {**load_chain(), **load()})


def check_supported(entry: Entry | ChainEntry) -> None:
    """Refuse an entry whose target architecture this build cannot run (before any download)."""
    if not entry.supported:
        raise UnsupportedModel(
            f"model '{entry.name}': target architecture '{entry.architecture}' "
            f"({entry.target}) is not supported for speculative decoding here "
            f"(supported: {', '.join(sorted(SUPPORTED))}); nothing was downloaded"
        )


CHAIN_FIELDS = ("kind", "target", "drafter", "architecture", "layout", "license", "params_b")
CHAIN_KINDS = ("mtp", "eagle")


@dataclass(frozen=True, slots=True)
class ChainEntry:
    """A chain drafter by name: an MTP head inside ``target``'s own checkpoint (``drafter`` None),
    or a published EAGLE-3 drafter repo for ``target``."""

    name: str
    kind: str  # "mtp" or "eagle"
    target: str  # HF repo id of the target (for MTP: the original repo, which keeps mtp.*)
    drafter: str | None  # the EAGLE-3 repo; None for MTP (the head is in the target)
    architecture: str  # the target's model_type
    layout: str  # "mtp", "eagle" (the EAGLE authors') or "speculators"
    license: str
    params_b: float  # the target's total parameters, billions
    active_params_b: float | None = None
    mtp_layers: int | None = None
    approximate: tuple[str, ...] = ()
    source: str = ""
    notes: str = ""

    @property
    def supported(self) -> bool:
        return self.architecture in SUPPORTED


def load_chain() -> dict[str, ChainEntry]:
    """The catalog's chain drafters, by name (``chain`` in catalog.json); refused by name when malformed."""
    try:
        data = json.loads(resources.files("mlx_spec").joinpath(FILE).read_text())
        chain = data.get("chain", {})
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"mlx_spec/{FILE} is missing or malformed: {type(e).__name__}: {e}") from None
    out = {}
    for name, d in chain.items():
        missing = [k for k in CHAIN_FIELDS if k not in d]
        if missing:
            raise CheckpointError(f"mlx_spec/{FILE}: chain entry '{name}' lacks {', '.join(missing)}")
        if d["kind"] not in CHAIN_KINDS:
            raise CheckpointError(
                f"mlx_spec/{FILE}: chain entry '{name}' has kind {d['kind']!r} "
                f"(expected one of {', '.join(CHAIN_KINDS)})"
            )
        known = {k: d[k] for k in ChainEntry.__dataclass_fields__ if k in d and k != "name"}
        known["approximate"] = tuple(d.get("approximate", ()))
        out[name] = ChainEntry(name=name, **known)
    return out


def check_chain(entry: ChainEntry) -> None:
    """Refuse, by name and before any download, a chain entry that lacks what the loader needs:
    a target architecture this build runs; for MTP, one MTP layer of a family whose head it
    loads, in the target's own checkpoint; for EAGLE-3, a drafter repo in a layout it reads."""
    from .mtp import DEEPSEEK_TYPES, MTP_TYPES  # (startup: models)

    check_supported(entry)
    where = f"model '{entry.name}'"
    if entry.kind == "mtp":
        if entry.architecture in DEEPSEEK_TYPES or entry.architecture not in MTP_TYPES:
            raise UnsupportedModel(
                f"{where}: the MTP loader reads the heads of {', '.join(sorted(MTP_TYPES))} targets, not "
                f"{entry.architecture}; nothing was downloaded"
            )
        if entry.layout != "mtp" or entry.drafter:
            raise CheckpointError(
                f"{where}: an MTP head is read from the target's own mtp.* tensors (layout 'mtp', no drafter "
                f"repo); the entry says layout {entry.layout!r}, drafter {entry.drafter!r}"
            )
        if entry.mtp_layers not in (None, 1):
            raise UnsupportedModel(
                f"{where}: {entry.mtp_layers} MTP layers; only one-layer MTP heads are supported; nothing was "
                "downloaded"
            )
    else:
        if not entry.drafter:
            raise CheckpointError(f"{where}: an EAGLE-3 entry needs the drafter's repo (its 'drafter' is empty)")
        if entry.layout not in EAGLE_LAYOUTS:
            raise UnsupportedModel(
                f"{where}: EAGLE-3 layout {entry.layout!r} is not one the loader reads "
                f"({', '.join(EAGLE_LAYOUTS)}); nothing was downloaded"
            )


EAGLE_LAYOUTS = ("eagle", "speculators")  # the EAGLE authors' / SpecForge, and speculators'
