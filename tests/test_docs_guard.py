"""What users read says how things work, not when they were found: README.md, docs/, mlx_spec/
and tui/ name no numbered lab entries ("session 7"), no issue numbers of a tracker ("issue 17",
"#17", "issues 17 and 18") and no paths under runs/ (a scratch folder nobody else has).

A reference to another project's tracker, written with its name (``ml-explore/mlx#3126``), is a
citation anyone can follow and stays allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".md", ".py", ".json", ".tcss", ".txt", ".toml"}

FORBIDDEN = {
    "a numbered lab entry": re.compile(r"\bsessions?[ -]\d+", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues?[ -]?\d+(?:\s*(?:,|and|&)\s*\d+)*", re.IGNORECASE),
    "a tracker number": re.compile(r"(?<![\w./-])#\d{1,5}\b"),
    "a path under runs/": re.compile(r"(?<![\w.-])runs/"),
}


def files() -> list[Path]:
    out = [ROOT / "README.md"]
    for folder in ("docs", "mlx_spec", "tui"):
        out += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
    return out


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for every forbidden mention in ``text``."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append((n, what, line.strip()))
    return found


@pytest.mark.parametrize(
    "text",
    [
        "measured in session 7",
        "Session 10: the latest run",
        "see issue 17",
        "issues 17 and 18",
        "fixed in #17",
        "output in runs/bench.txt",
        "the session-5 tuner",
        "issue17-bench10",
    ],
)
def test_each_kind_of_lab_reference_is_caught(text):
    assert hits(text), text


@pytest.mark.parametrize(
    "text",
    [
        "a crash class on Metal (ml-explore/mlx#3126)",
        "jundot/omlx#2987",
        "one session of the chat",
        "a new session starts",
        "tissue 5",
        "color: #123456",
        "benchmarks/results/2026-12-01-xeon-2core-linux/bench.txt",
    ],
)
def test_what_is_not_a_lab_reference_passes(text):
    assert not hits(text), text


def test_readme_docs_package_and_ui_name_no_lab_entries_issues_or_runs_paths():
    bad = [f"{p.relative_to(ROOT)}:{n}: {what}: {line[:120]}" for p in files() for n, what, line in hits(p.read_text())]
    assert not bad, "lab references in what users read (say how it works instead):\n" + "\n".join(bad)
