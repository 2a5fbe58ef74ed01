"""The `Format` of checkpoints that are one folder of unit files in known places (OLMo `local`, OLMo-core
0.1, veRL, DCP's Hugging Face safetensors): each such format is a module with

    detect(folder, storage_options) -> bool      the folder is one such checkpoint
    units(folder, storage_options) -> [path]     every unit file, in order
    spec(folder, units, encode_key, strict, storage_options) -> CheckpointSpec
    open_unit(path, storage_options, strict, encode_key, facts) -> Unit

and optionally `side_files(folder, storage_options)` (files to keep beside exports), `resume(folder,
storage_options)` (a trainer's files to resume from: read/formats/resume.py), `run_of(unit)` (the
checkpoint folder of a unit file: by default two levels up, for units in sub-folders), `UNIT_FOLDERS`
(sub-folders whose path names the checkpoint above them) and `unit_kind(name)`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

from ..errors import CheckpointError
from ..locations import StorageOptions, folder_of, join, name_of, subfolders
from ..tree import KeyEncoder
from .contract import CheckpointSpec, Unit, UnitShare
from .source import Source, config_files


class FolderFormat:
    ranked = False  # every unit is listed by the checkpoint's own metadata or layout
    group_claims, keeps_empty_values = False, True
    any_script, shares_folder = False, False  # a trainer's own files

    def __init__(self, module: ModuleType, title: str):
        self.module, self.name, self.title = module, module.FORMAT, title

    def _run_of(self, unit: str) -> str:
        run_of = getattr(self.module, "run_of", None)
        return run_of(unit) if run_of is not None else folder_of(folder_of(unit))

    def _source(self, run: str, units: list[str], storage_options: StorageOptions | None) -> Source:
        side: list[str] = getattr(self.module, "side_files", lambda folder, options: [])(run, storage_options)
        found = getattr(self.module, "resume", lambda folder, options: None)(run, storage_options)
        return Source(self.name, units, storage_options, config_files(run, storage_options) + side,
                      *((found.trainer, found.files) if found is not None else ()))

    def detect(self, folder: str, storage_options: StorageOptions | None) -> bool:
        return bool(self.module.detect(folder, storage_options))

    def source(self, folder: str, storage_options: StorageOptions | None) -> Source:
        return self._source(folder, self.module.units(folder, storage_options), storage_options)

    def latest(self, folder: str, storage_options: StorageOptions | None) -> str | None:
        return None  # a run folder's latest_checkpointed_iteration.txt is read where step folders are picked

    def unit_folder_of(self, folder: str) -> str | None:
        """The checkpoint folder above `folder` when `folder` is where its units are (veRL's actor/)."""
        return folder_of(folder.rstrip("/\\")) if name_of(folder) in getattr(self.module, "UNIT_FOLDERS", ()) else None

    def of_files(self, files: list[str], storage_options: StorageOptions | None) -> Source | None:
        runs = {self._run_of(f) for f in files}
        if len(runs) != 1 or not self.module.detect(next(iter(runs)), storage_options):
            return None
        return self._source(runs.pop(), files, storage_options)

    def plan(self, source: Source, encode_key: KeyEncoder, strict: bool) -> tuple[CheckpointSpec, Unit | None]:
        run = self._run_of(source.units[0])
        units = self.module.units(run, source.storage_options)  # every unit, whichever were given
        return self.module.spec(run, units, encode_key, strict, source.storage_options), None

    def unit_share(self, path: str, storage_options: StorageOptions | None, facts: dict[str, Any]) -> UnitShare | None:
        """The format's own (`module.unit_share`), where it has one; else each unit reads what it needs itself."""
        own = getattr(self.module, "unit_share", None)
        return None if own is None else cast(UnitShare, own(path, storage_options, facts))

    def open_unit(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
                  facts: dict[str, Any], share: Any = None) -> Unit:
        unit: Unit = self.module.open_unit(path, storage_options, strict, encode_key, facts)
        return unit

    def arrivals(self, folder: str, tag: str | None, looks: Any) -> None:
        """Their units are only known whole against the checkpoint's own metadata or layout, written with
        them: a folder that is, or holds, such a checkpoint (in its unit folder or one level down, as
        `open_source` finds them) is refused, by name, rather than read half-written."""
        up = self.unit_folder_of(folder)
        if self.detect(folder, None) or (up is not None and self.detect(up, None)) or \
                any(self.detect(join(folder, name), None) for name in subfolders(folder, None)):
            raise CheckpointError(f"{folder}: a checkpoint in the {self.title} format; watch takes rank files or "
                                  f"a DCP folder (ingest this one with `shardstore ingest` or `unshard` once it "
                                  f"is complete)")
        return None

    def unit_kind(self, name: str) -> str:
        own = getattr(self.module, "unit_kind", None)
        if own is not None:
            kind: str = own(name)
            return kind
        folder = name.split("/")[0] if "/" in name else ""
        return {"train": "trainer-state files", "model": "model files", "optim": "optimizer files"}.get(folder, "files")
