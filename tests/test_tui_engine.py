"""The chat UI over the real engine thread, on a tiny pair built in-process."""

from __future__ import annotations

import time

from mlx_spec.generation import engine_info
from mlx_spec.loading import load_pair
from mlx_spec.session import Session

import pytest
from helpers import save_tiny_pair
from tui_helpers import reply, screen_text, wait_for

from tui.app import SpecChatApp
from tui.backend import LocalBackend, Settings
from tui.widgets.memory_panel import MemoryPanel
from tui.widgets.spec_panel import SpecPanel

SIZE = (120, 40)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tui-pair"))


def local_backend(paths, no_draft: bool = False) -> LocalBackend:
    target, drafter = paths

    def loader(progress):
        pair = load_pair(str(target), None if no_draft else str(drafter), no_draft=no_draft)
        return Session.of(pair, engine_info(pair, None if no_draft else 4, None if no_draft else "flag"))

    return LocalBackend(loader)


async def test_chat_on_a_real_engine(tiny_pair, tmp_path):
    backend = local_backend(tiny_pair)
    app = SpecChatApp(backend, Settings(max_tokens=24), export_dir=tmp_path)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await reply(pilot, "hello")
            chat = app.chat
            assert chat.history[0] == {"role": "user", "content": "hello"}
            assert chat.history[1]["role"] == "assistant"
            assert "dflash2" in chat.turns[-1].meta and "block 4" in chat.turns[-1].meta
            view = app.screen.query_one(SpecPanel).view
            assert view.mode == "spec" and view.block_size == 4 and view.block_source == "flag"
            assert view.taus and 1 <= view.tau <= 4 and len(view.by_position) == 3
            assert "dflash2 · target" in screen_text(app).splitlines()[0]
            await wait_for(pilot, lambda: app.screen.query_one(MemoryPanel).memory is not None)
            mem = app.screen.query_one(MemoryPanel).memory
            assert mem.target > 0 and mem.drafter > 0 and mem.budget > mem.used > 0
            assert mem.context_tokens > 24 and mem.kv > 0
            await reply(pilot, "again")  # second turn goes through the chat template with history
            assert [m["role"] for m in chat.history] == ["user", "assistant"] * 2
            await pilot.press("f3")  # losslessness check on the last prompt, on the engine
            await wait_for(pilot, lambda: chat.turns[-1].role == "note", timeout=30)
            assert "Losslessness check PASS (identical)" in chat.turns[-1].text
    finally:
        backend.close()


def test_local_backend_cancel_and_plain(tiny_pair):
    backend = local_backend(tiny_pair, no_draft=True)
    try:
        info = backend.start()
        assert info.mode == "plain" and backend.tuner_unavailable().startswith("no drafter")
        assert backend.check_unavailable().startswith("no drafter")
        events = []
        t = time.monotonic()
        for ev in backend.stream([{"role": "user", "content": "hi"}], Settings(max_tokens=200)):
            events.append(ev)
            if len(events) == 3:
                backend.cancel()
        assert events[-1].finish_reason == "cancelled" and events[-1].completion_tokens < 200
        assert time.monotonic() - t < 30
        mem = backend.memory()
        assert mem.drafter == 0 and mem.target > 0
    finally:
        backend.close()
