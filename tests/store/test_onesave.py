"""Units of two saves of one run, same shapes, are never exported together."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import shardstore
from shardstore import values
from shardstore.errors import CheckpointError
from shardstore.store.onesave import OneSave, stamps


def _enc(obj: object) -> object:
    return values.encode(obj)


def test_stamps_are_found_by_path_and_inside_values_but_never_in_per_rank_state() -> None:
    assert list(stamps("optim/state/w/step", _enc(3))) == [("optim/state/w/step", 3)]
    trainer = _enc({"global_step": 10, "world_size": 4, "data_loader": {"step": 99}, "nested": {"epoch": 1}})
    assert dict(stamps("trainer", trainer)) == {"trainer/global_step": 10, "trainer/nested/epoch": 1}
    assert list(stamps("rng/torch/step", _enc(5))) == []
    assert list(stamps("state/dataset_state/train/epoch", _enc(5))) == []
    assert list(stamps("model/w", _enc("not a stamp"))) == []


def test_values_that_differ_per_rank_in_a_genuine_save_are_accepted() -> None:
    units = [(f"rank{r}.pt", {"rng": _enc((3, r)), "trainer": _enc({"global_step": 10, "sampler": {"epoch": r}}),
                              "optim/param_groups": _enc([{"lr": 1e-3}])}) for r in range(4)]
    _check(units)


def _check(units: list[tuple[str, dict]]) -> None:
    saves = OneSave()
    for name, objects in units:
        saves.add(name, objects)


def test_a_unit_of_another_save_is_named_with_the_value() -> None:
    units = [(f"rank{r}.pt", {"trainer": _enc({"global_step": 10 if r != 2 else 20})}) for r in range(4)]
    with pytest.raises(CheckpointError, match=r"rank2\.pt and rank0\.pt are from two different saves: "
                                              r"trainer/global_step is 20 in rank2\.pt but 10 in rank0\.pt"):
        _check(units)
    lr = [(f"rank{r}.pt", {"optim/param_groups": _enc([{"lr": 1e-3 if r else 2e-3}])}) for r in range(2)]
    with pytest.raises(CheckpointError, match="rank1.pt and rank0.pt .* optim/param_groups"):
        _check(lr)


@pytest.fixture(scope="module")
def composer(layout_checkpoints) -> Path:
    return layout_checkpoints("composer-hsdp", 8, "composer", steps=(10, 20), replicas=2, device="cuda",
                              devices_per_node=4)


@pytest.fixture
def mixed(composer: Path, tmp_path: Path) -> Path:
    """Step 10's folder with rank 5 of step 20 under step 10's name: a save over it that crashed."""
    src = tmp_path / "ep0-ba10"
    shutil.copytree(composer / "ep0-ba10", src)
    shutil.copy(composer / "ep0-ba20" / "ep0-ba20-rank5.pt", src / "ep0-ba10-rank5.pt")
    return src


def test_a_folder_mixing_two_saves_is_refused_before_anything_is_exported(mixed: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"ep0-ba10-rank5\.pt and ep0-ba10-rank0\.pt are from two different "
                                              r"saves: state/timestamp"):
        shardstore.unshard(mixed, out, jobs=1)
    assert not (out / "model.safetensors").exists()


def test_a_rank_of_another_save_is_refused_by_an_incremental_ingest(mixed: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shardstore.ingest(store, [mixed / f"ep0-ba10-rank{r}.pt" for r in range(4)], jobs=1)
    with pytest.raises(CheckpointError, match="ep0-ba10-rank5.pt and ep0-ba10-rank0.pt are from two different saves"):
        shardstore.ingest(store, [mixed / "ep0-ba10-rank5.pt"], jobs=1)
    assert sorted(shardstore.open(store).records()) == [0, 1, 2, 3]


def test_units_of_two_saves_from_workers_that_never_saw_each_other_are_refused_by_the_coordinator(
        mixed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch on a worker of its own, each listing the store before any other committed (workers
    starting together): no worker has a unit to compare its own with. The coordinator compares every
    record as it arrives, refuses the run naming both files, and says the store now holds both; an export
    of that store is refused too."""
    import importlib

    from shardstore.runner import Pool
    from shardstore.store.store import Store

    ingest_module = importlib.import_module("shardstore.ingest")  # (the package's `ingest` is the function)

    class Apart(Pool):
        def __init__(self, jobs: int, scheduler: str | None = None) -> None:
            super().__init__(1)
            self.jobs = jobs

        @property
        def inline(self) -> bool:
            return False

        def run(self, fn, args, names, on_done, here=None) -> None:  # type: ignore[no-untyped-def]
            with monkeypatch.context() as m:
                m.setattr(Store, "committed", lambda self: set())  # what each worker's listing found
                results = [here()] if here is not None else []
                for a in args:
                    ingest_module._WORKER_STORES.clear()  # a worker process of its own
                    results.append(fn(*a))
            for result in results:
                on_done(result)

    monkeypatch.setattr(ingest_module, "Pool", Apart)
    store = tmp_path / "store"
    with pytest.raises(CheckpointError, match=r"ep0-ba10-rank5\.pt and ep0-ba10-rank0\.pt are from two different "
                                              r"saves: state/timestamp .* now holds units of both"):
        shardstore.ingest(store, sorted(mixed.glob("*.pt")), jobs=4)
    assert 5 in shardstore.open(store).records()
    with pytest.raises(CheckpointError, match="from two different saves"):
        shardstore.export(store, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
