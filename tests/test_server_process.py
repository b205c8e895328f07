"""`serve --detach` -> `status` -> `stop`: identification by pid + start time, stale state files,
a renamed process, and refusing to serve when the drafter fails to load."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlx_spec.server import process

import httpx
import psutil
import pytest
from helpers import save_tiny_pair


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def state_env(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("MLX_SPEC_STATE_DIR", str(d))
    return d


def cli(*args, timeout=120):
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_state_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_SPEC_STATE_DIR", str(tmp_path / "x"))
    assert process.state_dir() == tmp_path / "x"
    monkeypatch.delenv("MLX_SPEC_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    if sys.platform != "darwin":
        assert process.state_dir() == tmp_path / "xdg" / "mlx_spec"


def test_detach_status_stop_cycle(pair_dirs, state_env):
    t, d = pair_dirs
    r = cli(
        "serve",
        "--detach",
        "--target",
        str(t),
        "--drafter",
        str(d),
        "--block-size",
        "4",
        "--port",
        "0",
        "--api-key",
        "s3cret-key",
    )
    assert r.returncode == 0, r.stderr
    files = list(state_env.glob("server-*.json"))
    assert len(files) == 1
    state = json.loads(files[0].read_text())
    assert "s3cret-key" not in files[0].read_text()  # the key itself is never written
    assert state["auth"] is True
    proc = psutil.Process(state["pid"])
    assert abs(proc.create_time() - state["create_time"]) < 0.01
    url = f"http://127.0.0.1:{state['port']}"
    assert "--api-key" not in " ".join(proc.cmdline())  # the key travels in the environment
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "x", "max_tokens": 3},
        headers={"Authorization": "Bearer s3cret-key"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["speculation"]["method"] == "dflash2"

    st = cli("status", "--json")
    assert st.returncode == 0
    servers = json.loads(st.stdout)["servers"]
    assert [s["pid"] for s in servers] == [state["pid"]] and servers[0]["health"] == "ready"
    assert servers[0]["speculation"]["block_size"] == 4
    assert "ready" in cli("status").stdout

    # a second detach on the same port is refused; the running one is untouched
    again = cli("serve", "--detach", "--target", str(t), "--no-draft", "--port", str(state["port"]))
    assert again.returncode != 0 and "already running" in again.stderr

    # stop while a client streams a long generation: the stream ends cleanly, then the process
    streamed, started = [], threading.Event()

    def long_stream():
        body = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3000,
            "stream": True,
            "temperature": 0,
        }
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body, timeout=30, headers={"Authorization": "Bearer s3cret-key"}
        ) as s:
            for ln in s.iter_lines():
                if ln:
                    streamed.append(ln)
                    started.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    assert started.wait(30)
    stop = cli("stop")
    reader.join(30)
    assert stop.returncode == 0 and f"stopped server pid {state['pid']}" in stop.stdout
    assert streamed[-1] == "data: [DONE]" and '"code":"cancelled"' in streamed[-2]
    assert not psutil.pid_exists(state["pid"]) or psutil.Process(state["pid"]).status() == psutil.STATUS_ZOMBIE
    assert not list(state_env.glob("server-*.json"))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
    again = cli("stop")
    assert again.returncode == 0 and "no mlx_spec server running" in again.stdout
    assert "no mlx_spec server running" in cli("status").stdout


def _write(directory: Path, pid: int, create_time: float, port: int) -> Path:
    return process.write_state(
        process.ServerState(pid, create_time, "127.0.0.1", port, "t", None, "log", time.time()), directory
    )


def test_stale_state_files_are_cleaned_and_never_killed(state_env):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_ct = psutil.Process(dead.pid).create_time()
    dead.wait()
    _write(state_env, dead.pid, dead_ct, 50001)
    # a live pid whose start time does not match: the pid was reused by someone else (us)
    me = psutil.Process()
    _write(state_env, me.pid, me.create_time() - 3600, 50002)
    (state_env / "server-50003.json").write_text("{not json")
    r = cli("status")
    assert r.returncode == 0
    assert r.stdout.count("removed stale state file") == 3 and "no longer running" in r.stdout
    assert "belongs to another process" in r.stdout
    assert not list(state_env.glob("server-*.json"))
    _write(state_env, me.pid, me.create_time() - 3600, 50002)
    r = cli("stop")
    assert r.returncode == 0 and "nothing to stop" in r.stdout and "removed stale" in r.stdout
    assert me.is_running()  # still here: identification is by pid AND start time


def test_renamed_process_is_found_and_stopped(state_env, tmp_path):
    code = (
        "import os, sys, time\n"
        "if sys.argv[-1] != 'again':\n"
        "    os.execv(sys.executable, ['zz-renamed-worker', '-c', CODE, 'again'])\n"
        "open('/proc/self/comm', 'w').write('zz-renamed')\n"
        "print('renamed', flush=True)\n"
        "time.sleep(120)\n"
    )
    full = f"CODE = {code!r}\n" + code
    child = subprocess.Popen([sys.executable, "-c", full], stdout=subprocess.PIPE, text=True)
    p = psutil.Process(child.pid)
    _write(state_env, child.pid, p.create_time(), 50010)
    assert child.stdout.readline().strip() == "renamed"
    assert "mlx_spec" not in " ".join(p.cmdline()) and p.cmdline()[0] == "zz-renamed-worker"
    if sys.platform.startswith("linux"):
        assert p.name() == "zz-renamed"
    st = json.loads(cli("status", "--json").stdout)
    assert [s["pid"] for s in st["servers"]] == [child.pid] and st["servers"][0]["health"] == "not answering"
    r = cli("stop", "--timeout", "5")
    assert r.returncode == 0 and f"stopped server pid {child.pid}" in r.stdout
    assert child.wait(5) is not None
    assert not list(state_env.glob("server-*.json"))


def test_stop_kills_children_and_escalates(state_env):
    """A server that ignores SIGTERM and has a child: stop escalates to SIGKILL, no orphan left."""
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    _write(state_env, parent.pid, psutil.Process(parent.pid).create_time(), 50020)
    r = cli("stop", "--timeout", "1")
    assert r.returncode == 0, r.stderr
    parent.wait(5)
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "orphan survived stop"
        time.sleep(0.05)


def test_refuses_to_serve_when_the_drafter_fails(pair_dirs, state_env, tmp_path):
    t, d = pair_dirs
    broken = tmp_path / "broken-drafter"
    broken.mkdir()
    (broken / "config.json").write_text((d / "config.json").read_text())  # no weights
    # the detached child is a foreground `serve`: its exit code and message come back in the report
    r = cli("serve", "--detach", "--target", str(t), "--drafter", str(broken), "--port", "0", timeout=60)
    assert r.returncode == 1 and "exited (code 1) before it was ready" in r.stderr
    assert "not serving: the pair failed to load" in r.stderr and "no *.safetensors" in r.stderr
    assert not list(state_env.glob("server-*.json"))


def test_ranks_of_a_dead_mlx_launch_are_kept_and_stopped(state_env, tmp_path):
    """mlx.launch killed (or OOM-killed) while its ranks run on: `status` keeps the group's state
    file and says mlx.launch is gone; `stop` ends the ranks without it, rank 0 first."""
    launcher = subprocess.Popen(["sleep", "60"])
    launcher_ct = psutil.Process(launcher.pid).create_time()
    launcher.kill()
    launcher.wait()
    order = tmp_path / "order.txt"
    code = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    open(sys.argv[2], 'a').write(sys.argv[1] + '\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('up', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.05)\n"
    )
    ranks = [
        subprocess.Popen([sys.executable, "-c", code, str(i), str(order)], stdout=subprocess.PIPE, text=True)
        for i in (1, 0)
    ]  # rank 1 first: stop must still signal rank 0 first
    try:
        for r in ranks:
            assert r.stdout.readline().strip() == "up"
        recorded = [
            {"rank": i, "pid": r.pid, "create_time": psutil.Process(r.pid).create_time()} for i, r in zip((1, 0), ranks)
        ]
        group = {
            "ranks": recorded,
            "hosts": ["127.0.0.1"],
            "hostfile": None,
            "backend": "ring",
            "port": None,
            "size": 2,
            "launcher_pid": launcher.pid,
        }
        process.write_state(
            process.ServerState(
                launcher.pid, launcher_ct, "127.0.0.1", 50030, "t", None, "log", time.time(), group=group
            ),
            state_env,
        )
        found = process.scan(state_env, clean=False)
        assert not found.stale and found.running[0][2].pid == ranks[1].pid  # rank 0 stands for the group
        r = cli("status")
        assert r.returncode == 0 and f"mlx.launch pid {launcher.pid} (gone" in r.stdout, r.stdout
        assert list(state_env.glob("server-*.json"))  # kept: its ranks still run
        r = cli("stop", "--timeout", "2")
        assert r.returncode == 0, r.stderr
        assert "stopped group server" in r.stdout and "(already gone)" in r.stdout
        for p in ranks:
            assert p.wait(5) == 0
        assert order.read_text().split() == ["0", "1"]  # rank 0 first, the rest after --timeout
        assert not list(state_env.glob("server-*.json"))
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()


def test_a_spawned_group_is_stopped_rank_0_first(tmp_path):
    """What `bench --ranks` and the foreground `serve --ranks` do on Ctrl-C, an error or a time
    limit (``process.stop_launched``), on a fake mlx.launch: its ranks are found by ``MLX_RANK``
    (the topmost process per rank: a rank's own subprocess inherits the variable), rank 0 gets
    SIGTERM first, then everything left, helpers included."""
    rank = (
        "import signal, subprocess, sys, time\n"
        "def bye(*_):\n"
        "    open(sys.argv[2], 'a').write(sys.argv[1] + '\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "if sys.argv[1] == '0':\n"
        "    subprocess.Popen(['sleep', '60'])  # a helper: MLX_RANK=0 in its environment too\n"
        "open(sys.argv[3] + '.' + sys.argv[1], 'w').close()\n"
        "while True:\n"
        "    time.sleep(0.05)\n"
    )
    launcher = (
        "import os, subprocess, sys, time\n"
        f"RANK = {rank!r}\n"
        "for i in (0, 1):\n"
        "    subprocess.Popen([sys.executable, '-c', RANK, str(i), sys.argv[1], sys.argv[2]],\n"
        "                     env={**os.environ, 'MLX_RANK': str(i)})\n"
        "while True:\n"
        "    time.sleep(0.05)\n"
    )
    order, ready = tmp_path / "order.txt", tmp_path / "ready"
    child = process.spawn(
        [sys.executable, "-c", launcher, str(order), str(ready)], None, quiet_stdin=True, stdout=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready.{i}").exists() for i in (0, 1)):
            assert time.monotonic() < deadline, "the fake ranks did not start"
            time.sleep(0.05)
        found = process.group_ranks(psutil.Process(child.pid))
        assert [r["rank"] for r in found] == [0, 1] and all(psutil.Process(r["pid"]).name() != "sleep" for r in found)
        family = psutil.Process(child.pid).children(recursive=True)
        assert process.stop_launched(child, timeout=2) == []
        assert order.read_text().split() == ["0", "1"]
        assert child.wait(5) is not None
        assert all(process._gone(p) for p in family)  # the helper too
    finally:
        if child.poll() is None:
            os.killpg(child.pid, 9)
