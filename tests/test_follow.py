"""`follow` (shardstore/follow.py) beside a live training run: tests/fixtures/training_run.py trains with
FSDP2 in gloo processes, saves with `dcp.save` every few steps as torchtitan does and rotates its step
folders; what its ranks gathered at each save is the reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.follow import LATEST, STAGING, Published, Skipped
from tests.conftest import assert_bitwise_equal

ROOT = Path(__file__).parents[1]


def _published(out: Path) -> list[str]:
    """The folders a reader of OUT sees (its hidden staging aside), each whole."""
    seen = sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))
    for name in seen:
        assert (out / name / "model.safetensors").is_file(), name
        assert not list((out / name).glob(".shardstore-scratch*")), name
    return seen


def test_a_live_run_is_followed_and_every_published_step_is_what_its_ranks_saved(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run, refs, out = tmp_path / "run", tmp_path / "refs", tmp_path / "out"
    trainer = subprocess.Popen([sys.executable, "-m", "tests.fixtures.training_run", str(run), str(refs), "12", "2",
                                "2", "0.3"], cwd=ROOT)
    events: list[object] = []
    try:
        while trainer.poll() is None:
            if run.is_dir():
                events += shardstore.follow(run, out, once=True, keep=3, jobs=1)
                seen = _published(out)
                if seen:  # latest names a whole folder, the newest
                    assert (out / LATEST).read_text() == max(seen, key=lambda n: int(n.split("-")[1]))
    finally:
        trainer.wait(timeout=300)
    assert trainer.returncode == 0
    events += shardstore.follow(run, out, once=True, keep=3, jobs=1)
    published = [e for e in events if isinstance(e, Published)]
    assert published and published[-1].name == "step-12"
    assert not [e for e in events if isinstance(e, Skipped) and not e.removed]
    for event in published:  # every step published is what the ranks held when it was saved
        if (out / event.name).is_dir():
            want = torch.load(refs / f"{event.name}.pt", weights_only=True)
            assert_bitwise_equal(load_file(out / event.name / "model.safetensors"), want, event.name)
    by_step = sorted({e.name for e in published}, key=lambda n: int(n.split("-")[1]))
    assert sorted(_published(out)) == sorted(by_step[-3:])  # --keep 3: the newest three
    assert len(by_step) >= 3, events
    assert (out / LATEST).read_text() == "step-12"
    assert not [p for p in (out / STAGING).iterdir()]


def test_a_checkpoint_is_published_only_once_its_trainer_finished_it(tmp_path: Path) -> None:
    """A step folder without its .metadata (dcp.save writes it last) is not read; once it is there, the
    folder is published; a second look publishes nothing again."""
    from tests.fixtures.training_run import train

    run, refs, out = tmp_path / "run", tmp_path / "refs", tmp_path / "out"
    train(run, refs, 2, 2, 1, pause=0)
    metadata = run / "step-2" / ".metadata"
    held = metadata.rename(tmp_path / "metadata")
    assert shardstore.follow(run, out, once=True, jobs=1) == []
    assert not (out / "step-2").exists() and not (out / LATEST).exists()
    held.rename(metadata)
    published = shardstore.follow(run, out, once=True, jobs=1)
    assert [e.name for e in published if isinstance(e, Published)] == ["step-2"]
    assert shardstore.follow(run, out, once=True, jobs=1) == []
    assert (out / LATEST).read_text() == "step-2"


def test_follow_options_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    with pytest.raises(shardstore.ExportError, match="keep and every"):
        shardstore.follow(tmp_path, tmp_path / "out", keep=0, once=True)
    with pytest.raises(TypeError, match="'step' is not an option"):
        shardstore.follow(tmp_path, tmp_path / "out", step=3, once=True)
    with pytest.raises(shardstore.ExportError, match="--adapter applies"):
        shardstore.follow(tmp_path, tmp_path / "out", adapter=True, once=True)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished run of two saves (step-2, step-4) and what its ranks gathered at each."""
    from tests.fixtures.training_run import train

    base = tmp_path_factory.mktemp("saved")
    train(base / "run", base / "refs", 4, 2, 2, pause=0)
    return base / "run", base / "refs"


def _is_saved(out: Path, refs: Path, name: str) -> None:
    from safetensors.torch import load_file

    assert_bitwise_equal(load_file(out / name / "model.safetensors"), torch.load(refs / f"{name}.pt", weights_only=True),
                         name)


def test_a_follower_killed_mid_export_leaves_nothing_published_and_resumes(saved_run: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """SIGKILL while a step's first rank file is committed to its scratch store: OUT shows no folder and no
    latest; started again, the follower publishes both steps, bit for bit, and nothing is left staged."""
    from tests.conftest import sigkill_mid_way

    run, refs = saved_run
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shardstore", "follow", str(run), str(out), "--once", "--jobs", "1"]
    scratch = out / STAGING / "step-2" / ".shardstore-scratch"
    sigkill_mid_way(cmd, scratch, units=2, commits=1, reset=out)
    assert _published(out) == [] and not (out / LATEST).exists()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert _published(out) == ["step-2", "step-4"] and (out / LATEST).read_text() == "step-4"
    for name in ("step-2", "step-4"):
        _is_saved(out, refs, name)
    assert not list((out / STAGING).iterdir())


def test_a_checkpoint_rotated_away_while_read_is_skipped_in_one_line(saved_run: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    """The trainer deletes step-2 (its rotation) as the follower starts reading it: skipped, said so,
    never tried again; step-4 is published."""
    from shardstore.follow import Following, follow

    run = shutil.copytree(saved_run[0], tmp_path / "run")
    out = tmp_path / "out"

    def rotated(src: str, folder: Path, step: int) -> object:
        if step == 2:
            shutil.rmtree(run / "step-2")
        return shardstore.unshard(src, folder, step=step, jobs=1)
    events = follow(run, out, Following(once=True, settle=0), rotated)
    assert [(type(e).__name__, e.name) for e in events] == [("Skipped", "step-2"), ("Published", "step-4")]
    assert isinstance(events[0], Skipped) and events[0].removed and "removed by its trainer" in events[0].why
    assert _published(out) == ["step-4"] and not (out / STAGING / "step-2").exists()


def test_a_live_run_saving_to_object_storage_is_followed(tmp_path: Path, s3) -> None:  # type: ignore[no-untyped-def]
    """The live run saving to S3 (a local S3 server) through torch's own FsspecWriter, rotating its steps
    there, and `follow` on the s3:// URL beside it: every step published is what the ranks gathered."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("live")
    refs, out = tmp_path / "refs", tmp_path / "out"
    trainer = subprocess.Popen([sys.executable, "-m", "tests.fixtures.training_run", "s3://live/run", str(refs), "8",
                                "2", "2", "0.3"], cwd=ROOT)
    events: list[object] = []
    try:
        while trainer.poll() is None:
            events += shardstore.follow("s3://live/run", out, once=True, keep=2, jobs=1)
    finally:
        trainer.wait(timeout=300)
    assert trainer.returncode == 0
    events += shardstore.follow("s3://live/run", out, once=True, keep=2, jobs=1)
    published = [e for e in events if isinstance(e, Published)]
    assert published and published[-1].name == "step-8", events
    assert not [e for e in events if isinstance(e, Skipped) and not e.removed], events
    for name in _published(out):
        _is_saved(out, refs, name)
    assert _published(out) == ["step-6", "step-8"] and (out / LATEST).read_text() == "step-8"


def test_a_run_on_object_storage_is_followed(saved_run: tuple[Path, Path], tmp_path: Path, s3) -> None:  # type: ignore[no-untyped-def]
    import s3fs

    run, refs = saved_run
    fs = s3fs.S3FileSystem()
    if not fs.exists("follow"):
        fs.mkdir("follow")
    fs.put(str(run) + "/", "follow/run/", recursive=True)
    fs.invalidate_cache()
    out = tmp_path / "out"
    events = shardstore.follow("s3://follow/run", out, once=True, jobs=1)
    assert [e.name for e in events if isinstance(e, Published)] == ["step-2", "step-4"]
    for name in ("step-2", "step-4"):
        _is_saved(out, refs, name)


@pytest.mark.parametrize("seed", range(int(os.environ.get("SHARDSTORE_FOLLOW_SEEDS", "2"))))
def test_killed_at_random_beside_a_live_run_it_never_shows_a_partial_step(seed: int, tmp_path: Path) -> None:
    """The follower SIGKILLed twice at seeded random moments while a run trains, saves and rotates beside
    it, and started again each time: at every moment a reader sees whole folders only and `latest` names
    one of them; at the end every step published is what the ranks saved. CI runs two seeds;
    SHARDSTORE_FOLLOW_SEEDS=50 runs fifty."""
    import random
    import signal
    import time

    rng = random.Random(seed)
    run, refs, out = tmp_path / "run", tmp_path / "refs", tmp_path / "out"
    trainer = subprocess.Popen([sys.executable, "-m", "tests.fixtures.training_run", str(run), str(refs), "16", "2",
                                "3", "0.3"], cwd=ROOT)
    cmd = [sys.executable, "-m", "shardstore", "follow", str(run), str(out), "--poll", "0.2", "--jobs", "1"]
    kills, follower = 0, None
    try:
        while not run.is_dir():
            time.sleep(0.05)
        follower = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        kill_at = time.monotonic() + rng.uniform(1.0, 4.0)
        while trainer.poll() is None:
            if out.is_dir():  # `latest` read first: a folder is published before `latest` names it
                latest = (out / LATEST).read_text() if (out / LATEST).exists() else None
                seen = _published(out)
                assert latest is None or latest in seen, (latest, seen)
            if kills < 2 and time.monotonic() > kill_at:
                follower.send_signal(signal.SIGKILL)
                follower.wait()
                kills += 1
                follower = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
                kill_at = time.monotonic() + rng.uniform(1.0, 4.0)
            time.sleep(0.01)
    finally:  # (a follower left running after a failed assertion would go on writing into OUT)
        if follower is not None:
            follower.send_signal(signal.SIGKILL)
            follower.wait()
        trainer.wait(timeout=300)
    assert trainer.returncode == 0 and kills == 2
    proc = subprocess.run([*cmd[:-4], "--once", "--jobs", "1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = _published(out)
    assert "step-16" in seen and (out / LATEST).read_text() == "step-16"
    for name in seen:
        _is_saved(out, refs, name)


@pytest.mark.parametrize("seed", range(int(os.environ.get("SHARDSTORE_FOLLOW_SEEDS", "2"))))
def test_a_trainer_killed_mid_save_leaves_its_partial_step_unpublished(seed: int, tmp_path: Path) -> None:
    """The trainer SIGKILLed at a seeded random moment (mid-save, often: it saves every step): the step it
    was writing has no .metadata and is not published; every step published is one its ranks finished,
    bit for bit (its reference, written after the save, is there unless the kill fell between the two)."""
    import random
    import signal
    import time

    run, refs, out = tmp_path / "run", tmp_path / "refs", tmp_path / "out"
    trainer = subprocess.Popen([sys.executable, "-m", "tests.fixtures.training_run", str(run), str(refs), "40", "1",
                                "40", "0"], cwd=ROOT, start_new_session=True)
    while not any(run.glob("step-*/.metadata")) and trainer.poll() is None:
        time.sleep(0.01)
    time.sleep(random.Random(seed).uniform(0.0, 1.0))
    os.killpg(trainer.pid, signal.SIGKILL)  # the job and its gloo ranks, as a scheduler ends a job
    trainer.wait()
    assert trainer.returncode == -signal.SIGKILL, "the run ended before the kill"
    events = shardstore.follow(run, out, once=True, jobs=1)
    published = {e.name for e in events if isinstance(e, Published)}
    whole = {p.parent.name for p in run.glob("step-*/.metadata")}
    assert published == whole and whole, (published, whole)
    assert not [e for e in events if isinstance(e, Skipped)]
    for name in published:
        if (refs / f"{name}.pt").exists():
            _is_saved(out, refs, name)


def test_a_full_disk_publishes_nothing_and_the_next_look_publishes(saved_run: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    """OUT on a real tmpfs too small for a step: the step is skipped in one line, nothing is published and
    `latest` is not written; once space is freed, the next look publishes both steps, bit for bit."""
    run, refs = saved_run
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()[:100]}); needs root")
    try:
        out = disk / "out"
        events = shardstore.follow(run, out, once=True, jobs=1)
        assert [type(e).__name__ for e in events] == ["Skipped", "Skipped"]
        assert all(not e.removed and "space" in e.why for e in events if isinstance(e, Skipped))
        assert _published(out) == [] and not (out / LATEST).exists()
        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)
        events = shardstore.follow(run, out, once=True, jobs=1)
        assert [e.name for e in events if isinstance(e, Published)] == ["step-2", "step-4"]
        for name in ("step-2", "step-4"):
            _is_saved(out, refs, name)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_composers_rank_files_sharing_the_run_folder_are_followed(layout_checkpoints, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Composer's default save_filename puts every rank's `ep0-ba{B}-rank{r}.pt` in the run folder itself:
    the files named for a step are that step; each is published once no file of it changed, a step with a
    rank file still missing waits for it, said nothing of, and is published once it is there."""
    from safetensors.torch import load_file

    from tests.fixtures.layouts import expected

    src = layout_checkpoints("composer-w2-follow", 2, "composer", steps=(10, 20))
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    for f in src.glob("ep0-ba*/ep0-ba*-rank*.pt"):
        shutil.copy(f, run / f.name)
    held = (run / "ep0-ba20-rank1.pt").rename(tmp_path / "held.pt")
    events = shardstore.follow(run, out, once=True, jobs=1)
    assert [(type(e).__name__, e.name) for e in events] == [("Published", "ep0-ba10")]
    assert not (out / "ep0-ba20").exists()
    held.rename(run / "ep0-ba20-rank1.pt")
    events = shardstore.follow(run, out, once=True, jobs=1)
    assert [(type(e).__name__, e.name) for e in events] == [("Published", "ep0-ba20")]
    for name in ("ep0-ba10", "ep0-ba20"):
        assert_bitwise_equal(load_file(out / name / "model.safetensors"), expected("composer")["model"], name)
    assert (out / LATEST).read_text() == "ep0-ba20"


def test_rank_files_are_taken_as_they_land_and_the_step_published_once_the_last_is_whole(tmp_path: Path) -> None:
    """A Composer run (FSDP1 rank files written in place, each landing in pieces, rank 1's after rank 0's):
    each rank's file is ingested once whole and still, before its checkpoint is complete, so publishing
    a step is left with its last ranks only; every step published is what the ranks gathered, bit for
    bit, and no staging of a rotated step is left behind."""
    import time

    from safetensors.torch import load_file

    run, refs, out = tmp_path / "run", tmp_path / "refs", tmp_path / "out"
    trainer = subprocess.Popen([sys.executable, "-m", "tests.fixtures.training_run", str(run), str(refs), "6", "2",
                                "2", "0.5", "composer", "0.4"], cwd=ROOT)
    events: list[object] = []
    try:
        while trainer.poll() is None:
            if run.is_dir():
                events += shardstore.follow(run, out, once=True, keep=2, jobs=1)
                _published(out)
            time.sleep(0.05)
    finally:
        trainer.wait(timeout=300)
    assert trainer.returncode == 0
    events += shardstore.follow(run, out, once=True, keep=2, jobs=1)
    published = [e for e in events if isinstance(e, Published)]
    assert [e.name for e in published] == ["ep0-ba2", "ep0-ba4", "ep0-ba6"], events
    assert any(e.early for e in published), published  # rank 0's file, taken while rank 1's landed
    assert not [e for e in events if isinstance(e, Skipped)], events  # (never read while a file of it landed)
    for event in published[-2:]:
        want = torch.load(refs / f"{event.name}.pt", weights_only=True)
        assert_bitwise_equal(load_file(out / event.name / "model.safetensors"), want, event.name)
    assert _published(out) == ["ep0-ba4", "ep0-ba6"] and (out / LATEST).read_text() == "ep0-ba6"
    assert not [p for p in (out / STAGING).iterdir()]


def _olmo_step(layout_checkpoints, run: Path) -> Path:  # type: ignore[no-untyped-def]
    """RUN/step10/ holding the OLMo layout's two rank files."""
    src = layout_checkpoints("olmo-w2-follow", 2, "olmo")
    (run / "step10").mkdir(parents=True)
    for f in src.glob("rank*.pt"):
        shutil.copy(f, run / "step10" / f.name)
    return run / "step10"


def test_a_run_begun_before_its_config_landed_is_started_again_with_it(layout_checkpoints, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`begin` takes rank 0's file before OLMo's config.yaml is there; the run of the whole checkpoint, once
    it is, does not finish the store planned without it (whose export would lack the config) but starts
    again: the export holds config.yaml, and the tensors bit for bit."""
    from safetensors.torch import load_file

    from shardstore import run as _run
    from tests.fixtures.layouts import expected

    step = _olmo_step(layout_checkpoints, tmp_path / "run")
    out = tmp_path / "out"
    assert _run.begin(_run.request(tmp_path / "run", out, tag="step10", jobs=1), [str(step / "rank0.pt")]) == (1, 2)
    (step / "config.yaml").write_text("model:\n  d_model: 24\n")
    shardstore.unshard(tmp_path / "run", out, step=10, jobs=1)
    assert (out / "config.yaml").read_text() == "model:\n  d_model: 24\n"
    assert_bitwise_equal(load_file(out / "model.safetensors"), expected("olmo")["model"], "step10")


def test_rank_files_taken_of_a_step_removed_before_it_was_complete_leave_no_staging(layout_checkpoints,  # type: ignore[no-untyped-def]
                                                                                   tmp_path: Path) -> None:
    """Rank 0's file is taken while rank 1's is missing (nothing is said or published); the trainer then
    removes the step: its staging goes at the next look."""
    step = _olmo_step(layout_checkpoints, tmp_path / "run")
    (step / "rank1.pt").unlink()
    out = tmp_path / "out"
    assert shardstore.follow(tmp_path / "run", out, once=True, jobs=1) == []
    assert (out / STAGING / "step10").is_dir() and not (out / "step10").exists()
    shutil.rmtree(step)
    assert shardstore.follow(tmp_path / "run", out, once=True, jobs=1) == []
    assert list((out / STAGING).iterdir()) == []
