"""`bench --context`: prompts padded to a context length from the package's own text, the same
every time and never past the length asked; one measured row on the tiny pair (its decode rows
agree token for token, its restart row really loads from disk)."""

from mlx_spec import contextbench
from mlx_spec.errors import BadRequest
from mlx_spec.loading import load_pair
from mlx_spec.policy import PolicyFactory
from mlx_spec.prompts import builtin_prompts
from mlx_spec.target import KVQuant

import pytest
from helpers import save_tiny_pair, tiny_engine_loader
from mlx_lm.models.cache import QuantizedKVCache


def test_context_sizes_parse_and_bad_ones_are_named():
    assert contextbench.parse_contexts("8k, 1k,4k,1k") == [1024, 4096, 8192]
    assert contextbench.parse_contexts("5000") == [5000]
    for bad in ("", "1m", "0", "4k,x"):
        with pytest.raises(BadRequest, match="--context"):
            contextbench.parse_contexts(bad)


def count(messages):  # a stand-in tokenizer: one token per word
    return sum(len(m["content"].split()) + 4 for m in messages)


@pytest.mark.parametrize("kind", ["agent", "prose"])
def test_padding_is_deterministic_realistic_and_within_the_length(kind):
    (prompt,) = builtin_prompts((kind,), 1)
    msgs, n = contextbench.padded(prompt, 3000, count)
    assert (msgs, n) == contextbench.padded(prompt, 3000, count)
    assert 2500 < n <= 3000 and count(msgs) == n
    own = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
    assert msgs[-len(own) :] == own  # the prompt itself comes last, untouched
    pad = msgs[: -len(own)]
    if kind == "agent":  # a long file handed over first
        assert len(pad) == 2 and "mlx_spec/" in pad[0]["content"] and "def " in pad[0]["content"]
    else:  # a long earlier conversation
        assert len(pad) >= 4 and [m["role"] for m in pad[:2]] == ["user", "assistant"]
    assert contextbench.padded(prompt, 3, count)[0] == own  # shorter than the prompt: no padding


def test_one_row_on_the_tiny_pair(tmp_path):
    pair = tiny_engine_loader(tmp_path / "pair")().pair
    (prompt,) = builtin_prompts(("agent",), 1)
    (row,) = contextbench.run(pair, [prompt], [1200], max_tokens=6, repeats=1, policies=PolicyFactory(pair))
    assert 1000 < row.prompt_tokens <= 1200
    assert row.identical and set(row.decode_tps) == {"mlx-lm plain", "plain (ours)", "default engine"}
    assert row.disk_bytes > 0 and row.disk_load_ms > 0 and row.ttft_cold_ms > 0
    assert "restart_margin" in contextbench.as_dicts([row])[0]
    assert "default engine tok/s" in contextbench.table([row])


def test_one_row_with_quantized_kv_and_a_drafting_window(tmp_path):
    """``bench --context --kv-bits 4 --draft-window 64``: every method runs on the quantized cache
    (mlx-lm's plain decoding too, from the same prefix), their tokens agree, and the drafter's
    context rows stay within the window."""
    t, d = save_tiny_pair(tmp_path / "pair", target_over={"head_dim": 32})
    pair = load_pair(str(t), str(d), kv=KVQuant(4, 32), draft_window=64)
    (prompt,) = builtin_prompts(("agent",), 1)
    (row,) = contextbench.run(pair, [prompt], [700], max_tokens=6, repeats=1, policies=PolicyFactory(pair))
    assert row.identical and row.disk_bytes > 0
    assert all(type(c) is QuantizedKVCache for c in pair.target.make_cache())
    assert all(c.limit == 64 for c in pair.drafter.make_cache())
