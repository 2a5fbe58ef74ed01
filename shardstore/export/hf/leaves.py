"""A checkpoint's model as the Hugging Face export sees it: its leaves by output-ready name, their shapes,
and the side files its reader kept (a config, a tokenizer)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Callable

from ...errors import ExportError
from ...hf_files import describes_model
from ...store.store import Store
from ...trainers.registry import trainer
from ...tree import Node
from ..resolve import build, leaves, model_node

CONFIG, GENERATION = "config.json", "generation_config.json"
# The trainers' own files beside a model's (kept beside other exports, not in a Hugging Face folder).
NOT_HF_FILES = ("fsdp_config.json", "config.yaml")
MAX_CONFIG_FILE = 64 << 20  # tokenizer.json of large vocabularies is tens of MB


def small_file(path: Path) -> bytes:
    """A config, index or tokenizer file of a Hugging Face folder, refused in one line where it is larger
    than such a file is."""
    if path.stat().st_size > MAX_CONFIG_FILE:
        raise ExportError(f"{path}: {path.stat().st_size} bytes; not a config, index or tokenizer file")
    return path.read_bytes()


def model_files(folder: Path, but: str = "") -> dict[str, bytes]:
    """A Hugging Face folder's files that describe its model (config, generation config, tokenizer), by
    name, but `but`."""
    return {p.name: small_file(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != but and describes_model(p.name)}


def side_config(store: Store, name: str) -> bytes | None:
    data = store.manifest.facts.side_files.get(name)
    return None if data is None else base64.b64decode(data)


def model_leaves(store: Store, subtree: str, strip_prefix: str | None,
                  rename: Callable[[str], str] = lambda n: n) -> dict[str, str]:
    """Output-ready name -> store path for every leaf of the model subtree."""
    out: dict[str, str] = {}
    for keys, path in leaves(model_node(store.manifest.tree, subtree)):
        name = ".".join(str(k) for k in keys)
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix):]
        name = rename(name)
        if name in out:
            raise ExportError(f"two tensors would both be named {name!r}")
        out[name] = path
    return out


def shape(store: Store, path: str) -> tuple[int, ...] | None:
    entry = store.manifest.arrays.get(path)
    if entry is not None:
        return entry.shape
    if path in store.manifest.facts.not_tensors:
        return None
    value = build(store, leaf(path))
    return tuple(value.shape) if hasattr(value, "shape") else None


def leaf(path: str) -> Node:
    return Node("leaf", path)


def module_attribute(store: Store, subtree: str) -> str | None:
    """`model.` when every name of the model starts so, in a checkpoint of a trainer whose module holds
    the transformers model as an attribute (a LightningModule's `self.model = AutoModelForCausalLM...`);
    None for the other trainers' checkpoints."""
    if not trainer(store.manifest.layout).module_prefix:
        return None
    names = list(model_leaves(store, subtree, None))
    firsts = {name.split(".", 1)[0] for name in names}
    return f"{firsts.pop()}." if len(firsts) == 1 and all("." in n for n in names) else None
