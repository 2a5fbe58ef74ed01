"""`shardstore watch`, run as a real process while rank files arrive the ways they do in practice."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import shardstore
from tests.conftest import assert_bitwise_equal, expected


def start_watch(store: Path, src: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shardstore.cli", "watch", str(store), str(src), "--poll", "0.1",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def committed(store: Path) -> set[int]:
    folder = store / "__shardstore__" / "ranks"
    return {int(p.stem) for p in folder.glob("*.json")} if folder.exists() else set()


def wait_for(condition, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.05)


def test_files_are_taken_only_once_complete(checkpoints, tmp_path: Path) -> None:
    """Half-written files are looked at and left: each negative check follows a complete file that arrived
    after them and was taken (the watcher looked at the whole folder, twice, since), not a fixed wait."""
    ckpt = checkpoints(4)
    src, store = tmp_path / "incoming", tmp_path / "store"
    src.mkdir()
    proc = start_watch(store, src, "--timeout", "240", "-q")
    try:
        # rank 3: copied under a temporary name, then renamed into place (rsync, most copy tools)
        shutil.copy(ckpt / "rank3.pt", src / ".rank3.pt.partial")
        os.rename(src / ".rank3.pt.partial", src / "rank3.pt")
        wait_for(lambda: committed(store) == {3})
        with open(src / "rank0.pt", "wb") as f:
            # rank 0: written in place slowly; rank 1: a zip whose central directory is not there yet
            data0, data1 = (ckpt / "rank0.pt").read_bytes(), (ckpt / "rank1.pt").read_bytes()
            f.write(data0[: len(data0) // 2])
            f.flush()
            (src / "rank1.pt").write_bytes(data1[:-200])
            shutil.copy(ckpt / "rank2.pt", src / ".rank2.pt.partial")  # then a whole file after them
            os.rename(src / ".rank2.pt.partial", src / "rank2.pt")
            wait_for(lambda: 2 in committed(store))
            assert committed(store) == {2, 3}  # looked at since they were there, and left
            f.write(data0[len(data0) // 2:])
        with open(src / "rank1.pt", "ab") as f:
            f.write(data1[-200:])
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    shardstore.export(store, tmp_path / "out")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(ckpt)["model"])


def test_timeout_names_missing_ranks(checkpoints, tmp_path: Path) -> None:
    ckpt = checkpoints(3)
    src = tmp_path / "incoming"
    src.mkdir()
    shutil.copy(ckpt / "rank0.pt", src / "rank0.pt")
    shutil.copy(ckpt / "rank2.pt", src / "rank2.pt")
    (src / "rank1.pt").write_bytes((ckpt / "rank1.pt").read_bytes()[:1000])  # stuck half-way
    proc = start_watch(tmp_path / "store", src, "--timeout", "4", "-q")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith("shardstore: error: ") and "Traceback" not in err
    assert "timed out after 4 s; ranks still missing: 1" in err and "rank1.pt" in err
    assert committed(tmp_path / "store") == {0, 2}


def test_a_dcp_folder_is_taken_once_its_metadata_is_there(dcp_checkpoints, tmp_path: Path) -> None:
    ckpt = dcp_checkpoints("fsdp2")
    src, store = tmp_path / "incoming", tmp_path / "store"
    src.mkdir()
    proc = start_watch(store, src, "--timeout", "240", "-q")
    try:
        for name in ("__0_0.distcp", "__1_0.distcp"):
            shutil.copy(ckpt / name, src / name)
        time.sleep(1.0)  # ten polls: without .metadata nothing is known about these files
        assert not store.exists() or committed(store) == set()
        data = (ckpt / "__2_0.distcp").read_bytes()
        (src / "__2_0.distcp").write_bytes(data[: len(data) // 2])  # half of a file
        shutil.copy(ckpt / ".metadata", src / ".metadata")
        wait_for(lambda: committed(store) == {0, 1})
        shutil.copy(ckpt / "__3_0.distcp", src / "__3_0.distcp")  # a whole file after the half one
        wait_for(lambda: 3 in committed(store))
        assert committed(store) == {0, 1, 3}  # the half file was looked at since, and left
        (src / "__2_0.distcp").write_bytes(data)
        assert proc.wait(timeout=240) == 0, proc.stderr.read()
    finally:
        proc.kill()
    shardstore.export(store, tmp_path / "out", format="torch")
    want = torch.load(f"{ckpt}.expected.pt.ref", weights_only=False)
    assert_bitwise_equal(torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False), want)  # dcp_to_torch_save's


def test_an_olmo_local_folder_is_refused_by_name(olmo_checkpoints, tmp_path: Path) -> None:
    """Its model/, optim/ and train/ files are not three checkpoints: watch says what the folder is."""
    import pytest

    src = olmo_checkpoints("local", "2.2", 3)
    with pytest.raises(shardstore.CheckpointError, match="a checkpoint in the OLMo `local` format; watch takes rank files or a DCP"):
        shardstore.watch(tmp_path / "store", src, timeout=5)
    assert callable(shardstore.watch)  # used once, still the function (no submodule of that name shadows it)


def test_plain_fsdp2_rank_files_arriving_are_ingested(fsdp2_files, tmp_path: Path) -> None:
    """Per-rank DTensor files (a plain FSDP2 save) arriving one by one, rank 2 first: the store is
    planned from the first to arrive and fills as the others do."""
    ckpt = fsdp2_files("fsdp2", 3)
    src, store = tmp_path / "incoming", tmp_path / "store"
    src.mkdir()
    proc = start_watch(store, src, "--timeout", "240", "-q")
    try:
        for rank in (2, 0, 1):
            shutil.copy(ckpt / f"model_rank{rank}.pt", src / f".model_rank{rank}.pt.partial")
            os.rename(src / f".model_rank{rank}.pt.partial", src / f"model_rank{rank}.pt")
            wait_for(lambda: rank in committed(store))
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    shardstore.export(store, tmp_path / "out")
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"),
                         dict(torch.load(f"{ckpt}.expected.pt.ref", weights_only=True)))
