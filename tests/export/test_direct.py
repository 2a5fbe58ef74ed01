"""One read, one write (sink/, each format's `plan_direct`): `unshard` without `--store` writes each shard straight into the
output, and the output is byte for byte what the two-step path (ingest into a store, then export) writes."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.export import plan_direct
from shardstore.export.registry import request
from shardstore.export.origin import RECORD
from tests.conftest import Phases, assert_bitwise_equal, expected, exported, sigkill_mid_way


def _same_as_two_step(src: Path, tmp_path: Path, **options: object) -> Path:
    """Unshard `src` both ways; the one-pass run must have been one pass (no export phase), and what it
    wrote must equal the two-step run's: byte for byte, or, for torch and DCP (whose zips carry a random
    serialization id, and lay their records out in another order), loaded the same bit for bit with
    every zip record's CRC-32 right. Returns the one-pass output folder."""
    one, two = tmp_path / "one", tmp_path / "two"
    phases = Phases()
    direct = shardstore.unshard(src, one, jobs=2, progress=phases, **options)
    assert phases.phases == ["ingest"], phases.phases  # nothing was exported from a store
    assert not shardstore.scratch_location(one).exists()
    shardstore.unshard(src, two, store=tmp_path / "store", jobs=2, **options)
    if options.get("format") == "dcp":
        assert_bitwise_equal(_dcp_state(one, tmp_path / "one.pt"), _dcp_state(two, tmp_path / "two.pt"), ordered=True)
        assert sorted(p.name for p in direct.files) == exported(one)
        return one
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for path in direct.files:
        if path.suffix == ".pt":
            assert zipfile.ZipFile(path).testzip() is None, path.name  # every record's CRC-32
            assert_bitwise_equal(torch.load(path, weights_only=False), torch.load(two / path.name, weights_only=False),
                                 path.name, ordered=True)
        else:
            assert path.read_bytes() == (two / path.name).read_bytes(), path.name
    return one


def _dcp_state(folder: Path, into: Path) -> dict:
    """A DCP folder as torch's own dcp_to_torch_save reads it, after checking every item's zip CRCs."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for info in FileSystemReader(str(folder)).read_metadata().storage_data.values():
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = f.read(info.length)
        if item[:4] == b"PK\x03\x04":  # a tensor, or a value, torch.save'd
            assert zipfile.ZipFile(io.BytesIO(item)).testzip() is None, info
    dcp_to_torch_save(folder, into)
    return torch.load(into, weights_only=False)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_files_in_one_pass(world: int, checkpoints, tmp_path: Path) -> None:
    """ShardedTensors, their rows split evenly (2) and unevenly (3)."""
    src = checkpoints(world)
    out = _same_as_two_step(src, tmp_path)
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])


def test_casts_splits_and_renames_in_one_pass(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3)
    out = _same_as_two_step(src, tmp_path, dtype="bfloat16", max_shard_size=200_000, strip_prefix="w")
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and len([n for n in names if n.startswith("model-")]) == 2
    got = {}
    for name in names:
        if name.endswith(".safetensors"):
            got |= load_file(out / name)
    want = {k.removeprefix("w"): v.to(torch.bfloat16) for k, v in expected(src)["model"].items()}
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("kind", ["tp", "fsdp2"])
def test_dcp_boxes_on_two_dimensions_in_one_pass(kind: str, dcp_checkpoints, tmp_path: Path) -> None:
    """tp: RowwiseParallel x FSDP, so some boxes are column blocks, written row by row."""
    src = dcp_checkpoints(kind)
    out = _same_as_two_step(src, tmp_path)
    want = torch.load(f"{src}.expected.pt.ref", weights_only=False)["model"]
    assert_bitwise_equal(load_file(out / "model.safetensors"), want)


def test_flat_parameters_in_one_pass(olmo_checkpoints, tmp_path: Path) -> None:
    """OLMo `local`: element ranges of flat parameters, one of them astride two ranks mid-row."""
    src = olmo_checkpoints("local", "2.2", 3)
    out = _same_as_two_step(src, tmp_path)
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])


def test_a_hugging_face_folder_in_one_pass(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(4, "hf")
    out = _same_as_two_step(src, tmp_path, format="hf", hf_config=src / "hf-config")
    assert (out / "config.json").exists()


@pytest.mark.parametrize("format", ["torch", "dcp"])
@pytest.mark.parametrize("world", [1, 3])
def test_torch_and_dcp_from_rank_files_in_one_pass(format: str, world: int, checkpoints, tmp_path: Path) -> None:
    """OLMo's three files (or a DCP folder) laid out up front; at world size 1 the small tensors are plain
    values, which the seal writes from the store."""
    src = checkpoints(world)
    out = _same_as_two_step(src, tmp_path, format=format)
    if format == "torch":
        assert_bitwise_equal(torch.load(out / "model.pt", weights_only=False), expected(src)["model"])


@pytest.mark.parametrize("format", ["torch", "dcp"])
@pytest.mark.parametrize("kind", ["tp", "fsdp2"])
def test_torch_and_dcp_from_dcp_boxes_in_one_pass(format: str, kind: str, dcp_checkpoints, tmp_path: Path) -> None:
    """Column boxes (tp) are written row by row and record no CRCs: the seal reads those entries back."""
    src = dcp_checkpoints(kind)
    out = _same_as_two_step(src, tmp_path, format=format)
    want = torch.load(f"{src}.expected.pt.ref", weights_only=False)["model"]
    if format == "torch":  # a plain DCP save: one checkpoint.pt in its own nesting
        assert_bitwise_equal(torch.load(out / "checkpoint.pt", weights_only=False)["model"], want)


def test_entries_whose_pieces_record_no_crc_are_read_back(dcp_checkpoints, tmp_path: Path, monkeypatch) -> None:
    """A piece written in more runs than the workers record CRCs for (a column box, row by row): the seal
    reads its entry back from the file, and the CRC is right."""
    from shardstore.sink import files, layout

    monkeypatch.setattr(files, "RECORDED_RUNS", 1)
    read_back = []
    real_pread = layout.os.pread
    monkeypatch.setattr(layout.os, "pread", lambda fd, n, at: read_back.append(n) or real_pread(fd, n, at))
    src = dcp_checkpoints("tp")
    out = shardstore.unshard(src, tmp_path / "out", format="torch", jobs=1)
    assert read_back  # some entry was checksummed from the file
    for path in out.files:
        assert zipfile.ZipFile(path).testzip() is None, path.name
    want = torch.load(f"{src}.expected.pt.ref", weights_only=False)["model"]
    assert_bitwise_equal(torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False)["model"], dict(want))


@pytest.mark.parametrize("format", ["torch", "dcp"])
def test_torch_and_dcp_from_flat_parameters_in_one_pass(format: str, olmo_checkpoints, tmp_path: Path) -> None:
    src = olmo_checkpoints("local", "2.2", 3)
    _same_as_two_step(src, tmp_path, format=format)


@pytest.mark.parametrize("format", ["torch", "dcp"])
def test_torch_and_dcp_under_hybrid_sharding_in_one_pass(format: str, tmp_path: Path) -> None:
    """Composer's HSDP files: one unit per group rank writes; checkpoint.pt keeps every rank's RNG state."""
    src = Path(__file__).parents[1] / "corpus" / "data" / "composer-t2.13-hsdp-w4" / "ep0-ba1"
    _same_as_two_step(src, tmp_path, format=format)


def test_a_crash_while_sealing_a_torch_export_resumes(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """Killed while the seal writes the second file's pickle and directory (the first is sealed): OUT
    holds nothing, and the rerun seals both again from the same journal."""
    from shardstore.export import torch as direct_torch

    src = checkpoints(3)
    out = tmp_path / "out"
    real, sealed = direct_torch.write_entries, []

    def die_on_the_second(zw, *args, **kwargs):
        if sealed:
            zw.out.write(b"half a pickle")
            raise KeyboardInterrupt
        sealed.append(zw.archive)
        return real(zw, *args, **kwargs)

    monkeypatch.setattr(direct_torch, "write_entries", die_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        shardstore.unshard(src, out, format="torch", jobs=1)
    monkeypatch.undo()
    assert sealed == ["model"] and not any(out.glob("*.pt"))
    phases = Phases()
    shardstore.unshard(src, out, format="torch", jobs=1, progress=phases)
    assert phases.phases == ["ingest"]  # every unit was journalled: only the seal and the move were left
    for name in ("model", "optim"):
        assert zipfile.ZipFile(out / f"{name}.pt").testzip() is None
        assert_bitwise_equal(torch.load(out / f"{name}.pt", weights_only=False), expected(src)[name])


@pytest.mark.parametrize("member", ["composer-t2.13-hsdp-w4", "composer-t2.1-hsdp-w4", "composer-t2.0-hsdp-w4"])
def test_hybrid_sharding_in_one_pass(member: str, tmp_path: Path) -> None:
    """Genuine HSDP rank files (2 replica groups of 2; torch 2.0 and 2.1 number placements within the
    group, 2.13 globally): one unit of each group rank writes, and the output is the two-step one."""
    src = Path(__file__).parents[1] / "corpus" / "data" / member / "ep0-ba1"
    _same_as_two_step(src, tmp_path, strip_prefix="model.")


def test_a_claim_whose_unit_never_committed_is_void(tmp_path: Path) -> None:
    """A unit that claimed its group rank and died before its commit: the rerun's units of that group
    rank write instead, and the output is whole."""
    from shardstore.sink import files, layout

    src = Path(__file__).parents[1] / "corpus" / "data" / "composer-t2.13-hsdp-w4" / "ep0-ba1"
    out = tmp_path / "out"
    scratch = shardstore.scratch_location(out)
    original = files.DirectWriter.claim

    def die_after_claiming(self, group_rank: int, rank: int) -> bool:
        won = original(self, group_rank, rank)
        if won and group_rank == 1:
            raise KeyboardInterrupt  # killed between its claim and its commit
        return won

    files.DirectWriter.claim = die_after_claiming
    try:
        with pytest.raises(KeyboardInterrupt):
            shardstore.unshard(src, out, jobs=1)
    finally:
        files.DirectWriter.claim = original
    claims = scratch / layout.FOLDER / layout.CLAIMS
    assert (claims / "1").read_text() == "1" and 1 not in shardstore.open(scratch).records()
    assert plan_direct(shardstore.open(scratch), request()) is not None  # what the rerun lays out first
    assert sorted(p.name for p in claims.iterdir()) == ["0"]  # rank 0's claim holds: it was journalled
    shardstore.unshard(src, out, jobs=1)
    two = shardstore.unshard(src, tmp_path / "two", store=tmp_path / "store", jobs=1)
    assert (out / "model.safetensors").read_bytes() == two.files[0].read_bytes()


def test_plain_values_under_the_model_take_the_two_step_path(checkpoints, tmp_path: Path) -> None:
    """At world size 1 the small plain tensors are values, whose shapes come with the data."""
    single = checkpoints(1)
    phases = Phases()
    shardstore.unshard(single, tmp_path / "out", jobs=2, progress=phases)
    assert phases.phases == ["ingest", "export"]
    store = shardstore.ingest(tmp_path / "store", shardstore.rank_files(single), jobs=1)
    assert plan_direct(store, request()) is None
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(single)["model"])


@pytest.mark.parametrize("format,target", [("safetensors", 0), ("safetensors", 1), ("safetensors", 2),
                                           ("torch", 1), ("dcp", 2)])
def test_sigkill_mid_way_leaves_nothing_finished_and_the_rerun_completes(format: str, target: int, checkpoints,
                                                                        tmp_path: Path) -> None:
    """Killed once `target` units are journalled: OUT holds nothing that looks finished, and the same
    command resumes, skipping the journalled units, to what a clean run writes."""
    src = checkpoints(6)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shardstore.cli", "unshard", str(src), str(out), "-j", "1", "--format", format, "-q"]
    scratch = shardstore.scratch_location(out)
    committed = sigkill_mid_way(cmd, scratch, 6, target, reset=out)
    assert [p.name for p in out.iterdir()] == [scratch.name]  # the output is still inside the scratch store
    rerun = subprocess.run(cmd[:-1], capture_output=True, text=True)  # without -q: its one line per phase
    assert rerun.returncode == 0, rerun.stderr
    assert ("were already done" in rerun.stderr) == (committed > 0), rerun.stderr  # journalled units skipped
    if format == "safetensors":
        assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])
        assert exported(out) == ["model.safetensors"]
    elif format == "torch":
        assert zipfile.ZipFile(out / "optim.pt").testzip() is None
        assert_bitwise_equal(torch.load(out / "optim.pt", weights_only=False), expected(src)["optim"])
    else:
        assert_bitwise_equal(_dcp_state(out, tmp_path / "dcp.pt")["model"], expected(src)["model"])


def test_a_crash_while_moving_the_files_into_out_resumes(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """Killed after the first of two files moved into OUT: the rerun moves the other and finishes."""
    import os

    src = checkpoints(3)
    out = tmp_path / "out"
    real, moved = os.replace, []

    def replace_once(a: object, b: object) -> None:
        if Path(b).parent != out or Path(b).name == RECORD:  # the store's own atomic writes, the export's record
            return real(a, b)
        if moved:
            raise KeyboardInterrupt  # killed between the two renames into OUT
        real(a, b)
        moved.append(Path(b))

    monkeypatch.setattr(os, "replace", replace_once)
    with pytest.raises(KeyboardInterrupt):
        shardstore.unshard(src, out, jobs=1, max_shard_size=600_000)
    monkeypatch.undo()
    assert [p.name for p in moved] == ["model-00001-of-00002.safetensors"] and not (out / "model.safetensors.index.json").exists()
    shardstore.unshard(src, out, jobs=1, max_shard_size=600_000)
    got = load_file(out / "model-00001-of-00002.safetensors") | load_file(out / "model-00002-of-00002.safetensors")
    assert_bitwise_equal(got, expected(src)["model"])


def test_an_earlier_export_in_out_is_refused_or_replaced(checkpoints, tmp_path: Path) -> None:
    from shardstore.errors import ExportError

    src = checkpoints(3)
    out = tmp_path / "out"
    shardstore.unshard(src, out, jobs=1, max_shard_size=600_000)  # two files and an index
    with pytest.raises(ExportError, match="earlier export that this one would not replace"):
        shardstore.unshard(src, out, jobs=1)
    result = shardstore.unshard(src, out, jobs=1, overwrite=True)
    assert exported(out) == ["model.safetensors"] and len(result.replaced) == 3
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])


def test_a_full_disk_is_one_line_and_the_rerun_completes(checkpoints, tmp_path: Path) -> None:
    """OUT on a real, tiny disk that holds the output (so the check before the ingest lets it start) but
    not the scratch store's records beside it: one line, no traceback, and once space is freed the same
    command completes, bit-exact."""
    src = checkpoints(3)
    disk = tmp_path / "disk"
    disk.mkdir()
    # 1.285 MB: the 1.21 MB output and the space check's margin fit, the scratch store's records (each
    # file a whole page on tmpfs) and the export journal beside them do not (measured: the run fails in
    # the scratch store between 1.26 and 1.31 MB, and completes from 1.315 MB)
    size = 1_285_000
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()[:100]}); needs root")
    try:
        cmd = [sys.executable, "-m", "shardstore.cli", "unshard", str(src), str(disk / "out"), "-j", "1", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "no space left on device" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (disk / "out" / "model.safetensors").exists()
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # free space
        assert subprocess.run(cmd).returncode == 0
        assert_bitwise_equal(load_file(disk / "out" / "model.safetensors"), expected(src)["model"])
    finally:
        subprocess.run(["umount", str(disk)], check=True)
