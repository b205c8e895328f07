"""The chat UI, driven by Pilot over a scripted FakeBackend (no MLX)."""

from __future__ import annotations

import asyncio

from mlx_spec.engine import Failed, Started

from tui_helpers import palette, reply, screen_text, send, wait_for

from tui.app import SpecChatApp
from tui.backend import LocalBackend, Settings
from tui.fake_backend import FakeBackend, sample_tune
from tui.screens.help import HelpScreen
from tui.screens.tuner import TunerScreen
from tui.widgets.memory_panel import MemoryPanel
from tui.widgets.message_view import MessageView
from tui.widgets.prompt_input import PromptInput
from tui.widgets.spec_panel import SpecPanel

SIZE = (120, 40)
REPLY = "Speculative decoding drafts a block of tokens and the target verifies them in one pass."


def make_app(tmp_path, **backend_kw) -> SpecChatApp:
    backend_kw.setdefault("replies", [REPLY])
    return SpecChatApp(FakeBackend(**backend_kw), Settings(max_tokens=64), export_dir=tmp_path)


async def test_streamed_reply_multi_turn_and_stats(tmp_path):
    app = make_app(tmp_path, replies=[REPLY, "Second **answer**."])
    async with app.run_test(size=SIZE) as pilot:
        await reply(pilot, "what is speculative decoding?")
        chat = app.chat
        assert [m["role"] for m in chat.history] == ["user", "assistant"]
        assert chat.history[1]["content"] == REPLY
        views = app.screen.query(MessageView)
        assert [v.role for v in views] == ["user", "assistant"] and views.last().text == REPLY
        view = app.screen.query_one(SpecPanel).view
        assert view.mode == "spec" and view.tau > 1 and 0 < view.acceptance < 1
        assert len(view.by_position) == 7 and view.taus and view.tps == 40.0
        assert view.trace and set(view.trace.split()) <= {"p"} | {x for x in view.trace.split() if x[0] == "d"}
        assert len(view.trace.split()) <= 8 and "d8:" in view.trace  # the last cycles, by source
        assert view.baseline_tps is None  # no tuner result, no A/B yet: speedup n/a
        text = screen_text(app)
        assert "SPECULATION ON" in text and "speedup    n/a" in text
        assert "acceptance by position" in text and "τ per cycle" in text
        await reply(pilot, "and then?")
        sent, settings = app.backend.requests[-1]
        assert [m["role"] for m in sent] == ["user", "assistant", "user"]
        assert sent[2]["content"] == "and then?" and settings.speculate and settings.max_tokens == 64
        assert app.screen.query(MessageView).last().text == "Second **answer**."
        # the second turn reused the first from the prefix cache, and says so
        assert app.screen.query_one(SpecPanel).view.cached_tokens > 0
        assert "reused" in screen_text(app) and "prompt tok cached" in app.chat.turns[-1].meta


async def test_main_screen_snapshot(tmp_path):
    app = make_app(tmp_path, stored=sample_tune(), tuner=sample_tune())
    async with app.run_test(size=SIZE) as pilot:
        await reply(pilot, "hi")
        lines = screen_text(app).splitlines()
    assert len(lines) == SIZE[1]
    assert lines[0].startswith(
        " SPECULATION ON   mlx_spec chat  dflash2 · target fake-target · drafter fake-drafter · block 8 (checkpoint)"
    )
    text = "\n".join(lines)
    for expected in (
        "▏ Speculation",
        "▏ τ          3.75  tokens/cycle",
        "▏ accept     39.3%  of drafts",
        "▏ tok/s      40.0  this reply",
        "▏ speedup    4.00×",
        "vs plain 10.0 tok/s",
        "(tuner 2026-01-01)",
        "▏  1 ████████████ 100%",
        "▏ Working set",
        "4.00 / 16.0 GiB 25%",
        " you",
        " hi",
        " assistant",
        "dflash2 · 15 tok · 40.0 tok/s (4.00×) · τ 3.75 · accept 39% · block 8 · stop",
        "f2 Spec on/off",
        "f3 Lossless check",
        "f4 Export",
        "f5 Re-tune",
    ):
        assert expected in text, expected


async def test_escape_cancels_and_keeps_partial_reply(tmp_path):
    app = make_app(tmp_path, hold_after=2)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "long one")
        await wait_for(pilot, lambda: app.chat._text)
        assert app.chat.generating
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.chat.turns[-1].meta.endswith("cancelled")
        partial = app.chat.history[-1]["content"]
        assert app.chat.history[-1]["role"] == "assistant" and 0 < len(partial) < len(REPLY)
        app.backend.hold_after = None
        await reply(pilot, "next")  # the UI is usable again
        assert app.chat.history[-1]["content"] == REPLY


class FailingBackend(FakeBackend):
    def stream(self, messages, settings):
        yield Started("r", 3, self.engine)
        yield Failed("r", "prompt (9000 tokens) exceeds the context length 8192", "ContextTooLong")


async def test_failure_restores_prompt(tmp_path):
    app = SpecChatApp(FailingBackend(), export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "too long")
        prompt = app.screen.query_one(PromptInput)
        await wait_for(pilot, lambda: not app.chat.generating and prompt.text == "too long")
        assert app.chat.history == [] and not app.screen.query(MessageView)
        assert app.screen.query_one(PromptInput).text == "too long"
        assert any("ContextTooLong" in n.message for n in app._notifications)


async def test_toggle_speculation_ab_gives_session_baseline(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.chat.ready)
        await pilot.press("f2")
        await pilot.pause()
        assert not app.settings.speculate
        assert "SPECULATION OFF · plain A/B" in screen_text(app).splitlines()[0]
        await reply(pilot, "plain please")
        assert app.backend.requests[-1][1].speculate is False
        assert app.screen.query_one(SpecPanel).view.mode == "ab-plain"
        assert app.chat.session_plain_tps == 40.0
        await pilot.press("f2")
        await reply(pilot, "spec please")
        view = app.screen.query_one(SpecPanel).view
        assert view.mode == "spec" and view.baseline_source == "A/B this session"
        assert "(A/B this session)" in screen_text(app)


async def test_export_and_palette(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await reply(pilot, "export me")
        await pilot.press("f4")
        await pilot.pause()
        files = list(tmp_path.glob("mlx_spec-chat-*.md"))
        assert len(files) == 1
        md = files[0].read_text()
        assert "## You\n\nexport me" in md and REPLY in md and "- drafter: fake-drafter" in md
        assert "τ 3.75" in md
        files[0].unlink()
        # the same through the command palette, and the losslessness check
        for command in ("Export chat as markdown", "Losslessness check"):
            await palette(pilot, command)
        await wait_for(pilot, lambda: app.chat.turns[-1].role == "note")
        assert len(list(tmp_path.glob("mlx_spec-chat-*.md"))) == 1
        assert "Losslessness check PASS (identical)" in app.chat.turns[-1].text
        messages, settings = app.backend.requests[-1]
        assert messages[-1] == {"role": "user", "content": "export me"}


async def test_first_launch_tuning_can_be_skipped_with_a_key(tmp_path):
    app = make_app(tmp_path, tuner=sample_tune(), tune_on_start=True, step_delay=2.0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, TunerScreen))
        assert "s: skip" in screen_text(app)
        await pilot.press("s")
        await wait_for(pilot, lambda: app.chat.ready)
        assert app.screen is app.chat and app.skip_tuning.is_set()
        assert app.backend.stored is None  # nothing stored: tuned at the next launch


async def test_first_launch_tuning_retune_and_unavailable_state(tmp_path):
    app = make_app(tmp_path, tuner=sample_tune(), tune_on_start=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, TunerScreen) and app.screen.result)
        await pilot.pause()
        text = screen_text(app)
        assert "Chosen: block size 8 (tuned 2026-01-01); plain decoding 10.0 tok/s" in text
        assert "◀ chosen" in text and "1.95×" in text and "not raced; model" in text
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert "block 8 (tuned 2026-01-01)" in screen_text(app).splitlines()[0]
        assert app.chat.baseline() == (10.0, "tuner 2026-01-01")
        app.backend.tuner = sample_tune(best=1)  # a re-tune that finds plain decoding faster
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, TunerScreen) and app.screen.result)
        assert "Chosen: off: plain decoding is faster here" in screen_text(app)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)
        header = screen_text(app).splitlines()[0]
        assert header.startswith(" PLAIN ") and "drafter fake-drafter unused: tuned 2026-01-01: off" in header
        await reply(pilot, "plain now")
        assert app.screen.query_one(SpecPanel).view.mode == "tuned-off"
    app = make_app(tmp_path)  # a backend without a tuner
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.chat.ready)
        assert app.screen is app.chat  # nothing to run on launch
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, TunerScreen))
        await pilot.pause()
        assert "Tuner not available: this scripted backend has no tuner" in screen_text(app).replace("\n", " ")


async def test_help_memory_warning_and_growing_prompt(tmp_path):
    app = make_app(tmp_path, memory_fraction=0.95)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.chat.ready)
        await wait_for(pilot, lambda: app.screen.query_one(MemoryPanel).memory is not None)
        await pilot.pause()
        assert app.screen.query_one(MemoryPanel).has_class("-warn")
        assert "above 90 % of the budget" in screen_text(app)
        prompt = app.screen.query_one(PromptInput)
        h = prompt.outer_size.height
        await pilot.press("a", "ctrl+j", "b", "ctrl+j", "c")
        await pilot.pause()
        assert prompt.text == "a\nb\nc" and prompt.outer_size.height == h + 2
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "mean acceptance length" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.chat


async def test_load_failure_exits_non_zero(tmp_path):
    app = make_app(tmp_path, load_error="drafter does not fit the target: vocab 128 != 256")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
    assert app.return_code == 1 and "vocab 128 != 256" in app.error

    def broken_loader(progress):
        raise FileNotFoundError("no such model: /nowhere")

    backend = LocalBackend(broken_loader)  # the real engine path
    app = SpecChatApp(backend, export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(100):
            if app.return_code is not None:
                break
            await asyncio.sleep(0.05)
    backend.close()
    assert app.return_code == 1 and "FileNotFoundError: no such model: /nowhere" in app.error


def test_engine_line_names_a_reduced_draft_vocabulary():
    from dataclasses import replace

    from mlx_spec.generation import EngineInfo

    from tui.widgets.engine_header import describe

    info = EngineInfo("dflash2", "t", "d", 4, "flag", draft_vocab=8192)
    assert describe(info, True)[0].endswith("block 4 (flag) · draft vocab 8192")
    assert "draft vocab" not in describe(replace(info, draft_vocab=0), True)[0]
