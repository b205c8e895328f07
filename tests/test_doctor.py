"""`mlx_spec doctor` on the tiny pair: a report that parses, with every section filled."""

from __future__ import annotations

import json

from mlx_spec.cli import main

from helpers import save_tiny_pair


def test_doctor_json_reports_backend_precision_costs_and_acceptance(tmp_path, capsys):
    t, d = save_tiny_pair(tmp_path)
    assert main(["doctor", "--json", "--target", str(t), "--drafter", str(d), "--reps", "1", "--max-tokens", "8"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["backend"]["kind"] == "cpu" and r["backend"]["budget"] > 0
    assert "float32" in r["precision"]["why"] or r["precision"]["why"]
    c = r["costs"]
    assert c["t1_ms"] > 0 and set(c["tt_ms"]) >= {"2", "4", "8", "16"} and set(c["td_ms"]) >= {"2", "16"}
    a = r["acceptance"]
    assert set(a["tau"]) == {"code-1", "math-1", "prose-1"} and all(v is None or v >= 1 for v in a["tau"].values())
    assert a["drafter"]["passes"] > 0 and a["drafter"]["nonfinite"] == 0
    assert "tuning" in r and r["elapsed_s"] > 0
    # a fixed block (no policy): the drafts are read with the target's choices, one wait a cycle
    assert r["host_syncs_per_cycle"] == 1.0


def test_doctor_text_under_the_mac_switch_names_the_faked_backend(tmp_path, capsys, monkeypatch):
    from mlx_spec import backend

    t, d = save_tiny_pair(tmp_path)
    with backend.use("metal"):
        assert main(["doctor", "--target", str(t), "--drafter", str(d), "--reps", "1", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    from mlx_spec.quantize import GPU_DRAFTER_ACTIVATIONS

    assert "backend      metal" in out and "faked" in out and f"{GPU_DRAFTER_ACTIVATIONS} activations" in out
    assert "Tt(B)" in out and "tau" in out and "host syncs   1.0 per cycle" in out
