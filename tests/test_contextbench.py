"""`bench --context`: prompts padded to a context length from the package's own text, the same
every time and never past the length asked; one measured row on the tiny pair (its decode rows
agree token for token, its restart row really loads from disk)."""

from argparse import Namespace
from dataclasses import replace

from mlx_spec import contextbench
from mlx_spec.analysis import COPY_SUBSET, copy_share
from mlx_spec.commands.bench import CONTEXT_PROMPTS, context_prompts
from mlx_spec.decode import plain_steps, spec_steps
from mlx_spec.errors import BadRequest
from mlx_spec.loading import load_pair
from mlx_spec.policy import PolicyFactory
from mlx_spec.prefix import PrefixCache
from mlx_spec.prompts import builtin_prompts
from mlx_spec.target import KVQuant
from mlx_spec.text import encode_prompt
from mlx_spec.verify import IDENTICAL, MISMATCH, NUMERIC

import mlx.core as mx
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
    assert row.verdict == IDENTICAL and set(row.decode_tps) == {"mlx-lm plain", "plain (ours)", "default engine"}
    assert row.disk_bytes > 0 and row.disk_load_ms > 0 and row.ttft_cold_ms > 0
    assert "restart_margin" in contextbench.as_dicts([row])[0]
    assert "default engine tok/s" in contextbench.table([row]) and " copy " in contextbench.table([row])
    assert 0.0 <= row.copy <= 1.0


def test_every_row_ends_the_reply_where_mlx_lm_does(tmp_path):
    """mlx-lm's ``stream_generate`` stops at an EOS token: our plain path and the engine end the
    reply there too (else the rows decode different lengths and never agree)."""
    pair = tiny_engine_loader(tmp_path / "pair")().pair
    (prompt,) = builtin_prompts(("agent",), 1)
    msgs, _ = contextbench.padded(prompt, 400, lambda m: len(encode_prompt(pair.tokenizer, messages=m)))
    ids = encode_prompt(pair.tokenizer, messages=msgs)
    ref = [t for s in plain_steps(pair.model, ids, max_tokens=8) for t in s.tokens]
    stop = next(t for t in ref[2:] if t not in ref[:2])  # a token the reply first makes after two others
    pair.tokenizer.eos_token_ids = {stop}
    (row,) = contextbench.run(pair, [prompt], [400], max_tokens=8, repeats=1, policies=PolicyFactory(pair))
    assert row.verdict == IDENTICAL and row.divergence is None, row.divergence
    assert row.copy == round(copy_share(ids, ref[: ref.index(stop) + 1]), 3)  # of the reply mlx-lm gave


def _row(context, kind, copy, engine, mlx=10.0, pid="p"):
    return contextbench.ContextRow(
        context,
        pid,
        kind,
        context,
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        1,
        {"mlx-lm plain": mlx, "default engine": engine},
        2.0,
        IDENTICAL,
        None,
        copy,
        {},
    )


def test_the_engine_is_judged_on_the_agent_replies_that_copy():
    """``copying``: per context, the lowest engine x mlx-lm among agent replies whose copy share
    reaches the main bench's COPY_SUBSET; a reply that does not copy (or a chat one) is not judged, and a context
    without any copying reply says so (None), never a number."""
    rows = [
        _row(1024, "agent", 0.95, 20.0),
        _row(1024, "agent", 0.90, 16.0, pid="q"),
        _row(1024, "agent", 0.30, 10.5, pid="r"),  # wrote new code: not a copying reply
        _row(1024, "prose", 1.0, 9.0, pid="s"),
        _row(4096, "agent", COPY_SUBSET - 0.01, 30.0),
    ]
    assert contextbench.copying(rows) == {1024: pytest.approx(1.6), 4096: None}
    one = [rows[0], replace(rows[3], prompt_tokens=830)]  # two prompts padded to one length asked
    assert contextbench.context_term(one) is None  # their spread is noise, not a context term
    line = contextbench.copying_line(rows)
    assert "1024: 1.60x" in line and "4096: no copying reply" in line


def test_the_default_context_prompts_are_a_copying_edit_and_a_chat():
    got = context_prompts(Namespace(prompts=None, kinds=None, per_kind=None))
    assert [p.id for p in got] == list(CONTEXT_PROMPTS) and [p.kind for p in got] == ["agent", "prose"]
    assert [p.id for p in context_prompts(Namespace(prompts=None, kinds="agent", per_kind=2))] == [
        "agent-1",
        "agent-2",
    ]


def test_one_row_with_quantized_kv_and_a_drafting_window(tmp_path):
    """``bench --context --kv-bits 4 --draft-window 64``: every method runs on the quantized cache
    (mlx-lm's plain decoding too, from the same prefix), their tokens agree, and the drafter's
    context rows stay within the window."""
    t, d = save_tiny_pair(tmp_path / "pair", target_over={"head_dim": 32})
    pair = load_pair(str(t), str(d), kv=KVQuant(4, 32), draft_window=64)
    (prompt,) = builtin_prompts(("agent",), 1)
    (row,) = contextbench.run(pair, [prompt], [700], max_tokens=6, repeats=1, policies=PolicyFactory(pair))
    assert row.verdict == IDENTICAL and row.disk_bytes > 0
    assert all(type(c) is QuantizedKVCache for c in pair.target.make_cache())
    assert all(c.limit == 64 for c in pair.drafter.make_cache())


def test_a_divergence_is_named_a_near_tie_only_within_rounding(tmp_path):
    """Two runs that part ways are a near tie (NUMERIC) where the target's logits put both tokens
    within rounding (either is its greedy choice), a MISMATCH otherwise; ``diverged`` reads the
    target's logits at the first differing token from the cached prefix; a row is a near tie only
    when every method that departed is one."""
    row = mx.zeros((50,), mx.float32).at[3].add(12.0).at[7].add(12.0)
    assert contextbench.tie_verdict(row, 3, 7)[0] == NUMERIC
    assert contextbench.tie_verdict(row.at[7].add(-0.01), 3, 7)[0] == MISMATCH
    pair = tiny_engine_loader(tmp_path / "pair")().pair
    ids = list(range(5, 40))
    cache = PrefixCache(1 << 30)
    list(spec_steps(pair.target, pair.drafter, ids, block_size=2, max_tokens=1, on_exit=cache.store))
    entry = cache.lookup(ids, drafter=True)
    ref = [t for s in plain_steps(pair.model, ids, max_tokens=6) for t in s.tokens]
    logits = pair.model(mx.array([ids]))[0, -1]
    runner_up = int(mx.argsort(logits)[-2])  # the target's second choice for the first token
    verdict, what = contextbench.diverged(pair, entry, ids, ref, [runner_up] + ref[1:])
    assert verdict == MISMATCH and what.startswith(f"token 0 ({ref[0]} vs {runner_up})")
    assert contextbench.diverged(pair, entry, ids, ref, ref[:4])[0] == MISMATCH  # one stopped early
    table = contextbench.table([replace(_row(1024, "agent", 1.0, 20.0), verdict=NUMERIC, divergence="...")])
    assert table.split()[-1] == "tie"
    assert contextbench.table([replace(_row(1024, "agent", 1.0, 20.0), verdict=MISMATCH)]).split()[-1] == "NO"
