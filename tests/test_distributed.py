"""Speculative decoding with the target sharded over two processes (MLX ``ring`` backend on
127.0.0.1), started as mlx.launch starts them: MLX_RANK + MLX_HOSTFILE (tests/distributed_worker.py).

- greedy: the 2-rank output equals single-process plain and single-process speculative decoding,
  token for token (tiny qwen3 and qwen3_5 hybrid targets, block sizes 2/4/8, DFlash 1 and 2);
- T > 0, fixed seed: the ranks agree on every committed token (checked every step);
- a follower that dies or hangs mid-generation fails the request within the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mlx_spec import distributed
from mlx_spec.decode import spec_steps
from mlx_spec.errors import UnsupportedModel
from mlx_spec.loading import load_drafter, load_target_model, save_drafter
from mlx_spec.server import process
from mlx_spec.target import Target

import mlx.core as mx
import pytest
from helpers import greedy_reference, save_tiny_tokenizer, tiny_drafter, tiny_model

HERE = Path(__file__).resolve().parent
PROMPT = [1, 5, 9, 17, 33, 2, 8, 40, 77]
N = 20
BLOCKS = (2, 4, 8)
# each block size on two ranks for each target, each drafter at some of them: the sharded part is
# the target's verify pass (the drafter is replicated, the same on every rank)
DRAFTER_BLOCKS = {"dflash1": (2, 8), "dflash2": (4,)}
LAUNCH_S = 90  # one launch of two ranks, all its cases included


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _build(kind: str):
    if kind == "qwen3_5":
        from test_hybrid import build

        return build("qwen3_5")
    return tiny_model(kind)


def _save(root: Path, kind: str, *, no_eos: bool = False) -> dict:
    """A tiny target with two drafters (DFlash 1 and DFlash 2) under root/kind. ``no_eos``: the
    head's row for the end-of-turn id is zero, so greedy replies run to max_tokens."""
    from mlx_lm.utils import save_config, save_model

    d = root / (kind + ("-no-eos" if no_eos else ""))
    model, cfg = _build(kind)
    if no_eos:
        lm = getattr(model, "language_model", model)
        lm.lm_head.weight = lm.lm_head.weight * (mx.arange(cfg["vocab_size"]) != 2)[:, None]
        mx.eval(model.parameters())
    save_model(d / "target", model)
    save_config(dict(cfg), d / "target" / "config.json")
    save_tiny_tokenizer(d / "target")
    out = {"target": str(d / "target")}
    for v2 in (False, True):
        _, drafter, dcfg = tiny_drafter(model, cfg, v2=v2)
        save_drafter(drafter, d / f"dflash{2 if v2 else 1}", dcfg)
        out[f"dflash{2 if v2 else 1}"] = str(d / f"dflash{2 if v2 else 1}")
    return out


def launch(tmp: Path, job: dict, *, timeout: float = LAUNCH_S, env: dict | None = None, first: int = 0):
    """Two ranks of tests/distributed_worker.py; returns (rank 0's JSON, return codes, seconds,
    logs). Once rank ``first`` is done, a rank still running after 5 s is killed (a stopped rank)."""
    ports = _free_ports(2)
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    job = dict(job, out=str(tmp / "out.json"))
    (tmp / "job.json").write_text(json.dumps(job))
    # (the ranks import the mlx_spec this test runs on: a PYTHONPATH already set stays, after HERE)
    path = os.pathsep.join([str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    base = dict(os.environ, MLX_HOSTFILE=str(hostfile), PYTHONPATH=path, **(env or {}))
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "distributed_worker.py"), str(tmp / "job.json")],
            env=dict(base, MLX_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        order = [first] + [r for r in range(len(procs)) if r != first]
        codes, logs = [None] * len(procs), [""] * len(procs)
        for i in order:
            p = procs[i]
            left = max(1.0, timeout - (time.monotonic() - t0))
            try:
                out, _ = p.communicate(timeout=left if i == first else min(left, 5.0))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            codes[i] = p.returncode
            logs[i] = out.decode(errors="replace")[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    took = time.monotonic() - t0
    if first != 0:
        return None, codes, took, logs
    assert (tmp / "out.json").exists(), f"rank 0 wrote nothing (codes {codes}):\n" + "\n---\n".join(logs)
    return json.loads((tmp / "out.json").read_text()), codes, took, logs


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {kind: _save(root, kind) for kind in ("qwen3", "qwen3_5")}


def _single(pair: dict, name: str, block: int, **sampling) -> list[int]:
    from mlx_spec.sampling import SamplingConfig

    model, _ = load_target_model(pair["target"])
    drafter, _ = load_drafter(pair[name])
    target = Target(model, drafter.args.target_layer_ids)
    drafter.bind(target.embed, target.head)
    toks = []
    for s in spec_steps(target, drafter, PROMPT, block_size=block, max_tokens=N, sampling=SamplingConfig(**sampling)):
        toks.extend(s.tokens)
    return toks


def test_greedy_two_ranks_equal_single_process(pairs, tmp_path):
    """One launch: for each target, plain (block 1) and blocks 2/4/8 on 2 ranks (DFlash 1 at 2
    and 8, DFlash 2 at 4 and with the adaptive policy)."""
    phases = []
    for kind, pair in pairs.items():
        for name in ("dflash1", "dflash2"):
            blocks = (1,) + DRAFTER_BLOCKS[name] if name == "dflash1" else DRAFTER_BLOCKS[name]
            cases = [{"prompt": PROMPT, "block": b, "max_tokens": N} for b in blocks]
            if name == "dflash2":  # the adaptive draft policy (DFlash + lookup): rank 0 decides
                cases.append({"prompt": PROMPT, "block": 8, "max_tokens": N, "policy": True})
                # and one whose costs make it stay plain: rank 0's stays_plain answers are shared
                cases.append({"prompt": PROMPT, "block": 8, "max_tokens": N, "policy": "plain"})
            phases.append({"target": pair["target"], "drafter": pair[name], "kind": kind, "name": name, "cases": cases})
    assert sorted(b for blocks in DRAFTER_BLOCKS.values() for b in blocks) == list(BLOCKS)  # every size runs
    got, codes, took, logs = launch(tmp_path, {"phases": phases})
    assert codes == [0, 0], logs
    assert got["group"] == {"size": 2, "rank": 0, "backend": "ring", "sharded": True}
    results = got["results"]
    assert all(r["error"] is None for r in results), results
    by = {
        (phases[r["phase"]]["kind"], phases[r["phase"]]["name"], r["block"], r["policy"]): r["tokens"] for r in results
    }
    for kind, pair in pairs.items():
        model, _ = load_target_model(pair["target"])
        plain = greedy_reference(model, PROMPT, N)
        assert by[(kind, "dflash1", 1, False)] == plain, kind  # 2-rank plain == 1-process plain
        assert by[(kind, "dflash2", 8, True)] == plain, kind  # with the shared adaptive policy
        assert by[(kind, "dflash2", 8, "plain")] == plain, kind  # a policy that stays plain
        # ... and it did: mostly plain cycles (a DFlash probe now and then), which decode pipelines
        # when a policy decides, asking rank 0's stays_plain over the wire: each pipelined step
        # costs its "step" message and that one-int answer, the choose after it nothing; a cycle
        # that is not plain: step, choose, pick (every greedy DFlash pass: it may trim) and one
        # stays_plain ending a run, and the plain step after it starts a run with a choose
        i = next(i for i, r in enumerate(results) if r["policy"] == "plain" and phases[r["phase"]]["kind"] == kind)
        mine, before = results[i], results[i - 1]
        src = mine["sources"][1:]
        assert src.count("plain") >= len(src) / 2, src
        sent = mine["wire"]["messages"] - before["wire"]["messages"]
        other = len(src) - src.count("plain")
        assert 2 * len(src) <= sent <= 2 * len(src) + 3 * other + 4, (sent, src)
        for name, blocks in DRAFTER_BLOCKS.items():
            for b in blocks:
                assert by[(kind, name, b, False)] == plain, (kind, name, b)
            # one block size per drafter against 1-process speculation too
            assert _single(pair, name, blocks[0]) == plain, (kind, name, blocks[0])


def test_chain_drafters_on_two_ranks_equal_plain_decoding(pairs, tmp_path):
    """An MTP head and an EAGLE-3 drafter beside DFlash on a sharded target: rank 0's policy
    drafts each source in turn (shared with the other rank, whose chain caches follow), and
    the output is the target's."""
    from helpers import make_eagle, write_mtp_checkpoint

    pair = pairs["qwen3"]
    write_mtp_checkpoint(tmp_path / "mtp", "qwen3")
    make_eagle(tmp_path / "eagle", "eagle", reduced=True, kind="qwen3")
    cases = [{"prompt": PROMPT + PROMPT, "block": 4, "max_tokens": N, "policy": "chains"}]
    phase = {"target": pair["target"], "drafter": pair["dflash2"], "kind": "qwen3", "name": "dflash2", "cases": cases}
    got, codes, _, logs = launch(
        tmp_path, {"phases": [dict(phase, mtp=str(tmp_path / "mtp"), eagle=str(tmp_path / "eagle"))]}
    )
    assert codes == [0, 0], logs
    (r,) = got["results"]
    assert r["error"] is None, r
    model, _ = load_target_model(pair["target"])
    assert r["tokens"] == greedy_reference(model, PROMPT + PROMPT, N)
    assert {"mtp", "eagle", "dflash"} <= set(r["sources"])


def test_sampled_ranks_agree_then_a_hung_rank_is_detected(pairs, tmp_path):
    """T > 0 with a seed: every step all_gathers the committed tokens and compares (check mode);
    the 2-rank run also equals the 1-process run with that seed (the same key, the same logits).
    Then, in the same launch, rank 1 hangs mid-generation: rank 0's watchdog fails the request
    within the timeout and reports the group unhealthy."""
    pair = pairs["qwen3"]
    timeout = 4.0
    cases = [
        {"prompt": PROMPT, "block": 4, "max_tokens": N, "temperature": 0.8, "seed": 7},
        {"prompt": PROMPT, "block": 8, "max_tokens": N, "temperature": 1.0, "seed": None},
        {"prompt": PROMPT, "block": 4, "max_tokens": N, "temperature": 0.8, "seed": 7, "stop_after": 5},
    ]
    phases = [
        {"target": pair["target"], "drafter": pair["dflash2"], "cases": cases},
        {
            "target": pair["target"],
            "drafter": pair["dflash2"],
            "cases": [{"prompt": PROMPT, "block": 4, "max_tokens": 200}],
        },
    ]
    job = {"phases": phases, "die_rank": 1, "die_phase": 1, "die_step": 3, "die_how": "hang", "timeout": timeout}
    got, codes, _, logs = launch(tmp_path, job, env={distributed.CHECK_ENV: "1"})
    assert codes[0] == 0, logs
    r = got["results"]
    assert all(x["error"] is None for x in r[:3]), r
    assert len(r[0]["tokens"]) == N and len(r[1]["tokens"]) == N
    assert r[0]["tokens"] == _single(pair, "dflash2", 4, temperature=0.8, seed=7)
    assert r[2]["tokens"] == r[0]["tokens"][: len(r[2]["tokens"])]  # a stop mid-run, then the next case ran
    hung = r[3]
    assert hung["error"].startswith("GroupFailed") and "within 4 s" in hung["error"], hung
    assert hung["healthy"] is False and hung["health"]["healthy"] is False
    assert timeout <= got["watchdog_s"] < timeout + 3, got


@pytest.mark.slow  # the server test kills a rank too
def test_dead_rank_fails_the_request(pairs, tmp_path):
    pair = pairs["qwen3"]
    job = {
        "phases": [
            {
                "target": pair["target"],
                "drafter": pair["dflash2"],
                "cases": [{"prompt": PROMPT, "block": 4, "max_tokens": 200}],
            }
        ],
        "die_rank": 1,
        "die_step": 3,
        "die_how": "exit",
        "timeout": 4.0,
    }
    got, codes, took, logs = launch(tmp_path, job, timeout=60)
    (res,) = got["results"]
    assert res["error"] and res["error"].startswith("GroupFailed"), res
    assert res["healthy"] is False and res["health"]["healthy"] is False and res["health"]["error"]
    assert codes[0] == 0, logs


@pytest.mark.slow
def test_a_follower_exits_when_rank_0_hangs(pairs, tmp_path):
    """Rank 0 stops (SIGSTOP) mid-generation: the follower's watchdog ends it (exit code 3)
    within the timeout instead of waiting in a collective forever."""
    pair = pairs["qwen3"]
    job = {
        "phases": [
            {
                "target": pair["target"],
                "drafter": pair["dflash2"],
                "cases": [{"prompt": PROMPT, "block": 4, "max_tokens": 200}],
            }
        ],
        "leader_stop_step": 3,
        "timeout": 4.0,
    }
    _, codes, took, logs = launch(tmp_path, job, timeout=60, first=1)
    assert codes[1] == 3, logs
    assert "no answer from the group within 4 s" in logs[1]


def test_refuses_a_target_without_shard():
    class Group:
        def size(self):
            return 2

    model, _ = tiny_model("qwen3")
    assert distributed.shard_problems(model, 2) == []
    assert "num_key_value_heads=2 is not divisible by 4" in distributed.shard_problems(model, 4)[0]
    import mlx.nn as nn

    class NoShard(nn.Module):
        model_type = "mystery"

    with pytest.raises(UnsupportedModel, match="'mystery' model defines no shard"):
        distributed.shard_target(NoShard(), Group())


def test_a_vocabulary_that_does_not_split_over_the_ranks_is_refused_by_name():
    """A 47-token qwen3_5 vocabulary over 2 ranks ended in mlx-lm's AssertionError traceback."""
    from test_hybrid import build

    class Group:
        def size(self):
            return 2

    model, _ = build("qwen3_5", vocab_size=47)
    assert distributed.shard_problems(model, 2) == [
        "vocab_size=47 is not divisible by 2 processes ('qwen3_5' splits its output head by vocabulary)"
    ]
    with pytest.raises(UnsupportedModel, match="vocab_size=47 is not divisible by 2"):
        distributed.shard_target(model, Group())
    from mlx_lm.models import qwen3_5
    from test_hybrid import CONFIGS

    tied = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(dict(CONFIGS["qwen3_5"], vocab_size=47, tie_word_embeddings=True)))
    assert distributed.shard_problems(tied, 2) == []  # a tied head is not split
    assert distributed.shard_problems(build("qwen3_5", vocab_size=48)[0], 2) == []


def test_single_process_is_untouched():
    assert not distributed.launched({})
    assert distributed.init_group(environ={}) is None
    assert distributed.group_info(None).as_dict() == {"size": 1, "rank": 0, "backend": "none", "sharded": False}
    assert distributed.launched({"MLX_RANK": "0", "MLX_HOSTFILE": "/x"})
    assert mx.distributed.is_available()


def test_plan_per_rank(pairs):
    """One rank's plan: half the sharded weights and KV, the replicated rest whole; the fewest
    machines of a budget that hold the pair."""
    from dataclasses import replace

    from mlx_spec import memory
    from mlx_spec.quantize import QuantChoice, safetensors_tensors

    pair = pairs["qwen3_5"]
    read = lambda p: json.loads((Path(p) / "config.json").read_text())  # noqa: E731
    quant = QuantChoice(None, None, 64, False, "")
    p1 = memory.inputs_for(
        read(pair["target"]),
        safetensors_tensors(pair["target"]),
        read(pair["dflash2"]),
        safetensors_tensors(pair["dflash2"]),
        quant,
        metal=False,
    )
    p2 = replace(p1, ranks=2)
    one = {i.name: i.bytes for i in memory.items(p1, 4096, 8)}
    two = {i.name: i.bytes for i in memory.items(p2, 4096, 8)}
    assert 0 < p1.replicated_weights < p1.target_weights
    assert two["target weights"] == p1.replicated_weights + (p1.target_weights - p1.replicated_weights) // 2
    assert two["target KV cache"] == one["target KV cache"] // 2
    assert two["recurrent state"] < one["recurrent state"]
    assert two["drafter weights"] == one["drafter weights"]  # replicated
    assert two["drafter context cache"] == one["drafter context cache"]
    t1, t2 = sum(one.values()), sum(two.values())
    budget = (t1 + t2) // 2
    assert memory.ranks_needed(p1, context=4096, block_size=8, budget=budget) == 2
    assert memory.ranks_needed(p1, context=4096, block_size=8, budget=t1) == 1
    assert memory.ranks_needed(p1, context=4096, block_size=8, budget=1) is None


def test_server_reports_a_dead_rank(pairs, tmp_path):
    """`mlx_spec serve` on two ranks: rank 0 serves and reports the group on /health; killing
    rank 1 mid-generation fails that request with 503 group_failed within the timeout, and rank 0
    stays up, answering /health with the group unhealthy."""
    import threading

    import httpx

    pair = _save(tmp_path, "qwen3", no_eos=True)
    ring = _free_ports(2)
    (http,) = _free_ports(1)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
    env = dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_SPEC_GROUP_TIMEOUT="20")
    cmd = [
        sys.executable,
        "-m",
        "mlx_spec",
        "serve",
        "--target",
        pair["target"],
        "--drafter",
        pair["dflash2"],
        "--block-size",
        "4",
        "--port",
        str(http),
    ]
    procs = [
        subprocess.Popen(
            cmd, env=dict(env, MLX_RANK=str(r)), stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"rank{r}.log", "w")
        )
        for r in (0, 1)
    ]
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + LAUNCH_S
        while True:
            assert time.monotonic() < deadline, (tmp_path / "rank0.log").read_text()
            assert procs[0].poll() is None, (tmp_path / "rank0.log").read_text()
            try:
                h = httpx.get(f"{url}/health", timeout=2)
                if h.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        group = {"size": 2, "rank": 0, "backend": "ring", "sharded": True}
        body = h.json()
        assert body["speculation"]["group"] == group and body["group"]["healthy"] is True
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8

        got = {}

        def long_request():
            t = time.monotonic()
            try:
                got["r"] = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3000}, timeout=60)
            except httpx.HTTPError as e:  # named below instead of a bare KeyError
                got["e"] = e
            got["s"] = time.monotonic() - t

        th = threading.Thread(target=long_request)
        th.start()
        time.sleep(1.5)
        procs[1].kill()
        th.join(60)
        assert "r" in got, f"the request on the killed group got no answer: {got.get('e')!r} after {got.get('s')} s"
        r = got["r"]
        if r.status_code == 200:  # the random target ended its reply (a stop) before the kill landed:
            t = time.monotonic()  # then the next request must fail on the dead rank, as fast
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3000}, timeout=60)
            got["s"] = time.monotonic() - t
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "group_failed" and "rank" in r.json()["error"]["message"]
        assert got["s"] < 45, got["s"]  # the group timeout (20 s) plus slack for a loaded machine
        h = httpx.get(f"{url}/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "group_failed"
        assert h.json()["group"]["healthy"] is False and h.json()["group"]["size"] == 2
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
        assert again.status_code == 503 and again.json()["error"]["code"] == "group_failed"
        procs[0].terminate()
        assert procs[0].wait(20) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _cli(*argv, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``mlx_spec ARGV``; past ``timeout``, Ctrl-C first (bench stops the group it started, in its
    own session, which a plain kill of the CLI would leave running), then SIGKILL."""
    cmd = [sys.executable, "-m", "mlx_spec", *argv]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_detached_group_is_stopped_with_every_rank(tmp_path):
    """`serve --ranks 2 --detach` runs mlx.launch in the background (ring on 127.0.0.1): the
    state file holds mlx.launch's pid and both ranks', `status --json` shows the group, a request
    runs on it, and `mlx_spec stop` ends mlx.launch and every rank within its bounded wait."""
    import httpx
    import psutil

    pair = _save(tmp_path, "qwen3", no_eos=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RANK") and k not in distributed.LAUNCH_ENV}
    env.update(MLX_SPEC_STATE_DIR=str(tmp_path / "state"), MLX_SPEC_GROUP_TIMEOUT="30", OPENBLAS_NUM_THREADS="1")
    (http,) = _free_ports(1)
    pids: list[int] = []
    try:
        r = _cli(
            "serve",
            "--target",
            pair["target"],
            "--drafter",
            pair["dflash2"],
            "--block-size",
            "4",
            "--port",
            str(http),
            "--ranks",
            "2",
            "--detach",
            env=env,
            timeout=LAUNCH_S,
        )
        assert r.returncode == 0, r.stderr
        assert "rank 0 pid" in r.stdout and "rank 1 pid" in r.stdout, r.stdout
        state = json.loads((tmp_path / "state" / f"server-{http}.json").read_text())
        group = state["group"]
        pids = [state["pid"]] + [x["pid"] for x in group["ranks"]]
        assert [x["rank"] for x in group["ranks"]] == [0, 1] and group["size"] == 2 and group["backend"] == "ring"
        assert all(psutil.pid_exists(p) for p in pids)

        st = _cli("status", "--json", env=env, timeout=60)
        (srv,) = json.loads(st.stdout)["servers"]
        g = srv["group"]
        assert srv["health"] == "ready" and g["size"] == 2 and g["sharded"] is True and g["healthy"] is True
        assert g["launcher_pid"] == state["pid"] and all(x["alive"] for x in g["ranks"]), g
        ok = httpx.post(f"http://127.0.0.1:{http}/v1/completions", json={"prompt": "hi", "max_tokens": 6}, timeout=60)
        assert ok.status_code == 200 and ok.json()["speculation"]["group"]["size"] == 2

        t = time.monotonic()
        stop = _cli("stop", "--timeout", "15", env=env, timeout=60)
        assert stop.returncode == 0 and "stopped group server" in stop.stdout, stop.stdout + stop.stderr
        assert time.monotonic() - t < 40
        gone = lambda p: not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE  # noqa: E731
        assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]
        assert json.loads(_cli("status", "--json", env=env, timeout=60).stdout)["servers"] == []
    finally:  # whatever a failure left: mlx.launch leads its own process group, its local ranks in it
        left = tmp_path / "state" / f"server-{http}.json"
        if left.exists():
            s = json.loads(left.read_text())
            pids += [x["pid"] for x in (s.get("group") or {}).get("ranks", [])]
            if process.alive(s["pid"], s["create_time"]):
                os.killpg(s["pid"], signal.SIGKILL)
        for p in pids:
            try:
                psutil.Process(p).kill()
            except psutil.NoSuchProcess:
                pass


def test_bench_reports_two_rank_pass_costs_beside_one_process(pairs, tmp_path):
    """`bench --costs-only --ranks 2`: T1, Td(B), Tt(B) measured in one process, then on two
    ranks that mlx.launch starts (ring, 127.0.0.1), with the all-reduce chain of one verify pass
    and the per-step message; side by side in one report."""
    pair = pairs["qwen3"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there " * 8}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RANK") and k not in distributed.LAUNCH_ENV}
    env.update(OPENBLAS_NUM_THREADS="1")
    r = _cli(
        "bench",
        "--target",
        pair["target"],
        "--drafter",
        pair["dflash2"],
        "--costs-only",
        "--ranks",
        "2",
        "--block-sizes",
        "2,4",
        "--repeats",
        "1",
        "--prompts",
        str(prompts),
        "--time-budget",
        "120",
        "--json",
        env=env,
        timeout=LAUNCH_S + 60,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    one, two = rep["single"], rep["ranks"]
    assert one["group"]["size"] == 1 and two["group"] == {"size": 2, "rank": 0, "backend": "ring", "sharded": True}
    assert rep["launch"]["ranks"] == 2 and rep["launch"]["hosts"] == ["127.0.0.1"]
    for c in (one, two):
        assert c["context"] == one["context"] > 8
        assert c["costs"]["t1_ms"] > 0 and set(c["costs"]["td_ms"]) == {"2", "4"}
        assert set(c["costs"]["tt_ms"]) == {"1", "2", "4"}
    assert set(two["allreduce_ms"]) == {"1", "2", "4"} and two["message_ms"] > 0
    assert "allreduce_ms" not in one
    from mlx_spec.commands.bench import costs_table

    text = costs_table([("single", one), ("ranks", two)])
    assert "1 process" in text and "2 ranks (ring)" in text and "Tt(4) (verify)" in text and "ratio" in text


def test_launch_plan_checks_the_group_flags(tmp_path):
    """`--ranks/--hosts/--hostfile/--backend/--ring-port`, checked before anything loads, and the
    mlx.launch command they make."""
    from mlx_spec.errors import BadRequest

    assert distributed.launch_plan(environ={}) is None
    local = distributed.launch_plan(2, environ={})
    assert local.local and local.ranks == 2 and local.backend == "ring" and local.port is not None
    cmd = local.command(["python", "-m", "mlx_spec", "serve"])
    assert cmd[1:7] == ["--backend", "ring", "--hosts", "127.0.0.1", "-n", "2"]
    assert cmd[cmd.index("--") :] == ["--", "python", "-m", "mlx_spec", "serve"]
    two = distributed.launch_plan(hosts="127.0.0.1,10.0.0.2", environ={})
    assert two.ranks == 2 and not two.local and two.port is None and two.local_ranks == 1
    assert "--hosts" in two.command([]) and "127.0.0.1,10.0.0.2" in two.command([])
    assert local.local_ranks == 2
    shown = distributed.Launch.shown(two.command(["serve"]))
    assert "--env" not in shown and "127.0.0.1,10.0.0.2" in shown and "serve" not in shown
    hf = tmp_path / "hosts.json"
    hf.write_text(
        json.dumps(
            {
                "backend": "jaccl",
                "hosts": [
                    {"ssh": "127.0.0.1", "ips": ["10.0.0.1"], "rdma": [None, "x"]},
                    {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["x", None]},
                ],
            }
        )
    )
    plan = distributed.launch_plan(hostfile=str(hf), environ={})
    assert plan.ranks == 2 and plan.backend == "jaccl" and plan.hosts == ("127.0.0.1", "b") and plan.local_ranks == 1
    remote0 = tmp_path / "remote0.json"  # the docs' old mistake: this Mac by name, so ssh starts rank 0
    remote0.write_text(
        json.dumps(
            {"hosts": [{"ssh": "mac-1.local", "ips": ["10.0.0.1"]}, {"ssh": "mac-2.local", "ips": ["10.0.0.2"]}]}
        )
    )
    for kw, msg in [
        ({"ranks": 1}, "at least 2 ranks"),
        ({"ranks": 3, "hosts": "a,b"}, "--ranks 3 but 2 hosts"),
        ({"hosts": "a", "hostfile": str(hf)}, "not both"),
        ({"ranks": 2, "backend": "mpi"}, "--backend"),
        ({"hosts": "a,b", "backend": "jaccl"}, "jaccl needs --hostfile"),
        ({"hostfile": str(tmp_path / "none.json")}, "no such file"),
        ({"backend": "jaccl"}, "need --ranks, --hosts or --hostfile"),
        ({"port": 5000}, "need --ranks, --hosts or --hostfile"),
        ({"ranks": 3, "port": 65534}, "past 65535"),
        ({"hosts": "10.0.0.1,127.0.0.1"}, "rank 0 must run on this machine"),
        ({"hostfile": str(remote0)}, "rank 0 must run on this machine"),
        ({"hosts": "127.0.0.1,mac-2.local"}, "needs IP addresses"),
    ]:
        with pytest.raises(BadRequest, match=msg):
            distributed.launch_plan(**kw, environ={})
    with pytest.raises(BadRequest, match="already a rank"):
        distributed.launch_plan(2, environ={"MLX_RANK": "0", "MLX_HOSTFILE": "/x"})
