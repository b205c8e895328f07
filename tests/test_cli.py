"""`mlx_spec generate` end to end on tiny models saved to disk."""

import json
import subprocess
import sys

from mlx_spec.cli import main

import pytest
from helpers import greedy_reference, save_tiny_pair


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_matches_mlx_lm(pair_dirs, capsys):
    from mlx_lm import load

    t, d = pair_dirs
    model, tok = load(str(t))
    prompt_ids = tok.encode("hello world")
    ref = greedy_reference(model, prompt_ids, 24)
    ref_text = tok.decode([x for x in ref if x not in tok.eos_token_ids])
    for B in (2, 4, 8):
        out = _json(
            capsys,
            [
                "generate",
                "--target",
                str(t),
                "--drafter",
                str(d),
                "--prompt",
                "hello world",
                "--max-tokens",
                "24",
                "--block-size",
                str(B),
                "--no-adaptive",
                "--json",
            ],
        )
        assert out["text"] == ref_text
        assert out["engine"] == {
            "method": "dflash2",
            "drafter": str(d),
            "block_size": B,
            "block_size_source": "flag",
            "target": str(t),
            "adaptive_max": 0,
            "draft_vocab": 0,
            "drafter_precision": "float weights, float32 (as loaded) activations",
            "mode": "speculative",
            "pinned": True,
            "group": {"size": 1, "rank": 0, "backend": "none", "sharded": False},
            "sources": ["dflash", "lookup"],
            "chains": [],
            "kv_cache": "",
            "draft_window": 0,
            "depths": [],
        }
        assert out["group"] == out["engine"]["group"]
        s = out["stats"]
        assert s["cycles"] > 0 and s["drafted"] > 0
        for k in (
            "cycles",
            "drafted",
            "accepted",
            "mean_acceptance_length",
            "acceptance_rate",
            "acceptance_by_position",
            "draft_ms",
            "verify_ms",
            "prefill_tps",
            "decode_tps",
        ):
            assert k in s
        assert len(s["acceptance_by_position"]) == B - 1
        assert out["prompt_tokens"] == len(prompt_ids)
    plain = _json(
        capsys,
        ["generate", "--target", str(t), "--no-draft", "--prompt", "hello world", "--max-tokens", "24", "--json"],
    )
    assert plain["text"] == ref_text and plain["engine"]["method"] == "plain"
    assert plain["stats"]["drafted"] == 0


def test_generate_adaptive_is_lossless_and_engaged(pair_dirs, capsys):
    """The per-cycle policy (the default; --adaptive is an accepted no-op): it picks each cycle's
    source and block (a random drafter is soon not worth drafting for: plain steps), and the text
    is still the target's; --no-adaptive drafts the fixed block every cycle."""
    t, d = pair_dirs
    fixed = _json(
        capsys,
        [
            "generate",
            "--target",
            str(t),
            "--drafter",
            str(d),
            "--prompt",
            "hello world",
            "--max-tokens",
            "40",
            "--block-size",
            "4",
            "--no-adaptive",
            "--json",
        ],
    )
    assert fixed["engine"]["adaptive_max"] == 0 and fixed["stats"]["plain_cycles"] == 0
    out = _json(
        capsys,
        [
            "generate",
            "--target",
            str(t),
            "--drafter",
            str(d),
            "--prompt",
            "hello world",
            "--max-tokens",
            "40",
            "--block-size",
            "4",
            "--adaptive",
            "--json",
        ],
    )
    assert out["text"] == fixed["text"]
    assert out["engine"]["adaptive_max"] == 16 and out["engine"]["block_size"] == 4
    s = out["stats"]
    assert s["drafted"] > 0 and s["plain_cycles"] + s["drafted_cycles"] == s["cycles"]
    assert s["plain_cycles"] > 0 or "lookup" in s["sources"]  # not the fixed block every cycle
    assert len(s["cycle_trace"]) == s["cycles"] and sum(s["block_sizes"].values()) == s["cycles"]
    assert all(L == 4 for src, L, _ in s["cycle_trace"][:-1] if src == "dflash")  # --block-size pins it
    default = _json(
        capsys,
        [
            "generate",
            "--target",
            str(t),
            "--drafter",
            str(d),
            "--prompt",
            "hello world",
            "--max-tokens",
            "40",
            "--block-size",
            "4",
            "--json",
        ],
    )
    assert default["text"] == fixed["text"] and default["engine"]["adaptive_max"] == 16


def test_chat_template_and_stop(pair_dirs, capsys):
    t, d = pair_dirs
    full = _json(
        capsys,
        [
            "generate",
            "--target",
            str(t),
            "--drafter",
            str(d),
            "--chat",
            "--prompt",
            "hi",
            "--max-tokens",
            "30",
            "--no-tune",
            "--json",
        ],
    )
    assert full["engine"]["block_size_source"] == "checkpoint (--no-tune)"
    text = full["text"]
    if len(text) > 4:
        stop = text[2:4]
        cut = _json(
            capsys,
            [
                "generate",
                "--target",
                str(t),
                "--drafter",
                str(d),
                "--chat",
                "--prompt",
                "hi",
                "--max-tokens",
                "30",
                "--stop",
                stop,
                "--no-tune",
                "--json",
            ],
        )
        assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop"


def test_no_silent_fallback(pair_dirs, tmp_path, capsys):
    t, d = pair_dirs
    # a target other than the default without a drafter: refuse, name the fix
    assert main(["generate", "--target", str(t), "--prompt", "x", "--max-tokens", "2"]) == 1
    assert "--no-draft" in capsys.readouterr().err
    # a broken drafter: refuse, never plain
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "--target", str(t), "--drafter", str(tmp_path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "not a DFlash drafter" in err
    assert main(["generate", "--target", str(t), "--drafter", str(d), "--prompt", "x", "--block-size", "1"]) == 1
    assert "--block-size must be >= 2" in capsys.readouterr().err


def test_console_script_streams(pair_dirs):
    t, d = pair_dirs
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec",
            "generate",
            "--target",
            str(t),
            "--drafter",
            str(d),
            "--prompt",
            "abc",
            "--max-tokens",
            "8",
            "--no-tune",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "engine: dflash2 speculative decoding" in r.stderr and "tau" in r.stderr
