"""Plan before download, against a local hub on 127.0.0.1 (tests/hub_server.py) with the real
huggingface-hub client in a subprocess (``HF_ENDPOINT`` is read when huggingface-hub is
imported). The hub serves a tiny mlx-lm target and a DFlash 2 drafter made here; its access log
proves what was fetched."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import save_tiny_pair
from hub_server import Hub, start

T, D, BIG = "org/tiny-target", "org/tiny-drafter", "org/big"
CHUNK = 10 << 20


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    t, d = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    h = Hub()
    h.add_folder(T, t)
    h.add_folder(D, d)
    h.repos["org/no-config"] = {"model.safetensors": h.repos[T]["model.safetensors"], "README.md": b"hi"}
    h.repos["org/broken"] = dict(h.repos[T])
    h.repos["org/wide"] = {
        **h.repos[T],
        "config.json": json.dumps({**json.loads(h.repos[T]["config.json"]), "hidden_size": 128}).encode(),
    }
    h.repos["org/other-arch"] = {
        **h.repos[T],
        "config.json": json.dumps({**json.loads(h.repos[T]["config.json"]), "model_type": "gpt_oss"}).encode(),
    }
    # huggingface-hub writes downloads in 10 MiB chunks, so a resumable cut needs a bigger file
    big = tmp_path_factory.mktemp("big") / "model.safetensors"
    mx.save_safetensors(str(big), {"pad": mx.arange(3 << 20, dtype=mx.float32)})
    h.repos[BIG] = {"config.json": b'{"model_type": "qwen3"}', "model.safetensors": big.read_bytes()}
    server = start(h)
    yield h
    server.shutdown()


@pytest.fixture()
def hf_home(tmp_path):
    return tmp_path / "hf"


def env_for(hub, hf_home, offline=False) -> dict:
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run(hub, hf_home, *args, offline=False, timeout=240):
    return subprocess.run(
        [sys.executable, *args], env=env_for(hub, hf_home, offline), capture_output=True, text=True, timeout=timeout
    )


def start_process(hub, hf_home, *args):
    return subprocess.Popen(
        [sys.executable, *args], env=env_for(hub, hf_home), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def snapshot_files(hf_home: Path, repo: str) -> set[str]:
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots"
    return {p.name for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def incomplete(hf_home: Path, repo: str) -> list[Path]:
    return list((hf_home / "hub" / f"models--{repo.replace('/', '--')}" / "blobs").glob("*.incomplete"))


GEN = [
    "-m",
    "mlx_spec",
    "generate",
    "--target",
    T,
    "--drafter",
    D,
    "--prompt",
    "hi",
    "--max-tokens",
    "4",
    "--block-size",
    "4",
]


def test_refused_plan_fetches_no_weight_file(hub, hf_home):
    hub.log.clear()
    r = run(hub, hf_home, *GEN, "--context", "100000000")
    assert r.returncode == 1, r.stderr
    assert "memory plan needs" in r.stderr and "--force" in r.stderr
    sizes = {len(hub.repos[T]["model.safetensors"]), len(hub.repos[D]["model.safetensors"])}
    weights = hub.weight_hits()
    assert weights, "the plan reads the safetensors headers"
    for h in weights:  # only ranged reads of the headers, never a whole weight file
        assert h.range and h.range.startswith("bytes=0-") and h.sent < min(sizes), h
    assert "model.safetensors" not in snapshot_files(hf_home, T) | snapshot_files(hf_home, D)
    assert "config.json" in snapshot_files(hf_home, T)  # the small files are there for the next try
    assert not incomplete(hf_home, T) and not incomplete(hf_home, D)


def test_download_run_then_offline(hub, hf_home):
    r = run(hub, hf_home, *GEN, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["engine"]["method"] == "dflash2" and out["tokens"] > 0
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= snapshot_files(hf_home, T)
    # offline afterwards: no request reaches the hub, the same output
    hub.log.clear()
    r2 = run(hub, hf_home, *GEN, "--json", offline=True)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["text"] == out["text"] and hub.log == []
    # even without HF_HUB_OFFLINE a complete download loads without asking the hub
    run(hub, hf_home, *GEN, "--json")
    assert not [h for h in hub.log if h.path.startswith("/api/")]
    # offline and never downloaded: a clear message naming the repo
    r3 = run(
        hub,
        hf_home,
        "-m",
        "mlx_spec",
        "generate",
        "--target",
        "org/broken",
        "--drafter",
        D,
        "--prompt",
        "x",
        "--no-tune",
        offline=True,
    )
    assert r3.returncode == 1 and "org/broken" in r3.stderr and "HF_HUB_OFFLINE=1" in r3.stderr


ERRORS = {  # target -> what the refusal says; each is refused before any weight byte is fetched
    "org/missing": "no such repo",
    "org/broken": "the hub answered HTTP 500",  # the hub fails (injected below)
    "org/no-config": "has no config.json",
    "org/other-arch": "architecture 'gpt_oss' is not supported",
    "org/wide": "hidden_size 64 != target's 128",
}
PLAN_EACH = """
import json, sys
from mlx_spec.config import LoadConfig
from mlx_spec.errors import MlxSpecError
from mlx_spec.session import plan_session
out = {}
for target in sys.argv[1:]:
    try:
        plan_session(LoadConfig(target=target, drafter="org/tiny-drafter", tune=False))
        out[target] = "planned"
    except MlxSpecError as e:
        out[target] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_hub_errors_are_named(hub, hf_home):
    hub.log.clear()
    hub.fail["/api/models/org/broken"] = 500
    try:
        r = run(hub, hf_home, "-c", PLAN_EACH, *ERRORS)
    finally:
        hub.fail.clear()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for target, message in ERRORS.items():
        assert target in got[target] and message in got[target], got[target]
        assert not incomplete(hf_home, target) and "model.safetensors" not in snapshot_files(hf_home, target)
    assert not [h for h in hub.weight_hits() if h.range is None]


def test_dropped_connection_resumes(hub, hf_home):
    code = f"from mlx_spec import hub; print(hub.download({BIG!r}))"
    hub.cut[(BIG, "model.safetensors")] = CHUNK + 4096  # the connection drops after one written chunk
    hub.log.clear()
    r = run(hub, hf_home, "-c", code)
    assert r.returncode == 0, r.stderr
    assert [h.range for h in hub.weight_hits()] == [None, f"bytes={CHUNK}-"]  # resumed, not restarted
    path = Path(r.stdout.strip().splitlines()[-1])
    assert (path / "model.safetensors").read_bytes() == hub.repos[BIG]["model.safetensors"]
    assert not incomplete(hf_home, BIG)


def test_killed_download_leaves_nothing_half_written(hub, hf_home):
    code = f"from mlx_spec import hub; print(hub.download({BIG!r}))"
    hub.stall[(BIG, "model.safetensors")] = CHUNK + 4096  # the transfer hangs after one written chunk
    hub.released.clear()
    p = start_process(hub, hf_home, "-c", code)
    try:
        deadline = time.monotonic() + 120
        while not (incomplete(hf_home, BIG) and incomplete(hf_home, BIG)[0].stat().st_size >= CHUNK):
            assert time.monotonic() < deadline and p.poll() is None, "the download did not start"
            time.sleep(0.1)
        p.send_signal(signal.SIGKILL)  # the process dies mid-download (closed terminal, crash)
        p.wait(60)
    finally:
        hub.released.set()
        if p.poll() is None:
            p.kill()
    assert "model.safetensors" not in snapshot_files(hf_home, BIG)  # never linked into the snapshot
    assert len(incomplete(hf_home, BIG)) == 1  # huggingface-hub's per-process partial file
    r = run(hub, hf_home, "-c", code)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert (path / "model.safetensors").read_bytes() == hub.repos[BIG]["model.safetensors"]
    assert not incomplete(hf_home, BIG)  # the dead process's partial file is cleared
