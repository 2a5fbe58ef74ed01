"""Lightning's and Fabric's sharded checkpoints: a DCP folder (read/formats/dcp.py) with rank 0's `meta.pt`.

Lightning's Trainer saves `epoch=E-step=N.ckpt/` (ModelCheckpoint's name) holding the DCP of its model
(`model` under FSDPStrategy, `state_dict` under ModelParallelStrategy) and of `optimizer_{i}`, and
`meta.pt`: everything else of the checkpoint dict (epoch, global_step, loops, callbacks, lr_schedulers,
hyper_parameters). Fabric's `fabric.save` puts the modules and optimizers in the DCP and every other value
of the state it was given in `meta.pt`. Those values join the state dict's top level (read/formats/trainer.py).

The model's Hugging Face description is where Lightning's logger left it: `hparams.yaml` (what
`save_hyperparameters` recorded) in the logger's version folder, `{log_dir}/checkpoints/<ckpt>` by
default. When it names a transformers model (`model_name_or_path: meta-llama/Llama-3.1-8B`, or a local
folder), that model's Hugging Face files are taken from the folder, or from the local Hugging Face cache
(never the network).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...hf_files import hf_model_file
from ...locations import StorageOptions, folder_of, is_url, join, listing, name_of, subfolders
from ...patterns import digits
from ...trainers import lightning as trainer
from ..primitives.container import read_small
from ..source import JSON_CONFIG, check_step

META = "meta.pt"  # rank 0's torch.save of every value but the modules and optimizers
OPTIMIZER = re.compile(r"optimizer_[0-9]+")  # the Trainer's key for its i-th optimizer's state
HPARAMS = "hparams.yaml"
MAX_HPARAMS = 1 << 20
# the keys a LightningModule's hyper-parameters name a transformers model by, as fine-tuning scripts spell them
MODEL_KEYS = ("model_name_or_path", "pretrained_model_name_or_path", "model_name", "model_id", "base_model",
              "model_path", "model")


def check_steps(meta: str, values: dict[str, Any]) -> None:
    """The epoch and global_step rank 0's meta.pt records against those its folder's name says: another
    save's meta.pt copied into the folder is refused. Fabric names its folders freely (they name nothing)."""
    for key, named in trainer.NAMED.items():
        check_step(meta, key, values.get(key), folder_of(meta), named)


def check_meta_there(folder: str, top_keys: set[str], has_meta: bool) -> None:
    """A DCP folder that is a Lightning Trainer's save (ModelCheckpoint's `*.ckpt` name, its model under
    `state_dict` or `model` and its optimizers under `optimizer_{i}`) holds meta.pt: the Trainer writes it
    with every save (epoch, global_step, loops, schedulers). Without it the save is unfinished or damaged,
    and read as a plain DCP folder it would lose all that (Lightning refuses it too)."""
    if has_meta or not name_of(folder).endswith(".ckpt") or not any(OPTIMIZER.fullmatch(k) for k in top_keys):
        return
    if top_keys <= {"state_dict", "model"} | {k for k in top_keys if OPTIMIZER.fullmatch(k)}:
        raise CheckpointError(f"{join(folder, META)}: missing from a Lightning checkpoint (its model and "
                              f"optimizer_N are there): an unfinished or damaged save")


def hparams_file(checkpoint: str, storage_options: StorageOptions | None) -> str | None:
    """The logger's hparams.yaml for a checkpoint folder: in the version folder above `checkpoints/`
    (Lightning's default), else the newest `lightning_logs/version_N/` beside a checkpoints folder."""
    up = folder_of(folder_of(checkpoint.rstrip("/\\")))
    here = join(up, HPARAMS)
    if here in listing(up, storage_options):
        return here
    logs = join(up, "lightning_logs")
    versions = sorted((n for n in subfolders(logs, storage_options) if n.startswith("version_")),
                      key=lambda n: int(n[8:]) if digits(n[8:]) else -1)
    for version in reversed(versions):
        found = join(join(logs, version), HPARAMS)
        if found in listing(join(logs, version), storage_options):
            return found
    return None


def model_files(checkpoint: str, storage_options: StorageOptions | None) -> list[str]:
    """The Hugging Face files (config.json, tokenizer) of the transformers model the run's hparams.yaml
    names, where they are on this machine; none when it names none, or none is here."""
    path = hparams_file(checkpoint, storage_options)
    if path is None:
        return []
    name = _model_name(_hparams(path, storage_options))
    folder = _local_model(name) if name is not None else None
    if folder is None:
        return []
    return [str(p) for p in sorted(folder.iterdir()) if p.is_file() and hf_model_file(p.name)]


def _hparams(path: str, storage_options: StorageOptions | None) -> Any:
    """The logger's record of the hyper-parameters, or None when it is not one (too large, nested too
    deeply, not YAML): it is a hint at the model's description, not part of the checkpoint, and an
    export that needs the description then asks for --hf-config."""
    import yaml

    try:
        return yaml.safe_load(read_small(path, storage_options, MAX_HPARAMS, "Lightning's hparams.yaml"))
    except (RecursionError, yaml.YAMLError, CheckpointError):
        return None


def _model_name(hparams: Any) -> str | None:
    """The first model a `MODEL_KEYS` key names, at the top level or one mapping down."""
    if not isinstance(hparams, dict):
        return None
    for scope in [hparams, *(v for v in hparams.values() if isinstance(v, dict))]:
        for key in MODEL_KEYS:
            value = scope.get(key)
            if isinstance(value, str) and value and len(value) < 1000:
                return value
    return None


def _local_model(name: str) -> Path | None:
    """A folder holding config.json for `name`: the folder it is, or its snapshot in the Hugging Face
    cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub), the one `refs/main` names."""
    if is_url(name):
        return None
    if (Path(name) / JSON_CONFIG).is_file():
        return Path(name)
    if name.count("/") != 1 or name.startswith((".", "/")):
        return None
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    cache = Path(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))
    repo = cache / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    snapshot = ref.read_text().strip() if ref.is_file() else None
    if not snapshot or name_of(snapshot) != snapshot:
        return None
    folder = repo / "snapshots" / snapshot
    return folder if (folder / JSON_CONFIG).is_file() else None
