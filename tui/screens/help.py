"""F1: what every number on the screen means, and the keys."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# mlx_spec chat

**Header**: the engine that really runs: method (`dflash2`, `dflash`, or `plain`), target,
drafter, and the block size with where it came from (`checkpoint` default, `flag` from
`--block-size`, or `tuned <date>`). `SPECULATION OFF` means you switched to plain decoding of
the same target for an A/B (F2); `PLAIN` means no drafter was loaded (`--no-draft`) or the
tuner found plain decoding faster on this machine (the source says so).

## Speculation panel (current reply)
- **τ** (mean acceptance length): tokens committed per draft-and-verify cycle, the target's
  bonus token included. Plain decoding is 1; the ceiling is the block size.
- **accept**: accepted draft tokens ÷ drafted tokens.
- **acceptance by position**: for draft position *k*, the share of cycles that drafted it in
  which it was accepted. It falls with *k*: a later token needs every earlier one right.
- **tok/s**: tokens committed per second of decoding for this reply (prefill excluded).
- **speedup**: tok/s ÷ plain-decoding tok/s of the same target on this machine, from the
  tuner's stored measurement (its end-to-end runs on built-in prompts), else from a plain
  A/B reply of at least 8 tokens in this session (F2), else `n/a`.
- **τ per cycle**: a sparkline of tokens committed by each cycle of this reply.

## Working set
Memory in use (MLX active + allocator cache) or the last reply's peak of live arrays,
whichever is larger, against the budget: Metal's recommended working set on Apple Silicon,
physical RAM elsewhere. Breakdown: target and drafter weights (the drafter shares the
target's embedding and head), the KV cache estimated for the last turn's length (prompt +
reply), and the rest (scratch, cached buffers). Red above 90 %. MLX numbers refresh between
replies (the engine thread is busy during one); RSS is the whole process.

## Losslessness check (F3)
Replays the conversation up to your last prompt greedily (first 64 tokens), once
speculatively at the block size in use and once plainly, and compares token ids and text
(`mlx_spec verify`). `identical` passes; `numeric` (a near tie that batched and single-token
arithmetic round differently) passes; `mismatch` is a bug.

## Keys
| key | action |
|---|---|
| Enter | send (Shift+Enter or Ctrl+J: newline) |
| Esc | cancel the reply in flight |
| F1 | this help |
| F2 | speculation on / off (A/B against plain decoding) |
| F3 | losslessness check on the last prompt |
| F4 | export the chat as markdown |
| F5 | re-tune the block size |
| F8 | thinking models: reasoning on/off from the next turn (the reasoning of a reply is folded under its token count; click it to open) |
| Ctrl+N | new conversation |
| Ctrl+P | command palette (all of the above) |
| Ctrl+Q | quit |
"""  # noqa: E501


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP)
