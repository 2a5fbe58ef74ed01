"""What every trainer's conventions must do (shardstore/trainers/): each trainer's tests subclass
`TrainerTests`, giving a checkpoint its own code saved and how the trainer itself resumes from the files
`--format torch` writes for it."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardstore
from shardstore.export import model_subtree
from shardstore.trainers.registry import TRAINERS


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
