"""Accelerate's per-rank FSDP files (`save_state` with `use_dcp=False`, the HF Trainer's too): each rank
`torch.save`s its own shard of each prepared model to `pytorch_model_fsdp_{i}_rank{r}.bin` and of each
optimizer to `optimizer_{i}_rank{r}.bin`, with no cross-rank step (for runs of thousands of ranks). Under
FSDP2 the tensors are DTensors, read by read/formats/dtensor.py as every rank's box; a model file's keys are its
state dict's, an optimizer file's `{"state", "param_groups"}` keyed by parameter name.

One checkpoint: the store's tree is `{"model": ..., "optimizer": ...}` (what accelerate's DCP save nests
under the same names; a second model or optimizer, `_1`, under `model_1`, `optimizer_1`). Planned from
rank 0's file of each part; every other file is checked against its part's (a digest of its keys and
layouts) by the worker that opens it.
"""

from __future__ import annotations

import re
from typing import Any

from ...facts import CheckpointFacts
from ...errors import CheckpointError, closed_on_error
from ...locations import StorageOptions, folder_of, listing, name_of
from ...tree import KeyEncoder, Node
from ..contract import CheckpointSpec, replica_count
from ..unit import FileUnit, planned_place
from .dtensor import File, array_spec, checked_leaves, digest_of, layouts_of, model_mesh, read_file
from .resume import Resume, resume_files

FORMAT = "accelerate"
UNIT_FILE = re.compile(r"(?P<part>pytorch_model_fsdp|optimizer)_(?P<index>[0-9]+)_rank(?P<rank>[0-9]+)\.bin\Z")
PART_KEY = {"pytorch_model_fsdp": "model", "optimizer": "optimizer"}


def _parse(path: str) -> tuple[str, int]:
    """(the part's key in the tree, the rank) a file's name says."""
    m = UNIT_FILE.match(name_of(path))
    if m is None:
        raise CheckpointError(f"{path}: not one of accelerate's per-rank FSDP files "
                              f"(pytorch_model_fsdp_N_rankR.bin, optimizer_N_rankR.bin)")
    index = int(m["index"])
    return PART_KEY[m["part"]] + (f"_{index}" if index else ""), int(m["rank"])


def run_of(unit: str) -> str:
    """The checkpoint folder of a unit file: the folder it is in."""
    return folder_of(unit)


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    return any(UNIT_FILE.match(name_of(p)) for p in listing(folder, storage_options))


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Every part's files, part by part (models first), rank by rank; every part at one world size."""
    found: dict[str, dict[int, str]] = {}
    for path in listing(folder, storage_options):
        if UNIT_FILE.match(name_of(path)):
            part, rank = _parse(path)
            found.setdefault(part, {})[rank] = path
    worlds = {part: max(ranks) + 1 for part, ranks in found.items()}
    for part, ranks in found.items():
        missing = sorted(set(range(max(worlds.values()))) - set(ranks))
        if missing:
            raise CheckpointError(f"{folder}: {part}'s files of ranks {', '.join(map(str, missing[:20]))} are missing "
                                  f"(the other parts have {max(worlds.values())} ranks)")
    order = sorted(found, key=lambda p: (not p.startswith("model"), p))
    return [found[part][r] for part in order for r in sorted(found[part])]


def resume(folder: str, storage_options: StorageOptions | None = None) -> Resume | None:
    """The HF Trainer's or Accelerate's scheduler, RNG and trainer state beside the files."""
    return resume_files(folder, storage_options)


def unit_kind(name: str) -> str:
    return "model files" if name_of(name).startswith("pytorch_model_fsdp") else "optimizer files"


def _read(path: str, world: int, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder) -> File:
    part, rank = _parse(path)
    if rank >= world:
        raise CheckpointError(f"{path}: names rank {rank} of a checkpoint of {world} ranks")
    return read_file(path, part, world, rank, storage_options, strict, encode_key)


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    """From rank 0's file of each part: a DTensor's pickle describes every rank's box."""
    parts = [_parse(p)[0] for p in unit_paths]
    world = parts.count(parts[0])
    firsts = {part: next(i for i, u in enumerate(unit_paths) if _parse(u) == (part, 0)) for part in dict.fromkeys(parts)}
    files = [_read(unit_paths[i], world, storage_options, strict, encode_key) for i in firsts.values()]
    try:
        arrays, objects, digests = {}, [], {}
        for f, base in zip(files, firsts.values()):
            layouts = layouts_of(f)
            mesh = model_mesh(layouts)
            digests[f.kind] = digest_of(f, layouts)
            for path in f.leaves:
                if path in layouts:
                    arrays[path] = array_spec(layouts[path][0], world, mesh, base)
                else:
                    objects.append(path)
        tree = Node("dict", "", [child for f in files for child in f.tree.children])
    finally:
        for f in files:
            f.zip.close()
    names = [name_of(u) for u in unit_paths]
    facts = CheckpointFacts(units=tuple(names), metadata=repr(sorted(digests.items())), replicas=replica_count(arrays),
                            reader={"accelerate": {"world": world, "digests": digests}})
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, facts)


def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> FileUnit:
    """One rank's file of one part, checked against its part's rank 0 file (their keys and layouts)."""
    index, count = planned_place(name_of(path), path, facts, "accelerate", "Accelerate")
    f = _read(path, facts["accelerate"]["world"], storage_options, strict, encode_key)
    unit = FileUnit(path, index, count, index, count, facts["metadata"], {}, f.zip)
    with closed_on_error(unit.close, path):
        unit.leaves.update(checked_leaves(f, facts["accelerate"]["digests"].get(f.kind, ""), f"rank 0's {f.kind} file"))
    return unit
