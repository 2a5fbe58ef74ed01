"""The command line, run as a user runs it: one clear line and a non-zero exit for every user error."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardstore
from shardstore.progress import size_text
from tests.conftest import assert_bitwise_equal, expected, exported
from tests.refusals import assert_refused, cli


def run(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command line; an `unshard` runs as `--dry-run` too (tests/refusals.py)."""
    return cli(*args, cwd=cwd)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert_refused(proc, *needles)


def error_line(*args: object) -> str:
    """Run the command line; it must fail with exactly one error line, which is returned."""
    proc = run(*args)
    assert_one_line_error(proc)
    return next(line for line in proc.stderr.splitlines() if line.startswith("shardstore: error: "))


def test_unshard_ls_and_export(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    proc = run("unshard", src, tmp_path / "out", "--store", tmp_path / "store", "--quiet")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])

    ls = run("ls", tmp_path / "store")
    assert ls.returncode == 0
    assert "layout: olmo (model, optim and trainer state at the top, as OLMo, veRL and DeepSpeed nest them)   world size: 2   " \
           "ranks ingested: 2/2" in ls.stdout
    assert any(line.split()[:4] == ["model/wte.weight", "float32", "[1000,", "300]"] for line in ls.stdout.splitlines())
    lines = {line.split()[0]: line for line in ls.stdout.splitlines()[1:]}
    assert "differs per rank" in lines["rng/cuda"] and "tensor(uint8[5056])" in lines["rng/cuda"]
    assert "[PosixPath('/scratch/run/step50'), PosixPath('/scratch/run/step100')]" in lines["checkpoints"]
    assert "<tests.fixtures.olmo_data.MixtureCheckpoint {world_size: 2, " in lines["data_checkpoint"]
    assert "differs per rank" not in lines["global_step"] and lines["global_step"].endswith(" 1")

    proc = run("export", tmp_path / "store", tmp_path / "pt", "--format", "torch")
    assert proc.returncode == 0, proc.stderr
    assert exported(tmp_path / "pt") == ["model.pt", "optim.pt", "train.pt"]
    assert "wrote" in proc.stdout and "export" in proc.stderr  # the progress bar


def test_unshard_says_which_checkpoint_it_found(checkpoints, tmp_path: Path) -> None:
    run_folder = tmp_path / "run"
    shutil.copytree(checkpoints(2), run_folder / "ckpt", ignore=shutil.ignore_patterns("expected.pt.ref"))
    proc = run("unshard", run_folder, tmp_path / "out", "-j", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == f"unshard: the checkpoint in {run_folder / 'ckpt'}"
    again = run("unshard", run_folder / "ckpt", tmp_path / "out2", "-j", "1")  # named exactly: nothing to say
    assert [line.split(":")[0] for line in again.stderr.splitlines()] == ["ingest", "unshard"], again.stderr  # one pass
    summary = again.stderr.splitlines()[-1]  # the summary after the run
    read = sum(f.stat().st_size for f in (run_folder / "ckpt").glob("rank*.pt"))
    assert summary.startswith(f"unshard: {len(expected(checkpoints(2))['model'])} tensors, ")
    assert f"[float32 {len(expected(checkpoints(2))['model'])} (" in summary and f"read {size_text(read)}, wrote " in summary


def test_missing_and_empty_folders(tmp_path: Path) -> None:
    assert_one_line_error(run("unshard", tmp_path / "nope", tmp_path / "out"), "nope", "no such directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run("unshard", tmp_path / "empty", tmp_path / "out"), "empty", "an empty folder")
    assert_one_line_error(run("ls", tmp_path / "nostore"), "nostore: no such store or checkpoint")


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
    # a run of two saves in one folder, as Composer names them: the newest is taken, or the one --tag names
    for tag, out, w in ((None, "newest", 3), ("ep0-ba10", "older", 2), ("ep0-ba20", "named", 3)):
        proc = run("unshard", src, tmp_path / out, *(("--tag", tag) if tag else ()))
        assert proc.returncode == 0, proc.stderr
        said = f"unshard: the checkpoint 'ep0-ba20' of 'ep0-ba10', 'ep0-ba20' in {src}; --tag or --step picks another"
        assert (said in proc.stderr.splitlines()) == (tag is None), proc.stderr
        assert_bitwise_equal(load_file(tmp_path / out / "model.safetensors"), expected(checkpoints(w))["model"])
    (src / "ep0-ba20-rank2.pt").unlink()  # the newest save missing a rank is never completed from the other
    assert_one_line_error(run("unshard", src, tmp_path / "out", "-q"), "rank", "missing")


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
    per_rank = run("show", tmp_path / "s", "rng/cuda").stdout.splitlines()
    assert [line.split(":")[0] for line in per_rank] == ["rng/cuda [rank 0]", "rng/cuda [rank 2]"]
    assert run("show", tmp_path / "s", "global_train_tokens_seen").stdout == "global_train_tokens_seen: 36\n"

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


def test_python_dash_m_and_help(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "shardstore", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: shardstore ")
    help_text = run("unshard", "--help").stdout
    assert "--max-shard-size SIZE" in help_text and "PARSE_SIZE" not in help_text
    assert "--strict" in help_text and "--overwrite" in help_text


def test_show_refuses_selections_outside_the_tensor_in_one_line(checkpoints, tmp_path: Path) -> None:
    assert run("ingest", tmp_path / "s", *sorted(checkpoints(2).glob("rank*.pt")), "-q").returncode == 0
    key = "model/wte.weight"  # [1000, 300]
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "5000"), key, "index 5000", "-1000 to 999")
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "0:2,::-1"), key, "steps must be positive")
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "0:2,0:4,0:1"), key, "3 indices", "[1000, 300]")
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "0,-301"), key, "dimension 1 of size 300")
    # slices reaching outside the tensor, which numpy clips (answering `[]`, exit 0), and empty ones
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "0:2,600:700"), key, "slice 600:700",
                          "dimension 1 of size 300", "-300 to 300")
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "-1001:"), key, "dimension 0 of size 1000")
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "0,5:3"), key, "slice 5:3 selects nothing")
    assert_one_line_error(run("show", tmp_path / "s", key, "--slice", "999:1000:2,-300:300:-1"), key, "steps")
    ok = run("show", tmp_path / "s", key, "--slice", "-1,...,298:")
    assert ok.returncode == 0 and len(ok.stdout.splitlines()[1].strip(" []").split()) == 2


def test_a_second_export_never_leaves_the_first_ones_files_beside_it(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(2)
    assert run("ingest", tmp_path / "s", *sorted(src.glob("rank*.pt")), "-q").returncode == 0
    out = tmp_path / "out"
    assert run("export", tmp_path / "s", out, "--max-shard-size", "600KB", "-q").returncode == 0
    first = exported(out)
    assert "model.safetensors.index.json" in first and len(first) >= 3
    (out / "notes.txt").write_text("mine")

    refused = run("export", tmp_path / "s", out)
    assert_one_line_error(refused, "earlier export", first[0], "--overwrite")
    assert exported(out) == sorted(first + ["notes.txt"])  # nothing was written or removed
    assert_one_line_error(run("export", tmp_path / "s", out, "--format", "torch"), "model.safetensors.index.json")

    proc = run("export", tmp_path / "s", out, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert exported(out) == ["model.safetensors", "notes.txt"]
    assert all(f"removed {out / name}" in proc.stdout for name in first)
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])
    assert (out / "notes.txt").read_text() == "mine"
    again = run("export", tmp_path / "s", out, "-q")  # the same export again replaces its own file
    assert again.returncode == 0, again.stderr


def test_a_failed_unshard_keeps_its_work_and_the_rerun_resumes(checkpoints, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(checkpoints(3), src)
    good = (src / "rank2.pt").read_bytes()
    (src / "rank2.pt").write_bytes(good[: len(good) // 2])
    out = tmp_path / "out"
    failed = run("unshard", src, out, "-j", "1")
    assert_one_line_error(failed, "rank2.pt", f"kept in {out / '.shardstore-scratch'}", "rerun")
    assert shardstore.open(out / ".shardstore-scratch").status().ranks_done == [0, 1]

    (src / "rank2.pt").write_bytes(good)
    resumed = run("unshard", src, out, "-j", "1")  # stderr is not a terminal: one plain line per phase
    assert resumed.returncode == 0, resumed.stderr
    phases = resumed.stderr.splitlines()
    assert [line.split(":")[0] for line in phases] == ["ingest", "unshard"], resumed.stderr  # one pass, a summary
    done_before = sum((src / f"rank{r}.pt").stat().st_size for r in (0, 1)) / 2**20
    assert f"({done_before:.1f} MiB were already done)" in phases[0]
    assert not (out / ".shardstore-scratch").exists()
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected(src)["model"])
    assert run("unshard", src, tmp_path / "q", "-q").stderr == ""


def test_an_interrupted_unshard_resumes(checkpoints, tmp_path: Path) -> None:
    src = checkpoints(3)

    class CtrlC(shardstore.Progress):
        def advance(self, nbytes: int) -> None:  # Ctrl-C lands right after the first rank is committed
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        shardstore.unshard(src, tmp_path / "out", jobs=1, progress=CtrlC())
    scratch = shardstore.scratch_location(tmp_path / "out")
    assert shardstore.open(scratch).status().ranks_done == [0]

    class Record(shardstore.Progress):
        def start(self, phase: str, total: int | None, done: int = 0) -> None:
            starts.append((phase, total, done))

    starts: list[tuple] = []
    shardstore.unshard(src, tmp_path / "out", jobs=1, progress=Record())
    sizes = [(src / f"rank{r}.pt").stat().st_size for r in range(3)]
    assert starts == [("ingest", sum(sizes), sizes[0])]  # the bar starts where the first run stopped; one pass
    assert not scratch.exists()
    assert_bitwise_equal(load_file(tmp_path / "out" / "model.safetensors"), expected(src)["model"])


def test_a_directory_or_fifo_given_as_a_rank_file(tmp_path: Path) -> None:
    import os

    (tmp_path / "rank0.pt").mkdir()
    assert_one_line_error(run("ingest", tmp_path / "s", tmp_path / "rank0.pt"), "rank0.pt", "is a directory")
    os.mkfifo(tmp_path / "rank1.pt")  # opening a FIFO for reading would wait for a writer forever
    assert_one_line_error(run("ingest", tmp_path / "s", tmp_path / "rank1.pt"), "rank1.pt", "not a regular file")
    assert_one_line_error(run("ingest", tmp_path / "s", "/dev/zero"), "/dev/zero", "not a regular file")


def test_watch_honours_storage_options(checkpoints, s3, tmp_path: Path) -> None:
    import os

    from tests.conftest import upload

    upload(checkpoints(1), "s3://watch-opts/unused")  # creates the bucket
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}  # only the option names the server
    options = '{"endpoint_url": "%s"}' % s3.url
    proc = subprocess.run([sys.executable, "-m", "shardstore", "--storage-options", options, "watch",
                           "s3://watch-opts/store", str(checkpoints(2)), "--timeout", "120", "-q"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    store = shardstore.open("s3://watch-opts/store", {"endpoint_url": s3.url})
    assert store.status().ok
    assert_bitwise_equal(store["model/wte.weight"][:], expected(checkpoints(2))["model"]["wte.weight"])


def test_rough_edges_of_show_ls_and_global_options(checkpoints, tmp_path: Path) -> None:
    """A typo in `show` gets suggestions; `--stats`/`--slice` on a value is refused, not ignored; `ls`
    filters by a pattern; `--storage-options` is taken after the command too."""
    store = tmp_path / "store"
    assert run("ingest", store, *sorted(checkpoints(2).glob("rank*.pt")), "-q").returncode == 0
    assert "did you mean model/wte.weight" in error_line("show", store, "model/wte.wieght")
    assert "global_step is a value, not a tensor: --stats and --slice apply to tensors" in error_line(
        "show", store, "global_step", "--stats")
    listed = run("ls", store, "model/*").stdout.splitlines()[1:]
    assert listed and all(line.startswith("model/") for line in listed)
    assert [line.split()[0] for line in run("ls", store, "wte").stdout.splitlines()[1:]] == [
        k for k in shardstore.open(store).keys() if "wte" in k]
    assert "no key matches 'nothing'" in error_line("ls", store, "nothing")
    after = run("status", store, "--storage-options", "{}")
    assert after.returncode == 0 and "ranks ingested: 2/2" in after.stdout
    assert "--storage-options" in error_line_or_usage("status", store, "--storage-options", "not json")


def error_line_or_usage(*args: object) -> str:
    """A bad option value: click's own usage error (exit 2), on one line, no traceback."""
    proc = run(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_dtype_takes_the_short_names_users_type(checkpoints, tmp_path: Path) -> None:
    """`--dtype bf16` (fp16, fp32, any case) is `--dtype bfloat16`: the same bytes, round to nearest even as
    torch casts; an unknown name is one line naming the choices, from the API as from the CLI."""
    from shardstore.export.registry import request

    src = checkpoints(2)
    assert run("unshard", src, tmp_path / "short", "--dtype", "BF16", "-q").returncode == 0
    assert run("unshard", src, tmp_path / "long", "--dtype", "bfloat16", "-q").returncode == 0
    short, long = load_file(tmp_path / "short" / "model.safetensors"), load_file(tmp_path / "long" / "model.safetensors")
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected(src)["model"].items()}
    assert_bitwise_equal(short, want, "--dtype BF16")
    assert_bitwise_equal(long, want, "--dtype bfloat16")
    assert request(dtype="fp16").dtype == "float16" and request(dtype="torch.float32").dtype == "float32"
    with pytest.raises(shardstore.ExportError, match="--dtype must be one of bfloat16, float16, float32 .*'int8'"):
        shardstore.unshard(src, tmp_path / "api", dtype="int8")
    assert not (tmp_path / "api").exists()


def test_json_output_for_scripts(checkpoints, tmp_path: Path) -> None:
    """`status`, `ls`, `show` and `verify` with --json print one JSON object on stdout (the schema in
    docs/commands.md) and keep their exit statuses."""
    import json

    src = checkpoints(2)
    store = tmp_path / "s"
    assert run("ingest", store, src / "rank0.pt", "-q").returncode == 0
    half = run("status", store, "--json")
    facts = json.loads(half.stdout)
    assert half.returncode == 1 and facts["ready"] is False and facts["ranks_missing"] == [1]
    assert facts["world_size"] == 2 and facts["tensors"] > facts["tensors_complete"]
    assert run("ingest", store, src / "rank1.pt", "-q").returncode == 0
    whole = run("status", store, "--json")
    assert whole.returncode == 0 and json.loads(whole.stdout)["ready"] is True
    listing = json.loads(run("ls", store, "--json").stdout)
    tensors = [k for k in listing["keys"] if k["kind"] == "tensor"]
    want = expected(src)["model"]
    name, tensor = next(iter(want.items()))
    key = f"model/{name}"
    assert {"key": key, "kind": "tensor", "dtype": "float32", "shape": list(tensor.shape), "complete": 1.0} in tensors
    shown = json.loads(run("show", store, key, "--json", "--slice", "0:2").stdout)
    assert torch.equal(torch.tensor(shown["values"], dtype=torch.float32), tensor[0:2])
    stats = json.loads(run("show", store, key, "--json", "--stats").stdout)["stats"]
    assert stats["max"] == tensor.max().item()
    assert run("export", store, tmp_path / "out", "-q").returncode == 0
    checked = run("verify", src, tmp_path / "out", "--json")
    report = json.loads(checked.stdout)
    assert checked.returncode == 0 and report["ok"] is True and report["differences"] == []
    assert report["tensors"] == len(want)


def test_every_long_command_reports_in_json_or_says_nothing(checkpoints, tmp_path: Path) -> None:
    """`ingest`, `unshard`, `export`, `average` and `watch` with --json print one JSON object on stdout and
    nothing else there (the schema in docs/commands.md); `verify -q` and `average -q` print nothing."""
    import json

    src, other = checkpoints(2), checkpoints(4)
    want = expected(src)["model"]
    half = run("ingest", tmp_path / "s", src / "rank0.pt", "--json")
    assert half.returncode == 0 and json.loads(half.stdout)["ranks_missing"] == [1]
    for args in (("unshard", src, tmp_path / "u"), ("export", tmp_path / "w", tmp_path / "e")):
        if args[0] == "export":
            assert json.loads(run("watch", tmp_path / "w", src, "--json").stdout)["ready"] is True
        proc = run(*args, "--json")
        report = json.loads(proc.stdout)
        files = sorted(str(p) for p in args[2].iterdir() if not p.name.startswith("."))
        assert proc.returncode == 0 and sorted(report["files"]) == files, proc.stderr
        assert report["tensors"] == len(want) and report["dtypes"]["float32"]["tensors"] == len(want)
        assert report["parameters"] == sum(t.numel() for t in want.values())
        assert report["write_bytes"] == sum(Path(f).stat().st_size for f in files) and report["seconds"] >= 0
    assert json.loads(run("unshard", src, tmp_path / "u", "--json").stdout)["read_bytes"] > 0
    averaged = run("average", src, other, tmp_path / "a", "--json")
    report = json.loads(averaged.stdout)
    assert averaged.returncode == 0 and report["averaged"] == len(want) and report["checkpoints"] == 2
    assert report["files"] == [str(tmp_path / "a" / "model.safetensors")]
    quiet = run("verify", src, tmp_path / "u", "-q")
    assert quiet.returncode == 0 and not quiet.stdout and not quiet.stderr
    assert run("verify", src, tmp_path / "a", "-q").returncode == 1  # the mean is not either checkpoint


def test_dry_run_says_what_the_run_would_do_and_writes_nothing(checkpoints, tmp_path: Path) -> None:
    """`unshard --dry-run` plans from what planning reads: the files the real run then writes, with the
    sizes it gives them (safetensors: exact), the casts, the bytes to read; OUT is not made. A run that
    would be refused is refused the same way, in one line."""
    import json

    src = checkpoints(2)
    out = tmp_path / "out"
    plan = shardstore.unshard(src, out, dtype="bf16", plan=True)
    assert isinstance(plan, shardstore.api.Plan) and not out.exists()
    want = expected(src)["model"]
    assert plan.casts == {"float32 -> bfloat16": len(want)} and plan.one_pass and plan.world_size == 2
    assert plan.read == sum(f.stat().st_size for f in src.glob("rank*.pt"))
    shardstore.unshard(src, out, dtype="bf16")
    assert [(name, (out / name).stat().st_size) for name, _ in plan.files] == plan.files
    text = run("unshard", src, tmp_path / "o2", "--dry-run", "--format", "torch")
    assert text.returncode == 0 and "a real run would start" in text.stdout and not (tmp_path / "o2").exists()
    facts = json.loads(run("unshard", src, tmp_path / "o2", "--dry-run", "--json").stdout)
    assert facts["would_start"] and facts["casts"] == {} and facts["read_bytes"] == plan.read
    shardstore.unshard(src, tmp_path / "o3")
    assert facts["files"] == [{"name": "model.safetensors", "bytes": (tmp_path / "o3" / "model.safetensors").stat().st_size}]
    partial = tmp_path / "partial"
    shutil.copytree(src, partial, ignore=shutil.ignore_patterns("rank1.pt"))
    refused = run("unshard", partial, tmp_path / "o4", "--dry-run")
    assert_one_line_error(refused, "rank files are missing for ranks 1")
    assert not (tmp_path / "o4").exists()


def test_shell_completion_as_documented() -> None:
    """The line docs/commands.md gives makes a bash completion function, which completes commands."""
    env = {**os.environ, "_SHARDSTORE_COMPLETE": "bash_source"}
    source = subprocess.run([sys.executable, "-m", "shardstore"], capture_output=True, text=True, env=env)
    assert "_shardstore_completion()" in source.stdout
    env = {**os.environ, "_SHARDSTORE_COMPLETE": "bash_complete", "COMP_WORDS": "shardstore ver", "COMP_CWORD": "1"}
    words = subprocess.run([sys.executable, "-m", "shardstore"], capture_output=True, text=True, env=env)
    assert words.stdout.split() == ["plain,verify"]
    assert '_SHARDSTORE_COMPLETE=bash_source shardstore' in (Path(__file__).parents[1] / "docs" / "commands.md").read_text()


def _listing(*args: object) -> list[tuple]:
    """`ls --json`'s keys: (key, kind, dtype, shape) for a tensor, (key, kind, preview) for a value."""
    import json

    proc = run("ls", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return [(k["key"], k["kind"], k.get("dtype"), k.get("shape"), k.get("preview")) for k in json.loads(proc.stdout)["keys"]]


def _shown(*args: object) -> torch.Tensor:
    """`show --json`'s values, as the tensor of the dtype it names (bfloat16 widened to float32 exactly)."""
    import json

    proc = run("show", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    wide = torch.float32 if shown["dtype"] == "bfloat16" else getattr(torch, shown["dtype"])
    return torch.tensor(shown["values"], dtype=wide).to(getattr(torch, shown["dtype"]))


def test_ls_and_show_take_rank_files_without_ingesting_them(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """`ls CHECKPOINT` lists what `ls STORE` lists of the store unshard makes of it (keys, dtypes, shapes,
    values), `show CHECKPOINT KEY` shows what torch gathered, bit for bit; the scratch store is planned in
    a temporary folder, removed afterwards (after an error too), and holds no tensor but the one shown."""
    from shardstore.inspect import inspect

    src = checkpoints(2)
    shardstore.unshard(src, tmp_path / "out", store=tmp_path / "store", jobs=1)
    assert _listing(src) == _listing(tmp_path / "store")
    text = run("ls", src, "wte").stdout.splitlines()
    assert text[0].startswith(f"checkpoint: {src}   format: ShardedTensor rank files") and "rank files: 2/2" in text[0]
    assert [line.split() for line in text[1:]][0] == ["model/wte.weight", "float32", "[1000,", "300]"]

    want = expected(src)["model"]
    assert torch.equal(_shown(src, "model/wte.weight", "--slice", "998:1000,-300:300"), want["wte.weight"][998:1000])
    assert torch.equal(_shown(src, "model/proj.weight"), want["proj.weight"])  # a staged tensor, from both ranks
    assert_one_line_error(run("show", src, "model/wte.wieght"), f"{src}: no key", "did you mean model/wte.weight")
    assert_one_line_error(run("ls", tmp_path / "store", "--step", "1"), "is a shardstore store", "--step")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with inspect(src, jobs=1) as seen:  # ls: the plan and the values, no tensor
        assert seen.checkpoint == str(src) and seen.store.status().complete == []
        assert seen.store.values("global_step") == {0: 1, 1: 1}
    with inspect(src, "model/wte.weight", jobs=1) as seen:  # show: that tensor only
        assert seen.store.status().complete == ["model/wte.weight"]
        assert Path(seen.store.location).is_relative_to(tmp_path / "tmp")
    with pytest.raises(shardstore.StoreError, match="no key"), inspect(src, "model/nope", jobs=1):
        pass
    assert list((tmp_path / "tmp").iterdir()) == []


def test_ls_and_show_take_a_dcp_folder(tmp_path: Path) -> None:
    """A DCP folder saved by torch in the test: `show` of it is what torch's own DCP reader loads, bit for
    bit (bfloat16 too), and the issue's slice of a [512, 64] tensor is refused, not answered with `[]`."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(53)
    state = {"model": {"w": torch.randn(512, 64, generator=gen), "b": torch.randn(7, 3, generator=gen).bfloat16()},
             "step": 9}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    back = {"model": {"w": torch.zeros(512, 64), "b": torch.zeros(7, 3, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(back, checkpoint_id=tmp_path / "ckpt")

    assert [entry[:4] for entry in _listing(tmp_path / "ckpt")] == [
        ("model/w", "tensor", "float32", [512, 64]), ("model/b", "tensor", "bfloat16", [7, 3]),
        ("step", "value", None, None)]
    assert torch.equal(_shown(tmp_path / "ckpt", "model/w", "--slice", "0:2,60:64"), back["model"]["w"][0:2, 60:64])
    assert torch.equal(_shown(tmp_path / "ckpt", "model/b"), back["model"]["b"])
    assert_one_line_error(run("show", tmp_path / "ckpt", "model/w", "--slice", "0:2,600:700"), "model/w",
                          "slice 600:700", "dimension 1 of size 64")


def _ctrl_c_line(monkeypatch, *args: object) -> str:
    """The command run in this process with Ctrl-C pressed once its first unit is in: its exit status is 130
    and its one line is returned."""
    from click.testing import CliRunner

    from shardstore import cli as cli_module

    class CtrlC(shardstore.Progress):
        def advance(self, nbytes: int) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_progress", lambda quiet: contextlib.nullcontext(CtrlC()))
    result = CliRunner().invoke(cli_module.main, [str(a) for a in args])
    assert result.exit_code == 130 and len(result.stderr.splitlines()) == 1, result.stderr
    return result.stderr.strip()


def test_the_ctrl_c_line_says_what_was_left_and_what_a_rerun_does(checkpoints, tmp_path: Path, monkeypatch) -> None:
    """unshard keeps its work for the rerun, ingest its files, and a command that reads leaves nothing: no
    line asks to put right what nothing needs putting right."""
    from shardstore.ingest import Session

    src = checkpoints(3)
    out = tmp_path / "out"
    line = _ctrl_c_line(monkeypatch, "unshard", src, out, "-j", "1")
    assert line == f"shardstore: interrupted; the work so far is kept in {out / '.shardstore-scratch'}: a rerun " \
                   f"into the same OUT resumes from it"
    line = _ctrl_c_line(monkeypatch, "unshard", src, tmp_path / "o2", "--store", tmp_path / "st", "-j", "1")
    assert line.endswith(f"kept in {tmp_path / 'st'}: a rerun with the same --store resumes from it")
    line = _ctrl_c_line(monkeypatch, "ingest", tmp_path / "s", *sorted(src.glob("rank*.pt")), "-j", "1")
    assert line.endswith(f"the files ingested so far are kept in {tmp_path / 's'} (one cut short is not among "
                         f"them): rerun to ingest the rest")
    assert shardstore.open(tmp_path / "s").status().ranks_done == [0]

    real = Session.ingest

    def interrupted(*args: object, **kwargs: object) -> None:  # Ctrl-C once the scratch store is filled
        real(*args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "ingest", interrupted)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert _ctrl_c_line(monkeypatch, "show", src, "model/wte.weight") == "shardstore: interrupted; nothing was left behind"
    assert list((tmp_path / "tmp").iterdir()) == []
