"""One error hierarchy. Every message names the culprit and, where there is one, the fix."""

from __future__ import annotations


class MlxSpecError(Exception):
    """Base class for every error mlx_spec raises on purpose."""


class CheckpointError(MlxSpecError):
    """A checkpoint file is malformed: extra, missing or mis-shaped tensors, bad config."""


class IncompatiblePair(MlxSpecError):
    """The drafter does not fit the target (hidden size, vocab, tap layers)."""


class UnsupportedModel(MlxSpecError):
    """An architecture, quantization or cache type we cannot run exactly."""


class PlanError(MlxSpecError):
    """The memory plan does not fit the budget."""


class ContextTooLong(MlxSpecError):
    """A prompt (plus max tokens) exceeds the usable context."""


class BadRequest(MlxSpecError):
    """Invalid user input (CLI flag, request field)."""


class InvalidPrompt(BadRequest):
    """The prompt itself is invalid: token ids outside the vocabulary, nothing to encode."""

    param = "prompt"


class Cancelled(MlxSpecError):
    """A generation was cancelled by its client."""


class PrefillTimeout(MlxSpecError):
    """A request's prefill ran past its time budget (``--prefill-timeout``); the request failed
    and its caches were dropped. Checked between prefill chunks, so a long prompt is cut off at
    the first chunk boundary past the budget."""


class HubError(MlxSpecError):
    """A model hub could not give a repo's files: missing repo or file, server error, offline."""


class BadModelFile(CheckpointError):
    """A model file (GGUF, safetensors, JSON config) is truncated, corrupt or crafted: counts,
    lengths or offsets that do not fit the file. Names the file, and the field and byte offset
    where known."""

    def __init__(self, path, problem: str, field: str | None = None, offset: int | None = None):
        self.path, self.problem, self.field, self.offset = str(path), problem, field, offset
        where = ", ".join(
            x for x in (f"field {field}" if field else "", f"byte offset {offset}" if offset is not None else "") if x
        )
        super().__init__(
            f"{path}: {problem}"
            + (f" ({where})" if where else "")
            + "; the file is damaged or not what it claims to be: download or copy it again"
        )
