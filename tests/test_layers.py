"""The package's layering, read from its source: the data flows read -> plan -> sink -> store -> export,
no module imports a stage above it, and there is no import circle anywhere, counting the imports made
inside functions (one of those may defer a slow import; it may not hide a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "shardstore"

# What each part of the package may not import (by module-name prefix).
FORBIDDEN = {
    "shardstore.read": ("shardstore.store", "shardstore.sink", "shardstore.export", "shardstore.plan",
                        "shardstore.ingest", "shardstore.values", "shardstore.api", "shardstore.cli"),
    "shardstore.read.primitives": ("shardstore.read.formats", "shardstore.read.contract", "shardstore.read.registry",
                                   "shardstore.read.discover"),
    "shardstore.store": ("shardstore.read", "shardstore.sink", "shardstore.export", "shardstore.plan",
                         "shardstore.ingest"),
    "shardstore.sink": ("shardstore.read", "shardstore.export", "shardstore.ingest", "shardstore.plan"),
    "shardstore.export": ("shardstore.read", "shardstore.ingest", "shardstore.plan"),
    "shardstore.plan": ("shardstore.read.formats", "shardstore.read.primitives", "shardstore.sink",
                        "shardstore.export", "shardstore.ingest"),
    "shardstore.ingest": ("shardstore.export", "shardstore.read.formats"),
    # a trainer's conventions: names and files, not bytes, nor where they are read from or written to
    "shardstore.trainers": ("shardstore.read", "shardstore.store", "shardstore.sink", "shardstore.export",
                            "shardstore.ingest", "shardstore.plan", "shardstore.run"),
    # a checkpoint read into a scratch store for `ls` and `show`: below the API and the command line
    "shardstore.inspect": ("shardstore.export", "shardstore.api", "shardstore.cli", "shardstore.verify",
                           "shardstore.run"),
    # a run: below the API and the command line
    "shardstore.run": ("shardstore.api", "shardstore.cli"),
}
BOTTOM = ("tree", "records", "errors", "dtypes", "facts", "ranges", "locations", "paths", "crc", "tempfiles", "jsonin",
          "hf_files", "values", "patterns")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """The package's modules `name` imports, each with whether the import is at the module's top level."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
    return [(m, at_top) for m, at_top in found if m in modules and m != name]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, bool]]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_module_imports_a_stage_above_it(graph) -> None:
    wrong = []
    for name, imports in graph.items():
        rules = [bad for part, bad in FORBIDDEN.items() if name == part or name.startswith(part + ".")]
        if name.split(".")[-1] in BOTTOM and name.count(".") == 1:
            rules.append(tuple(f"shardstore.{m}" for m in ("read", "store", "sink", "export", "plan", "ingest")))
        for target, _ in imports:
            if any(target == b or target.startswith(b + ".") for bad in rules for b in bad):
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle(graph) -> None:
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(name):] + [name]))
        if name in done:
            return
        for target, _ in graph[name]:
            visit(target, stack + [name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The two checks above on a package made to break them: they can fail."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import x\n")
    modules = {"shardstore.a": tmp_path / "a.py", "shardstore.b": tmp_path / "b.py"}
    graph = {n: _imports(n, p, modules) for n, p in modules.items()}
    assert graph == {"shardstore.a": [("shardstore.b", True)], "shardstore.b": [("shardstore.a", False)]}
    with pytest.raises(AssertionError, match="import circle: shardstore.a -> shardstore.b -> shardstore.a"):
        test_no_import_circle(graph)  # hidden inside a function, still a circle
    up = {"shardstore.store.x": [("shardstore.read.contract", True)]}
    with pytest.raises(AssertionError, match="shardstore.store.x imports shardstore.read.contract"):
        test_no_module_imports_a_stage_above_it(up)


MOST_PARAMETERS = 8  # a function taking more takes a request (a frozen dataclass) instead


def test_no_function_takes_more_than_eight_parameters() -> None:
    """Options travel as one request value (`RunRequest`, `ExportRequest`, `Watching`): a function over
    eight parameters is a request not yet made. The command line's click commands take one per option."""
    over = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
                clicked = name == "shardstore.cli" and any("command" in ast.unparse(d) for d in node.decorator_list)
                if len(names) > MOST_PARAMETERS and not clicked:
                    over.append(f"{name}.{node.name}: {len(names)}")
    assert over == []
