"""Packed stores (store format 4, store/packs.py): a task's cells in one object, found through the commit
records, read by the exports and by Zarr through the storage transformer, refused by Zarr without it, and
never trusted further than the records are checked. On a file system (packs.ON_FILE_SYSTEMS) for the
same code paths as object storage, where tests/store/test_object_storage.py counts the requests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.errors import StoreError
from shardstore.ingest import ingest_files
from shardstore.store import packs
from shardstore.store.store import RANKS, Store
from tests.conftest import assert_bitwise_equal, expected


@pytest.fixture
def packed(monkeypatch) -> None:
    monkeypatch.setattr(packs, "ON_FILE_SYSTEMS", True)


def _records(store: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in (store / RANKS).glob("*.json")}


def _cell_files(store: Path) -> list[Path]:
    return [p for p in store.rglob("c.*") if "__shardstore__" not in p.parts]


def test_a_packed_store_keeps_a_tasks_cells_in_one_object_and_exports_every_byte(packed, checkpoints,
                                                                                tmp_path: Path) -> None:
    src = checkpoints(4)
    store = tmp_path / "s"
    shardstore.ingest(store, [src / "rank0.pt"], jobs=1)
    opened = Store.open(store)
    ingest_files(opened, [src / f"rank{r}.pt" for r in (1, 2, 3)])  # one task: three units, one pack
    opened.assemble_ready()  # (what the coordinator does once they are in)
    records = _records(store)
    named = {pack for rec in records.values() for pack in rec["packs"]}
    assembly = [json.loads(p.read_text()) for p in (store / packs.ASSEMBLED).iterdir()]
    assert len(assembly) == 1  # the one assembly that found every piece in
    assert sorted(f"{packs.PACKS}/{p.name}" for p in (store / packs.PACKS).iterdir()) == \
        sorted(named | {pack for a in assembly for pack in a["packs"]})
    assert all(rec["packs"] and rec["spans"].keys() == rec["cells"].keys() for rec in records.values())
    assert len(named) == 2 and len({p for r in (1, 2, 3) for p in records[r]["packs"]}) == 1
    assert sum(len(c) for rec in records.values() for c in rec["cells"].values()) > len(named)
    assert not _cell_files(store)  # no cell is a file of its own

    want = expected(src)
    shardstore.export(store, tmp_path / "st")
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), want["model"])
    shardstore.export(store, tmp_path / "pt", format="torch")
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "optim.pt", weights_only=True), want["optim"])

    opened = shardstore.open(store)
    weight = want["model"]["wte.weight"]
    assert_bitwise_equal(opened["model/wte.weight"][3:7], weight[3:7])  # a slice, through Zarr's view
    group = opened.zarr
    assert np.array_equal(group["model/wte.weight"][:], weight.numpy())
    import zarr

    with pytest.raises(ValueError, match="storage transformers"):  # Zarr alone refuses, never reads fill values
        zarr.open_array(store / "model" / "wte.weight", mode="r")


def test_a_record_that_misplaces_a_cell_is_refused_naming_it(packed, checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    store = tmp_path / "s"
    shardstore.ingest(store, [src / "rank0.pt", src / "rank1.pt"], jobs=1)
    path = store / RANKS / "1.json"
    good = json.loads(path.read_text())
    array = next(p for p, spans in good["spans"].items() if len(spans) >= 1)
    cases = {
        "onto another cell's bytes": lambda r: r["spans"][array][0].__setitem__(1, _other_start(r, array)),
        "a size that is not its cell's": lambda r: r["spans"][array][0].__setitem__(2, r["spans"][array][0][2] + 8),
        "a pack that is not a pack": lambda r: r["packs"].__setitem__(0, "__shardstore__/manifest.json"),
        "a pack it does not list": lambda r: r["spans"][array][0].__setitem__(0, len(r["packs"])),
    }
    for what, damage in cases.items():
        record = json.loads(json.dumps(good))
        damage(record)
        path.write_text(json.dumps(record))
        with pytest.raises(StoreError, match=r"ranks/1\.json") as caught:
            shardstore.export(store, tmp_path / f"out-{len(what)}")
        assert "damaged" in str(caught.value), what
    path.write_text(json.dumps(good))
    assembly = next((store / packs.ASSEMBLED).iterdir())
    placed = json.loads(assembly.read_text())
    array = next(iter(placed["spans"]))
    placed["spans"][array][0][2] += 1
    assembly.write_text(json.dumps(placed))
    with pytest.raises(StoreError, match=f"{assembly.name} places a cell of {array} wrongly"):
        shardstore.export(store, tmp_path / "out-assembly")
    placed["spans"][array][0][2] -= 1
    placed["packs"] = good["packs"]  # a unit's pack: its bytes are that unit's cells
    assembly.write_text(json.dumps(placed))
    with pytest.raises(StoreError, match=f"{assembly.name} is damaged"):
        shardstore.export(store, tmp_path / "out-assembly-2")
    placed["packs"] = [f"{packs.PACKS}/{assembly.stem}.bin"]
    assembly.write_text(json.dumps(placed))
    shardstore.export(store, tmp_path / "out")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])


def _other_start(record: dict, array: str) -> int:
    """The offset of a cell of the same pack other than `array`'s first."""
    first = record["spans"][array][0]
    return next(s[1] for spans in record["spans"].values() for s in spans if s[0] == first[0] and s[1] != first[1])


def test_a_task_that_commits_nothing_leaves_no_pack_and_one_that_fails_later_keeps_its_earlier_units(
        packed, checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3)
    store_path = tmp_path / "s"
    shardstore.ingest(store_path, [src / "rank0.pt"], jobs=1)
    before = sorted((store_path / packs.PACKS).iterdir())
    bad = tmp_path / "rank2.pt"
    bad.write_bytes((src / "rank2.pt").read_bytes()[:-100])  # its end (the zip's directory) cut off
    store = Store.open(store_path)
    with pytest.raises(shardstore.CheckpointError):
        ingest_files(store, [bad])
    assert sorted((store_path / packs.PACKS).iterdir()) == before  # nothing appeared, nothing half-written
    with pytest.raises(shardstore.CheckpointError):
        ingest_files(store, [src / "rank1.pt", bad])
    assert set(_records(store_path)) == {0, 1}
    assert len(list((store_path / packs.PACKS).iterdir())) == len(before) + 1
    shardstore.ingest(store_path, [src / "rank2.pt"], jobs=1)
    shardstore.export(store_path, tmp_path / "out")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])
