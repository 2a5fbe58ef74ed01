"""Which format a checkpoint is in, and its spec: everything that asks the registry's formats in turn.

The formats know nothing of one another; here each is asked, in the registry's order, whether a folder
(`open_source`), some named files (`source_of_files`) or an arriving checkpoint (`arriving`) is its own.
Then the one found plans the checkpoint (`plan`), and in a worker opens one of its units (`open_unit`).
"""

from __future__ import annotations

import base64
import os
from dataclasses import replace
from typing import Any

from ..errors import CheckpointError
from ..locations import StorageOptions, is_url, join, listing, name_of, subfolders
from ..tree import KeyEncoder
from .arrival import Arrived, Looks
from .contract import CheckpointSpec, Format, Unit, UnitShare
from .layouts import name_rank
from .primitives.container import forget_parsed, read_small
from .registry import fallback, folder_formats, formats, get
from .source import MAX_SIDE_FILE, Source, pick


def plan(source: Source, encode_key: KeyEncoder, strict: bool = False) -> tuple[CheckpointSpec, Unit | None]:
    """The spec, and the unit planning had to open whole to make it (rank 0 of per-rank files), left
    open for the caller, who owns it: ingesting it from there reads that file once, not twice."""
    fmt = get(source.format)
    spec, unit = fmt.plan(source, encode_key, strict)
    spec.facts = replace(spec.facts, ranked=fmt.ranked, group_claims=fmt.group_claims,
                         keeps_empty_values=fmt.keeps_empty_values)
    spec.facts = replace(spec.facts, **beside(source))
    return spec, unit


def spec_of(source: Source, encode_key: KeyEncoder, strict: bool = False) -> CheckpointSpec:
    """The spec alone (the unit planning opened, closed)."""
    spec, unit = plan(source, encode_key, strict)
    if unit is not None:
        unit.close()
    return spec


def beside(source: Source) -> dict[str, Any]:
    """What the store keeps of the files beside the checkpoint's units (the facts `side_files`, `trainer`,
    `resume_files`), which its exports write back."""
    kept: dict[str, Any] = {}
    if source.side_files:
        kept["side_files"] = {name_of(f): _side_file(f, source.storage_options) for f in source.side_files}
    if source.trainer is not None:
        kept.update(trainer=source.trainer, resume_files={name: _side_file(f, source.storage_options)
                                                          for name, f in source.resume_files.items()})
    return kept


def _side_file(path: str, storage_options: StorageOptions | None) -> str:
    """A small file of the run (config.yaml), base64, for the manifest: exports write it back unchanged."""
    return base64.b64encode(read_small(path, storage_options, MAX_SIDE_FILE, "a run's config")).decode()


def open_source(src: str | os.PathLike[str], tag: str | None = None, step: int | None = None,
                storage_options: StorageOptions | None = None) -> Source:
    """The checkpoint in folder `src`, whichever format it is in: `src` itself, the newest one its own
    pointer names, or one of its sub-folders (a run folder of step folders: `--tag` or `--step` picks
    one, and two are never mixed, whatever their formats); else rank files (read/formats/rankfile.py)."""
    src = os.fspath(src)
    forget_parsed()
    for fmt in folder_formats():
        if fmt.detect(src, storage_options):
            _one_checkpoint(src, fmt.title, storage_options)
            return fmt.source(src, storage_options)
    for fmt in folder_formats():
        up = getattr(fmt, "unit_folder_of", lambda folder: None)(src)
        if up is not None and fmt.detect(up, storage_options):
            return fmt.source(up, storage_options)  # given the sub-folder its files are in (veRL's actor/)
    if tag in (None, "latest") and step is None:
        for fmt in folder_formats():
            newest = fmt.latest(src, storage_options)
            if newest is not None:
                return fmt.source(newest, storage_options)
    below: dict[str, Format] = {}
    for name in subfolders(src, storage_options):
        sub = join(src, name)
        found = next((f for f in folder_formats() if f.detect(sub, storage_options)), None)
        if found is not None:
            below[name] = found
    if below:
        name = pick(src, list(below), tag, step, storage_options)
        return below[name].source(join(src, name), storage_options)
    return fallback().find(src, tag, step, storage_options)


def _one_checkpoint(src: str, title: str, storage_options: StorageOptions | None) -> None:
    """Refuse a folder that holds a checkpoint in a folder format beside rank files of another: an export
    written into the checkpoint's own folder (a model.safetensors, a DCP .metadata) would otherwise be
    taken for the checkpoint the next time, in place of the rank files."""

    ranked = sorted(name_of(p) for p in listing(src, storage_options) if name_rank(name_of(p)) is not None)
    if ranked:
        raise CheckpointError(f"{src}: holds two checkpoints, {title} files and rank files ({ranked[0]}"
                              f"{' ...' if len(ranked) > 1 else ''}); move one of them out (an export written "
                              f"into the checkpoint's own folder?)")


def source_of_files(files: list[str | os.PathLike[str]], storage_options: StorageOptions | None = None) -> Source:
    """The checkpoint some of whose unit files are given (`shardstore ingest STORE FILE...`), or the one in
    the folder given alone."""

    names = [os.fspath(f) for f in files]
    forget_parsed()
    if len(names) == 1 and not names[0].endswith((".pt", ".distcp", ".safetensors")) \
            and (is_url(names[0]) or os.path.isdir(names[0])):
        return open_source(names[0], storage_options=storage_options)
    for fmt in formats():
        found = fmt.of_files(names, storage_options)
        if found is not None:
            return found
    raise CheckpointError(f"{names[0] if names else 'no files'}: not the unit files of a checkpoint shardstore reads")


def open_unit(format: str, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any] | None = None, share: Any = None) -> Unit:
    """Open one unit of work of a checkpoint of `format` (in a worker). `facts` are what the store kept
    of the checkpoint when it was planned (the manifest's extra); `share`, its `unit_share`."""
    return get(format).open_unit(path, storage_options, strict, encode_key, facts or {}, share)


def unit_shares(format: str, paths: list[str], storage_options: StorageOptions | None,
                facts: dict[str, Any]) -> dict[str, UnitShare]:
    """Each unit's share of what planning parsed (`Format.unit_share`), where its format has one."""
    fmt = get(format)
    shares = {path: fmt.unit_share(path, storage_options, facts) for path in paths}
    return {path: share for path, share in shares.items() if share is not None}


def arriving(folder: str, tag: str | None, looks: Looks) -> Arrived:
    """The checkpoint arriving in `folder`: the first format, in the registry's order, that says so (rank
    files, the fallback, take any folder)."""
    for fmt in formats():
        found = fmt.arrivals(folder, tag, looks)
        if found is not None:
            return found
    raise AssertionError("the fallback format takes any folder")
