"""Every command's --help: each flag explains itself and shows its default; --version; tune takes
one budget flag and no flags that skip tuning."""

import argparse
import importlib
import subprocess
import sys

import mlx_spec
from mlx_spec.cli import COMMANDS, HelpFormatter

import pytest


def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_spec", *argv], capture_output=True, text=True, timeout=120)


def _flags(parser, name):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, p in a.choices.items():
                yield from _flags(p, f"{name} {sub}")
        elif not isinstance(a, argparse._HelpAction):
            yield name, a


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_has_help_and_default(command):
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    importlib.import_module(f"mlx_spec.commands.{command}").add_arguments(p)
    for where, action in _flags(p, command):
        assert action.help, f"{where} {action.option_strings or action.dest}: no help text"
        shown = HelpFormatter("x")._get_help_string(action)
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in shown, f"{where} {action.option_strings}: default not shown"


def test_version():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mlx_spec {mlx_spec.__version__}"


def _main(capsys, *argv) -> tuple[int, str, str]:
    """The CLI in this process (argparse exits on --help and on unknown flags)."""
    from mlx_spec.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help_shows_defaults(capsys):
    serve = _main(capsys, "serve", "--help")[1]
    assert "(default: 8080)" in serve and "(default: 16)" in serve
    gen = " ".join(_main(capsys, "generate", "--help")[1].split())
    assert "--max-tokens MAX_TOKENS most tokens in the generated text (default: 256)" in gen


def test_tune_has_one_budget_flag_and_no_skip_flags(capsys):
    out = _main(capsys, "tune", "--help")[1]
    assert "--budget" in out
    for flag in ("--tune-budget", "--no-tune", "--block-size ", "skips tuning"):
        assert flag not in out, flag
    for argv in (["--no-tune"], ["--block-size", "4"], ["--tune-budget", "5"]):
        rc, _, err = _main(capsys, "tune", *argv)
        assert rc == 2 and "unrecognized arguments" in err and "Traceback" not in err
    rc, _, err = _main(capsys, "tune", "--budget", "0", "--target", "/does/not/matter")
    assert rc == 1 and "--budget must be a positive number" in err
    # generate still has them
    gen = _main(capsys, "generate", "--help")[1]
    assert "--no-tune" in gen and "--tune-budget" in gen and "--block-size" in gen


def test_docs_stand_alone():
    """The project's docs (and docstrings) never send a reader to design notes outside the repo."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    files = [root / "README.md", *root.glob("docs/*.md"), *root.glob("mlx_spec/**/*.py"), *root.glob("tui/**/*.py")]
    banned = ("DESIGN.md", "STYLE.md", "../shared", "dflash-spec.md", "mlx-lm-notes.md", "users-and-peers.md")
    hits = [f"{f.relative_to(root)}: {b}" for f in files for b in banned if b in f.read_text()]
    assert not hits, hits
