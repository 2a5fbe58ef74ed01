"""The store as other Zarr readers see it."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import shardstore
from shardstore.errors import StoreError
from shardstore.store.backend import LocalBackend
from tests.conftest import expected
from tests.store.conformance import BackendTests


def test_zarr_walks_the_store_without_warnings_and_reads_the_same_bits(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    shardstore.ingest(tmp_path / "s", sorted(src.glob("rank*.pt")), jobs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr warns about any object it does not recognise
        group = zarr.open_group(tmp_path / "s", mode="r", zarr_format=3)
        members = dict(group.members(max_depth=None))
        group.tree()
    assert "model/wte.weight" in members and members["__shardstore__"].shape == (0,)
    want = expected(src)["model"]["wte.weight"].numpy()
    assert np.array_equal(members["model/wte.weight"][:], want)


def _metadata(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("zarr.json"))}


def test_a_scratch_store_writes_array_metadata_only_once_an_array_is_to_be_written(checkpoints,
                                                                                  tmp_path: Path) -> None:
    """A one-pass unshard's scratch store never holds array data, so its arrays get no zarr.json; when the
    export turns out to write into the store after all (no direct layout), every array gets the zarr.json
    a normal store has (naming the packed transformer: a scratch store is packed), and Zarr reads the same
    bits through the store's view."""
    from shardstore.ingest import session
    from shardstore.read.discover import source_of_files
    from shardstore.store.store import Store

    src = checkpoints(2)
    files = sorted(src.glob("rank*.pt"))
    normal = shardstore.ingest(tmp_path / "normal", files, jobs=1)
    lean = Store.create(tmp_path / "lean", normal.manifest, array_metadata=False)
    assert not any(f"{a}/zarr.json" in _metadata(tmp_path / "lean") for a in normal.manifest.arrays)
    lean.ensure_array_metadata()
    assert _metadata(tmp_path / "lean") == _metadata(tmp_path / "normal")
    with session(tmp_path / "scratch", source_of_files(files), jobs=1, scratch=True) as planned:
        planned.ingest(direct=None)  # a one-pass export that wrote into the store after all
    scratch = Store.open(tmp_path / "scratch")
    assert scratch.manifest.packed and not normal.manifest.packed
    assert _metadata(tmp_path / "scratch") == _packed(_metadata(tmp_path / "normal"), normal.manifest.arrays)
    assert np.array_equal(scratch.zarr["model/wte.weight"][:], expected(src)["model"]["wte.weight"].numpy())


def _packed(metadata: dict[str, bytes], arrays: Any) -> dict[str, bytes]:
    """A store's zarr.json documents as a packed store has them: its arrays' name the transformer."""
    from shardstore.store.packs import transformed

    return {key: json.dumps(transformed(json.loads(raw))).encode() if key.removesuffix("/zarr.json") in arrays
            else raw for key, raw in metadata.items()}


def test_assembly_keeps_no_more_staging_bytes_than_its_cache_holds(checkpoints, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Assembling staged arrays reads a rank's staging file whole only while all kept fit the cache; one
    that would not fit is read piece by piece. A staging file its worker handed back is not read at all.
    The arrays are the same bits every way."""
    from shardstore.sink import cells
    from shardstore.store import backend
    from shardstore.store import store as store_module

    src = checkpoints(3)
    files = sorted(src.glob("rank*.pt"))
    want = expected(src)["model"]
    real = backend.LocalBackend.read
    kept: list[int] = []
    staging_reads: list[str] = []

    def spy(self, key, start=0, length=None):  # notes each staging file read whole
        data = real(self, key, start, length)
        if key.startswith("__shardstore__/staging/"):
            staging_reads.append(key)
            if start == 0 and len(data) == os.path.getsize(self._path(key)):
                kept.append(len(data))
        return data

    sized: list[str] = []  # a staging file's size is its commit record's: no request (on object storage) each
    real_size = backend.LocalBackend.size

    def size_spy(self, key):
        sized.append(key)
        return real_size(self, key)

    sizes: list[int] = []
    for name in ("handed back", "roomy", "tight"):
        if name == "tight":  # room for the largest staging file, not for two
            monkeypatch.setattr(store_module, "STAGING_CACHE_BYTES", max(sizes) + 1)
        kept.clear()
        staging_reads.clear()
        with monkeypatch.context() as m:
            m.setattr(backend.LocalBackend, "read", spy)
            m.setattr(backend.LocalBackend, "size", size_spy)
            m.setattr(cells, "INLINE_BYTES", 0)  # (staged bytes in the records: test_staged_bytes_go_in_the_records)
            if name != "handed back":
                m.setattr(cells, "HANDBACK_BYTES", 0)
            shardstore.ingest(tmp_path / name, files, jobs=1)
        assert not [k for k in sized if k.startswith("__shardstore__/staging/")]
        sizes = sorted(p.stat().st_size for p in (tmp_path / name / "__shardstore__" / "staging").iterdir())
        group = zarr.open_group(tmp_path / name, mode="r", zarr_format=3)
        staged = [p for p, e in shardstore.open(tmp_path / name).manifest.arrays.items()
                  if e.staged and p.removeprefix("model/") in want]
        assert staged
        for path in staged:
            assert np.array_equal(group[path][:], want[path.removeprefix("model/")].numpy()), path
        if name == "roomy":
            assert sorted(kept) == sizes and len(sizes) == 3 and sum(sizes[:2]) > max(sizes) + 1
        elif name == "handed back":
            assert staging_reads == [] and len(sizes) == 3
        else:
            assert len(kept) == 1 and sum(kept) <= max(sizes) + 1


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> LocalBackend:
        return LocalBackend(tmp_path / "store")

    def test_a_publish_whose_sync_fails_shows_no_record(self, backend: LocalBackend,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
        """The records of a batch are renamed into place only after the one sync of everything: the disk
        failing at that sync leaves no record and no temporary."""
        calls: list[list[str]] = []

        def failing(keys: list[str]) -> None:
            calls.append(list(keys))
            raise OSError(5, "Input/output error")

        backend.write("cells/a", [b"cell bytes"])
        monkeypatch.setattr(backend, "sync", failing)
        with pytest.raises(OSError, match="Input/output error"):
            backend.publish([("ranks/0.json", b"{}"), ("ranks/1.json", b"{}")], after=["cells/a"])
        # it failed where it was meant to: at the one sync, which covered the cell and both records' temporaries
        assert len(calls) == 1 and calls[0][0] == "cells/a" and len(calls[0]) == 3
        assert backend.list("ranks") == [] and not list(Path(backend.root, "ranks").iterdir())


def test_staged_bytes_go_in_the_records(checkpoints, tmp_path: Path) -> None:
    """A unit's few staged bytes are in its commit record (store format 3): no staging file is written or
    read, a store opened afresh assembles the same bits from the records, and a record whose staged bytes
    are damaged or cut short is refused with one line naming it."""
    import json

    src = checkpoints(3)
    files = sorted(src.glob("rank*.pt"))
    shardstore.ingest(tmp_path / "s", files, jobs=2)
    assert not (tmp_path / "s" / "__shardstore__" / "staging").exists()
    ranks = tmp_path / "s" / "__shardstore__" / "ranks"
    records = {r: json.loads((ranks / f"{r}.json").read_text()) for r in range(3)}
    assert all(rec["staged"] and rec["staging"] for rec in records.values())
    want = expected(src)["model"]
    staged = [p for p, e in shardstore.open(tmp_path / "s").manifest.arrays.items()
              if e.staged and p.removeprefix("model/") in want]
    assert staged

    def assembled(store: Path) -> dict[str, np.ndarray]:
        group = zarr.open_group(store, mode="r", zarr_format=3)
        return {p: group[p][:] for p in staged}

    got = assembled(tmp_path / "s")
    for path in staged:
        assert np.array_equal(got[path], want[path.removeprefix("model/")].numpy()), path
    for path in staged:  # assembled again from the records alone, by a store opened afresh
        for cell in (tmp_path / "s" / path).glob("c*"):
            cell.unlink()
    assert sorted(shardstore.open(tmp_path / "s").assemble_ready()) == sorted(staged)
    assert all(np.array_equal(a, got[p]) for p, a in assembled(tmp_path / "s").items())

    for damage, message in ((lambda t: t[:-2] + "!=", "damaged commit record"),
                            (lambda t: t[:8], "1.json's staged bytes are shorter than its commit record says")):
        rec = dict(records[1], staging=damage(records[1]["staging"]))
        (ranks / "1.json").write_text(json.dumps(rec))
        for path in staged:
            for cell in (tmp_path / "s" / path).glob("c*"):
                cell.unlink()
        with pytest.raises(StoreError, match=message):
            shardstore.open(tmp_path / "s").assemble_ready()


def test_a_unit_puts_in_its_record_no_more_than_its_share_of_what_the_coordinator_holds(
        checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged bytes inline in the records are all held by the coordinator (as kept staging files are, within
    STAGING_CACHE_BYTES): a unit inlines them only up to its world size's share of that, so a large world
    cannot make the records hold more. Past its share, a unit writes a staging file, and the store
    assembles the same bits."""
    import base64
    import json

    from shardstore.sink import cells

    src = checkpoints(3)
    files = sorted(src.glob("rank*.pt"))
    inline = shardstore.ingest(tmp_path / "inline", files, jobs=1)
    records = [json.loads(p.read_text()) for p in (tmp_path / "inline" / "__shardstore__" / "ranks").iterdir()]
    staged = [len(base64.b64decode(rec["staging"])) for rec in records]
    assert len(staged) == 3 and inline._staged_bytes == sum(staged)  # held, and counted as held
    monkeypatch.setattr(cells, "STAGING_CACHE_BYTES", 3 * max(staged) - 1)  # the largest unit's is over its share
    shardstore.ingest(tmp_path / "files", files, jobs=1)
    records = [json.loads(p.read_text()) for p in (tmp_path / "files" / "__shardstore__" / "ranks").iterdir()]
    over = [n for n in staged if n > (3 * max(staged) - 1) // 3]
    assert over and sum("staging" not in rec for rec in records) == len(over)
    assert len(list((tmp_path / "files" / "__shardstore__" / "staging").iterdir())) == len(over)
    a, b = (zarr.open_group(tmp_path / s, mode="r", zarr_format=3) for s in ("inline", "files"))
    paths = [p for p, e in inline.manifest.arrays.items() if e.staged]
    assert paths and all(np.array_equal(a[p][:], b[p][:]) for p in paths)


def test_a_store_made_by_this_process_is_assembled_without_looking_for_its_cells(
        checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a coordinator writes the cells of staged arrays: the run that made the store writes them without
    asking whether they exist (on S3, a request each), and a store opened afresh asks once, for all. Only
    the first assembly assumes so: after it, other runs may have written cells."""
    from shardstore.store import backend

    looked: list[list[str]] = []
    real = backend.LocalBackend.read_many

    def spy(self, keys, length=None):  # type: ignore[no-untyped-def]
        if length == 1 and keys:
            looked.append(list(keys))
        return real(self, keys, length)

    monkeypatch.setattr(backend.LocalBackend, "read_many", spy)
    files = sorted(checkpoints(3).glob("rank*.pt"))
    made = shardstore.ingest(tmp_path / "s", files, jobs=2)
    staged = [p for p, e in made.manifest.arrays.items() if e.staged]
    assert staged and looked == []
    assert made.status().ok and looked == []  # (all written by it: known without asking)
    opened = shardstore.open(tmp_path / "s")
    assert opened.status().ok and len(looked) == 1 and len(looked[0]) == len(staged)
