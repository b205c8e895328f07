"""Hugging Face hub repos: metadata first, weights only when asked.

``fetch_meta`` reads what a memory plan needs without any weight byte: the repo's file list,
``config.json`` and the other small files (tokenizer, chat template, a draft vocabulary), and the
safetensors headers (huggingface-hub's ``get_safetensors_metadata``: a ranged read of each file's
first bytes). ``download`` then fetches the repo with huggingface-hub's own progress bars; an
interrupted download resumes where it stopped (huggingface-hub keeps ``.incomplete`` blobs and
links a file into the snapshot only once it is whole). ``local_snapshot`` finds a complete
download without the network, so a pair once downloaded loads offline; ``HF_HUB_OFFLINE=1`` is
honoured and a missing file is named.

Errors become ``HubError`` with the repo, the file and what the hub said.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub import errors as hf

from .errors import HubError
from .quantize import Tensor

log = logging.getLogger(__name__)

ALLOW = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")  # what a pair needs
INDEX = "model.safetensors.index.json"


def is_repo_id(ref: str) -> bool:
    """``owner/name`` that is not a local path."""
    return not ref.startswith((".", "/", "~")) and ref.count("/") == 1 and not Path(ref).expanduser().exists()


def offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


@dataclass(frozen=True)
class RepoMeta:
    """What the memory plan needs from a hub repo, read without its weights."""

    repo: str
    revision: str  # the commit the files come from
    path: Path  # the local snapshot folder that holds the small files fetched so far
    config: dict
    tensors: tuple[Tensor, ...]
    weight_files: tuple[str, ...]
    weight_bytes: int  # bytes the download will fetch for the weights (0 when the hub gives no sizes)


def _wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in ALLOW)


def _hub_error(repo: str, e: BaseException, what: str = "") -> HubError:
    """A huggingface-hub exception -> HubError naming the repo (and file) and what went wrong."""
    where = f"{repo}" + (f" ({what})" if what else "")
    if isinstance(e, hf.GatedRepoError):
        return HubError(f"{where}: gated repo; accept its license on the hub and log in (`hf auth login`)")
    if isinstance(e, hf.RepositoryNotFoundError):
        return HubError(f"{where}: no such repo on the hub (or it is private: log in with `hf auth login`)")
    if isinstance(e, hf.RevisionNotFoundError):
        return HubError(f"{where}: no such revision on the hub")
    if isinstance(e, hf.EntryNotFoundError):
        return HubError(f"{where}: the repo has no such file")
    if isinstance(e, (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled)):
        return HubError(
            f"{where}: not in the local cache and the hub cannot be asked "
            f"({'HF_HUB_OFFLINE=1' if offline() else 'no connection'}); download it once online"
        )
    if isinstance(e, hf.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return HubError(f"{where}: the hub answered HTTP {status}: {str(e).splitlines()[0]}")
    return HubError(f"{where}: {type(e).__name__}: {e}")


def fetch_meta(repo: str, revision: str | None = None) -> RepoMeta:
    """Config, small files and safetensors headers of ``repo``; no weight file is downloaded."""
    if offline():
        raise HubError(f"{repo}: not downloaded yet and HF_HUB_OFFLINE=1 forbids asking the hub")
    api = HfApi()
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:
        raise _hub_error(repo, e) from None
    sizes = {s.rfilename: (s.size or 0) for s in info.siblings or []}
    if "config.json" not in sizes:
        raise HubError(
            f"{repo}: the repo has no config.json, so it is not a model in Hugging Face layout "
            f"(files: {', '.join(sorted(sizes)[:8]) or 'none'})"
        )
    weights = tuple(sorted(n for n in sizes if n.endswith(".safetensors")))
    if not weights:
        raise HubError(f"{repo}: no *.safetensors weights in the repo (only safetensors checkpoints load)")
    path = None
    for name in sorted(n for n in sizes if _wanted(n) and not n.endswith(".safetensors")):
        try:
            local = hf_hub_download(repo, name, revision=info.sha)
        except Exception as e:
            raise _hub_error(repo, e, name) from None
        path = Path(local[: -len(name)])  # the snapshot folder (``name`` may hold a subfolder)
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise HubError(f"{repo}: config.json is not valid JSON: {e}") from None
    try:
        st = api.get_safetensors_metadata(repo, revision=info.sha)
    except Exception as e:
        raise _hub_error(repo, e, "safetensors headers") from None
    tensors = tuple(
        Tensor(name, tuple(t.shape), t.dtype) for f in st.files_metadata.values() for name, t in f.tensors.items()
    )
    return RepoMeta(repo, info.sha, path, config, tensors, weights, sum(sizes[n] for n in weights))


def local_snapshot(repo: str) -> Path | None:
    """The cached snapshot of ``repo`` if it holds a whole checkpoint (config and every weight
    file the index names); never touches the network."""
    try:
        path = Path(snapshot_download(repo, allow_patterns=list(ALLOW), local_files_only=True))
    except Exception:
        return None
    return path if complete(path) else None


def complete(path: Path) -> bool:
    """A model folder with its config and all its weight files."""
    if not (path / "config.json").is_file():
        return False
    index = path / INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return bool(shards) and all((path / s).is_file() for s in shards)
    return any(path.glob("*.safetensors"))


def clear_partials(repo: str) -> int:
    """Remove partial files a killed download left in the repo's blob folder. huggingface-hub
    writes each download to its own ``<etag>.<id>.incomplete`` file under the lock
    ``.locks/<repo>/<etag>.lock``; a partial whose lock nobody holds belongs to no live download.
    Returns how many were removed."""
    folder = f"models--{repo.replace('/', '--')}"
    blobs = Path(constants.HF_HUB_CACHE) / folder / "blobs"
    removed = 0
    for part in sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []:
        lock = FileLock(str(Path(constants.HF_HUB_CACHE) / ".locks" / folder / f"{part.name.split('.')[0]}.lock"))
        try:
            with lock.acquire(timeout=0):
                part.unlink(missing_ok=True)
                removed += 1
        except Timeout:  # another process is downloading this file now
            continue
    if removed:
        log.info("%s: removed %d partial file(s) of an interrupted download", repo, removed)
    return removed


def download(repo: str, revision: str | None = None) -> Path:
    """The repo's files (``ALLOW``) in the local cache, with huggingface-hub's progress bars;
    resumes an interrupted download; offline: the cached copy or a HubError naming the repo."""
    cached = local_snapshot(repo)
    if cached is not None and revision is None:
        return cached
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=list(ALLOW)))
    except Exception as e:
        raise _hub_error(repo, e, "download") from None
    finally:
        clear_partials(repo)
    if not complete(path):
        missing = "config.json" if not (path / "config.json").is_file() else "weight files"
        raise HubError(
            f"{repo}: the download is incomplete ({missing} missing in {path})"
            + ("; HF_HUB_OFFLINE=1 is set: download it once online" if offline() else "")
        )
    return path
