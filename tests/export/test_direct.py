"""One read, one write (export/direct.py): `unshard` without `--store` writes each shard straight into the
output, and the output is byte for byte what the two-step path (ingest into a store, then export) writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.export import plan_direct
from tests.conftest import Phases, assert_bitwise_equal, expected, sigkill_mid_way


def _same_as_two_step(src: Path, tmp_path: Path, **options: object) -> Path:
    """Unshard `src` both ways; the one-pass run must have been one pass (no export phase), and every file
    it wrote must equal the two-step run's byte for byte. Returns the one-pass output folder."""
    one, two = tmp_path / "one", tmp_path / "two"
    phases = Phases()
    direct = shardstore.unshard(src, one, jobs=2, progress=phases, **options)
    assert phases.phases == ["ingest"], phases.phases  # nothing was exported from a store
    assert not shardstore.scratch_location(one).exists()
    shardstore.unshard(src, two, store=tmp_path / "store", jobs=2, **options)
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for path in direct.files:
        assert path.read_bytes() == (two / path.name).read_bytes(), path.name
    return one


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


@pytest.mark.parametrize("member", ["composer-t2.13-hsdp-w4", "composer-t2.1-hsdp-w4", "composer-t2.0-hsdp-w4"])
def test_hybrid_sharding_in_one_pass(member: str, tmp_path: Path) -> None:
    """Genuine HSDP rank files (2 replica groups of 2; torch 2.0 and 2.1 number placements within the
    group, 2.13 globally): one unit of each group rank writes, and the output is the two-step one."""
    src = Path(__file__).parents[1] / "corpus" / "data" / member / "ep0-ba1"
    _same_as_two_step(src, tmp_path, strip_prefix="model.")


def test_a_claim_whose_unit_never_committed_is_void(tmp_path: Path) -> None:
    """A unit that claimed its group rank and died before its commit: the rerun's units of that group
    rank write instead, and the output is whole."""
    from shardstore.export import direct

    src = Path(__file__).parents[1] / "corpus" / "data" / "composer-t2.13-hsdp-w4" / "ep0-ba1"
    out = tmp_path / "out"
    scratch = shardstore.scratch_location(out)
    original = direct.DirectWriter.claim

    def die_after_claiming(self, group_rank: int, rank: int) -> bool:
        won = original(self, group_rank, rank)
        if won and group_rank == 1:
            raise KeyboardInterrupt  # killed between its claim and its commit
        return won

    direct.DirectWriter.claim = die_after_claiming
    try:
        with pytest.raises(KeyboardInterrupt):
            shardstore.unshard(src, out, jobs=1)
    finally:
        direct.DirectWriter.claim = original
    claims = scratch / direct.FOLDER / direct.CLAIMS
    assert (claims / "1").read_text() == "1" and 1 not in shardstore.open(scratch).records()
    assert plan_direct(shardstore.open(scratch)) is not None  # what the rerun lays out first
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
    assert plan_direct(store) is None
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(single)["model"])


@pytest.mark.parametrize("target", [0, 1, 2])
def test_sigkill_mid_way_leaves_nothing_finished_and_the_rerun_completes(target: int, checkpoints,
                                                                        tmp_path: Path) -> None:
    """Killed once `target` units are journalled: OUT holds nothing that looks finished, and the same
    command resumes, skipping the journalled units, to the same bytes as a clean run."""
    src = checkpoints(6)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shardstore.cli", "unshard", str(src), str(out), "-j", "1", "-q"]
    committed = sigkill_mid_way(cmd, shardstore.scratch_location(out), 6, target, reset=out)
    assert not (out / "model.safetensors").exists()  # the output is still inside the scratch store
    rerun = subprocess.run(cmd[:-1], capture_output=True, text=True)  # without -q: its one line per phase
    assert rerun.returncode == 0, rerun.stderr
    assert ("were already done" in rerun.stderr) == (committed > 0), rerun.stderr  # journalled units skipped
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_crash_while_moving_the_files_into_out_resumes(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """Killed after the first of two files moved into OUT: the rerun moves the other and finishes."""
    import os

    src = checkpoints(3)
    out = tmp_path / "out"
    real, moved = os.replace, []

    def replace_once(a: object, b: object) -> None:
        if Path(b).parent != out:  # the store's own atomic writes
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
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"] and len(result.replaced) == 3
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])


def test_a_full_disk_is_one_line_and_the_rerun_completes(checkpoints, tmp_path: Path) -> None:
    """OUT on a real, tiny disk that holds the output (so the check before the ingest lets it start) but
    not the scratch store's records beside it: one line, no traceback, and once space is freed the same
    command completes, bit-exact."""
    src = checkpoints(3)
    disk = tmp_path / "disk"
    disk.mkdir()
    size = (src / "rank0.pt").stat().st_size // 2  # above the 1.2 MB output, below what the run writes
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={max(size, 1_400_000)}", "tmpfs", str(disk)],
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
