"""A scripted backend for the UI tests and demos: no MLX, no models, deterministic events."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from mlx_spec.engine import Delta, Done, Started
from mlx_spec.errors import MlxSpecError
from mlx_spec.generation import PLAIN, SPECULATIVE, TUNED_OFF, EngineInfo
from mlx_spec.stats import StatsSnapshot
from mlx_spec.tuning import TuneSkipped

from .backend import CheckResult, Event, Memory, Progress, Settings, TuneRow, TuneView

GiB = 1 << 30

SPEC_INFO = EngineInfo("dflash2", "fake-target", "fake-drafter", 8, "checkpoint")


def _stats(accepts: list[int], tokens: int, block: int, elapsed_s: float, cached: int = 0) -> StatsSnapshot:
    """Running stats for scripted cycles (the real ones come from mlx_spec.stats)."""
    cycles = len(accepts)
    drafted = cycles * (block - 1)
    reached = [cycles] * (block - 1)
    hits = [sum(1 for a in accepts if a > k) for k in range(block - 1)]
    tps = (tokens - 1) / elapsed_s if elapsed_s > 0 and tokens > 1 else 0.0
    return StatsSnapshot(
        cycles=cycles,
        drafted=drafted,
        accepted=sum(accepts),
        mean_acceptance_length=round((sum(accepts) + cycles) / cycles, 4) if cycles else 0.0,
        acceptance_rate=round(sum(accepts) / drafted, 4) if drafted else 0.0,
        acceptance_by_position=tuple(round(h / r, 4) for h, r in zip(hits, reached)) if cycles else (),
        decode_tps=round(tps, 2),
        end_to_end_tps=round(tps, 2),
        cached_tokens=cached,
    )


@dataclass
class FakeBackend:
    """Plays ``replies`` in turn (the last one repeats). Each reply is split into words; a cycle
    commits ``pattern[i] + 1`` words with ``pattern[i]`` drafts accepted.

    ``hold_after``: block the stream after that many steps until ``cancel()`` or ``release()``,
    so a test can act while a reply is in flight.
    """

    replies: list[str] = field(default_factory=lambda: ["Hello **there**, how can I help?"])
    pattern: tuple[int, ...] = (3, 1, 5, 2)
    engine: EngineInfo = SPEC_INFO
    step_delay: float = 0.0
    tps: float = 40.0  # reported decode tok/s (scripted, independent of the delay)
    hold_after: int | None = None
    load_error: str | None = None
    tuner: TuneView | None = None  # None: this scripted backend has no tuner
    stored: TuneView | None = None
    tune_on_start: bool = False  # first launch: report tuning progress while "loading"
    memory_fraction: float = 0.25
    requests: list = field(default_factory=list)
    think_format: object = None  # thinking.ThinkFormat: the scripted model writes reasoning

    def __post_init__(self):
        self._cancel = threading.Event()
        self._release = threading.Event()
        self._ready = False
        self._turn = 0

    def start(self, progress: Progress | None = None) -> EngineInfo:
        if self.load_error:
            raise MlxSpecError(self.load_error)
        if self.tune_on_start and self.tuner:
            try:
                self.retune(progress or (lambda f, m: None))
            except TuneSkipped:  # as the real loader: the checkpoint's block, nothing stored
                pass
        self._ready = True
        return self.info

    @property
    def info(self) -> EngineInfo | None:
        return self.engine if self._ready else None

    def stream(self, messages: list[dict], settings: Settings) -> Iterator[Event]:
        self.requests.append(([dict(m) for m in messages], settings))
        self._cancel.clear()
        self._release.clear()
        text = self.replies[min(self._turn, len(self.replies) - 1)]
        self._turn += 1
        spec = settings.speculate and self.engine.speculative
        info = (
            self.engine
            if spec or not self.engine.speculative
            else replace(
                self.engine,
                method="plain",
                drafter=None,
                block_size=1,
                block_size_source="plain (--no-draft)",
                mode=PLAIN,
            )
        )  # an A/B request, as generation.for_request makes it
        block = info.block_size
        rid = f"fake-{self._turn}"
        yield Started(rid, sum(len(m["content"].split()) for m in messages), info)
        words = [w + " " for w in text.split(" ")]
        words[-1] = words[-1].rstrip(" ")
        out, accepts, n, i, step = "", [], 0, 0, 0
        # like the prefix cache: a later turn reuses the words of every earlier message
        cached = sum(len(m["content"].split()) for m in messages[:-1])
        finish = "stop"
        while i < len(words):
            if self._cancel.is_set():
                finish = "cancelled"
                break
            if step == 0 or not spec:
                k, acc, drafted = 1, 0, 0
            else:
                acc = min(self.pattern[(step - 1) % len(self.pattern)], block - 1)
                k, drafted = acc + 1, block - 1
                accepts.append(acc)
            part = words[i : i + k]
            i, n, step = i + len(part), n + len(part), step + 1
            out += "".join(part)
            stats = _stats(accepts, n, block, (n - 1) / self.tps if n > 1 else 0.0, cached)
            source = "" if step == 1 else "dflash" if drafted else "plain"
            yield Delta(rid, "".join(part), tuple(range(len(part))), drafted, acc, stats, source)
            if self.step_delay:
                time.sleep(self.step_delay)
            if self.hold_after is not None and step == self.hold_after:
                self._release.wait(10)
        stats = _stats(accepts, n, block, (n - 1) / self.tps if n > 1 else 0.0, cached)
        yield Done(rid, out, finish, len(messages), n, info, stats, {})

    def release(self) -> None:
        self._release.set()

    def cancel(self) -> None:
        self._cancel.set()
        self._release.set()

    def memory(self) -> Memory | None:
        budget = 16 * GiB
        used = int(self.memory_fraction * budget)
        return Memory(
            used=used,
            peak=used,
            budget=budget,
            budget_source="fake",
            target=used // 2,
            drafter=used // 8,
            kv=used // 8,
            context_tokens=100,
            prefix=used // 16,
            swap_used=0,
            swap_total=2 * GiB,
            rss=used,
        )

    def tuner_unavailable(self) -> str | None:
        if not self.engine.drafter:
            return "no drafter loaded (--no-draft): there is no block size to tune"
        return None if self.tuner else "this scripted backend has no tuner"

    def stored_tune(self) -> TuneView | None:
        return self.stored

    def retune(self, progress: Progress) -> TuneView:
        if not self.tuner:
            raise MlxSpecError(self.tuner_unavailable())
        rows = self.tuner.rows
        for j, row in enumerate(rows):
            progress(j / len(rows), f"block size {row.block_size}")
            time.sleep(self.step_delay)
        progress(1.0, "done")
        self.stored = self.tuner
        if self.tuner.best > 1:
            self.engine = replace(
                self.engine,
                method="dflash2",
                block_size=self.tuner.best,
                block_size_source=self.tuner.source,
                mode=SPECULATIVE,
            )
        else:
            self.engine = replace(
                self.engine, method="plain", block_size=1, block_size_source=self.tuner.source, mode=TUNED_OFF
            )
        return self.tuner

    def check_unavailable(self) -> str | None:
        return None if self.engine.drafter else "no drafter loaded (--no-draft)"

    def check(self, messages: list[dict], settings: Settings) -> CheckResult:
        self.requests.append(([dict(m) for m in messages], settings))
        return CheckResult(True, "identical", 12, "12 tokens at block size 8, same token ids and text")

    def close(self) -> None:
        self.cancel()


def sample_tune(best: int = 8) -> TuneView:
    rows = (
        TuneRow(1, 10.0, 1.0),
        TuneRow(4, 16.0, 1.6, 2.8),
        TuneRow(8, 19.5, 1.95, 3.9),
        TuneRow(16, None, 1.4, 4.2, "not raced; model"),
    )
    source = "tuned 2026-01-01" if best > 1 else "tuned 2026-01-01: off — plain decoding faster on this machine"
    return TuneView(best=best, baseline_tps=10.0, rows=rows, date="2026-01-01", source=source)
