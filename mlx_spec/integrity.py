"""Cheap checks of model files before they are loaded: a damaged file is named, with how to get
it again, instead of surfacing as a traceback from deep inside a loader.

A safetensors file is an 8-byte header length, a JSON header giving each tensor's dtype, shape
and byte range, then the data. Its size must be exactly header + the end of the last range, and
each range must hold its tensor's bytes. Checking that reads a few kilobytes, never the data, so
it runs before every load. No MLX here: the default-target cache check runs before MLX loads.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from .errors import CheckpointError
from .modelfiles import SAFETENSORS_DTYPES, SAFETENSORS_MAX_HEADER

MAX_HEADER_BYTES = SAFETENSORS_MAX_HEADER  # the safetensors format's own limit
MODEL_JSON = ("config.json", "tokenizer.json", "tokenizer_config.json")
ITEM_BYTES = SAFETENSORS_DTYPES  # bytes per element by safetensors dtype


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file at ``path`` (a short phrase), or None if its size
    and header agree."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"only {size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return f"cut short or not a safetensors file: the header claims {n} bytes, the file has {size}"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not valid JSON (not a safetensors file, or overwritten)"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in t["data_offsets"])
            want = math.prod(int(d) for d in t["shape"]) * ITEM_BYTES.get(t["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            return f"tensor '{name}' has a malformed header entry"
        if not 0 <= begin <= stop or (want and stop - begin != want):
            return f"tensor '{name}' has inconsistent byte offsets {begin}..{stop}"
        end = max(end, stop)
    expected = 8 + n + end
    if size < expected:
        return f"cut short: {size} of {expected} bytes ({expected - size} missing)"
    if size > expected:
        return f"{size - expected} bytes longer than its header describes"
    return None


def model_dir_problem(path: Path) -> tuple[Path, str] | None:
    """The first damaged file of an mlx-lm / DFlash model folder (config and tokenizer JSON,
    every *.safetensors), with what is wrong; None if all look whole. Other files (a draft
    vocabulary, ...) are checked by their own readers, which say more."""
    for f in (path / name for name in MODEL_JSON):
        if not f.is_file():
            continue
        try:
            json.loads(f.read_bytes())
        except (OSError, ValueError) as e:
            return f, f"not valid JSON ({e})"
    for f in sorted(path.glob("*.safetensors")):
        if problem := safetensors_problem(f):
            return f, problem
    return None


def refetch_hint(path: Path, name: str) -> str:
    """How to get a model folder again: the Hugging Face cache re-downloads, a local folder is
    copied or converted again."""
    parts = Path(path).resolve().parts
    if "snapshots" in parts and any(p.startswith("models--") for p in parts):
        repo = next(p for p in parts if p.startswith("models--"))[len("models--") :].replace("--", "/")
        return (
            f"fetch it again: `huggingface-cli download {repo} --force-download` (or delete "
            f"{Path(*parts[: parts.index('snapshots')])} and run again)"
        )
    return f"copy or convert {name} again from its source"


def check_model_dir(path: Path, what: str, name: str | None = None) -> None:
    """Raise ``CheckpointError`` naming the damaged file of a model folder and how to fetch it
    again; nothing if it looks whole."""
    found = model_dir_problem(Path(path))
    if found is not None:
        f, problem = found
        raise CheckpointError(f"{what} file {f} is damaged: {problem}; {refetch_hint(Path(path), name or str(path))}")
