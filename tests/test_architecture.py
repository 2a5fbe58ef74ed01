"""docs/internals.md draws the package's stages from the code: every module and folder its layout names is
there (the test fails when one it names is gone or renamed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
NAMES_UP_TO = 8  # a line indented more is a description's continuation; less, names and then their description


def named(page: str) -> list[str]:
    """The package paths the page's `shardstore/` layout block names: its folders and modules, and the
    modules each one's description names in it."""
    block = re.search(r"```\nshardstore/\n(.*?)```", page, re.S)
    assert block is not None, "docs/internals.md has no shardstore/ layout block"
    paths, folders, here = [], {-1: "shardstore"}, "shardstore"
    for line in block.group(1).splitlines():
        indent, text = len(line) - len(line.lstrip()), line.strip()
        description = text
        if text and indent <= NAMES_UP_TO:
            names, _, description = text.partition("  ")
            depth = indent // 2 - 1  # shardstore/'s own entries are indented by 2
            parent = folders[depth - 1]
            here = parent
            for name in names.split():
                paths.append(f"{parent}/{name.rstrip('/')}")
                if name.endswith("/"):
                    here = folders[depth] = f"{parent}/{name.rstrip('/')}"
        paths += [f"{here}/{module}" for module in re.findall(r"\b[a-z_]+\.py\b", description)]
    return paths


def test_every_module_the_architecture_page_names_is_there() -> None:
    paths = named((ROOT / "docs" / "internals.md").read_text())
    assert len(paths) >= 30  # the block was found and read as a layout, not skipped
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_a_module_gone_from_the_package_is_found() -> None:
    page = "```\nshardstore/\n  read/    formats: contract.py, gone.py\n  plan.py  spec\n```\n"
    assert named(page) == ["shardstore/read", "shardstore/read/contract.py", "shardstore/read/gone.py",
                           "shardstore/plan.py"]
