"""What every trainer's conventions must do (shardstore/trainers/): each trainer's tests subclass
`TrainerTests`, giving a checkpoint its own code saved and how the trainer itself resumes from the files
`--format torch` writes for it, and `StepsTests`, giving a run folder its own code left."""

from __future__ import annotations

import shutil
from importlib import import_module
from pathlib import Path

import pytest

import shardstore
from shardstore.export import model_subtree
from shardstore.read.discover import open_source
from shardstore.read.layouts import RANK_FILE
from shardstore.read.source import step_of
from shardstore.trainers.contract import Steps
from shardstore.trainers.registry import RUNS, TRAINERS


class TrainerTests:
    trainer: str  # its name in the registry
    model: str  # where its model sits in `checkpoint`'s tree (a store path)

    @pytest.fixture
    def checkpoint(self) -> Path:
        """A checkpoint folder as the trainer's own code saved it."""
        raise NotImplementedError

    def resume(self, out: Path, checkpoint: Path, tmp_path: Path) -> None:
        """The trainer itself resumes from `out` (a `--format torch` export of `checkpoint`), asserting it has
        the state the checkpoint's ranks gathered."""
        raise NotImplementedError

    def described(self, request: pytest.FixtureRequest, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str] | None:
        """A checkpoint of the trainer with its model described where the trainer keeps the description
        (its own save, or a copy with the description put there, the environment set where it is read
        from), and the `model_type` it describes; None for a trainer that keeps none."""
        raise NotImplementedError

    def test_hf_finds_the_model_description_where_the_trainer_keeps_it(self, checkpoint: Path, tmp_path: Path,
                                                                        request: pytest.FixtureRequest,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """`--format hf` with no --hf-config: the trainer's own description of the model, found where it
        keeps it, is the output's config.json; a trainer that keeps none is refused in one line, before
        anything is written."""
        from transformers import AutoConfig

        described = self.described(request, tmp_path, monkeypatch)
        if described is None:
            with pytest.raises(shardstore.ExportError, match="cannot tell which Hugging Face model this is"):
                shardstore.unshard(checkpoint, tmp_path / "hf", format="hf", jobs=2)
            assert not (tmp_path / "hf").exists()
            return
        folder, model_type = described
        shardstore.unshard(folder, tmp_path / "hf", format="hf", jobs=2)
        assert AutoConfig.from_pretrained(tmp_path / "hf").model_type == model_type

    def test_its_checkpoint_is_known_as_its_own_and_its_model_found(self, checkpoint: Path) -> None:
        with shardstore.inspect(checkpoint) as found:
            assert found.store.manifest.layout == self.trainer
            assert model_subtree(found.store) == self.model
        assert self.trainer in TRAINERS

    def test_the_trainer_resumes_from_the_torch_export(self, checkpoint: Path, tmp_path: Path) -> None:
        shardstore.unshard(checkpoint, tmp_path / "out", format="torch", jobs=2)
        self.resume(tmp_path / "out", checkpoint, tmp_path)

    def test_every_file_of_its_torch_export_is_known_as_an_earlier_exports(self, checkpoint: Path,
                                                                            tmp_path: Path) -> None:
        """Another export into the same OUT is refused while the torch export's files are there, and
        replaces all of them with `overwrite`: no file the trainer's export wrote is left beside it."""
        out = tmp_path / "out"
        written = {p.name for p in shardstore.unshard(checkpoint, out, format="torch", jobs=2).files}
        with pytest.raises(shardstore.ExportError, match="holds files of an earlier export"):
            shardstore.unshard(checkpoint, out, format="safetensors", jobs=2)
        result = shardstore.unshard(checkpoint, out, format="safetensors", jobs=2, overwrite=True)
        assert written and {p.name for p in out.iterdir() if not p.name.startswith(".")} == {p.name for p in result.files}


class StepsTests:
    """What every trainer's naming of a run's checkpoints must do (trainers/contract.py `Steps`): each
    trainer's tests subclass it with a run folder as the trainer's own code left it."""

    trainer: str  # its module in shardstore/trainers/
    folder: Path  # a run folder as the trainer's own code left it
    taken: str  # the checkpoint in it the trainer resumes from (its pointer's, else its newest)
    name: str  # the trainer's own name of a checkpoint of `{step}` (its code's format string)

    @pytest.fixture
    def run(self) -> tuple[Path, str]:
        return self.folder, self.taken

    def named(self, step: int) -> str:
        return self.name.format(step=step)

    def copy(self, run: Path, taken: str, step: int) -> None:
        """A copy of checkpoint `taken` of `run` put beside it as the trainer names one of `step`."""
        shutil.copytree(run / taken, run / self.named(step), symlinks=True)

    @property
    def steps(self) -> Steps:
        steps: Steps = import_module(f"shardstore.trainers.{self.trainer}").STEPS
        return steps

    def _taken(self, run: Path, **pick: int) -> str:
        """The checkpoint of `run` shardstore reads (by its first unit: its folder, or its rank files' tag)."""
        unit = Path(open_source(run, **pick).units[0])
        name = unit.resolve().relative_to(run.resolve()).parts[0]
        rank_file = RANK_FILE.match(name)
        return rank_file.group("tag") if rank_file and unit.parent.resolve() == run.resolve() else name

    def test_its_checkpoints_are_named_by_their_step(self, run: tuple[Path, str]) -> None:
        folder, taken = run
        step = self.steps.step(taken)
        assert step is not None and self.steps.step(self.named(step)) == step
        assert self.steps in RUNS and step_of(self.named(12345)) == 12345
        assert self._taken(folder) == taken

    def test_the_checkpoint_it_would_resume_from_is_taken(self, run: tuple[Path, str], tmp_path: Path) -> None:
        """Beside a copy of a later step's name: the one the trainer's pointer names, or (none) the newest;
        `--step` takes an earlier one by its name."""
        folder, taken = run
        here = tmp_path / "run"
        shutil.copytree(folder, here, symlinks=True)
        step = self.steps.step(taken)
        assert step is not None and step > 0
        self.copy(here, taken, step + 1000)
        self.copy(here, taken, step - 1)
        newest = taken if self.steps.latest and (here / self.steps.latest).exists() else self.named(step + 1000)
        assert self._taken(here) == newest
        assert self._taken(here, step=step - 1) == self.named(step - 1)
        assert self._taken(here, step=step) == taken
