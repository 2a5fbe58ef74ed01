"""Stores and rank files on a real S3 API server: the same code path as local disk, bit-exact results,
and a connection cut mid-ingest that a rerun recovers from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.store.backend import FsspecBackend
from tests.conftest import assert_bitwise_equal, expected, upload
from tests.fixtures.servers import Proxy
from tests.store.conformance import BackendTests

QUICK_FAIL = json.dumps({"config_kwargs": {"connect_timeout": 1, "read_timeout": 3, "retries": {"max_attempts": 1}}})


def cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstore.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_unshard_from_s3_with_the_store_on_s3(s3, checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3)
    url = upload(src, "s3://ckpt-a/run1")
    proc = cli("unshard", url, tmp_path / "out", "--store", "s3://ckpt-a/store", "-q")
    assert proc.returncode == 0, proc.stderr
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])
    assert not Path("s3:").exists()  # the store went to S3, not to a local folder named like it

    store = shardstore.open("s3://ckpt-a/store")
    assert store.status().ok and store.location == "s3://ckpt-a/store"
    assert_bitwise_equal(store["model/wte.weight"][100:104], expected(src)["model"]["wte.weight"][100:104])
    shardstore.export(store, tmp_path / "pt", format="torch")
    assert_bitwise_equal(torch.load(tmp_path / "pt" / "optim.pt", weights_only=True), expected(src)["optim"])
    show = cli("show", "s3://ckpt-a/store", "model/wte.weight", "--slice", "0:1,0:2")
    assert show.returncode == 0 and "complete, from ranks 0, 1, 2" in show.stdout


def test_connection_cut_mid_ingest_then_rerun_completes(s3, checkpoints, tmp_path: Path) -> None:
    src = checkpoints(8)
    url = upload(src, "s3://ckpt-b/run")
    proxy = Proxy(s3.port)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    files = [f"{url}/rank{r}.pt" for r in range(8)]
    cmd = [sys.executable, "-m", "shardstore.cli", "--storage-options", QUICK_FAIL, "ingest", "s3://ckpt-b/store",
           *files, "-j", "1", "-q"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # cut once some ranks are in, but not all
        time.sleep(0.2)
        try:
            ranks = shardstore.open("s3://ckpt-b/store").status().ranks_done
        except shardstore.StoreError:
            continue
        if ranks:
            break
    proxy.cut()
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1].split("\r")[-1]
    assert last.startswith("shardstore: error: ") and "Traceback" not in err and "rerun" in last
    status = shardstore.open("s3://ckpt-b/store").status()
    assert status.ranks_done and not status.ok  # cut mid-way: some ranks done, the rest not marked done
    proxy.resume()
    again = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert again.returncode == 0, again.stderr
    proxy.cut()
    store = shardstore.open("s3://ckpt-b/store")
    assert store.status().ok
    shardstore.export(store, tmp_path / "out")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])


@pytest.mark.parametrize("whole", [True, False], ids=["small-file-whole", "central-directory-first"])
def test_requests_per_rank_file_are_a_small_constant_beyond_its_large_storages(s3, checkpoints, tmp_path: Path,
                                                                               monkeypatch, whole: bool) -> None:
    """Counted at the server: a rank file up to WHOLE bytes costs one request for all of it; a larger one,
    one for the zip's end and central directory, one per run of local headers (with the records of up to
    GAP bytes between them), and for a storage larger than that, one for it and one for the headers after it.
    (In this process, jobs=1, so that the larger case can be had from small files by lowering WHOLE.)"""
    import zipfile

    from shardstore.read.primitives import container
    from shardstore.read.primitives.container import GAP

    if not whole:
        monkeypatch.setattr(container, "WHOLE", 0)
    src = checkpoints(3)
    assert all((src / f"rank{r}.pt").stat().st_size <= container.WHOLE for r in range(3)) == whole
    url = upload(src, f"s3://ckpt-r/run-{whole}")
    before = len(s3.requests())
    shardstore.ingest(tmp_path / "store", url, jobs=1)
    gets = [path for method, path in s3.requests()[before:] if method == "GET"]
    counts = {}
    for rank in (1, 2):  # read by a worker only (rank 0 is also planned from)
        with zipfile.ZipFile(src / f"rank{rank}.pt") as z:
            large = sum(1 for i in z.infolist() if i.file_size > GAP)
        counts[rank] = sum(1 for p in gets if p.split("?")[0] == f"/ckpt-r/run-{whole}/rank{rank}.pt")
        assert counts[rank] == 1 if whole else 1 < counts[rank] <= 2 + 2 * large, (rank, counts, large)
    planning = sum(1 for p in gets if p.split("?")[0] == f"/ckpt-r/run-{whole}/rank0.pt")
    assert planning <= 2 * (2 + 2 * large)  # the coordinator's skimmed read of rank 0 costs about one more file


def test_a_rank_file_opened_with_its_tail_has_what_a_head_says(s3, monkeypatch) -> None:
    """Opening a rank file on S3 fetches its end (all of a small one) in the same request that tells its
    size and version: the same size and stamp a HEAD gives (identities of files ingested before match), and
    the bytes it holds served from memory. Where the service refuses a suffix range (S3 does for an empty
    object), the file is opened the plain way."""
    import s3fs

    from shardstore.read.primitives.container import DataFile, remote_stamp

    fs = s3fs.S3FileSystem()
    fs.mkdir("tails")
    body = bytes(range(256)) * 40
    real = s3fs.S3FileSystem._call_s3

    async def refusing(self, method, *args, **kwargs):  # type: ignore[no-untyped-def]
        if method == "get_object" and str(kwargs.get("Range", "")).startswith("bytes=-"):
            raise OSError(22, "The requested range is not satisfiable")
        return await real(self, method, *args, **kwargs)

    for name, data, refused in (("small", body[:1000], False), ("large", body, False), ("empty", b"", False),
                                ("refused", body[:1000], True)):
        fs.pipe_file(f"tails/{name}", data)
        before = len(s3.requests())
        with monkeypatch.context() as m:
            if refused:
                m.setattr(s3fs.S3FileSystem, "_call_s3", refusing)
            f = DataFile(f"s3://tails/{name}", ahead=2048)
        asked = [m for m, _ in s3.requests()[before:]]
        info = fs.info(f"tails/{name}", refresh=True)
        assert (f.size, f.stamp) == (len(data), remote_stamp(info)), name
        assert asked == (["HEAD"] if refused else ["GET"]), (name, asked)
        if data:
            before = len(s3.requests())
            assert f.read(len(data) - 100, 100) == data[-100:]
            assert len(s3.requests()) == before + refused
            assert f.read(0, 10) == data[:10]  # (outside what was fetched, for the large one: asked for)
        f.close()


class TestS3Backend(BackendTests):
    """The same promises over a real S3 API (moto), through fsspec."""

    @pytest.fixture
    def backend(self, s3, tmp_path: Path) -> FsspecBackend:
        import s3fs

        fs = s3fs.S3FileSystem()
        if not fs.exists("backend-tests"):
            fs.mkdir("backend-tests")
        return FsspecBackend(f"s3://backend-tests/{tmp_path.name}")


@pytest.mark.parametrize("version", [3, 4], ids=["format-3-cell-objects", "format-4-packed"])
def test_a_rank_file_costs_at_most_three_requests_and_an_older_store_is_still_completed(
        s3, checkpoints, tmp_path: Path, version: int) -> None:
    """Counted at the server, W=8 from S3 into S3 (store/packs.py): what each rank file costs is its GET,
    its commit record's PUT and its share of its task's pack, at most 3 requests; no cell is an object of its
    own (those the coordinator assembles from staged pieces are one more pack). A store of format 3 (a cell an object) is still completed in its own format, and
    both export every byte."""
    import dataclasses

    from shardstore import values
    from shardstore.plan import plan_checkpoint
    from shardstore.read.discover import source_of_files, spec_of
    from shardstore.store.store import Store

    src = checkpoints(8)
    url = upload(src, f"s3://ckpt-p/run{version}")
    files = [f"{url}/rank{r}.pt" for r in range(8)]
    store_url = f"s3://ckpt-p/store{version}"
    if version == 3:  # as a shardstore of then made it
        manifest = plan_checkpoint(spec_of(source_of_files(files[:1]), values.encode))
        Store.create(store_url, dataclasses.replace(manifest, version=3))
    before = len(s3.requests())
    shardstore.ingest(store_url, files, jobs=2)
    asked = [(method, path.split("?")[0]) for method, path in s3.requests()[before:]]
    put_cells = {p.removeprefix(f"/ckpt-p/store{version}/") for m, p in asked if m == "PUT" and "/c." in p}
    store = shardstore.open(store_url)
    unit_packs = {f"/ckpt-p/store{version}/{pack}" for rec in store.records().values() for pack in rec.packs}
    per_file = [(m, p) for m, p in asked if p.startswith(f"/ckpt-p/run{version}/rank")
                or m == "PUT" and (p in unit_packs or "/__shardstore__/ranks/" in p)]
    assembly = [p for m, p in asked if m == "PUT" and "/__shardstore__/packs/" in p and p not in unit_packs]
    arrays = store.manifest.arrays
    unit_cells = {f"{path}/c." + ".".join(map(str, arrays[path].cell_index(cell)))
                  for rec in store.records().values() for path, cells in rec.cells.items() for cell in cells}
    assert store.manifest.packed == (version == 4) and unit_cells
    if version == 4:
        planning = 1  # the coordinator's read of rank 0 to plan from: once a run, not once a file
        assert len(per_file) <= 3 * 8 + planning, sorted(per_file)
        assert not put_cells and len(assembly) == 1  # the assembled cells too: one pack (and its record)
    else:
        assert unit_cells <= put_cells and not [p for _, p in asked if "/packs/" in p]
    shardstore.export(store, tmp_path / "out")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])
    assert_bitwise_equal(store["model/wte.weight"][1:3], expected(src)["model"]["wte.weight"][1:3])
