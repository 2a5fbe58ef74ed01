"""The command line, run as a user runs it: one clear line and a non-zero exit for every user error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import assert_bitwise_equal, expected


def run(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardstore.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("shardstore: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unshard_ls_and_export(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    proc = run("unshard", src, tmp_path / "out", "--store", tmp_path / "store", "--quiet")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])

    ls = run("ls", tmp_path / "store")
    assert ls.returncode == 0
    assert "layout: olmo   world size: 2   ranks ingested: 2/2" in ls.stdout
    assert any(line.split()[:4] == ["model/wte.weight", "float32", "[1000,", "300]"] for line in ls.stdout.splitlines())
    assert "rng/python_seed" in ls.stdout and "differs per rank" in ls.stdout

    proc = run("export", tmp_path / "store", tmp_path / "pt", "--format", "torch")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "pt").iterdir()) == ["model.pt", "optim.pt", "train.pt"]
    assert "wrote" in proc.stdout and "export" in proc.stderr  # the progress bar


def test_missing_and_empty_folders(tmp_path: Path) -> None:
    assert_one_line_error(run("unshard", tmp_path / "nope", tmp_path / "out"), "nope", "no such directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run("unshard", tmp_path / "empty", tmp_path / "out"), "no rank files")
    assert_one_line_error(run("ls", tmp_path / "nostore"), "no such store")


def test_missing_rank(checkpoints, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(checkpoints(3), src)
    (src / "rank1.pt").unlink()
    assert_one_line_error(run("unshard", src, tmp_path / "out"), "world size is 3", "ranks 1")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_two_checkpoints_in_one_folder_are_never_mixed(checkpoints, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for step, w in (("ep0-ba10", 2), ("ep0-ba20", 3)):
        for f in checkpoints(w).glob("rank*.pt"):
            shutil.copy(f, src / f"{step}-{f.name}")
    assert_one_line_error(run("unshard", src, tmp_path / "out"), "more than one checkpoint", "--tag")
    proc = run("unshard", src, tmp_path / "out", "--tag", "ep0-ba20", "-q")
    assert proc.returncode == 0, proc.stderr
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(checkpoints(3))["model"])


def test_corrupt_and_truncated_files(checkpoints, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(checkpoints(2), src)
    data = (src / "rank1.pt").read_bytes()
    (src / "rank1.pt").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("unshard", src, tmp_path / "out"), "rank1.pt", "truncated")
    (src / "rank1.pt").write_bytes(b"this is not a checkpoint")
    assert_one_line_error(run("unshard", src, tmp_path / "out"), "rank1.pt", "not a torch checkpoint")


def test_export_refuses_an_incomplete_store(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3)
    proc = run("ingest", tmp_path / "store", src / "rank0.pt", src / "rank2.pt", "-q")
    assert proc.returncode == 0, proc.stderr
    assert_one_line_error(run("export", tmp_path / "store", tmp_path / "out"), "incomplete", "ranks missing: 1")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert run("ingest", tmp_path / "store", src / "rank1.pt", "-q").returncode == 0
    assert run("export", tmp_path / "store", tmp_path / "out", "-q").returncode == 0


def test_bad_options(tmp_path: Path) -> None:
    proc = run("export", tmp_path, tmp_path / "o", "--max-shard-size", "lots")
    assert proc.returncode == 2 and "not a size" in proc.stderr and "Traceback" not in proc.stderr
    assert "--dtype" in run("export", "--help").stdout


def test_status_show_and_partial_export(checkpoints, tmp_path: Path) -> None:
    import json
    import struct

    import numpy as np

    src = checkpoints(3)
    want = expected(src)["model"]
    assert run("ingest", tmp_path / "s", src / "rank0.pt", src / "rank2.pt", "-q").returncode == 0

    st = run("status", tmp_path / "s")
    assert st.returncode == 1 and "ranks ingested: 2/3; missing: 1" in st.stdout and "not ready to export" in st.stdout
    assert "partial: model/wte.weight (67%)" in st.stdout

    show = run("show", tmp_path / "s", "model/wte.weight", "--slice", "0:2,0:3")
    assert show.returncode == 0 and "torch.float32 [1000, 300], 67% present, from ranks 0, 2" in show.stdout
    printed = [float(x) for x in show.stdout.splitlines()[1].strip(" []").split()]
    assert printed == pytest.approx(want["wte.weight"][0, :3].tolist(), abs=5e-7)
    stats = run("show", tmp_path / "s", "model/wte.weight", "--slice", "0:334", "--stats")
    assert stats.returncode == 0 and f"count  {334 * 300}" in stats.stdout
    assert_one_line_error(run("show", tmp_path / "s", "model/wte.weight", "--slice", "400:402"),
                          "rows 334-667 have not arrived")
    assert_one_line_error(run("show", tmp_path / "s", "model/nope"), "no key 'model/nope'")
    assert "same on all ranks" not in run("show", tmp_path / "s", "rng/python_seed").stdout
    assert "[rank 2]: 1002" in run("show", tmp_path / "s", "rng/python_seed").stdout

    proc = run("export", tmp_path / "s", tmp_path / "partial", "--allow-partial", "-q")
    assert proc.returncode == 0 and "partial export: ranks 1 missing" in proc.stderr
    raw = (tmp_path / "partial" / "model.safetensors").read_bytes()
    header = json.loads(raw[8: 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["__metadata__"]["shardstore_partial"] == "true"
    assert header["__metadata__"]["shardstore_missing_ranks"] == "1"
    got = load_file(tmp_path / "partial" / "model.safetensors")
    assert_bitwise_equal(got["wte.weight"][:334], want["wte.weight"][:334])
    assert torch.isnan(got["wte.weight"][334:668]).all()  # rank 1's rows are holes, marked as NaN
    assert_bitwise_equal(got["wte.weight"][668:], want["wte.weight"][668:])
    assert np.isnan(got["proj.weight"][2:4].numpy()).all()  # a staged tensor's missing piece, too

    assert run("ingest", tmp_path / "s", src / "rank1.pt", "-q").returncode == 0
    st = run("status", tmp_path / "s")
    assert st.returncode == 0 and "ready to export" in st.stdout
