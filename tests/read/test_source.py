"""Finding one checkpoint among several: step names are ASCII digits, and pointers stay inside the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import shardstore
from shardstore.errors import CheckpointError
from shardstore.read.discover import open_source
from shardstore.read.source import names_step, pick
from tests.refusals import assert_refused, cli

TORCHTITAN = Path(__file__).parents[1] / "fixtures" / "data" / "torchtitan" / "tt-w4-tp2" / "checkpoint"


@pytest.mark.parametrize("name", ["step-٩", "step٩", "iter_٠٠٠٠٠٠٩", "checkpoint-٩", "ep0-ba٩", "step-²"])
def test_a_step_name_in_other_digits_names_no_step(name: str) -> None:
    """Not taken for step 9 by --step 9, and never the newest: with it, there is no newest to take."""
    assert not names_step(name, 9)
    with pytest.raises(CheckpointError, match="holds more than one checkpoint"):
        pick("run", ["step-4", name], None, None)
    with pytest.raises(CheckpointError, match="no checkpoint matches --step 9"):
        pick("run", ["step-4", name], None, 9)


def test_a_step_folder_named_in_arabic_indic_digits_is_not_the_newest(tmp_path: Path) -> None:
    """torchtitan's run with a copy of step-2 as `step-٩`: the newest is not guessed (refused in one line,
    nothing left); --step 4 is step-4."""
    run = tmp_path / "checkpoint"
    shutil.copytree(TORCHTITAN, run)
    shutil.copytree(run / "step-2", run / "step-٩")
    assert_refused(cli("unshard", run, tmp_path / "out", "-q"), "holds more than one checkpoint", "step-٩")
    assert not (tmp_path / "out").exists()
    assert open_source(run, step=4).units[0].startswith(str(run / "step-4"))
    with pytest.raises(CheckpointError, match="no checkpoint matches --step 9"):
        open_source(run, step=9)


def test_a_step_folder_linking_out_of_the_run_is_refused(tmp_path: Path) -> None:
    """A run whose newest step folder (by its name, or by latest_checkpointed_iteration.txt) links to
    another run's: refused in one line naming where it leads, nothing left; a link within the run is
    followed; the target named itself is read."""
    run, other = tmp_path / "checkpoint", tmp_path / "other" / "step-4"
    shutil.copytree(TORCHTITAN / "step-2", run / "step-2")
    shutil.copytree(TORCHTITAN / "step-4", other)
    (run / "step-6").symlink_to(other)
    assert_refused(cli("unshard", run, tmp_path / "out", "-q"), f"{run / 'step-6'}: leads to {other}, outside {run}")
    assert not (tmp_path / "out").exists()
    (run / "latest_checkpointed_iteration.txt").write_text("6")
    with pytest.raises(CheckpointError, match="leads to"):
        open_source(run)
    (run / "step-6").unlink()
    (run / "step-6").symlink_to(run / "step-2")  # within the run: the same checkpoint under another name
    assert open_source(run).units[0].startswith(str(run / "step-6"))
    shardstore.unshard(other, tmp_path / "pt", format="torch")
    assert (tmp_path / "pt" / "checkpoint.pt").is_file()


def test_a_composer_dcp_folder_of_another_batch_is_refused(tmp_path: Path) -> None:
    """Composer's DCP save records its timestamp as bytes items: ep0-ba1 copied as ep0-ba2 is refused in one
    line naming the item, nothing left; as ep0-ba1 it unshards."""
    corpus = Path(__file__).parents[1] / "corpus" / "data" / "composer-dcp-t2.13-hsdp-w4" / "ep0-ba1"
    shutil.copytree(corpus, tmp_path / "ep0-ba2")
    assert_refused(cli("unshard", tmp_path / "ep0-ba2", tmp_path / "out", "-q"), str(tmp_path / "ep0-ba2"),
                   "state.timestamp.batch: records batch 1, but its folder is ep0-ba2")
    assert not (tmp_path / "out").exists()
    shutil.copytree(corpus, tmp_path / "ep0-ba1")
    assert cli("unshard", tmp_path / "ep0-ba1", tmp_path / "ok", "-q").returncode == 0


def test_deepspeeds_latest_naming_a_tag_folder_out_of_the_run_is_refused(tmp_path: Path) -> None:
    """DeepSpeed's `latest` names global_step2, a link to another run's tag folder: refused in one line
    naming where it leads, nothing left; the save folder the link's target is in unshards."""
    genuine = Path(__file__).parents[1] / "fixtures" / "data" / "deepspeed" / "z1-w3"
    other, run = tmp_path / "other", tmp_path / "run"
    shutil.copytree(genuine, other)
    run.mkdir()
    tag = (other / "latest").read_text().strip()
    shutil.copy(other / "latest", run / "latest")
    (run / tag).symlink_to(other / tag)
    assert_refused(cli("unshard", run, tmp_path / "out", "-q"), f"{run / tag}: leads to {other / tag}, outside {run}")
    assert not (tmp_path / "out").exists()
    assert cli("unshard", other, tmp_path / "ok", "-q").returncode == 0


def test_a_runs_latest_link_names_its_checkpoint(tmp_path: Path) -> None:
    """A run folder's `latest` link to one of its step folders (OLMo's pointer) is taken without --step,
    or with --tag latest, as latest_checkpointed_iteration.txt is; --step still picks. A pointer naming a
    step that is not there is refused saying so."""
    run = tmp_path / "checkpoint"
    shutil.copytree(TORCHTITAN, run)
    (run / "latest").symlink_to("step-2")
    for how in ({}, {"tag": "latest"}):
        assert open_source(run, **how).units[0].startswith(str(run / "step-2"))  # type: ignore[arg-type]
    assert open_source(run, step=4).units[0].startswith(str(run / "step-4"))
    (run / "latest").unlink()
    (run / "latest_checkpointed_iteration.txt").write_text("6")
    with pytest.raises(CheckpointError, match=r"matches the step latest_checkpointed_iteration.txt names \(6\); it "
                                              r"holds step-2, step-4$"):
        open_source(run)


def test_a_runs_pointer_file_on_object_storage_names_its_newest(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A run folder on S3: its latest_checkpointed_iteration.txt (a file: object storage has no links) is
    read there as on a local disk, and names the step taken over the newest by name."""
    from tests.conftest import upload

    url = "s3://runs/checkpoint"
    for step in ("step-2", "step-4"):
        upload(TORCHTITAN / step, f"{url}/{step}", "*")
    assert open_source(url).units[0].startswith(f"{url}/step-4/")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    upload(tmp_path, url, "latest_checkpointed_iteration.txt")
    assert open_source(url).units[0].startswith(f"{url}/step-2/")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("step-2")
    upload(tmp_path, url, "latest_checkpointed_iteration.txt")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt: names no step"):
        open_source(url)
