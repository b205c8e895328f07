"""Prefix cache: a later request that shares a prefix with an earlier one prefills only the rest,
and its output is exactly what a fresh run gives (speculative and plain, full and sliding-window
drafters, hybrid targets), without ever mutating what the cache keeps."""

from mlx_spec.decode import plain_steps, spec_steps
from mlx_spec.drafter import ContextCache
from mlx_spec.engine import Done, Engine, Request
from mlx_spec.prefix import Prefill, PrefixCache, take

import mlx.core as mx
import pytest
from helpers import tiny_drafter, tiny_engine_loader, tiny_model
from test_hybrid import build

TURN1 = [1, 5, 9, 17, 33, 2, 8, 40, 77, 3, 4, 50, 61, 7, 19, 23, 29, 31, 37, 41]
N = 24


def tokens(steps):
    return [t for s in steps for t in s.tokens]


def run_spec(target, drafter, prompt, prefix=None, block=4, n=N):
    kw = {}
    if prefix is not None:
        kw = dict(prefill=prefix.lookup(prompt, drafter=True), on_exit=prefix.store)
    steps = list(spec_steps(target, drafter, prompt, block_size=block, max_tokens=n, **kw))
    return tokens(steps), steps[0].cached_tokens


@pytest.fixture(scope="module")
def pair():
    model, cfg = tiny_model("qwen3")
    target, drafter, _ = tiny_drafter(model, cfg, v2=True)
    return model, cfg, target, drafter


def conversation(first_reply):
    """Turn 2's prompt: turn 1's prompt + reply + new user tokens (a chat's second turn)."""
    return TURN1 + first_reply + [2, 11, 13, 14, 90]


@pytest.mark.parametrize("block", [2, 4, 8])
def test_second_turn_reuses_the_first_and_matches_a_fresh_run(pair, block):
    _, _, target, drafter = pair
    cache = PrefixCache(64 << 20)
    reply, cached = run_spec(target, drafter, TURN1, cache, block)
    assert cached == 0 and len(cache) == 1
    prompt2 = conversation(reply)
    fresh, _ = run_spec(target, drafter, prompt2, None, block)
    reused, cached = run_spec(target, drafter, prompt2, cache, block)
    assert reused == fresh
    # Everything the first run fed is reused: its prompt and all but its last (unfed) token.
    assert cached == len(TURN1) + len(reply) - 1
    assert cache.hits == 1


def test_shared_system_prompt_partial_match(pair):
    """Two requests that diverge after a shared prefix: the cache trims to the common part."""
    _, _, target, drafter = pair
    cache = PrefixCache(64 << 20)
    run_spec(target, drafter, TURN1, cache)
    other = TURN1[:17] + [99, 98, 97, 96]
    fresh, _ = run_spec(target, drafter, other)
    reused, cached = run_spec(target, drafter, other, cache)
    assert (reused, cached) == (fresh, 17)
    # ...and the first entry was not harmed: re-running turn 1 reuses it and matches.
    again, cached = run_spec(target, drafter, TURN1, cache)
    assert again == run_spec(target, drafter, TURN1)[0] and cached == len(TURN1) - 1


def test_entries_are_never_mutated(pair):
    _, _, target, drafter = pair
    cache = PrefixCache(64 << 20)
    reply, _ = run_spec(target, drafter, TURN1, cache)
    entry = next(iter(cache._entries.values()))
    before = [mx.array(c.keys[..., : c.offset, :]) for c in entry.target]
    ctx_before = [mx.array(c.keys) for c in entry.drafter]
    prompt2 = conversation(reply)
    got = take(entry, len(TURN1) + 3, drafter=True)
    list(spec_steps(target, drafter, prompt2[: len(TURN1) + 9], block_size=4, max_tokens=8, prefill=got))
    for c, b in zip(entry.target, before):
        assert mx.array_equal(c.keys[..., : c.offset, :], b)
    for c, b in zip(entry.drafter, ctx_before):
        assert mx.array_equal(c.keys, b)


def test_plain_decoding_reuses_and_matches(pair):
    model, *_ = pair
    cache = PrefixCache(64 << 20)

    def run(prompt, prefix):
        kw = dict(prefill=prefix.lookup(prompt, drafter=False), on_exit=prefix.store) if prefix is not None else {}
        steps = list(plain_steps(model, prompt, max_tokens=N, **kw))
        return tokens(steps), steps[0].cached_tokens

    reply, _ = run(TURN1, cache)
    prompt2 = conversation(reply)
    fresh, _ = run(prompt2, None)
    reused, cached = run(prompt2, cache)
    assert reused == fresh and cached >= len(TURN1) + len(reply) - 1


def test_plain_entry_cannot_serve_a_speculative_run(pair):
    """A plain run keeps no drafter context; speculation must not start from it."""
    model, _, target, drafter = pair
    cache = PrefixCache(64 << 20)
    list(plain_steps(model, TURN1, max_tokens=8, prefill=None, on_exit=cache.store))
    assert cache.lookup(TURN1 + [5, 6], drafter=True) is None
    assert cache.lookup(TURN1 + [5, 6], drafter=False) is not None


def test_cancelled_run_leaves_a_consistent_entry(pair):
    _, _, target, drafter = pair
    cache = PrefixCache(64 << 20)
    gen = spec_steps(target, drafter, TURN1, block_size=4, max_tokens=N, on_exit=cache.store)
    got = [next(gen) for _ in range(3)]
    gen.close()
    assert len(cache) == 1
    reply = tokens(got)
    prompt2 = TURN1 + reply + [7, 7, 7]
    fresh, _ = run_spec(target, drafter, prompt2)
    reused, cached = run_spec(target, drafter, prompt2, cache)
    assert reused == fresh and cached > len(TURN1)


def test_sliding_window_drafter(pair):
    """Window rows already dropped cannot be rebuilt: such a prefix is refused, others reused."""
    model, cfg, _, _ = pair
    target, drafter, _ = tiny_drafter(model, cfg, v2=True, window=8)
    cache = PrefixCache(64 << 20)
    reply, _ = run_spec(target, drafter, TURN1, cache)
    entry = next(iter(cache._entries.values()))
    assert entry.drafter[0].keys.shape[2] == 7  # window - 1 rows kept
    assert take(entry, 5, drafter=True) is None  # its window needs rows 0..4, long gone
    assert take(entry, 5, drafter=False) is not None  # the target cache alone could serve it
    prompt2 = conversation(reply)
    fresh, _ = run_spec(target, drafter, prompt2)
    reused, cached = run_spec(target, drafter, prompt2, cache)
    assert reused == fresh and cached == len(TURN1) + len(reply) - 1


def test_hybrid_target_reuses_only_whole_entries():
    model, cfg = build("qwen3_5")
    target, drafter, _ = tiny_drafter(model, cfg, v2=True, taps=(0, 3))
    cache = PrefixCache(64 << 20)
    reply, _ = run_spec(target, drafter, TURN1, cache)
    entry = next(iter(cache._entries.values()))
    assert take(entry, len(entry.tokens) - 2, drafter=True) is None  # GDN state cannot be trimmed
    prompt2 = conversation(reply)
    fresh, _ = run_spec(target, drafter, prompt2)
    reused, cached = run_spec(target, drafter, prompt2, cache)
    assert reused == fresh and cached == len(entry.tokens)
    # A prompt that diverges inside the entry is a miss, not a wrong answer.
    other = TURN1[:-2] + [99, 98]
    assert run_spec(target, drafter, other, cache) == (run_spec(target, drafter, other)[0], 0)


def test_budget_and_lru_eviction(pair):
    _, _, target, drafter = pair
    probe = PrefixCache(1 << 30)
    run_spec(target, drafter, TURN1, probe)
    one = probe.nbytes
    cache = PrefixCache(int(one * 2.5))
    prompts = [[p] + TURN1[1:] for p in (60, 61, 62)]
    for p in prompts:
        run_spec(target, drafter, p, cache)
    assert len(cache) == 2 and cache.nbytes <= cache.budget
    assert cache.lookup(prompts[0] + [1], drafter=True) is None  # the oldest went first
    assert cache.lookup(prompts[2] + [1], drafter=True) is not None
    off = PrefixCache(0)
    run_spec(target, drafter, TURN1, off)
    assert len(off) == 0 and off.lookup(TURN1, drafter=True) is None


def test_an_extended_entry_replaces_the_one_it_extends(pair):
    _, _, target, drafter = pair
    cache = PrefixCache(64 << 20)
    reply, _ = run_spec(target, drafter, TURN1, cache)
    run_spec(target, drafter, conversation(reply), cache)
    assert len(cache) == 1


def test_a_prefill_must_be_a_proper_prefix(pair):
    _, _, target, drafter = pair
    bad = Prefill(tuple(TURN1), target.make_cache(), [ContextCache()])
    with pytest.raises(ValueError):
        next(spec_steps(target, drafter, TURN1, block_size=4, max_tokens=4, prefill=bad))


def test_engine_reuses_a_conversation_and_reports_it(tmp_path):
    def chat(engine, messages):
        done = engine.submit(Request(messages=messages, max_tokens=12)).result()
        assert isinstance(done, Done)
        return done

    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}]
    loader = tiny_engine_loader(tmp_path / "a")
    with Engine(loader, prefix_cache=32 << 20) as warm, Engine(loader) as cold:
        warm.wait_ready(60)
        cold.wait_ready(60)
        d1 = chat(warm, turn1)
        assert d1.stats.cached_tokens == 0 and d1.timings["cache_n"] == 0
        turn2 = turn1 + [{"role": "assistant", "content": d1.text}, {"role": "user", "content": "more"}]
        d2, ref = chat(warm, turn2), chat(cold, turn2)
        assert d2.text == ref.text
        assert d2.stats.cached_tokens > 0 and ref.stats.cached_tokens == 0
        assert d2.timings["cache_n"] == d2.stats.cached_tokens
        assert d2.timings["prompt_n"] == d2.prompt_tokens - d2.stats.cached_tokens
        snap = warm.snapshot()
        assert snap["cached_tokens"] == d2.stats.cached_tokens and snap["prefix_cache_bytes"] > 0
        assert cold.snapshot()["prefix_cache_bytes"] == 0
        # Plain decoding on the same engine (A/B toggle) can reuse the target's part too.
        d3 = warm.submit(Request(messages=turn2, max_tokens=12, speculate=False)).result()
        assert d3.text == ref.text and d3.stats.cached_tokens > 0
