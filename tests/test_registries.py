"""No module outside a registry branches on an input format's, an output format's or a trainer's name: it
asks the format or the trainer (its flags, its methods). The registries (and the modules defining what
they list) may; the few branches still elsewhere are listed below, each with its reason, and the test
fails when one is added, and when one listed is gone (so the list only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

from shardstore.export.registry import FORMATS as OUTPUTS
from shardstore.read.registry import formats
from shardstore.trainers.registry import TRAINERS

PACKAGE = Path(__file__).parents[1] / "shardstore"
NAMES = {f.name for f in formats()} | set(OUTPUTS) | set(TRAINERS)
ASKED = ("format", "fmt", "layout", "trainer")  # what a branch on a name compares it with
REGISTRIES = ("read/formats/", "read/registry.py", "read/discover.py", "export/registry.py", "trainers/registry.py")
STILL = {  # file -> the names it still branches on, and why
    # version-1 manifests name their format, not its flags: the flags as that format had them then
    "store/manifest.py": {"megatron-torch"},
}


def _branches(path: Path) -> set[str]:
    """The registry names `path` compares a format, layout or trainer with, as literals or through a
    module-level tuple of them."""
    tree = ast.parse(path.read_text())
    named: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
            values = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
            for target in node.targets:
                if isinstance(target, ast.Name) and values & NAMES:
                    named[target.id] = values & NAMES
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(any(a in ast.unparse(s).lower() for a in ASKED) for s in sides):
            continue
        for side in sides:
            elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            found |= {e.value for e in elements if isinstance(e, ast.Constant) and e.value in NAMES}
            if isinstance(side, ast.Name):
                found |= named.get(side.id, set())
    return found


def test_no_module_outside_a_registry_branches_on_a_name() -> None:
    seen = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith(REGISTRIES):
            continue
        names = _branches(path)
        if names:
            seen[where] = names
    assert seen == STILL


def test_the_check_finds_a_branch_on_a_name(tmp_path: Path) -> None:
    """It can fail: a comparison of a store's layout with a trainer's name is found, as one with a tuple
    of input formats' names kept in a constant is."""
    module = tmp_path / "m.py"
    module.write_text('SCRIPTS = ("torch-save", "dcp")\n'
                      'def f(store, source):\n'
                      '    if store.manifest.layout == "lightning":\n'
                      '        return source.format in SCRIPTS\n'
                      '    return "torch" in store.keys()\n')
    assert _branches(module) == {"lightning", "torch-save", "dcp"}
