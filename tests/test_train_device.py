"""The prepared GPU session (benchmarks/device/: device_stage.sh, device_run.sh, device_tasks.py; docs/training.md
"When a session has the GPU"): its report renders, and a dry run on this CPU goes end to end."""

import importlib.util
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "benchmarks" / "device"


def _device_tasks():
    spec = importlib.util.spec_from_file_location("device_tasks", DEVICE / "device_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


device_tasks = _device_tasks()


def test_scripts_parse():
    for name in ("device_run.sh", "device_stage.sh"):
        r = subprocess.run(["bash", "-n", str(DEVICE / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_summary_renders_costs_run_and_evals(tmp_path):
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    run.mkdir()
    costs = {
        "t1_ms": 2.0,
        "context": 187,
        "td_ms": {"2": 1.0},
        "tt_ms": {"1": 2.1, "2": 2.4},
        "sizes": [1, 2],
        "reps": 5,
        "draft_vocab": 8192,
        "backend": {"device": "Device(gpu, 0)", "mlx": "0.32.4"},
    }
    (out / "costs.md").write_text(device_tasks.costs_markdown(costs))
    (run / "summary.json").write_text(
        json.dumps(
            {
                "tokens": 1000,
                "seconds": 60.0,
                "batches": 2,
                "step": 48,
                "gen_tok_s": 500.0,
                "steps_s": 3.0,
                "stopped": False,
                "replay_bytes": 2**20,
                "replay_evicted": 0,
            }
        )
    )
    (run / "run_config.json").write_text(json.dumps({"seed": 0, "recipe": {"layers": 2}}))
    row = {"block": 8, "tau": 2.5, "tau_by_kind": {"code": 3.0, "prose": 2.0}}
    (out / "eval_new.json").write_text(
        json.dumps({"drafter": "d", "prompts": 20, "max_tokens": 64, "draft_vocab": 8192, "rows": [row]})
    )
    device_tasks.main(["summary", "--out", str(out), "--run", str(run)])
    text = (out / "summary.md").read_text()
    assert "500.0 tok/s" in text and "| 8 | 2.50 | 3.00 | 2.00 |" in text and "| 2 | 2.400 | 1.20 | 1.000 |" in text


@pytest.mark.slow
def test_device_run_dry_on_this_cpu(tmp_path):
    """The whole script with --dry (no install, tiny settings, the default pair): every step runs
    and the bundle unpacks to the exported drafter, the cost curve and both evals (~2-3 min)."""
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    r = subprocess.run(
        ["bash", "benchmarks/device/device_run.sh", "--dry", "--budget-s", "400"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert {"log.txt", "summary.md", "costs.json"} <= set(files) and len(files) <= 8
    assert all(p.stat().st_size <= 16 * 2**20 for p in out.iterdir())
    bundle = tmp_path / "bundle.tgz"
    bundle.write_bytes(b"".join((out / f).read_bytes() for f in files if f.startswith("bundle.tgz.")))
    with tarfile.open(bundle) as t:
        names = set(t.getnames())
    assert {
        "bundle/drafter/model.safetensors",
        "bundle/eval_new.json",
        "bundle/eval_shipped.json",
        "bundle/costs.md",
        "bundle/summary.json",
    } <= names
    assert "rc 0" in (out / "log.txt").read_text()


def test_device_run_caps_every_step_by_the_time_left(tmp_path):
    """With less time than the pack's reserve, no step runs past it: the probe is skipped at once
    (a limit of 0 would mean no limit at all to `timeout`) and the script stops, in seconds."""
    import time

    env = {**os.environ, "OUT": str(tmp_path / "out")}
    t = time.monotonic()
    r = subprocess.run(
        ["bash", "benchmarks/device/device_run.sh", "--dry", "--budget-s", "45"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = (tmp_path / "out" / "log.txt").read_text()
    assert r.returncode == 1 and "probe: skipped (no time left)" in log, log
    assert time.monotonic() - t < 30
