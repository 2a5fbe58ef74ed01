"""Which files of a folder are a Hugging Face model's own (config, generation config, tokenizer): what a
reader keeps beside a checkpoint, and what `--format hf` copies into its folder."""

from __future__ import annotations

from .trainers import verl

# A model's Hugging Face files besides its weights (config, generation config, tokenizer), which trainers
# keep beside their checkpoints: what `--format hf` takes with no flag...
HF_MODEL_FILES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
# ...but for those describing other weights or the run: an index of weights (an export writes its own), the
# HF Trainer's own state and the metrics its train()/evaluate() leave in output_dir.
NOT_HF_MODEL_FILES = ("trainer_state.json", "all_results.json", "train_results.json", "eval_results.json",
                      "test_results.json")
# A PEFT adapter's config, and veRL's record of its LoRA: kept beside the checkpoint for the adapter's export,
# never copied as the model's
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, verl.LORA_META)


def hf_model_file(name: str) -> bool:
    """Whether a file of this name beside a checkpoint is one of its model's Hugging Face files (or its
    adapter's config), which a reader keeps."""
    return name.endswith(HF_MODEL_FILES) and not name.endswith(".index.json") and name not in NOT_HF_MODEL_FILES \
        and not name.startswith(".")  # a hidden file is no model's: shardstore's own record of an export


def describes_model(name: str) -> bool:
    """Whether a kept file (`hf_model_file`) goes beside an export, or into a Hugging Face folder: not the
    adapter's config, which describes weights under other names."""
    return hf_model_file(name) and name not in ADAPTER_FILES
