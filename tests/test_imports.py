"""A file's head says what it depends on (docs/architecture.md, "Imports").

Imports sit at the top of the file. An import inside a function stays only for one of four
reasons, named in a comment on its line (or the line above): ``# (layer: ...)``,
``# (cycle: a -> b -> a)``, ``# (optional: ...)`` or ``# (startup: ...)``. The walker reads every
module of mlx_spec/ and tui/ with ``ast`` (nothing is imported, so it costs milliseconds); a
subprocess checks that the commands the startup reason serves do not load MLX and the rest.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlx_spec", "tui")
REASONS = ("layer", "cycle", "optional", "startup")
REASON = re.compile(r"#.*\((" + "|".join(REASONS) + r"):\s*\S")


def local_imports(source: str, name: str = "<source>") -> list[ast.stmt]:
    """The import statements inside a function (or a method, or a function inside one) of ``source``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, name), False)
    return found


def unexplained(source: str, name: str = "<source>") -> list[str]:
    """``line: statement`` of each function-level import with no reason comment on one of its own
    lines or on the line just above it."""
    lines = source.splitlines()
    out = []
    for node in local_imports(source, name):
        near = lines[node.lineno - 2 : node.end_lineno] if node.lineno > 1 else lines[: node.end_lineno]
        if not any(REASON.search(line) for line in near):
            out.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_every_function_level_import_says_why_it_is_not_at_the_top():
    problems = [
        f"{path.relative_to(ROOT)}:{hit}" for path in sources() for hit in unexplained(path.read_text(), str(path))
    ]
    assert not problems, (
        "imports inside functions with no reason: move them to the top of the file, or say on the line "
        "which of # (layer: ...), # (cycle: a -> b -> a), # (optional: ...), # (startup: ...) keeps them "
        "there (docs/architecture.md, Imports):\n" + "\n".join(problems)
    )


def test_the_walker_finds_a_bare_local_import_and_accepts_a_reasoned_one():
    bare = "import os\n\n\ndef f():\n    import json\n\n    return json\n"
    assert unexplained(bare) == ["5: import json"]
    method = "class A:\n    def f(self):\n        def g():\n            from . import x\n\n        return g\n"
    assert unexplained(method) == ["4: from . import x"]
    split = "def f():\n    from .x import (\n        a,\n        b,\n    )\n"
    assert unexplained(split) == ["2: from .x import ("]
    for reason in REASONS:
        same_line = f"def f():\n    import mlx.core as mx  # ({reason}: why)\n"
        line_above = f"def f():\n    # ({reason}: why)\n    import mlx.core as mx\n"
        assert unexplained(same_line) == unexplained(line_above) == []
    for not_a_reason in ("# lazy", "# (heavy: rarely used)", "# (startup)", "# startup: why"):
        assert unexplained(f"def f():\n    import json  {not_a_reason}\n") == [f"2: import json  {not_a_reason}"]
    assert unexplained("import json\ntry:\n    import orjson\nexcept ImportError:\n    orjson = None\n") == []


HEAVY = ("mlx", "mlx_lm", "transformers", "fastapi", "uvicorn", "starlette", "textual")
LIGHT = (["--help"], ["status", "--help"], ["stop", "--help"])


def test_help_and_the_light_commands_load_no_mlx_mlx_lm_transformers_or_fastapi():
    """What the startup reason keeps: ``mlx_spec --help`` and the light commands' modules load
    none of the heavy packages (their own imports at the top included)."""
    script = (
        "import json, sys\n"
        "from mlx_spec.cli import main\n"
        f"for argv in {LIGHT!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == [], f"{LIGHT} loaded {run.stdout.splitlines()[-1]}"
