"""What keeps a Megatron torch_dist checkpoint of DeepSeek-V3's structure (thousands of files, 100,000+
items: benchmarks/megatron_moe_bench.py) from costing time per file times items: its .metadata parsed
once per process, and each unit reading only its own file's items."""

from __future__ import annotations

from pathlib import Path

from shardstore.read.formats import dcp

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "megatron" / "core0.19.2" / "tp2-pp2" \
    / "iter_0000010"


def test_a_torch_dist_metadata_is_parsed_once(monkeypatch):
    """Finding a checkpoint's files and planning it both read its .metadata: the second read is the first's."""
    calls = []
    parse = dcp._parse
    monkeypatch.setattr(dcp, "_parse", lambda *a: calls.append(a) or parse(*a))
    dcp._LAST_TORCH_DIST.clear()
    first = dcp.read_checkpoint(MEGATRON)
    assert dcp.read_checkpoint(MEGATRON) is first
    assert len(calls) == 1


def test_a_changed_metadata_is_parsed_again(tmp_path, monkeypatch):
    """The parse is kept by the .metadata's bytes: another save in the same folder is read afresh."""
    import shutil

    folder = tmp_path / "iter"
    shutil.copytree(MEGATRON, folder)
    dcp._LAST_TORCH_DIST.clear()
    first = dcp.read_checkpoint(folder)
    shutil.copy(MEGATRON.parent.parent / "tp2-pp1" / "iter_0000010" / ".metadata", folder / ".metadata")
    assert dcp.read_checkpoint(folder).digest != first.digest


def test_items_by_file_are_the_metadata_order_of_each_file():
    ckpt = dcp.read_checkpoint(MEGATRON)
    assert set(ckpt.by_file) == set(ckpt.files)
    for name in ckpt.files:
        assert ckpt.by_file[name] == [i for i in ckpt.items if i.file == name]
