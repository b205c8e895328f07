"""The prefix cache's disk tier: a run that starts from a prefix loaded from disk gives exactly
the tokens of a cold run; damaged or foreign entries are skipped with a warning (and the prompt
prefilled); the store stays within its budget, least recently used first; a new store object or
a new process finds what an earlier one wrote."""

import json
import logging
import os
import subprocess
import sys

from mlx_spec.decode import plain_steps, spec_steps
from mlx_spec.prefix import PrefixCache
from mlx_spec.prefix_store import (
    DiskConfig,
    PrefixStore,
    clear,
    identity_of,
    list_entries,
)

import pytest
from helpers import tiny_drafter, tiny_model
from test_hybrid import build

PROMPT = [1, 5, 9, 17, 33, 2, 8, 40, 77, 3, 4, 50, 61, 7, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
N = 16
ID = identity_of({"target": "tiny", "drafter": "tiny-d"})


def tokens(steps):
    return [t for s in steps for t in s.tokens]


@pytest.fixture(scope="module")
def pair():
    model, cfg = tiny_model("qwen3")
    target, drafter, _ = tiny_drafter(model, cfg, v2=True)
    return model, cfg, target, drafter


def cache_on(root, identity=ID, budget=64 << 20, memory=64 << 20, min_tokens=8):
    """A PrefixCache with a disk tier at ``root`` (a fresh object: what a restart builds)."""
    c = PrefixCache(memory)
    c.attach(PrefixStore(DiskConfig(root, budget, min_tokens), identity))
    return c


def run_spec(target, drafter, prompt, cache=None, n=N):
    kw = dict(prefill=cache.lookup(prompt, drafter=True), on_exit=cache.store) if cache is not None else {}
    steps = list(spec_steps(target, drafter, prompt, block_size=4, max_tokens=n, **kw))
    return tokens(steps), steps[0].cached_tokens


def test_a_run_from_a_prefix_loaded_after_a_restart_matches_a_cold_run(pair, tmp_path):
    _, _, target, drafter = pair
    first = cache_on(tmp_path)
    reply, _ = run_spec(target, drafter, PROMPT, first)
    assert len(first.disk) == 1 and not list(tmp_path.glob("*/.*"))  # written, no temporary file left
    prompt2 = PROMPT + reply + [2, 11, 13]
    cold, _ = run_spec(target, drafter, prompt2)
    restarted = cache_on(tmp_path, memory=0)  # a new process: nothing in memory, the disk tier only
    got, cached = run_spec(target, drafter, prompt2, restarted)
    assert got == cold
    assert cached == len(PROMPT) + len(reply) - 1  # everything the first run fed
    assert restarted.disk.hits == 1 and restarted.disk_tokens == cached
    assert restarted.stats()["disk"]["bytes_read"] > 0


def test_a_disk_hit_is_kept_in_memory_for_the_next_turn(pair, tmp_path):
    _, _, target, drafter = pair
    run_spec(target, drafter, PROMPT, cache_on(tmp_path))
    restarted = cache_on(tmp_path)
    again = PROMPT + [5, 6, 7]
    run_spec(target, drafter, again, restarted)
    assert restarted.disk.hits == 1 and len(restarted) >= 1
    got, cached = run_spec(target, drafter, again + [8], restarted)
    assert restarted.disk.hits == 1 and cached > len(PROMPT)  # the second turn hit memory
    assert got == run_spec(target, drafter, again + [8])[0]


def test_plain_decoding_from_disk_matches(pair, tmp_path):
    model, *_ = pair

    def run(prompt, cache):
        kw = dict(prefill=cache.lookup(prompt, drafter=False), on_exit=cache.store) if cache is not None else {}
        steps = list(plain_steps(model, prompt, max_tokens=N, **kw))
        return tokens(steps), steps[0].cached_tokens

    run(PROMPT, cache_on(tmp_path))
    prompt2 = PROMPT + [3, 3, 3]
    restarted = cache_on(tmp_path, memory=0)
    got, cached = run(prompt2, restarted)
    assert got == run(prompt2, None)[0] and cached >= len(PROMPT)
    # A plain entry holds no drafter context: a speculative run must not start from it.
    assert cache_on(tmp_path, memory=0).lookup(prompt2, drafter=True) is None


def test_short_prefixes_stay_in_memory_only(pair, tmp_path):
    _, _, target, drafter = pair
    c = cache_on(tmp_path, min_tokens=len(PROMPT) + N + 1)
    run_spec(target, drafter, PROMPT, c)
    assert len(c) == 1 and len(c.disk) == 0


def _one_entry(tmp_path, pair):
    _, _, target, drafter = pair
    c = cache_on(tmp_path)
    reply, _ = run_spec(target, drafter, PROMPT, c)
    (path,) = c.disk.dir.glob("*.safetensors")
    return path, PROMPT + reply + [2, 11]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong identity"])
def test_a_damaged_or_foreign_entry_is_skipped_with_a_warning(pair, tmp_path, caplog, damage):
    _, _, target, drafter = pair
    path, prompt2 = _one_entry(tmp_path, pair)
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 100])
    elif damage == "garbage":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    else:  # an entry of another model copied into this model's folder
        other = cache_on(tmp_path / "other", identity="f" * 24)
        run_spec(target, drafter, PROMPT, other)
        (foreign,) = other.disk.dir.glob("*.safetensors")
        os.replace(foreign, path)
    cold, _ = run_spec(target, drafter, prompt2)
    with caplog.at_level(logging.WARNING, logger="mlx_spec.prefix_store"):
        restarted = cache_on(tmp_path, memory=0)
        got, cached = run_spec(target, drafter, prompt2, restarted)
    assert (got, cached) == (cold, 0)
    assert any("ignoring" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    assert restarted.disk.skipped == 1


def test_an_entry_damaged_after_the_scan_is_skipped_at_load(pair, tmp_path, caplog):
    """The file breaks between the index's scan and the load (another process, a full disk)."""
    _, _, target, drafter = pair
    path, prompt2 = _one_entry(tmp_path, pair)
    restarted = cache_on(tmp_path, memory=0)
    data = path.read_bytes()
    path.write_bytes(data[:-64])
    with caplog.at_level(logging.WARNING, logger="mlx_spec.prefix_store"):
        got, cached = run_spec(target, drafter, prompt2, restarted)
    assert (got, cached) == (run_spec(target, drafter, prompt2)[0], 0)
    assert not path.exists() and any("ignoring" in r.getMessage() for r in caplog.records)


def test_another_models_entries_are_not_used_nor_touched(pair, tmp_path):
    _, _, target, drafter = pair
    path, prompt2 = _one_entry(tmp_path, pair)
    other = cache_on(tmp_path, identity="0" * 24, memory=0)
    assert other.lookup(prompt2, drafter=True) is None
    assert path.exists() and other.disk.skipped == 0


def test_the_store_stays_within_its_budget_least_recently_used_first(pair, tmp_path):
    _, _, target, drafter = pair
    path, _ = _one_entry(tmp_path / "probe", pair)
    one = path.stat().st_size
    c = cache_on(tmp_path, budget=int(one * 2.5), memory=0)
    prompts = [[p] + PROMPT[1:] for p in (60, 61, 62)]
    run_spec(target, drafter, prompts[0], c)
    run_spec(target, drafter, prompts[1], c)
    first = sorted(c.disk.dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)[0]
    os.utime(first, (1, 1))  # make the order unambiguous on coarse clocks
    assert c.lookup(prompts[0] + [1], drafter=True) is not None  # a hit refreshes the first entry
    run_spec(target, drafter, prompts[2], c)
    assert len(c.disk) == 2 and sum(p.stat().st_size for p in c.disk.dir.glob("*.safetensors")) <= c.disk.config.budget
    fresh = cache_on(tmp_path, budget=int(one * 2.5), memory=0)
    assert fresh.lookup(prompts[0] + [1], drafter=True) is not None  # used last: kept
    assert fresh.lookup(prompts[1] + [1], drafter=True) is None  # least recently used: gone
    assert fresh.lookup(prompts[2] + [1], drafter=True) is not None


def test_an_extended_prefix_replaces_the_entry_it_extends(pair, tmp_path):
    _, _, target, drafter = pair
    c = cache_on(tmp_path)
    reply, _ = run_spec(target, drafter, PROMPT, c)
    run_spec(target, drafter, PROMPT + reply + [4, 4], c)
    assert len(c.disk) == 1 and len(list(c.disk.dir.glob("*.safetensors"))) == 1


def test_a_new_process_finds_the_entry(pair, tmp_path):
    path, prompt2 = _one_entry(tmp_path, pair)
    code = (
        "import json, sys; from mlx_spec.prefix_store import DiskConfig, PrefixStore; "
        f"s = PrefixStore(DiskConfig(sys.argv[1], 64 << 20, 8), {ID!r}); "
        "found = s.best(json.loads(sys.argv[2]), True, 0); "
        "print(json.dumps([len(s), found[1] if found else None]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), json.dumps(prompt2)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        check=True,
    )
    n, keep = json.loads(out.stdout.strip().splitlines()[-1])
    assert n == 1 and keep == len(prompt2) - 3  # the entry: the prompt + the fed reply


def test_list_and_clear(pair, tmp_path):
    path, _ = _one_entry(tmp_path, pair)
    (tmp_path / ID / "junk.safetensors").write_bytes(b"nope")
    good, bad = list_entries(tmp_path)
    assert [g.path for g in good] == [path] and good[0].drafter and len(good[0].tokens) > len(PROMPT)
    assert [b[0].name for b in bad] == ["junk.safetensors"]
    assert clear(tmp_path)[0] == 2 and list_entries(tmp_path) == ([], [])


def test_hybrid_target_entries_serve_whole_prefixes_only(tmp_path):
    model, cfg = build("qwen3_5")
    target, drafter, _ = tiny_drafter(model, cfg, v2=True, taps=(0, 3))
    c = cache_on(tmp_path)
    reply, _ = run_spec(target, drafter, PROMPT, c)
    assert len(c.disk) == 1
    prompt2 = PROMPT + reply + [9, 9]
    got, cached = run_spec(target, drafter, prompt2, cache_on(tmp_path, memory=0))
    assert got == run_spec(target, drafter, prompt2)[0] and cached == len(PROMPT) + len(reply) - 1
    other = PROMPT[:-2] + [99, 98]  # diverges inside the entry: the recurrent state cannot be cut
    assert cache_on(tmp_path, memory=0).lookup(other, drafter=True) is None


def test_a_restarted_engine_loads_the_prefix_from_disk_and_counts_it(tmp_path):
    from mlx_spec.engine import Done, Engine, Request
    from mlx_spec.server.app import prometheus

    from helpers import tiny_engine_loader

    msgs = [{"role": "system", "content": "You are terse. " * 4}, {"role": "user", "content": "hello there"}]
    loader = tiny_engine_loader(tmp_path / "pair")
    disk = DiskConfig(tmp_path / "store", 64 << 20, 8)

    def ask(engine, messages):
        done = engine.submit(Request(messages=messages, max_tokens=8)).result()
        assert isinstance(done, Done)
        return done

    with Engine(loader, prefix_cache=32 << 20, prefix_disk=disk) as first:
        first.wait_ready(60)
        d1 = ask(first, msgs)
    turn2 = msgs + [{"role": "assistant", "content": d1.text}, {"role": "user", "content": "more"}]
    with Engine(loader) as cold:
        cold.wait_ready(60)
        ref = ask(cold, turn2)
    with Engine(loader, prefix_cache=32 << 20, prefix_disk=disk) as again:
        again.wait_ready(60)
        d2 = ask(again, turn2)
        assert d2.text == ref.text and d2.stats.cached_tokens > 0 and ref.stats.cached_tokens == 0
        snap = again.snapshot()
        assert snap["prefix_cache"]["disk"]["hits"] == 1
        text = prometheus(again, {}, {"rejected": 0, "in_flight": 0})
    assert 'mlx_spec:prefix_cache_hits_total{tier="disk"} 1' in text
    assert "mlx_spec:prefix_cache_disk_bytes_read_total 0\n" not in text


def test_the_serve_flags_make_the_disk_config_and_bad_values_are_named(tmp_path):
    import argparse

    from mlx_spec.cli import add_prefix_disk_args, prefix_disk_of
    from mlx_spec.errors import BadRequest

    p = argparse.ArgumentParser()
    add_prefix_disk_args(p)
    cfg = prefix_disk_of(p.parse_args(["--prefix-disk-mb", "8", "--prefix-disk-min-tokens", "500"]))
    assert (cfg.budget, cfg.min_tokens) == (8 << 20, 500) and cfg.root.name == "prefix"
    assert prefix_disk_of(p.parse_args(["--prefix-disk-mb", "0"])) is None
    for bad, name in (
        (["--prefix-disk-mb", "-1"], "--prefix-disk-mb"),
        (["--prefix-disk-min-tokens", "0"], "--prefix-disk-min-tokens"),
    ):
        with pytest.raises(BadRequest, match=name):
            prefix_disk_of(p.parse_args(bad))
