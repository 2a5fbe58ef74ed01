"""The package's public names, imported on first use, and what the command line's start-up loads."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import shardstore

MODULES = {"api", "errors", "inspect", "verify", "progress", "records", "store.handle", "store.store"}


def test_every_public_name_is_its_modules_object() -> None:
    import importlib

    for name in shardstore.__all__:
        if name == "__version__":
            continue
        value = getattr(shardstore, name)
        assert not isinstance(value, types.ModuleType), name
        defined = [m for m in MODULES if getattr(importlib.import_module(f"shardstore.{m}"), name, None) is value]
        assert defined, name


def test_a_submodule_imported_first_never_hides_the_function_of_its_name() -> None:
    """`import shardstore.export.registry` binds the subpackage as an attribute of shardstore; the public
    `shardstore.export` stays the function, as it was when the package imported the API eagerly."""
    probe = ("import shardstore.export.registry, shardstore.verify, shardstore.inspect, shardstore.ingest, "
             "shardstore.follow, shardstore.average, shardstore\n"
             "print(*(callable(getattr(shardstore, n)) and not isinstance(getattr(shardstore, n), type(shardstore))"
             " for n in ('export', 'verify', 'inspect', 'ingest', 'follow', 'average')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True"] * 6


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        shardstore.nothing  # noqa: B018


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["unshard", "--help"]])
def test_the_command_lines_start_up_loads_no_api(argv: list[str]) -> None:
    """`shardstore --version` and `--help` load click and the command line only (benchmarks/startup.py times
    them); a command's own --help loads the registries its choices name, still not numpy's users' API."""
    probe = ("import sys\nfrom shardstore.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
             "print('LOADED', *sorted(m for m in ('numpy', 'torch', 'zarr', 'shardstore.api', 'shardstore.read.registry')"
             " if m in sys.modules))" % (argv,))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    loaded = out.rsplit("LOADED", 1)[1].split()
    if argv[0] == "unshard":
        assert "shardstore.api" not in loaded and "torch" not in loaded
        assert "safetensors" in out and "megatron" in out  # the --format choices were listed
    else:
        assert loaded == []
