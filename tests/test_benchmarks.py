"""The benchmark harness in benchmarks/ stays runnable from a clone: every script imports (only
the package and its dependencies: no folder outside the repository on ``sys.path``) and answers
``--help``; every shell script parses; benchmarks/README.md names every script."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PY = sorted(BENCH.rglob("*.py"))
SH = sorted(BENCH.rglob("*.sh"))


@pytest.fixture
def same_environment():
    """A script may set environment variables when imported (blas_sgemm.py asks for no BLAS):
    they must not leak into later tests' subprocesses."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"harness_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_harness_is_there():
    assert {p.name for p in PY} >= {"pass_anatomy.py", "batch_profile.py", "plan_accuracy.py", "device_tasks.py"}


@pytest.mark.parametrize("path", PY, ids=lambda p: str(p.relative_to(BENCH)))
def test_each_harness_script_imports_and_answers_help(path, monkeypatch, capsys, same_environment):
    assert "sys.path" not in path.read_text(), f"{path.name} edits sys.path: run it from a clone as it is"
    mod = _load(path)
    assert callable(getattr(mod, "main", None)), f"{path.name} has no main()"
    monkeypatch.setattr(sys, "argv", [path.name, "--help"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", PY, ids=lambda p: str(p.relative_to(BENCH)))
def test_every_package_name_a_script_imports_exists(path):
    """Imports inside functions too (they run only past ``--help``): each ``from mlx_spec... import
    name`` names a module and a name the package has."""
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mlx_spec":
            try:
                mod = importlib.import_module(node.module)
            except ImportError as e:
                missing.append(f"line {node.lineno}: {node.module} ({e})")
                continue
            for alias in node.names:
                if not hasattr(mod, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"line {node.lineno}: {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mlx_spec":
                    try:
                        importlib.import_module(alias.name)
                    except ImportError as e:
                        missing.append(f"line {node.lineno}: {alias.name} ({e})")
    assert not missing, f"{path.name} imports what the package no longer has: {missing}"


@pytest.mark.parametrize("path", SH, ids=lambda p: str(p.relative_to(BENCH)))
def test_each_shell_script_parses(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_readme_names_every_script_and_every_results_folder():
    readme = (BENCH / "README.md").read_text()
    missing = [str(p.relative_to(BENCH)) for p in PY + SH if p.name not in readme]
    assert not missing, f"benchmarks/README.md does not say what these do: {missing}"
    results = BENCH / "results"
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        assert (folder / "README.md").is_file(), f"{folder.name} has no README.md saying which command made each file"
