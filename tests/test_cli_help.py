"""Every command's --help: each flag explains itself and shows its default; --version; tune takes
one budget flag and no flags that skip tuning."""

import argparse
import importlib
import subprocess
import sys

import pytest

import mlx_spec
from mlx_spec.cli import COMMANDS, HelpFormatter


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


def test_help_shows_defaults():
    serve = _cli("serve", "--help").stdout
    assert "(default: 8080)" in serve and "(default: 16)" in serve
    gen = " ".join(_cli("generate", "--help").stdout.split())
    assert "--max-tokens MAX_TOKENS most tokens in the generated text (default: 256)" in gen


def test_tune_has_one_budget_flag_and_no_skip_flags():
    out = _cli("tune", "--help").stdout
    assert "--budget" in out
    for flag in ("--tune-budget", "--no-tune", "--block-size ", "skips tuning"):
        assert flag not in out, flag
    for argv in (["--no-tune"], ["--block-size", "4"], ["--tune-budget", "5"]):
        r = _cli("tune", *argv)
        assert r.returncode == 2 and "unrecognized arguments" in r.stderr and "Traceback" not in r.stderr
    # generate still has them
    gen = _cli("generate", "--help").stdout
    assert "--no-tune" in gen and "--tune-budget" in gen and "--block-size" in gen
