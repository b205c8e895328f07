"""Messages that worker threads post to the UI (``post_message`` is thread-safe)."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_spec.generation import EngineInfo

from textual.message import Message

from .backend import CheckResult, Event, Memory, TuneView


@dataclass
class EngineReady(Message):
    info: EngineInfo
    stored_tune: TuneView | None


@dataclass
class EngineFailed(Message):
    error: str


@dataclass
class ReplyEvent(Message):
    """One engine event (Started / Delta / Done / Failed) of the reply in flight."""

    event: Event


@dataclass
class ReplyCrashed(Message):
    """The backend raised instead of sending a Failed event."""

    error: str


@dataclass
class MemoryRead(Message):
    memory: Memory | None


@dataclass
class TuneProgress(Message):
    fraction: float
    text: str


@dataclass
class TuneFinished(Message):
    view: TuneView | None
    error: str | None = None


@dataclass
class CheckFinished(Message):
    result: CheckResult | None
    error: str | None = None
