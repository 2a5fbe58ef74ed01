"""OLMo-core trainer checkpoints to Hugging Face: a checkpoint written by OLMo-core's own trainer code
(ai2-olmo-core 2.3.0, kept in tests/fixtures/data/olmo-core-trainer with the script that wrote it) loads
with `from_pretrained` and gives OLMo-core's own logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.errors import ExportError
from tests.conftest import assert_bitwise_equal

CKPT = Path(__file__).parent.parent / "fixtures" / "data" / "olmo-core-trainer"
IDS = torch.tensor([[5, 9, 13, 40, 2, 77], [1, 8, 21, 3, 66, 30]])


def test_olmo_core_checkpoint_loads_with_olmo_cores_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    result = shardstore.unshard(CKPT / "step1", tmp_path / "hf", format="hf", jobs=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "Olmo2ForCausalLM"
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    # OLMo-core's own model computed these on the machine that made the fixture (OLMo-core is not installed
    # here to compute them again): another CPU's float32 kernels may round the last digits differently,
    # so they are compared to 1e-5; the weights themselves are compared bit for bit below.
    torch.testing.assert_close(logits, torch.load(CKPT / "expected.pt.ref", weights_only=False)["logits"],
                               rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["num_key_value_heads"]) == (99, 98, 2)
    assert "dolma2-tokenizer" in result.notes[0]


def test_the_model_and_trainer_state_unshard_as_saved(tmp_path: Path) -> None:
    """The trainer-state files hold values only (step, data loader position): they join the tree."""
    shardstore.unshard(CKPT / "step1", tmp_path / "out", format="torch", jobs=2)
    model = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert_bitwise_equal(model, dict(torch.load(CKPT / "expected.pt.ref", weights_only=False)["model"]), "model")
    train = torch.load(tmp_path / "out" / "train.pt", weights_only=False)
    assert train["global_step"] == 1
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model"]["d_model"] == 16


@pytest.mark.parametrize("change, words", [
    (lambda m: m["block"]["attention"].__setitem__("sliding_window", {"pattern": [4096, -1]}), "sliding-window"),
    (lambda m: m["block"].__setitem__("name", "moe_reordered_norm"), "'moe_reordered_norm' blocks"),
    (lambda m: m["block"]["attention"].__setitem__("qk_norm", None), "q/k norms missing"),
])
def test_what_transformers_cannot_express_is_refused_by_name(change, words: str, tmp_path: Path) -> None:
    src = shutil.copytree(CKPT / "step1", tmp_path / "step1")
    experiment = json.loads((src / "config.json").read_text())
    change(experiment["model"])
    (src / "config.json").write_text(json.dumps(experiment))
    with pytest.raises(ExportError, match=words):
        shardstore.unshard(src, tmp_path / "hf", format="hf", jobs=1)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
