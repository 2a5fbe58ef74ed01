"""PEFT adapters (shardstore/export/adapters.py) in checkpoints the trainers' own code saved
(tests/fixtures/data/peft/, tests/fixtures/peft_fsdp.py: a PeftModel under FSDP2 in gloo processes):

- the HF Trainer's checkpoint-N/ of a PeftModel (adapter only, peft's saved names, no adapter_config.json),
  LoRA with a trained lm_head and DoRA with rsLoRA;
- an adapter-only DCP save with its adapter_config.json;
- Accelerator.save_state's whole wrapped model (base weights under `base_layer`).

The oracle is peft itself, here: the live PeftModel rebuilt from what the ranks gathered, its logits and
its `merge_and_unload()`, against `PeftModel.from_pretrained` of the `--adapter` folder and
`from_pretrained` of the `--merge-adapter` folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore
from tests.conftest import assert_bitwise_equal
from tests.refusals import assert_refused, cli

DATA = Path(__file__).parents[1] / "fixtures" / "data" / "peft"
VERL = Path(__file__).parents[1] / "fixtures" / "data" / "verl" / "t2.13" / "fsdp2-lora-w3"
HF_TRAINER = ["--lora-alpha", "16", "--no-rslora"]  # what the HF Trainer's FSDP folder does not say of lora-w3
# name -> (the checkpoint, the options it needs where its trainer keeps no adapter config, its reference)
ADAPTERS = {"lora-w3": (DATA / "lora-w3" / "checkpoint-4", HF_TRAINER, DATA / "lora-w3.expected.pt.ref"),
            "dora-w2": (DATA / "dora-w2" / "checkpoint-4", ["--lora-alpha", "8", "--rslora"],
                        DATA / "dora-w2.expected.pt.ref"),
            "adapter-only-w2": (DATA / "adapter-only-w2", [], DATA / "adapter-only-w2.expected.pt.ref"),
            "ds-z2-w3": (DATA / "ds-z2-w3" / "checkpoint-3", [], DATA / "ds-z2-w3.expected.pt.ref"),
            "ds-z3-w3": (DATA / "ds-z3-w3" / "checkpoint-3", [], DATA / "ds-z3-w3.expected.pt.ref"),
            "lightning-w2": (DATA / "lightning-w2" / "checkpoints", ["--lora-alpha", "16", "--no-rslora"],
                             DATA / "lightning-w2.expected.pt.ref"),
            "verl-fsdp2-w3": (VERL, [], VERL.parent / "fsdp2-lora-w3.expected.pt.ref")}
# the whole wrapped model saved, base weights too
WHOLE = {"lora-w3-save-state": (DATA / "lora-w3-save-state" / "checkpoint-4", HF_TRAINER,
                                DATA / "lora-w3-save-state.expected.pt.ref"),
         "dora-w2-save-state": (DATA / "dora-w2-save-state" / "checkpoint-4", ["--lora-alpha", "8", "--rslora"],
                                DATA / "dora-w2-save-state.expected.pt.ref"),
         "ds-z2-w3-save-state": (DATA / "ds-z2-w3-save-state" / "checkpoint-3", [],
                                 DATA / "ds-z2-w3-save-state.expected.pt.ref"),
         "ds-z3-w3-save-state": (DATA / "ds-z3-w3-save-state" / "checkpoint-3", [],
                                 DATA / "ds-z3-w3-save-state.expected.pt.ref"),
         "lightning-w2": ADAPTERS["lightning-w2"], "verl-fsdp2-w3": ADAPTERS["verl-fsdp2-w3"]}


def _ref(name: str) -> dict[str, Any]:
    """What the ranks gathered (peft's names), their model's config, and a batch to run it on."""
    _, _, path = ADAPTERS.get(name) or WHOLE[name]
    ref: dict[str, Any] = torch.load(path, weights_only=True)
    if "config" not in ref:  # veRL's keeps the model's config in its huggingface/ folder
        ref["config"] = json.loads(next(VERL.glob("global_step_*/actor/huggingface/config.json")).read_text())
    ref.setdefault("batch", torch.arange(12).view(2, 6) % ref["config"]["vocab_size"])
    return ref


def _config_file(ref: dict[str, Any], tmp_path: Path) -> Path:
    """The model's config.json, for the merged model's description (--hf-config)."""
    (tmp_path / "config.json").write_text(json.dumps(ref["config"]))
    return tmp_path / "config.json"


def _base(ref: dict[str, Any]) -> Any:
    """The base model, its weights those the ranks gathered (the wrapped model's base layers and originals)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", "."): v
             for k, v in ref["model"].items() if "lora_" not in k and ".modules_to_save." not in k}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**ref["config"]))
    model.load_state_dict(plain)
    return model.eval()


def _live(ref: dict[str, Any], tmp_path: Path) -> Any:
    """The live PeftModel: the base wrapped by peft with the run's config, the gathered state loaded."""
    from peft import LoraConfig, get_peft_model

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "adapter_config.json").write_text(json.dumps(ref["adapter_config"]))
    model = get_peft_model(_base(ref), LoraConfig.from_pretrained(tmp_path / "config"))
    model.load_state_dict(ref["model"])
    return model.eval()


def _is_merge_and_unload(out: Path, ref: dict[str, Any], tmp_path: Path) -> dict[str, torch.Tensor]:
    """`out` holds the live model's `merge_and_unload()`: its tensors and names, and its logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    merged = _live(ref, tmp_path).merge_and_unload()
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(merged.state_dict())
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(written[key], value, rtol=0, atol=1e-6, msg=key)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(exported, ref), _logits(merged, ref), rtol=0, atol=1e-5)
    return written


def _alpha(options: list[str]) -> tuple[float | None, bool | None]:
    """The API's lora_alpha and rslora for a case's command-line options."""
    return (float(options[1]), options[2] == "--rslora") if options else (None, None)


def _logits(model: Any, ref: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(ref["batch"]).logits
    return logits


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_the_adapter_folder_is_what_peft_saves_and_loads_with_the_live_logits(name: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    src, options, _ = ADAPTERS[name]
    ref, out = _ref(name), tmp_path / "adapter"
    proc = cli("unshard", src, out, "--format", "hf", "--adapter", *options, "-q")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["adapter_config.json",
                                                                                   "adapter_model.safetensors"]
    assert_bitwise_equal(load_file(out / "adapter_model.safetensors"), ref["adapter"], "adapter")
    written, trained = json.loads((out / "adapter_config.json").read_text()), ref["adapter_config"]
    for key in ("r", "lora_alpha", "use_rslora", "use_dora", "peft_type"):
        assert written[key] == trained[key], key
    assert set(written["target_modules"]) == set(trained["target_modules"])
    assert set(written["modules_to_save"] or ()) == set(trained["modules_to_save"] or ())
    loaded = PeftModel.from_pretrained(_base(ref), out).eval()
    torch.testing.assert_close(_logits(loaded, ref), _logits(_live(ref, tmp_path), ref), rtol=0, atol=1e-6)
    # `verify` knows an adapter folder by itself, and takes what the checkpoint does not say from its config
    checked = shardstore.verify(src, out, jobs=2)
    assert checked.ok and checked.tensors == len(ref["adapter"]), checked.differences


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_the_merged_model_is_peft_merge_and_unload(name: str, tmp_path: Path) -> None:
    """The whole wrapped model (Accelerator.save_state): merged in float32 row block by row block, under the
    model's own names, the trained lm_head in place of the original; its logits those of the live model's
    merge_and_unload()."""
    src, options, _ = WHOLE[name]
    ref, out = _ref(name), tmp_path / "merged"
    alpha, rslora = _alpha(options)
    result = shardstore.unshard(src, out, format="hf", merge_adapter=True, hf_config=_config_file(ref, tmp_path),
                                lora_alpha=alpha, rslora=rslora, jobs=2)
    assert any("merged the" in note for note in result.notes)
    written = _is_merge_and_unload(out, ref, tmp_path)
    # the safetensors export of it is the Hugging Face folder's weights, its model undescribed
    shardstore.unshard(src, tmp_path / "st", merge_adapter=True, lora_alpha=alpha, rslora=rslora, jobs=2)
    from safetensors.torch import load_file
    assert_bitwise_equal(load_file(tmp_path / "st" / "model.safetensors"), written, "safetensors", ordered=True)
    assert shardstore.verify(src, out, merge_adapter=True, lora_alpha=alpha, rslora=rslora, jobs=2).ok
    if alpha is None:  # the checkpoint says its alpha: a wrong one is refused
        with pytest.raises(shardstore.ExportError, match="says"):
            shardstore.verify(src, out, merge_adapter=True, lora_alpha=1000.0, rslora=False, jobs=2)
        return
    wrong = shardstore.verify(src, out, merge_adapter=True, lora_alpha=alpha * 2, rslora=rslora, jobs=2)
    assert not wrong.ok and all("elements differ" in d.what for d in wrong.differences)


def test_an_adapter_only_checkpoint_is_not_merged_and_a_plain_export_says_why(tmp_path: Path) -> None:
    src, options, _ = ADAPTERS["lora-w3"]
    line = assert_refused(cli("unshard", src, tmp_path / "hf", "--format", "hf", "--hf-config",
                              _config_file(_ref("lora-w3"), tmp_path),
                              "-q"), "holds LoRA adapter weights only", "--adapter writes the adapter")
    assert "--merge-adapter" not in line
    assert_refused(cli("unshard", src, tmp_path / "m", "--format", "hf", "--merge-adapter", *options, "-q"),
                   "holds the adapter only (its base was not saved)")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m").exists()


def test_what_the_tensors_do_not_say_is_asked_for_and_checked_against_the_trainers_config(tmp_path: Path) -> None:
    """The HF Trainer's folder keeps no adapter_config.json: alpha and rsLoRA are asked for; where the
    checkpoint keeps one, an option saying otherwise, or a config whose rank or target modules are not the
    tensors', is refused."""
    src, _, _ = ADAPTERS["lora-w3"]
    assert_refused(cli("unshard", src, tmp_path / "a", "--format", "hf", "--adapter", "-q"),
                   "keeps no adapter_config.json", "--lora-alpha A, and --rslora or --no-rslora")
    only = shutil.copytree(DATA / "adapter-only-w2", tmp_path / "only")
    assert_refused(cli("unshard", only, tmp_path / "b", "--format", "hf", "--adapter", "--lora-alpha", "32", "-q"),
                   "--lora-alpha 32, but the checkpoint's adapter_config.json says 16")
    config = json.loads((only / "adapter_config.json").read_text())
    (only / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    assert_refused(cli("unshard", only, tmp_path / "c", "--format", "hf", "--adapter", "-q"),
                   "r is 8, but the adapter's lora_A have [4] rows")
    (only / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["k_proj", "v_proj"]}))
    assert_refused(cli("unshard", only, tmp_path / "d", "--format", "hf", "--adapter", "-q"),
                   "do not name base_model.model.model.layers.0.self_attn.q_proj, which the checkpoint adapts")
    (only / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.(q|v)_proj"}))
    shardstore.unshard(only, tmp_path / "e", format="hf", adapter=True, jobs=1)  # peft's regex form, matched whole
    for out in "abcd":
        assert not (tmp_path / out).exists()


def test_a_broken_adapter_is_refused_naming_the_module(tmp_path: Path) -> None:
    """A lora_A without its lora_B, and an adapter whose product is not its base weight's shape (another
    model's adapter), each refused in one line naming the module; nothing written."""
    from safetensors.torch import save_file

    ref = _ref("lora-w3-save-state")
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    missing = {k: v for k, v in ref["model"].items() if k != f"{module}.lora_B.default.weight"}
    (tmp_path / "missing").mkdir()
    save_file(missing, tmp_path / "missing" / "model.safetensors")
    assert_refused(cli("unshard", tmp_path / "missing", tmp_path / "a", "--format", "hf", "--adapter",
                       "--lora-alpha", "16", "--no-rslora", "-q"), f"{module}: its adapter has lora_A but no lora_B")
    other = {**ref["model"], f"{module}.base_layer.weight": torch.zeros(32, 64)}
    (tmp_path / "other").mkdir()
    save_file(other, tmp_path / "other" / "model.safetensors")
    assert_refused(cli("unshard", tmp_path / "other", tmp_path / "b", "--format", "hf", "--merge-adapter",
                       "--lora-alpha", "16", "--no-rslora", "--hf-config", _config_file(ref, tmp_path), "-q"),
                   f"{module}: its base weight is [32, 64], but its adapter makes [64, 64]: an adapter of another model")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_adapter_options_are_refused_where_they_do_not_apply(tmp_path: Path) -> None:
    src, options, _ = ADAPTERS["lora-w3"]
    assert_refused(cli("unshard", src, tmp_path / "a", "--adapter", *options, "-q"),
                   "--adapter applies to --format hf only")
    assert_refused(cli("unshard", src, tmp_path / "a", "--format", "torch", "--merge-adapter", *options, "-q"),
                   "--merge-adapter writes a model: --format safetensors and hf")
    assert_refused(cli("unshard", src, tmp_path / "b", "--format", "hf", "--adapter", "--merge-adapter", *options,
                       "-q"), "one of them")
    assert_refused(cli("unshard", src, tmp_path / "c", "--format", "hf", "--lora-alpha", "16", "-q"),
                   "--lora-alpha and --rslora go with --adapter or --merge-adapter")
    plain = DATA.parent / "accelerate" / "fsdp2-w2" / "checkpoint-4"
    assert_refused(cli("unshard", plain, tmp_path / "d", "--format", "hf", "--adapter", "--lora-alpha", "16",
                       "--no-rslora", "-q"), "holds no PEFT (LoRA) adapter")


@pytest.fixture
def base_folder(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The base model of a fixture's run as `save_pretrained` writes it (the weights its ranks gathered)."""
    def make(name: str) -> Path:
        out = tmp_path / f"base-{name}"
        _base(_ref(name)).save_pretrained(out)
        return out
    return make


@pytest.mark.parametrize("name", ["lora-w3", "dora-w2", "ds-z2-w3", "ds-z3-w3"])
def test_the_hf_trainers_adapter_is_merged_onto_the_base_folder(name: str, tmp_path: Path, base_folder) -> None:  # type: ignore[no-untyped-def]
    """The HF Trainer's PEFT checkpoint-N holds the adapter only: merged onto --base (read in place), every
    tensor of the base in the output, the trained lm_head the checkpoint's; peft's merge_and_unload of the
    live model is the oracle; `verify` recomputes it."""
    src, options, _ = ADAPTERS[name]
    ref, out, base = _ref(name), tmp_path / "merged", base_folder(name)
    alpha, rslora = _alpha(options)
    result = shardstore.unshard(src, out, format="hf", merge_adapter=True, base=base, lora_alpha=alpha,
                                rslora=rslora, jobs=2)
    assert any(f"of {base}" in note for note in result.notes)
    written = _is_merge_and_unload(out, ref, tmp_path)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == ref["config"]["hidden_size"]
    proc = cli("verify", src, out, "--merge-adapter", "--base", base, *options)
    assert proc.returncode == 0 and f"verified {len(written)} tensors" in proc.stderr, proc.stdout + proc.stderr


def test_the_base_is_found_in_the_local_hub_cache_and_never_fetched(tmp_path: Path, base_folder,  # type: ignore[no-untyped-def]
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src, options, _ = ADAPTERS["lora-w3"]
    revision = "0123456789abcdef0123456789abcdef01234567"
    cached = tmp_path / "hub" / "models--tiny--llama"
    shutil.copytree(base_folder("lora-w3"), cached / "snapshots" / revision)
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    shardstore.unshard(src, tmp_path / "a", format="hf", merge_adapter=True, base="tiny/llama", lora_alpha=16.0,
                       rslora=False, jobs=1)
    assert (tmp_path / "a" / "model.safetensors").is_file()
    with pytest.raises(shardstore.ExportError, match="not in the local Hugging Face cache .* never downloads"):
        shardstore.unshard(src, tmp_path / "b", format="hf", merge_adapter=True, base="tiny/other", lora_alpha=16.0,
                           rslora=False, jobs=1)
    assert not (tmp_path / "b").exists()


def test_a_base_the_adapter_does_not_fit_is_refused_before_any_rank_is_read(tmp_path: Path, base_folder) -> None:  # type: ignore[no-untyped-def]
    """A base of another model (a module the adapter adapts of another shape; a trained module missing), a
    --base for a checkpoint holding its own base weights, and --base without --merge-adapter: one line each."""
    from safetensors.torch import load_file, save_file

    src, options, _ = ADAPTERS["lora-w3"]
    other = base_folder("lora-w3")
    weights = load_file(other / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}, other / "model.safetensors")
    assert_refused(cli("unshard", src, tmp_path / "a", "--format", "hf", "--merge-adapter", "--base", other, *options,
                       "-q"), "model.layers.0.self_attn.q_proj.weight is [64, 32], but the adapter of "
                              "base_model.model.model.layers.0.self_attn.q_proj makes [64, 64]: an adapter of another model")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, other / "model.safetensors")
    assert_refused(cli("unshard", src, tmp_path / "b", "--format", "hf", "--merge-adapter", "--base", other, *options,
                       "-q"), "lm_head.weight is missing, but the checkpoint's trained base_model.model.lm_head.weight")
    whole, whole_options, _ = WHOLE["lora-w3-save-state"]
    assert_refused(cli("unshard", whole, tmp_path / "c", "--format", "hf", "--merge-adapter", "--base", other,
                       *whole_options, "-q"), "--base: the checkpoint holds its own base weights")
    assert_refused(cli("unshard", src, tmp_path / "d", "--format", "hf", "--adapter", "--base", other, *options, "-q"),
                   "--base goes with --merge-adapter")
    for out in "abcd":
        assert not (tmp_path / out).exists()


def test_a_rank_file_of_a_run_with_another_lora_rank_is_refused_naming_it(tmp_path: Path) -> None:
    """veRL's rank files, one of them from the same run made with r=8 (tests/fixtures/data/verl/t2.13/
    other-rank/): refused in one line naming that file, no adapter written."""
    run = shutil.copytree(VERL, tmp_path / "run")
    other = VERL.parent / "other-rank" / "model_world_size_3_rank_1.pt"
    shutil.copy(other, next(run.glob("global_step_*/actor")) / other.name)
    line = assert_refused(cli("unshard", run, tmp_path / "out", "--format", "hf", "--adapter", "-q"),
                          "model_world_size_3_rank_1.pt: its keys or tensor layouts differ from rank 0's")
    assert "adapter_model.safetensors" not in line
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()
