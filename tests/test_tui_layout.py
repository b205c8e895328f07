"""The chat UI's numbers stay true and its layout holds, at 120 and 160 columns (Pilot over the
scripted FakeBackend, no MLX): the header on one line, the panel agreeing with it, a reply's
figures fixed when it ends, notifications clear of the prompt box."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tui_helpers import reply, screen_text, wait_for

from tui.app import SpecChatApp
from tui.backend import Settings, TuneRow, TuneView
from tui.fake_backend import SPEC_INFO, FakeBackend, sample_tune
from tui.screens.tuner import TunerScreen
from tui.widgets.engine_header import fit
from tui.widgets.prompt_input import PromptInput
from tui.widgets.spec_panel import SpecPanel

WIDTHS = (120, 160)
# what a real session shows: a bundled drafter's full path, a tuned block, a reduced vocabulary
REAL = replace(
    SPEC_INFO,
    target="smollm2-135m-instruct",
    drafter="/home/me/mlx_spec/models/smollm2-135m-dflash2",
    block_size_source="tuned 2026-12-01",
    draft_vocab=8192,
)


def make_app(tmp_path, **kw) -> SpecChatApp:
    kw.setdefault("replies", ["A speculative reply of a few words, long enough to count."])
    return SpecChatApp(FakeBackend(**kw), Settings(max_tokens=64), export_dir=tmp_path)


def sidebar(app) -> str:
    """The sidebar's column of the screen (right of its border)."""
    return "\n".join(line.split("▏", 1)[1] if "▏" in line else "" for line in screen_text(app).splitlines())


def header_lines(app) -> list[str]:
    lines = screen_text(app).splitlines()
    assert lines[1].strip().startswith("▏"), lines[:2]  # line 2 is the body: the header did not wrap
    return lines[:1]


@pytest.mark.parametrize("width", WIDTHS)
async def test_header_is_one_whole_line(tmp_path, width):
    app = make_app(tmp_path, engine=REAL)
    async with app.run_test(size=(width, 40)) as pilot:
        await reply(pilot, "hi")
        (head,) = header_lines(app)
        assert len(head) <= width and "…" not in head
        for part in ("SPECULATION ON", "drafter smollm2-135m-dflash2", "block 8 (tuned 2026-12-01)", "vocab 8192"):
            assert part in head, (part, head)
        if width == 160:
            assert "mlx_spec chat" in head and "target smollm2-135m-instruct" in head and "draft vocab 8192" in head
        await pilot.press("f2")
        await pilot.pause()
        (head,) = header_lines(app)
        assert head.startswith(" SPECULATION OFF · plain A/B ") and "vocab 8192" in head and "…" not in head
        if width == 160:
            assert "target smollm2-135m-instruct" in head


def test_fit_keeps_the_block_and_vocab_longest():
    line = "dflash2 · target t · drafter d · block 6 (tuned 2026-12-01) · draft vocab 8192"
    assert fit(line, "SPECULATION ON", 200).plain == f" SPECULATION ON   mlx_spec chat  {line}"
    narrow = fit(line, "SPECULATION ON", 90).plain
    assert "mlx_spec chat" not in narrow and "block 6 (tuned 2026-12-01)" in narrow and "vocab 8192" in narrow
    assert fit(line, "SPECULATION ON", 30).cell_len == 30


@pytest.mark.parametrize("width", WIDTHS)
async def test_f2_does_not_show_the_speculative_reply_as_plain(tmp_path, width):
    app = make_app(tmp_path, stored=sample_tune(), tuner=sample_tune())
    async with app.run_test(size=(width, 40)) as pilot:
        await reply(pilot, "spec")
        assert "speedup    4.00×" in sidebar(app)
        await pilot.press("f2")
        await pilot.pause()
        side = sidebar(app)
        assert "SPECULATION OFF (A/B)" in side and "40.0" not in side and "plain side" not in side
        assert "tok/s      –" in side and "speedup    –" in side
        view = app.screen.query_one(SpecPanel).view
        assert view.mode == "ab-plain" and view.tokens == 0
        await reply(pilot, "plain")
        side = sidebar(app)
        assert "tok/s      40.0  this reply" in side and "speedup    1.00×  the plain side" in side


@pytest.mark.parametrize("width", WIDTHS)
async def test_retune_fixes_earlier_figures_and_panel_agrees_with_header(tmp_path, width):
    app = make_app(tmp_path, stored=sample_tune(), tuner=sample_tune())
    async with app.run_test(size=(width, 40)) as pilot:
        await reply(pilot, "first")
        first = app.chat.turns[-1].meta
        assert "40.0 tok/s (4.00×)" in first and "block 8" in first
        # a re-tune that moves the baseline (10 -> 20 tok/s) and the block (8 -> 6)
        rows = (TuneRow(1, 20.0, 1.0), TuneRow(6, 30.0, 1.5, 2.5))
        app.backend.tuner = TuneView(best=6, baseline_tps=20.0, rows=rows, date="2026-12-01", source="tuned 2026-12-01")
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, TunerScreen) and app.screen.result)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)
        await pilot.pause()
        (head,) = header_lines(app)
        assert "block 6 (tuned 2026-12-01)" in head
        side = sidebar(app)
        assert "block      6  tuned 2026-12-01" in side and "block      8" not in side
        assert "4.00×" not in side and "2.00×" not in side  # the old reply is not re-scored
        assert app.chat.turns[-1].meta == first  # its own line keeps its figures
        await reply(pilot, "second")
        assert "speedup    2.00×" in sidebar(app) and "(2.00×)" in app.chat.turns[-1].meta
        assert app.chat.turns[1].meta == first and "(4.00×)" in screen_text(app)


@pytest.mark.parametrize("width", WIDTHS)
async def test_memory_panel_rows_do_not_wrap(tmp_path, width):
    app = make_app(tmp_path)
    async with app.run_test(size=(width, 40)) as pilot:
        await reply(pilot, "hi")
        await pilot.pause(0.2)
        rows = sidebar(app).splitlines()
        i = next(k for k, r in enumerate(rows) if r.startswith(" prefix"))
        assert rows[i].rstrip().endswith("kept across turns") and rows[i + 1].startswith(" other"), rows[i : i + 2]


@pytest.mark.parametrize("width", WIDTHS)
async def test_notifications_leave_the_prompt_box_clear(tmp_path, width):
    from textual.widgets._toast import Toast

    app = make_app(tmp_path)
    async with app.run_test(size=(width, 40), notifications=True) as pilot:
        await reply(pilot, "hi")
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.chat.turns[-1].role == "note")
        await pilot.pause(0.2)
        prompt = app.screen.query_one(PromptInput).region
        toasts = [t.region for t in app.screen.walk_children() if isinstance(t, Toast)]
        assert toasts and all(not t.overlaps(prompt) for t in toasts), (toasts, prompt)


def test_spec_panel_shows_trimmed_drafter_blocks():
    from tui.widgets.spec_panel import SpecView, render_numbers

    v = SpecView(
        mode="spec",
        method="dflash2",
        block_size=4,
        tokens=10,
        drafted_cycles=2,
        plain_cycles=5,
        sources=(("dflash", 2, 6, 3),),
        trimmed=3,
    )
    text = render_numbers(v).plain
    assert "5 plain steps" in text and "trimmed" in text and "3×" in text
    assert "trimmed" not in render_numbers(SpecView(mode="spec", method="dflash2", tokens=10)).plain


def test_spec_panel_names_each_cycles_source():
    """Chain drafters in the panel: their share per source, and the last cycles by source."""
    from tui.widgets.spec_panel import SpecView, render_numbers

    v = SpecView(
        mode="spec",
        method="dflash2",
        block_size=4,
        tokens=12,
        drafted_cycles=4,
        plain_cycles=1,
        sources=(("dflash", 1, 2, 1), ("mtp", 1, 2, 2), ("eagle", 1, 3, 3), ("lookup", 1, 7, 7)),
        trace="p d3:1 m3:2 e4:3 l8:7",
    )
    text = render_numbers(v).plain
    assert " mtp" in text and " eagle" in text and "3/3 accepted" in text
    assert "last" in text and "p d3:1 m3:2 e4:3 l8:7" in text
    assert "last" not in render_numbers(SpecView(mode="spec", method="dflash2", tokens=10)).plain
