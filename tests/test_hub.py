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


# -- the catalog's chain entries by name (--model), planned before any download ------------------

MTP_REPO, STRIPPED_REPO = "Qwen/Qwen3.5-27B", "Qwen/Qwen3.6-27B"  # (qwen3.5-27b-mtp, qwen3.6-27b-mtp)
EAGLE_TARGET, EAGLE_REPO = "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


@pytest.fixture(scope="module")
def chain_hub(tmp_path_factory):
    """The catalog's repos of two chain entries served by tiny models: a Qwen3.5 target with its
    MTP head (and one whose conversion stripped it), a llama target and its EAGLE-3 drafter."""
    from helpers import save_chain_family, write_mtp_checkpoint

    root = tmp_path_factory.mktemp("chain")
    q = root / "qwen"
    q.mkdir()
    write_mtp_checkpoint(q, "qwen3_5")
    # sharded as the original repo is (the head's tensors in a shard of their own, named in the
    # index), and the same repo as a conversion that stripped them
    shards = {
        "model.safetensors": "model-00001-of-00002.safetensors",
        "model-mtp.safetensors": "model-00002-of-00002.safetensors",
    }
    index = {"metadata": {}, "weight_map": {}}
    for old, name in shards.items():
        index["weight_map"] |= dict.fromkeys(mx.load(str(q / old)), name)
        (q / old).rename(q / name)
    (q / "model.safetensors.index.json").write_text(json.dumps(index))
    h = Hub()
    h.add_folder(MTP_REPO, q)
    kept = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    h.repos[STRIPPED_REPO] = {k: v for k, v in h.repos[MTP_REPO].items() if k != "model-00002-of-00002.safetensors"}
    h.repos[STRIPPED_REPO]["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": kept}).encode()
    fam = save_chain_family(root / "llama", "llama")
    h.add_folder(EAGLE_TARGET, fam["target"])
    h.add_folder(EAGLE_REPO, fam["eagle"])
    server = start(h)
    yield h
    server.shutdown()


def test_a_chain_entry_by_name_is_planned_from_the_hub_before_any_download(chain_hub, hf_home):
    """plan --model NAME of an MTP entry: its target, the head's rows, read from the hub's headers
    (no weight file fetched); an entry whose repo has no mtp.* tensors is refused by name."""
    chain_hub.log.clear()
    r = run(chain_hub, hf_home, "-m", "mlx_spec", "plan", "--model", "qwen3.5-27b-mtp", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"] == MTP_REPO and out["drafter"] is None and out["chains"] == {"mtp": "in the target"}
    names = [i["name"] for i in out["items"]]
    assert "MTP head weights" in names and "MTP head draft KV cache" in names
    assert chain_hub.weight_hits() and all(h.range and h.range.startswith("bytes=0-") for h in chain_hub.weight_hits())
    assert not [n for n in snapshot_files(hf_home, MTP_REPO) if n.endswith(".safetensors")]
    r = run(chain_hub, hf_home, "-m", "mlx_spec", "plan", "--model", "qwen3.5-27b-mtp")
    assert r.returncode == 0 and r.stdout.startswith(f"target {MTP_REPO}, MTP head in the target"), r.stdout
    assert "MTP head weights" in r.stdout
    chain_hub.log.clear()
    r = run(chain_hub, hf_home, "-m", "mlx_spec", "plan", "--model", "qwen3.6-27b-mtp")
    assert r.returncode == 1 and f"{STRIPPED_REPO} has no mtp.* tensors" in r.stderr, r.stderr
    assert "nothing was downloaded" in r.stderr and not [h for h in chain_hub.weight_hits() if h.range is None]


def test_an_eagle_entry_by_name_downloads_and_drafts_the_targets_own_text(chain_hub, hf_home):
    """generate --model NAME of an EAGLE-3 entry: the target and the drafter's repo, fetched from
    the hub; it drafts with EAGLE-3 (and lookup) and says so; the text is plain decoding's."""
    args = ["-m", "mlx_spec", "generate", "--model", "llama3.1-8b-instruct-eagle3", "--prompt", "hello hello"]
    args += ["--max-tokens", "8", "--json"]
    r = run(chain_hub, hf_home, *args, "--no-tune")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    engine = out["engine"]
    assert engine["target"] == EAGLE_TARGET and engine["drafter"] is None
    assert engine["sources"] == ["eagle", "lookup"] and [k for k, _ in engine["chains"]] == ["eagle"]
    assert engine["block_size_source"] == "not tuned (--no-tune): the stated default prior"
    assert "model.safetensors" in snapshot_files(hf_home, EAGLE_REPO)
    plain = run(chain_hub, hf_home, *args, "--no-draft", offline=True)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["text"] == out["text"]
