"""The read contract: what every checkpoint format gives the rest of shardstore.

A checkpoint is read in two halves.
- The coordinator asks a `Source` for the checkpoint's `CheckpointSpec`: the key tree, every sharded
  array's global shape, dtype and shard boxes (and which unit holds each), which leaves are plain values.
  That is all the planner needs to lay out the store.
- Each worker opens one unit of work (`open_unit`: one rank file, one .distcp file) and gets its leaves:
  `ShardedLeaf`s whose `LocalPiece`s say where each box's bytes are (a zip, a tensor view of it), and
  plain values. Units expose `path`, `rank` (their number in the checkpoint), `world_size`,
  `group_rank`, `group_size`, `leaves`, `size`, `value_zip(path)` and `close()`.
Nothing here knows about Zarr; nothing above knows about pickles or file formats. A new format is a new
module in read/ and one line in `_OPENERS` and `open_source`.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError, closed_on_error
from ..locations import StorageOptions, filesystem, is_url, local

# A tensor at or below this size held whole by one unit is kept as a value, like a rank file's plain
# tensors (an optimizer's step, a scale); anything larger, or split across units, gets an array.
SMALL_TENSOR_BYTES = 64 << 10


@dataclass
class Node:
    """One node of a state dict's key tree. A container (`kind` dict, odict, list or tuple) lists its
    children in order, each under its real key as typed JSON (values.encode); a leaf has none. `path` is
    the node's store path. The tree is what the store keeps to rebuild the exact nesting."""

    kind: str
    path: str
    children: list[tuple[Any, "Node"]] = field(default_factory=list)

    def leaf_paths(self) -> list[str]:
        """Store paths of every leaf below, in state-dict order."""
        if self.kind == "leaf":
            return [self.path]
        return [p for _, child in self.children for p in child.leaf_paths()]

    def to_json(self) -> dict[str, Any]:
        if self.kind == "leaf":
            return {"t": "leaf", "p": self.path}
        return {"t": self.kind, "p": self.path, "c": [[key, child.to_json()] for key, child in self.children]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Node":
        return cls(d["t"], d["p"], [(key, cls.from_json(child)) for key, child in d.get("c", ())])


Skeleton = Node


@dataclass
class CheckpointSpec:
    """A checkpoint as the planner sees it, whatever its format."""

    format: str  # "torch-save" (per-rank ShardedTensor files) or "dcp"
    world_size: int  # units of work: ranks, or .distcp files
    group_size: int  # units per replica group (hybrid sharding); the world size otherwise
    tree: Skeleton
    arrays: dict[str, Any]  # store path -> ShardedSpec (dtype, shape, shard boxes with their holders)
    replicated: dict[str, Any]  # store path -> a plain tensor every unit holds whole (world size 1)
    objects: list[str]  # store paths of every other leaf
    extra: dict[str, Any] = field(default_factory=dict)  # format facts the store keeps (DCP: its files)


@dataclass
class Source:
    """One checkpoint: its format and its units of work, in order."""

    format: str
    units: list[str]
    storage_options: StorageOptions | None = None
    side_files: list[str] = field(default_factory=list)  # the run's config.yaml: copied beside the export

    @property
    def folder(self) -> str:
        """The folder every file of the checkpoint is in: where it was found."""
        return "/".join(os.path.commonprefix([u.split("/")[:-1] for u in self.units]))

    def spec(self, encode_key: Any, strict: bool = False) -> CheckpointSpec:
        spec, unit = self.plan(encode_key, strict)
        if unit is not None:
            unit.close()
        return spec

    def plan(self, encode_key: Any, strict: bool = False) -> tuple[CheckpointSpec, Any | None]:
        """The spec, and the unit planning had to open whole to make it (rank 0 of per-rank files), left
        open for the caller, who owns it: ingesting it from there reads that file once, not twice."""
        spec, unit = self._spec(encode_key, strict)
        if self.side_files:
            spec.extra["side_files"] = {_name(f): _side_file(f, self.storage_options) for f in self.side_files}
        return spec, unit

    def _spec(self, encode_key: Any, strict: bool) -> tuple[CheckpointSpec, Any | None]:
        if self.format == "dcp":
            from . import dcp

            trainer = [u for u in self.units if u.endswith(".pt")]
            return dcp.spec(dcp.read_checkpoint(_folder(self.units[0]), self.storage_options), encode_key, trainer,
                            strict, self.storage_options), None
        if self.format in FOLDER_FORMATS:
            module = FOLDER_FORMATS[self.format]()
            run = run_of(module, self.units[0])
            return module.spec(run, module.units(run, self.storage_options), encode_key, strict,
                               self.storage_options), None
        from .rankfile import read_rank_file, spec_of

        rf = read_rank_file(self.units[0], encode_key=encode_key, storage_options=self.storage_options,
                            strict=strict, digests=True)
        with closed_on_error(rf.close, rf.path):
            return spec_of(rf), rf


MAX_SIDE_FILE = 1 << 20


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def _side_file(path: str, storage_options: StorageOptions | None) -> str:
    """A small file of the run (config.yaml), base64, for the manifest: exports write it back unchanged."""
    from .container import read_small

    return base64.b64encode(read_small(path, storage_options, MAX_SIDE_FILE, "a run's config")).decode()


def _olmo_local() -> Any:
    from . import olmo_local

    return olmo_local


def _olmo_core() -> Any:
    from . import olmo_core

    return olmo_core


def _dtensor() -> Any:
    from . import dtensor

    return dtensor


def _dcp_hf() -> Any:
    from . import dcp_hf

    return dcp_hf


def run_of(module: Any, unit: str) -> str:
    """The checkpoint folder a unit file of a folder format lies in: one level up for formats whose
    files are the folder's own, else two (model/rank0.pt, actor/model_..._rank_0.pt)."""
    return getattr(module, "run_of", lambda path: _folder(_folder(path)))(unit)


# Formats whose units live in sub-folders (model/, optim/, train/, actor/) of one checkpoint folder.
FOLDER_FORMATS: dict[str, Callable[[], Any]] = {"olmo-local": _olmo_local, "olmo-core": _olmo_core,
                                                "dtensor": _dtensor, "dcp-hf": _dcp_hf}


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def _open_rank_file(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any,
                    facts: dict[str, Any]) -> Any:
    from .rankfile import read_rank_file

    return read_rank_file(path, encode_key=encode_key, storage_options=storage_options, strict=strict,
                          planned=facts.get("skim"))


def _open_distcp(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any,
                 facts: dict[str, Any]) -> Any:
    from . import dcp

    if path.endswith(".pt"):  # OLMo's train/rank<N>.pt beside model_and_optim/
        return dcp.open_trainer_unit(path, storage_options, strict, encode_key)
    return dcp.open_unit(path, storage_options, strict)


def _open_in_folder(format: str) -> Callable[..., Any]:
    def opener(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any,
               facts: dict[str, Any]) -> Any:
        return FOLDER_FORMATS[format]().open_unit(path, storage_options, strict, encode_key, facts)

    return opener


_OPENERS: dict[str, Callable[..., Any]] = {"torch-save": _open_rank_file, "dcp": _open_distcp,
                                           **{f: _open_in_folder(f) for f in FOLDER_FORMATS}}


def open_unit(format: str, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: Any,
              facts: dict[str, Any] | None = None) -> Any:
    """Open one unit of work of a checkpoint of `format` (in a worker). `facts` are what the store kept
    of the checkpoint when it was planned (the manifest's extra), for formats whose units need them."""
    return _OPENERS[format](path, storage_options, strict, encode_key, facts or {})


def dcp_folder(src: str | os.PathLike[str], tag: str | None, step: int | None,
               storage_options: StorageOptions | None) -> str | None:
    """The DCP checkpoint folder `src` is, or holds (OLMo's model_and_optim/, Composer's ep*-ba*/ and its
    latest-rank0.pt link, step*/), or None when `src` holds no DCP checkpoint."""
    from .dcp import has_metadata

    src = os.fspath(src)
    if has_metadata(src, storage_options):
        return src
    join = (lambda a, b: f"{a.rstrip('/')}/{b}") if is_url(src) else os.path.join
    if has_metadata(join(src, "model_and_optim"), storage_options):
        return join(src, "model_and_optim")
    if is_url(src):
        fs, base = filesystem(src, storage_options)
        found = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)
                 if fs.isdir(p) and fs.exists(f"{p.rstrip('/')}/.metadata")]
    else:
        root = Path(local(src))
        if not root.is_dir():
            return None
        if tag in (None, "latest") and (root / "latest-rank0.pt").is_dir():  # Composer's link to the newest
            return str((root / "latest-rank0.pt").resolve())
        found = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / ".metadata").is_file())
        found += sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "model_and_optim" / ".metadata").is_file())
    if not found:
        return None
    there = found
    if tag not in (None, "latest"):
        found = [f for f in found if f == tag]
    if step is not None:
        found = [f for f in found if f.endswith((f"ba{step}", f"step{step}"))]
    if len(found) != 1:
        if not found:
            raise CheckpointError(f"{src}: no DCP checkpoint matches {'--tag ' + tag if tag else f'--step {step}'}; "
                                  f"it holds {', '.join(there)}")
        raise CheckpointError(f"{src}: holds more than one checkpoint ({', '.join(found)}); pick one with --tag or --step")
    folder = join(src, found[0])
    return folder if has_metadata(folder, storage_options) else join(folder, "model_and_optim")


def open_source(src: str | os.PathLike[str], tag: str | None = None, step: int | None = None,
                storage_options: StorageOptions | None = None) -> Source:
    """The checkpoint in folder `src`, whichever format it is in."""
    from .layouts import discover

    src = os.fspath(src)
    join = (lambda a, b: f"{a.rstrip('/')}/{b}") if is_url(src) else os.path.join
    folder = dcp_folder(src, tag, step, storage_options)
    if folder is not None:
        from .dcp import read_checkpoint, trainer_files

        files = read_checkpoint(folder, storage_options).files
        run = _folder(folder) if _name(folder) == "model_and_optim" else folder
        return Source("dcp", [join(folder, f) for f in files] + trainer_files(folder, storage_options), storage_options,
                      _config(run, storage_options) + _config(run, storage_options, JSON_CONFIG))
    found = _folder_checkpoint(src, tag, step, storage_options)
    if found is not None:
        format, run = found
        module = FOLDER_FORMATS[format]()
        side = getattr(module, "side_files", lambda run, storage_options: [])(run, storage_options)
        return Source(format, module.units(run, storage_options), storage_options,
                      _config(run, storage_options) + side)
    files = [os.fspath(f) for f in discover(src, tag, step, storage_options)]
    return Source("torch-save", files, storage_options, _config(_folder(files[0]), storage_options))


def _folder_checkpoint(src: str, tag: str | None, step: int | None,
                       storage_options: StorageOptions | None) -> tuple[str, str] | None:
    """(format, folder) when `src` is an OLMo `local` / OLMo-core checkpoint, or a run folder holding such
    checkpoints one level down (step1000/, step2000/: pick one with --tag or --step)."""
    parent = _folder(src.rstrip("/\\"))
    for format, module in FOLDER_FORMATS.items():
        if module().detect(src, storage_options):
            return format, src
        if _name(src.rstrip("/\\")) in getattr(module(), "UNIT_FOLDERS", ()) and module().detect(parent, storage_options):
            return format, parent  # given the sub-folder its files are in (veRL's actor/)
    if is_url(src) or not os.path.isdir(local(src)):
        return None
    below = [(format, os.path.join(src, name)) for name in sorted(os.listdir(local(src)))
             if os.path.isdir(os.path.join(local(src), name))
             for format, module in FOLDER_FORMATS.items() if module().detect(os.path.join(src, name), storage_options)]
    if not below:
        return None
    there = ", ".join(os.path.basename(b[1]) for b in below)
    if tag in (None, "latest") and step is None and len(below) > 1:
        step = _latest_step(src)
    if tag not in (None, "latest"):
        below = [b for b in below if os.path.basename(b[1]) == tag]
    if step is not None:
        below = [b for b in below if re.search(rf"(?:^|[-_])step_?0*{step}$", os.path.basename(b[1]))]
    if len(below) != 1:
        names = ", ".join(os.path.basename(b[1]) for b in below)
        if not below:
            raise CheckpointError(f"{src}: no checkpoint matches {'--tag ' + tag if tag else f'--step {step}'}; "
                                  f"it holds {there}")
        raise CheckpointError(f"{src}: holds more than one checkpoint ({names}); pick one with --tag or --step")
    return below[0]


LATEST = "latest_checkpointed_iteration.txt"  # veRL's (and Megatron's) pointer to the newest step


def _latest_step(run: str) -> int | None:
    """The step a run folder's latest_checkpointed_iteration.txt names, if it has one."""
    path = os.path.join(local(run), LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path, "rb").read(64).strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: names no step ({text[:20]!r}); pick a checkpoint with --tag or --step")
    return int(text)


CONFIG = "config.yaml"


JSON_CONFIG = "config.json"  # OLMo-core's experiment config in each checkpoint; the HF Trainer's model config


def _config(folder: str, storage_options: StorageOptions | None, name: str = CONFIG) -> list[str]:
    """The run's config.yaml (or `name`) in the checkpoint folder, if there is one (OLMo's unsharder
    copies config.yaml; OLMo-core's trainer writes config.json into every checkpoint)."""
    from .trainer import join, listing

    path = join(folder, name)
    return [path] if path in listing(folder, storage_options) else []


def source_of_files(files: list[str | os.PathLike[str]], storage_options: StorageOptions | None = None) -> Source:
    """The checkpoint some of whose unit files are given (`shardstore ingest STORE FILE...`)."""
    names = [os.fspath(f) for f in files]
    if len(names) == 1 and not names[0].endswith((".pt", ".distcp", ".safetensors")) \
            and (is_url(names[0]) or os.path.isdir(names[0])):
        return open_source(names[0], storage_options=storage_options)  # a checkpoint folder
    for format, module in FOLDER_FORMATS.items():
        runs = {run_of(module(), n) for n in names}
        if len(runs) == 1 and module().detect(next(iter(runs)), storage_options):
            run = runs.pop()
            return Source(format, names, storage_options, _config(run, storage_options))
    if names and all(n.endswith(".distcp") for n in names):
        return Source("dcp", names, storage_options)
    if any(n.endswith(".distcp") for n in names):
        raise CheckpointError("give .distcp files of one DCP checkpoint, or rank files, not both")
    return Source("torch-save", names, storage_options)
