"""The chat UI with a thinking model (scripted, no MLX): reasoning streams apart from the answer,
dimmed and folded under its token count when the reply ends; F8 turns thinking off for the next
turn (the chat template's switch goes with the request)."""

from __future__ import annotations

from mlx_spec.thinking import ThinkFormat

from textual.widgets import Collapsible
from tui_helpers import reply, screen_text

from tui.app import SpecChatApp
from tui.backend import Settings, request_for
from tui.fake_backend import FakeBackend
from tui.widgets.message_view import MessageView

SIZE = (120, 40)
THOUGHT = "<think>The user wants a short answer, so keep it brief.</think>Blocks are drafted then verified."


async def test_reasoning_folds_under_its_token_count_and_f8_toggles(tmp_path):
    backend = FakeBackend(replies=[THOUGHT, "Plain answer."], think_format=ThinkFormat())
    app = SpecChatApp(backend, Settings(max_tokens=64), export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await reply(pilot, "how does it work?")
        view = app.screen.query(MessageView).last()
        assert view.text == "Blocks are drafted then verified."
        assert view.reasoning == "The user wants a short answer, so keep it brief."
        assert 5 <= view.reasoning_tokens <= 16  # the scripted backend's words up to </think> (and its boundary cycle)
        box = view.query_one(".reasoning-box", Collapsible)
        assert box.collapsed and box.title == f"reasoning ({view.reasoning_tokens} tok)"
        text = screen_text(app)
        assert f"reasoning ({view.reasoning_tokens} tok)" in text and "keep it brief" not in text  # folded
        assert "<think>" not in text and "Blocks are drafted" in text
        assert app.chat.history[-1] == {
            "role": "assistant",
            "content": "Blocks are drafted then verified.",
            "reasoning_content": "The user wants a short answer, so keep it brief.",
        }
        box.collapsed = False  # a click on the title opens it
        await pilot.pause(0.1)
        assert "keep it brief" in screen_text(app)
        # F8: thinking off for the next turn; the request carries the template's switch
        assert backend.requests[-1][1].think is None
        await pilot.press("f8")
        await pilot.pause()
        assert app.settings.think is False
        await reply(pilot, "again?")
        settings = backend.requests[-1][1]
        assert settings.think is False
        assert request_for([{"role": "user", "content": "x"}], settings).template_kwargs == {"enable_thinking": False}
        last = app.screen.query(MessageView).last()
        assert last.text == "Plain answer." and last.reasoning == ""
        assert not last.query_one(".reasoning-box", Collapsible).has_class("-shown")
        await pilot.press("f8")
        await pilot.pause()
        assert app.settings.think is True


async def test_f8_without_a_thinking_model_says_so(tmp_path):
    app = SpecChatApp(FakeBackend(replies=["Hi."]), Settings(max_tokens=64), export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await reply(pilot, "hello")
        await pilot.press("f8")
        await pilot.pause(0.1)
        assert app.settings.think is None
        assert any("writes no reasoning" in n.message for n in app._notifications)
