"""An export into a folder that holds one: of the same checkpoint it is replaced (a rerun), of another only
with --overwrite (export/origin.py); and OUT inside the run the user named is refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from shardstore.export.origin import RECORD
from tests.refusals import assert_refused, cli


def _train(run: Path, steps: tuple[int, ...]) -> dict[int, dict[str, torch.Tensor]]:
    """A user's training script: a tiny model trained with AdamW, `dcp.save`d as {"model", "optim"} into
    run/step<N> at each of `steps`; what the model held at each, as the trainer had it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held = {}
    for step in range(1, max(steps) + 1):
        loss = model(torch.randn(4, 16)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step in steps:
            dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=run / f"step{step}")
            held[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return held


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    folder = tmp_path_factory.mktemp("origin") / "run"
    return folder, _train(folder, (2, 4))


def _holds(out: Path, model: dict[str, torch.Tensor]) -> bool:
    got = load_file(out / "model.safetensors")
    return got.keys() == model.keys() and all(torch.equal(got[k], model[k]) for k in model)


def test_out_inside_the_run_the_user_named_is_refused_up_front(run, tmp_path: Path) -> None:
    """`unshard run run/export`: the checkpoint taken is run/step4, but OUT inside the run would make the
    run hold a folder that is no step, and the next `unshard run` would fail on it."""
    folder, _ = run
    for args in (("unshard", folder, folder / "export"), ("unshard", folder, tmp_path / "o", "--store", folder / "st")):
        assert_refused(cli(*args, "-q"), "inside the run's folder", str(folder))
        assert sorted(p.name for p in folder.iterdir()) == ["step2", "step4"]
    assert_refused(cli("unshard", folder / "step4", folder / "step4" / "out", "-q"), "inside the checkpoint's folder")
    assert cli("unshard", folder, tmp_path / "out", "-q").returncode == 0


def test_an_export_of_another_step_is_replaced_only_with_overwrite(run, tmp_path: Path) -> None:
    folder, held = run
    out = tmp_path / "out"
    assert cli("unshard", folder, out, "-q").returncode == 0  # the newest: step 4
    assert _holds(out, held[4])
    record = json.loads((out / RECORD).read_text())
    assert sorted(record["units"]) == sorted(p.name for p in (folder / "step4").glob("*.distcp"))

    # step 2 into the folder holding step 4's export: refused up front, step 4's export untouched
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert_refused(cli("unshard", folder, out, "--step", "2", "-q"), str(out), "holds the export of another "
                   "checkpoint", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    # the same checkpoint again (a rerun, here in another format's dtype) is no other checkpoint's
    assert cli("unshard", folder, out, "--dtype", "bf16", "-q").returncode == 0
    assert cli("unshard", folder, out, "--step", "2", "--overwrite", "-q").returncode == 0
    assert _holds(out, held[2])
    assert cli("unshard", folder / "step2", out, "-q").returncode == 0  # step 2 named as its folder: the same


def test_a_store_of_another_checkpoint_is_refused_too(run, tmp_path: Path) -> None:
    """The two-step path (`ingest` into a store, `export` from it) checks the same record."""
    folder, held = run
    out = tmp_path / "out"
    for step in (2, 4):
        assert cli("ingest", tmp_path / f"s{step}", folder / f"step{step}", "-q").returncode == 0
    assert cli("export", tmp_path / "s4", out, "-q").returncode == 0
    assert_refused(cli("export", tmp_path / "s2", out, "-q"), "holds the export of another checkpoint")
    assert _holds(out, held[4])
    assert cli("export", tmp_path / "s2", out, "--overwrite", "-q").returncode == 0
    assert _holds(out, held[2])


def test_a_damaged_record_is_refused_in_one_line(run, tmp_path: Path) -> None:
    folder, _ = run
    out = tmp_path / "out"
    assert cli("unshard", folder, out, "-q").returncode == 0
    (out / RECORD).write_text('{"units": [1, 2]}')
    assert_refused(cli("unshard", folder, out, "-q"), str(out / RECORD), "not a record shardstore wrote")
