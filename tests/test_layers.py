"""The package's layers (docs/architecture.md): no module imports a layer above its own.

The table of modules and layers lives in one place, docs/architecture.md; this test reads it,
parses every module's imports with ``ast`` (module-level and inside functions alike) and checks:
every module under mlx_spec/ has a row, no row names a module that is not there (unless it is
marked planned), no import goes to a higher layer, and only the commands that start them import
the server package or the chat UI.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mlx_spec"
DOC = ROOT / "docs" / "architecture.md"
LAYERS = ("base", "model", "decode", "session", "front end")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([a-z ]+?)\s*\|\s*(.*?)\s*\|\s*$")
# (commands/bench: `bench --ranks` starts and stops its mlx.launch group with server/process)
STARTERS = {"commands/serve", "commands/status", "commands/stop", "commands/chat", "commands/bench"}
FIX = "add it to the table in docs/architecture.md (module | layer | what it is)"


def table() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m and m.group(2) in LAYERS:
            assert m.group(1) not in rows, f"docs/architecture.md lists `{m.group(1)}` twice"
            rows[m.group(1)] = (m.group(2), m.group(3))
    assert len(rows) > 20, "docs/architecture.md's module table was not found"
    return rows


def key(path: Path) -> str:
    """mlx_spec/server/app.py -> 'server/app'; a package's __init__ -> the package."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    return "/".join(parts)


def modules() -> dict[str, Path]:
    return {key(p): p for p in sorted(PKG.rglob("*.py"))}


def _ours(dotted: str) -> str | None:
    """The table key of an imported dotted name, or None when it is not ours."""
    if dotted == "tui" or dotted.startswith("tui."):
        return "tui"
    if dotted != "mlx_spec" and not dotted.startswith("mlx_spec."):
        return None
    parts = dotted.split(".")[1:]
    while parts:  # the longest prefix that is a module (the rest is a name inside it)
        p = PKG.joinpath(*parts)
        if p.with_suffix(".py").is_file() or (p / "__init__.py").is_file():
            return "/".join(parts)
        parts.pop()
    return "__init__"


def imports(path: Path, package: list[str]) -> dict[str, int]:
    """Table keys this file imports -> first line; relative imports resolved against ``package``."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package[: len(package) - node.level + 1]
                base = ".".join(head + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            k = _ours(name)
            if k is not None:
                found.setdefault(k, node.lineno)
    return found


def _package_of(path: Path) -> list[str]:
    return [PKG.name] + list(path.relative_to(PKG).parent.parts)


def test_every_module_has_a_layer():
    rows, mods = table(), modules()
    missing = sorted(set(mods) - set(rows))
    assert not missing, f"modules with no layer: {missing}: {FIX}"
    for name, (_, what) in rows.items():
        planned = what.startswith("planned")
        if name == "tui":
            continue
        if planned:
            assert name not in mods, f"`{name}` exists now: drop 'planned' from its row in docs/architecture.md"
        else:
            assert name in mods, (
                f"docs/architecture.md lists `{name}` but mlx_spec/ has no such module: "
                "remove the row, or mark it 'planned:'"
            )


def test_no_module_imports_a_layer_above_its_own():
    rows = table()
    rank = {name: LAYERS.index(layer) for name, (layer, _) in rows.items()}
    problems = []
    for name, path in modules().items():
        if name not in rank:
            continue  # reported by test_every_module_has_a_layer
        for dep, line in imports(path, _package_of(path)).items():
            if dep == name:
                continue
            if dep not in rank:
                problems.append(f"mlx_spec/{path.relative_to(PKG)}:{line} imports `{dep}`, which has no layer: {FIX}")
            elif rank[dep] > rank[name]:
                problems.append(
                    f"mlx_spec/{path.relative_to(PKG)}:{line}: `{name}` ({rows[name][0]}) imports "
                    f"`{dep}` ({rows[dep][0]}), a higher layer"
                )
    assert not problems, "\n".join(problems)


def test_only_the_commands_that_start_them_import_the_server_or_the_tui():
    problems = []
    for name, path in modules().items():
        if name == "server" or name.startswith("server/") or name in STARTERS:
            continue
        for dep, line in imports(path, _package_of(path)).items():
            if dep == "tui" or dep == "server" or dep.startswith("server/"):
                problems.append(f"mlx_spec/{path.relative_to(PKG)}:{line} imports `{dep}`")
    assert not problems, "\n".join(problems)


def test_the_import_reader_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: imports inside functions count, relative imports resolve."""
    src = tmp_path / "x.py"
    src.write_text(
        "from .errors import BadRequest\n\ndef f():\n    import tui.app\n"
        "    import mlx_spec.server.app\n    from . import BLAS\n    from .server import tools\n"
    )
    assert set(imports(src, ["mlx_spec"])) == {"errors", "tui", "server/app", "__init__", "server", "server/tools"}
    src.write_text("def g():\n    from ..engine import Done\n    from . import tools\n")
    assert set(imports(src, ["mlx_spec", "server"])) == {"engine", "server", "server/tools"}


def test_no_import_circles():
    """No two modules import each other, directly or round a loop, at the top of a file or inside
    a function (a package's own __init__ aside: importing a package runs it first anyway). Within
    a layer this is what keeps the layers' order meaningful: a module can be read, tested and
    moved knowing only what it imports."""
    mods = modules()
    packages = {k for k, p in mods.items() if p.name == "__init__.py"}
    graph = {
        name: sorted(d for d in imports(path, _package_of(path)) if d != name and d in mods and d not in packages)
        for name, path in mods.items()
        if name not in packages
    }
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(
            "modules importing each other (move what both need below them): " + " -> ".join(e.args[1])
        ) from None


def private_uses(path: Path, package: list[str]) -> list[str]:
    """Another of our modules' underscore names that this file takes: ``from .x import _y``, or
    ``x._y`` where ``x`` is one of our modules imported by name (dunders aside)."""
    own = key(path) if path.is_relative_to(PKG) else None
    found, bound = [], {}

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package[: len(package) - node.level + 1]
                base = ".".join(head + ([node.module] if node.module else []))
            for a in node.names:
                sub = _ours(f"{base}.{a.name}")
                if sub is not None and sub != _ours(base):  # a module imported by name
                    bound[a.asname or a.name] = sub
                elif private(a.name) and _ours(base) not in (None, own):
                    found.append(f"{node.lineno}: from {base} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and _ours(a.name) is not None:
                    bound[a.asname] = _ours(a.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and bound[node.value.id] != own
            and private(node.attr)
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_takes_another_modules_underscore_names():
    """A leading underscore means "this module's own": no other module imports or reads it (what
    two modules share is public, named for what it does)."""
    problems = [
        f"mlx_spec/{path.relative_to(PKG)}:{hit}"
        for name, path in modules().items()
        for hit in private_uses(path, _package_of(path))
    ]
    assert not problems, "\n".join(problems)


def test_the_underscore_reader_sees_both_spellings(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("from .decode import _finish, Step\nfrom . import batch\n\ndef f():\n    return batch._take\n")
    assert private_uses(src, ["mlx_spec"]) == ["1: from mlx_spec.decode import _finish", "5: batch._take"]
    src.write_text("from .decode import Step\nfrom . import batch\n\ndef f():\n    return batch.Step, batch.__name__\n")
    assert private_uses(src, ["mlx_spec"]) == []
