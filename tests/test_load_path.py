"""One load path: flags -> LoadConfig -> session -> EngineInfo.mode, and the CLI around it.

Every flag and name is checked before anything loads; every command that names a block size
uses the one the engine would run and says where it came from. The CLI checks call
``cli.main`` with a command line, as the console script does (tests/test_cli.py runs the console
script itself), with a private cache folder; a refusal that must come before anything loads has
the loading functions replaced by ones that fail the test.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import importlib
import json
import threading
import time

from mlx_spec.config import LoadConfig
from mlx_spec.errors import BadRequest, CheckpointError, MlxSpecError

import pytest
from helpers import save_tiny_pair

LOADING = ("memory plan", "loading target")  # what a command prints once it starts planning / loading


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def pair(pair_dirs):
    from mlx_spec.loading import load_pair

    t, d = pair_dirs
    return load_pair(str(t), str(d))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(d))
    return d


# -- the configuration ----------------------------------------------------------------------------


def test_load_config_is_frozen_and_refuses_bad_values():
    cfg = LoadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 4
    for bad in (
        dict(block_size=1),
        dict(block_size=0),
        dict(context=1),
        dict(group_size=48),
        dict(draft_vocab="half"),
        dict(target_bits="3"),
        dict(prefix_cache=-1),
        dict(tune_budget_s=0),
        dict(budget=0),
        dict(target=""),
    ):
        with pytest.raises(BadRequest):
            LoadConfig(**bad)


def test_flags_become_a_config_once():
    from mlx_spec.cli import load_config

    args = argparse.Namespace(
        target="t",
        drafter="d",
        no_draft=False,
        block_size=6,
        target_bits="4",
        drafter_bits=None,
        group_size=32,
        draft_vocab="full",
        context=2048,
        force=True,
        no_tune=True,
        tune_budget=12.0,
        no_adaptive=True,
        prefix_cache_mb=1.5,
        budget_gb=2.0,
        prompt_tokens=100,
        ranks=2,
    )
    cfg = load_config(args)
    assert cfg == LoadConfig(
        target="t",
        drafter="d",
        block_size=6,
        target_bits="4",
        group_size=32,
        draft_vocab="full",
        context=2048,
        force=True,
        tune=False,
        tune_budget_s=12.0,
        adaptive=False,
        prefix_cache=int(1.5 * 2**20),
        budget=2 * 2**30,
        prompt_tokens=100,
        ranks=2,
    )
    # a command without some flags (tune has no --block-size) gets the defaults
    assert load_config(argparse.Namespace(target="t")) == LoadConfig(target="t")
    with pytest.raises(BadRequest, match="--budget-gb"):
        load_config(argparse.Namespace(target="t", budget_gb=-1.0))


def test_names_are_checked_before_anything_loads(pair_dirs, tmp_path):
    from mlx_spec.session import check

    t, d = pair_dirs
    assert check(LoadConfig(target=str(t), drafter=str(d))) == str(d)
    with pytest.raises(MlxSpecError, match="target '/does/not/exist' does not exist"):
        check(LoadConfig(target="/does/not/exist"))
    with pytest.raises(MlxSpecError, match="no drafter for target"):
        check(LoadConfig(target=str(t)))
    assert check(LoadConfig(target=str(t), no_draft=True)) is None
    with pytest.raises(CheckpointError, match="no config.json"):
        check(LoadConfig(target=str(t), drafter=str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a DFlash drafter config"):
        check(LoadConfig(target=str(t), drafter=str(tmp_path)))
    check(LoadConfig(target=str(t), drafter="someone/some-drafter"))  # a repo id: resolved when loading


# -- the block size and the mode --------------------------------------------------------------------


def _stored(key, best, date="2026-11-29T12:00:00+00:00"):
    from mlx_spec.tuning import Candidate, TuneResult

    cands = (
        Candidate(1, True, 10.0, 0.05, 1.0, None, 1.0, 3, final=True),
        Candidate(6, True, 13.0, 0.04, 1.3, 2.5, 1.3, 3, final=True),
    )
    return TuneResult(key, best, date, cands)


def test_one_rule_for_the_block_size(pair, tmp_path):
    """--block-size wins, then --no-tune (checkpoint), then the stored result (tuned once)."""
    from mlx_spec.session import BlockChoice, choose_block
    from mlx_spec.tuning import save_result, tune_key

    calls = []

    def fake_tune(p, budget_s, progress):
        calls.append(budget_s)
        return _stored({}, 6)

    ckpt = pair.drafter.args.block_size
    cfg = LoadConfig(tune_budget_s=7.0)
    assert choose_block(pair, dataclasses.replace(cfg, block_size=3), root=tmp_path, tune_fn=fake_tune) == BlockChoice(
        3, "flag", pinned=True
    )
    assert choose_block(pair, dataclasses.replace(cfg, tune=False), root=tmp_path, tune_fn=fake_tune) == BlockChoice(
        ckpt, "checkpoint (--no-tune)"
    )
    assert choose_block(pair, cfg, root=tmp_path, tuning="stored") == BlockChoice(
        ckpt, "checkpoint; not tuned on this machine yet"
    )  # verify never tunes
    assert calls == []
    assert choose_block(pair, cfg, root=tmp_path, tune_fn=fake_tune) == BlockChoice(6, "tuned 2026-11-29")
    assert choose_block(pair, cfg, root=tmp_path, tune_fn=fake_tune).block_size == 6 and calls == [7.0]
    assert choose_block(pair, cfg, root=tmp_path, tuning="none") == BlockChoice(ckpt, "checkpoint")
    save_result(_stored(tune_key(pair), 1), tmp_path)
    off = choose_block(pair, cfg, root=tmp_path, tuning="stored")
    assert off.off and off.block_size == 1 and off.source.startswith("tuned 2026-11-29: off")


def test_the_mode_is_decided_in_one_place(pair):
    from mlx_spec.generation import engine_info, for_request, plain_view
    from mlx_spec.session import BlockChoice, info_for

    spec = info_for(pair, BlockChoice(4, "flag", pinned=True))
    assert (spec.mode, spec.method, spec.block_size, spec.speculative, spec.pinned) == (
        "speculative",
        "dflash2",
        4,
        True,
        True,
    )
    assert not info_for(pair, BlockChoice(4, "tuned 2026-11-29")).pinned
    off = info_for(pair, BlockChoice(1, "tuned 2026-11-29: off — plain decoding faster", off=True))
    assert (off.mode, off.method, off.drafter, off.speculative) == ("tuned-off", "plain", pair.drafter_id, False)
    # the per-cycle policy (the default) stays speculative: plain steps where drafts do not pay are
    # its own choice, and lookup drafts may pay where DFlash does not
    off_policy = info_for(
        pair, BlockChoice(1, "tuned 2026-11-29: off — plain decoding faster", off=True), adaptive=True
    )
    assert (
        off_policy.speculative
        and off_policy.adaptive_max >= 16
        and off_policy.block_size == pair.drafter.args.block_size
    )
    assert "DFlash drafts start resting" in off_policy.describe()
    plain = engine_info(plain_view(pair))
    assert (plain.mode, plain.drafter) == ("plain", None)
    with pytest.raises(BadRequest):  # a block of 1 is never "plain" by accident: only the tuner's off is
        engine_info(pair, 1, "tuned 2026-11-29")
    p, ab = for_request(pair, spec, speculate=False)
    assert p.drafter is None and ab.mode == "plain"
    p, same = for_request(pair, off)
    assert p.drafter is None and same is off


def test_no_code_parses_the_provenance_text():
    """``block_size_source`` is for people: no code compares it or looks inside it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    parse = re.compile(
        r'startswith\("tuned|(block_size_source|block_source)\s*(==|!=|\.startswith|\.endswith)'
        r"|in\s+\w*\.?(block_size_source|block_source)\b"
    )
    hits = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for folder in ("mlx_spec", "tui")
        for p in (root / folder).rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if parse.search(line)
    ]
    assert hits == []


# -- the CLI, as a user runs it ----------------------------------------------------------------------


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a pair fails the test (a refusal must come first)."""
    from mlx_spec import session

    def loaded(*a, **k):
        raise AssertionError("the command loaded the pair before refusing")

    monkeypatch.setattr(session, "load", loaded)


def test_generate_names_a_missing_target_not_a_missing_drafter(cache, capsys):
    from mlx_spec.cli import main

    assert main(["generate", "--target", "/does/not/exist", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "target '/does/not/exist' does not exist" in err and "no drafter" not in err


def test_a_bad_drafter_is_refused_before_planning_or_loading(pair_dirs, cache, tmp_path, capsys, nothing_loads):
    from mlx_spec.cli import main

    t, _ = pair_dirs
    assert main(["generate", "--target", str(t), "--drafter", "/no/such/drafter", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "drafter '/no/such/drafter' does not exist" in err, err
    assert not any(s in err for s in LOADING) and "unavailable" not in err, err
    empty, broken = tmp_path / "empty", tmp_path / "broken"
    empty.mkdir()
    broken.mkdir()
    (broken / "config.json").write_text('{"hidden_size": 8}')
    for path, why in ((empty, "no config.json"), (broken, "not a DFlash drafter config")):
        assert main(["generate", "--target", str(t), "--drafter", str(path), "--prompt", "x"]) == 1
        err = capsys.readouterr().err
        assert why in err and not any(s in err for s in LOADING) and "unavailable" not in err, err


@pytest.mark.parametrize("command, block", [("generate", "1"), ("serve", "0"), ("chat", "1")])
def test_block_size_0_or_1_is_refused_before_any_model_loads(
    pair_dirs, cache, command, block, capsys, monkeypatch, nothing_loads
):
    from mlx_spec import session
    from mlx_spec.cli import main

    def checked(cfg):  # every command checks the pair's names before it plans, listens or starts the UI
        raise AssertionError("the pair was checked before the block size was refused")

    monkeypatch.setattr(session, "check", checked)
    for name in ("serve", "chat"):  # the commands that call check themselves
        monkeypatch.setattr(importlib.import_module(f"mlx_spec.commands.{name}"), "check", checked)
    t, d = pair_dirs
    assert main([command, "--target", str(t), "--drafter", str(d), "--block-size", block]) == 1
    err = capsys.readouterr().err
    assert "--block-size must be >= 2" in err, err
    assert not any(s in err for s in LOADING) and "listening" not in err, err


@pytest.mark.parametrize("command", ["verify", "bench", "plan"])
def test_every_loading_command_refuses_block_size_1_first(pair_dirs, cache, capsys, command):
    from mlx_spec.cli import main

    t, d = pair_dirs
    for block in ("0", "1"):
        assert main([command, "--target", str(t), "--drafter", str(d), "--block-size", block]) == 1
        err = capsys.readouterr().err
        assert "--block-size must be >= 2" in err and not any(s in err for s in LOADING), err


def test_plan_verify_and_generate_name_the_block_the_engine_runs(pair, pair_dirs, cache, tmp_path, capsys):
    """With a stored tuning result (block 6) every command reports block 6 and where it came from;
    without one, plan says the first load tunes."""
    from mlx_spec.cli import main
    from mlx_spec.tuning import save_result, tune_key

    t, d = pair_dirs
    flags = ["--target", str(t), "--drafter", str(d)]

    def plan(*more):
        assert main(["plan", *flags, *more]) == 0
        return capsys.readouterr().out

    ckpt = pair.drafter.args.block_size
    before = json.loads(plan("--json"))
    assert before["engine"]["block_size"] == ckpt and "first load tunes" in before["engine"]["block_size_source"]
    assert before["block_size"] == ckpt

    save_result(_stored(tune_key(pair), 6), cache)
    assert "block size 6 (tuned 2026-11-29)" in plan()
    assert json.loads(plan("--block-size", "3", "--json"))["engine"]["block_size_source"] == "flag"
    got = json.loads(plan("--json"))
    assert got["engine"] == {"block_size": 6, "block_size_source": "tuned 2026-11-29", "plain": False}
    assert got["block_size"] == 6  # the memory plan is made for that block too
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    assert main(["verify", *flags, "--prompts", str(prompts), "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "verify: block size 6: the engine's block size (tuned 2026-11-29)" in err, err
    assert main(["generate", *flags, "--prompt", "hello", "--max-tokens", "4", "--json"]) == 0
    g = json.loads(capsys.readouterr().out)
    assert g["engine"]["block_size"] == 6 and g["engine"]["block_size_source"] == "tuned 2026-11-29"
    assert g["engine"]["mode"] == "speculative"


class _Health(http.server.BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


def test_status_names_the_drafter_the_server_runs(tmp_path, monkeypatch, capsys):
    """A server started without --drafter runs the bundled one: status's top-level drafter is the
    one its /health reports, not the (empty) flag."""
    from mlx_spec.server import process

    import psutil

    spec = {
        "enabled": True,
        "method": "dflash2",
        "target": "smollm2-135m-instruct",
        "drafter": "/x/models/smollm2-135m-dflash2",
        "block_size": 6,
        "block_size_source": "tuned 2026-11-29",
        "draft_vocab": None,
    }
    _Health.body = json.dumps({"status": "ok", "speculation": spec}).encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        me = psutil.Process()
        state = process.ServerState(
            me.pid,
            me.create_time(),
            "127.0.0.1",
            server.server_address[1],
            "smollm2-135m-instruct",
            None,
            str(tmp_path / "log"),
            time.time(),
        )
        process.write_state(state, tmp_path / "state")
        monkeypatch.setenv("MLX_SPEC_STATE_DIR", str(tmp_path / "state"))
        from mlx_spec.cli import main

        assert main(["status", "--json"]) == 0
    finally:
        server.shutdown()
    s = json.loads(capsys.readouterr().out)["servers"][0]
    assert s["drafter"] == s["speculation"]["drafter"] == spec["drafter"] and s["health"] == "ready"
