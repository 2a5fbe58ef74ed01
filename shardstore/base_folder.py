"""The base model an adapter-only checkpoint is merged onto (`--merge-adapter --base`): a Hugging Face
folder on local disk, or a model in the local Hugging Face cache, read in place, never fetched.

The folder is a model as `save_pretrained` leaves it: config.json, model.safetensors or its shards and
model.safetensors.index.json, tokenizer files. Each safetensors file's header is checked as the readers
check one (read/primitives/safetensors_file.py) and its tensors become `FileTensor`s the export streams;
the files stay open while the export runs (`opened`).
"""

from __future__ import annotations

import os
import re
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from . import jsonin
from .errors import ExportError
from .export.adapters import BaseModel, FileTensor
from .export.contract import ExportRequest
from .export.hf.leaves import CONFIG, model_files, small_file
from .export.safetensors import INDEX, SINGLE
from .read.primitives.safetensors_file import SafetensorsFile

MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # "org/name" on the Hub


def folder(base: str | os.PathLike[str]) -> Path:
    """The folder `base` names: a local folder, else a model id's snapshot in the local Hugging Face cache
    ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub) at the revision its refs/main names."""
    path = Path(base)
    if path.is_dir():
        return path
    text = os.fspath(base)
    if MODEL_ID.match(text):
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
        cached = Path(hub) / f"models--{text.replace('/', '--')}"
        ref = cached / "refs" / "main"
        revision = ref.read_text().strip() if ref.is_file() and ref.stat().st_size < 256 else ""
        if re.fullmatch(r"[0-9a-f]{40}", revision) and (cached / "snapshots" / revision).is_dir():
            return cached / "snapshots" / revision
        raise ExportError(f"--base {text}: not a folder, and not in the local Hugging Face cache ({hub}); "
                          f"shardstore never downloads: `huggingface-cli download {text}` first, or give its folder")
    raise ExportError(f"--base {text}: no such folder (a Hugging Face model's: config.json, model.safetensors)")


@contextmanager
def opened(request: ExportRequest) -> Iterator[ExportRequest]:
    """`request` with its `--base` opened (`ExportRequest.base_model`), its files closed on leaving; the
    request as it is without one."""
    if request.base is None:
        yield request
        return
    where = folder(request.base)
    if not (where / CONFIG).is_file():
        raise ExportError(f"{where}: no config.json; --base takes a Hugging Face model's folder")
    if (where / INDEX).is_file():
        index = jsonin.loads(small_file(where / INDEX), str(where / INDEX), "safetensors index", ExportError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v and v != ".."
                                                       for v in weight_map.values()):
            raise ExportError(f"{where / INDEX}: no weight_map of file names")
        files = sorted(set(weight_map.values()))
    elif (where / SINGLE).is_file():
        files, weight_map = [SINGLE], None
    else:
        raise ExportError(f"{where}: no model.safetensors (or its index); --base reads safetensors weights")
    with ExitStack() as stack:
        tensors: dict[str, FileTensor] = {}
        for name in files:
            sf = stack.enter_context(SafetensorsFile(where / name))
            for key, ref in sf.tensors.items():
                if weight_map is not None and weight_map.get(key) != name:
                    raise ExportError(f"{where / name}: holds {key}, which its index puts in {weight_map.get(key)}")
                tensors[key] = FileTensor(key, ref.dtype, ref.shape, None, sf.storage_offset(key), sf.range)
        if weight_map is not None and set(weight_map) != set(tensors):
            missing = sorted(set(weight_map) - set(tensors))
            raise ExportError(f"{where / INDEX}: names {missing[0] if missing else '?'}, which no file of it holds")
        yield replace(request, base_model=BaseModel(str(where), tensors, model_files(where)))
