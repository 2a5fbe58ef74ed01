"""Lightning's and Fabric's sharded checkpoints: `epoch=E-step=N.ckpt/` (DCP of `state_dict` and
`optimizer_0`, and rank 0's `meta.pt` with everything else) and Fabric's `fabric.save` folders, written by
Lightning's own Trainer and Fabric under ModelParallelStrategy (FSDP2, and FSDP2 x TP) in gloo processes
(tests/fixtures/lightning_fsdp.py; kept in tests/fixtures/data/lightning/), against what the live ranks
gathered, and resumed from by Lightning's Trainer and Fabric in one CPU process.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore
from shardstore.read.discover import open_source
from tests.conftest import exported
from tests.read.conformance import FormatTests

from .test_trainer_parts import same_optimizer

DATA = Path(__file__).parents[2] / "fixtures" / "data" / "lightning"
# ModelParallelStrategy: FSDP2 over 3 ranks (uneven shards), 2 x 2 FSDP2 x TP; FSDPStrategy (FSDP1) over 3
RUNS = ["trainer-w3", "trainer-w4-tp2", "trainer-fsdp1-w3"]
META = ["epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "lr_schedulers",
        "hparams_name", "hyper_parameters"]


def _want(name: str) -> dict:
    return torch.load(DATA / f"{name}.expected.pt.ref", weights_only=True)


@pytest.mark.parametrize("run", RUNS)
def test_the_trainers_folder_becomes_the_checkpoint_lightning_saves_whole(run: str, tmp_path: Path) -> None:
    """The checkpoints folder given alone: its last.ckpt link is taken. --format torch writes one
    checkpoint.ckpt as Lightning saves a full one: state_dict and optimizer_states (by parameter number) bit
    for bit what the live ranks gathered, and meta.pt's values as meta.pt holds them."""
    want = _want(run)
    shardstore.unshard(DATA / run / "checkpoints", tmp_path / "pt", format="torch")
    assert exported(tmp_path / "pt") == ["checkpoint.ckpt"]
    got = torch.load(tmp_path / "pt" / "checkpoint.ckpt", weights_only=False)
    assert sorted(got) == sorted(["state_dict", "optimizer_states", *META])
    assert set(got["state_dict"]) == set(want["model"])
    assert all(torch.equal(got["state_dict"][k], v) for k, v in want["model"].items())
    assert len(got["optimizer_states"]) == 1
    same_optimizer(got["optimizer_states"][0], want["optimizer"])
    meta = torch.load(next((DATA / run / "checkpoints").glob("epoch=*")) / "meta.pt", weights_only=False)
    assert {k: got[k] for k in META if k != "callbacks"} == {k: meta[k] for k in META if k != "callbacks"}
    assert repr(got["callbacks"]) == repr(meta["callbacks"])  # holds a tensor(inf): == is elementwise


def test_the_torch_export_is_what_lightnings_own_consolidate_checkpoint_gives(tmp_path: Path) -> None:
    """Against Lightning's `consolidate_checkpoint` (its functions, in this process) on FSDPStrategy's
    folder: the same state_dict and meta.pt keys; the same optimizer state, which Lightning's tool leaves
    keyed by parameter name and shardstore numbers as Lightning's own full save does."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    folder = DATA / "trainer-fsdp1-w3" / "checkpoints" / "epoch=1-step=4.ckpt"
    theirs = _format_checkpoint(_load_distributed_checkpoint(folder))
    shardstore.unshard(folder, tmp_path / "pt", format="torch")
    ours = torch.load(tmp_path / "pt" / "checkpoint.ckpt", weights_only=False)
    assert sorted(ours) == sorted(theirs)
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    assert all(torch.equal(ours["state_dict"][k], v) for k, v in theirs["state_dict"].items())
    assert len(ours["optimizer_states"]) == len(theirs["optimizer_states"]) == 1
    same_optimizer(ours["optimizer_states"][0], theirs["optimizer_states"][0])
    assert repr({k: ours[k] for k in META}) == repr({k: theirs[k] for k in META})


def test_steps_by_lightnings_names_and_the_model_for_safetensors(tmp_path: Path) -> None:
    """--step 4 finds epoch=1-step=4.ckpt; safetensors takes the model (state_dict) alone."""
    from safetensors.torch import load_file

    want = _want("trainer-w3")
    run = tmp_path / "checkpoints"
    shutil.copytree(DATA / "trainer-w3" / "checkpoints", run, symlinks=True)
    (run / "last.ckpt").unlink()
    shutil.copytree(run / "epoch=1-step=4.ckpt", run / "epoch=0-step=2.ckpt")
    assert open_source(run, step=4).units[0].startswith(str(run / "epoch=1-step=4.ckpt"))
    assert open_source(run).units[0].startswith(str(run / "epoch=1-step=4.ckpt"))  # the newest by its name
    shardstore.unshard(run, tmp_path / "st", step=4)
    st = load_file(tmp_path / "st" / "model.safetensors")
    assert set(st) == set(want["model"]) and all(torch.equal(st[k], v) for k, v in want["model"].items())


def test_hf_export_takes_the_model_hparams_yaml_names_from_the_local_cache(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's hparams.yaml names the model (`model_name_or_path`): its Hugging Face files come from the
    local Hugging Face cache, the LightningModule's attribute (`model.`) comes off every name, and
    transformers loads the folder into the gathered weights' logits. Not in the cache: the export asks for
    --hf-config before any ingest."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.fixtures.lightning_fsdp import CONFIG, MODEL_NAME

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(shardstore.ExportError, match="--hf-config"):
        shardstore.unshard(DATA / "trainer-w3" / "checkpoints", tmp_path / "none", format="hf")
    assert not (tmp_path / "none").exists()
    repo = tmp_path / "hub" / f"models--{MODEL_NAME.replace('/', '--')}"
    LlamaConfig(**CONFIG).save_pretrained(repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    shardstore.unshard(DATA / "trainer-w3" / "checkpoints", tmp_path / "hf", format="hf")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    gathered = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    gathered.load_state_dict({k.removeprefix("model."): v for k, v in _want("trainer-w3")["model"].items()})
    ids = torch.tensor([[5, 9, 13, 40, 2, 77], [1, 8, 21, 3, 66, 30]])
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, gathered(input_ids=ids).logits)


def _module() -> Any:
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures.lightning_fsdp import CONFIG

    class Module(L.LightningModule):
        def __init__(self, config: dict, lr: float = 1e-2) -> None:
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(5)  # other weights than the checkpoint's: the resume must replace them
            self.model = LlamaForCausalLM(LlamaConfig(**config))
            self.seen: dict = {}

        def training_step(self, batch: Any, index: int) -> Any:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": optimizer,
                    "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))}

        def on_train_start(self) -> None:
            self.seen.update(step=self.trainer.global_step, epoch=self.current_epoch,
                             model={k: v.clone() for k, v in self.state_dict().items()},
                             optimizer=copy.deepcopy(self.trainer.optimizers[0].state_dict()))

    return Module(CONFIG)


def test_fabric_loads_its_state_from_the_torch_export_on_one_cpu(tmp_path: Path) -> None:
    """Fabric's folder keeps the user's own keys: checkpoint.pt holds them as `fabric.save` was given them,
    and `fabric.load` on one CPU restores the model, the optimizer (keyed by name) and the plain values."""
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures.lightning_fsdp import CONFIG

    want = _want("fabric-w2")
    shardstore.unshard(DATA / "fabric-w2", tmp_path / "pt", format="torch")
    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(5)
    model = fabric.setup(LlamaForCausalLM(LlamaConfig(**CONFIG)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0, "scheduler": None}
    assert fabric.load(tmp_path / "pt" / "checkpoint.pt", state) == {}
    assert state["step"] == 4 and state["scheduler"]["last_epoch"] == 4
    assert all(torch.equal(model.module.state_dict()[k], v) for k, v in want["model"].items())
    saved = optimizer.optimizer.state_dict()
    moments = want["optimizer"]["state"]
    names = [n for g in want["optimizer"]["param_groups"] for n in g["params"]]
    assert all(torch.equal(saved["state"][i][k], moments[n][k]) for i, n in enumerate(names) for k in moments[n])


class TestLightningConformance(FormatTests):
    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        return DATA / "trainer-w3" / "checkpoints" / "epoch=1-step=4.ckpt"

    @pytest.fixture
    def foreign(self, tmp_path: Path) -> Path:
        return DATA / "trainer-w4-tp2" / "checkpoints" / "epoch=0-step=4.ckpt" / "__1_0.distcp"


def test_an_unreadable_hparams_yaml_is_no_description(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hparams.yaml is the logger's, not the checkpoint's: nested past any parser's depth, or not YAML, it
    names no model, so --format hf asks for --hf-config up front, and --format torch is not held up."""
    run = tmp_path / "run"
    shutil.copytree(DATA / "trainer-w3", run, symlinks=True)
    hparams = run / "lightning_logs" / "version_0" / "hparams.yaml"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for text in ("[" * 100_000, "model_name_or_path: [unclosed\n  - {"):
        hparams.write_text(text)
        with pytest.raises(shardstore.ExportError, match="--hf-config"):
            shardstore.unshard(run / "checkpoints", tmp_path / "hf", format="hf")
    shardstore.unshard(run / "checkpoints", tmp_path / "pt", format="torch")
    assert (tmp_path / "pt" / "checkpoint.ckpt").is_file()


META_FILE = "meta.pt"


def _forged_meta(run: Path, **values: int) -> Path:
    """A copy of trainer-w3's checkpoints folder whose epoch=1-step=4.ckpt/meta.pt records `values` instead."""
    from tests.fixtures.forge import resaved

    shutil.copytree(DATA / "trainer-w3" / "checkpoints", run, symlinks=True)
    meta = run / "epoch=1-step=4.ckpt" / META_FILE
    resaved(meta, meta, lambda state: state.update(values))
    return run


@pytest.mark.parametrize("values, needle", [({"global_step": 2, "epoch": 0}, "records global_step 2"),
                                            ({"epoch": 0}, "records epoch 0")])
def test_a_meta_pt_of_another_step_is_refused(values: dict, needle: str, tmp_path: Path) -> None:
    """ModelCheckpoint names the folder by the epoch and global_step dump_checkpoint records in meta.pt at
    the same moment: another save's meta.pt in epoch=1-step=4.ckpt/ is refused in one line, nothing left."""
    from tests.refusals import assert_refused, cli

    run = _forged_meta(tmp_path / "checkpoints", **values)
    assert_refused(cli("unshard", run, tmp_path / "out", "--format", "torch", "-q"),
                   str(run / "epoch=1-step=4.ckpt" / META_FILE), needle, "its folder is epoch=1-step=4.ckpt")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("run", [*RUNS, "fabric-w2"])
def test_every_genuine_meta_pt_agrees_with_its_folder(run: str) -> None:
    """Each fixture's recorded epoch and step are those its name says (Fabric's names say nothing), read
    by the check itself: nothing refused."""
    from shardstore.read.formats import lightning

    for meta in sorted((DATA / run).rglob(META_FILE)):
        values = torch.load(meta, weights_only=False)
        lightning.check_steps(str(meta), values)
        if "global_step" in values and meta.parent.name != "last.ckpt":
            assert f"step={values['global_step']}" in meta.parent.name and f"epoch={values['epoch']}" in meta.parent.name


def test_a_last_ckpt_leading_out_of_the_run_is_refused(tmp_path: Path) -> None:
    """last.ckpt linking to another run's checkpoint outside the folder named: refused in one line naming
    where it leads, nothing left; that checkpoint named itself is read."""
    from tests.refusals import assert_refused, cli

    other = tmp_path / "other" / "epoch=1-step=4.ckpt"
    shutil.copytree(DATA / "trainer-w3" / "checkpoints" / "epoch=1-step=4.ckpt", other)
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    (run / "last.ckpt").symlink_to(other)
    assert_refused(cli("unshard", run, tmp_path / "out", "--format", "torch", "-q"),
                   f"{run / 'last.ckpt'}: leads to {other}, outside {run}")
    assert not (tmp_path / "out").exists()
    assert_refused(cli("unshard", run, tmp_path / "out", "--tag", "last.ckpt", "-q"), "leads to", str(other))
    shardstore.unshard(other, tmp_path / "pt", format="torch")
    assert (tmp_path / "pt" / "checkpoint.ckpt").is_file()
