"""Export: one module per output format, each reading only through the store's API, all streaming."""

from __future__ import annotations

import math
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import dtypes, paths, tempfiles
from ..errors import ExportError, StoreError
from ..hf_files import ADAPTER_FILES
from ..progress import Progress
from ..sink.layout import MOVING
from ..sink.output import output_error, write_side_files
from ..store.onesave import check_one_save
from ..store.store import Status, Store
from ..trainers import registry as trainers
from ..tree import Node, node_at
from . import origin
from .contract import DirectExport, ExportRequest, OutputFormat, Planned
from .hf import NO_HF_DESCRIPTION, check_adapter, has_hf_description
from .notes import flat_buckets
from .registry import FORMATS as _FORMATS
from .resolve import NOT_A_MODEL, leaves, model_node

FORMATS = tuple(_FORMATS)  # the output formats' names (export/registry.py)


@dataclass
class ExportResult:
    files: list[Path]
    skipped: list[str] = field(default_factory=list)  # non-tensor leaves a safetensors file cannot hold
    partial: dict[str, str] | None = None  # set when holes were filled (--allow-partial)
    replaced: list[Path] = field(default_factory=list)  # a previous export's files removed (overwrite)
    notes: list[str] = field(default_factory=list)  # what the user should know about the output
    dtypes: dict[str, tuple[int, int]] = field(default_factory=dict)  # output dtype -> (tensors, elements)
    read: int | None = None  # bytes of the checkpoint's files read (unshard, local files), for the summary


def _dtypes(store: Store, tensors: list[Any]) -> dict[str, tuple[int, int]]:
    """How many tensors and elements of each dtype the output holds: a tensors-only format's own tensors,
    else the store's sharded ones (its small plain tensors aside)."""
    shapes = [(it.dtype, it.shape) for it in tensors] or [(a.dtype, a.shape) for a in store.manifest.arrays.values()]
    counts: dict[str, tuple[int, int]] = {}
    for dtype, shape in shapes:
        n, elements = counts.get(dtype, (0, 0))
        counts[dtype] = (n + 1, elements + math.prod(shape))
    return counts


# Every file name an export of any format writes: what a previous export may have left in OUT (the
# formats' own, and the torch files a trainer resumes from with its own files beside them: trainers/).
_OUTPUT_NAME = re.compile(r"(model(-[0-9]{5}-of-[0-9]{5})?\.safetensors|model\.safetensors\.index\.json"
                          r"|checkpoint\.pt|__[0-9]+_0\.distcp|\.metadata|config\.yaml|config\.json"
                          r"|generation_config\.json|latest_checkpointed_iteration\.txt|release|weights|context"
                          rf"|{trainers.writes()})\Z")

# The tokenizer files a Hugging Face model keeps (transformers' tokenizers' own names), which every export
# of a model copies beside its weights
_TOKENIZER_NAME = re.compile(r"(tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json"
                             r"|vocab\.(json|txt)|merges\.txt|chat_template\.(jinja|json)|.+\.tiktoken)\Z")


def previous_outputs(out: Path, planned: list[str]) -> list[Path]:
    """Files of an earlier export in `out` that this one would not replace (they would be left beside it)."""
    if not out.is_dir():
        return []
    tops = {name.split("/")[0] for name in planned}  # (Megatron's release/.metadata: its folder release/)
    # where OUT holds a shardstore export (its record), the tokenizer's files an export copies beside it are
    # that export's too (a file of any other name is the user's: left alone)
    exported = (out / origin.RECORD).is_file()
    return sorted(p for p in out.iterdir() if (_OUTPUT_NAME.match(p.name) or exported and _TOKENIZER_NAME.match(p.name))
                  and p.name not in tops)


def model_subtree(store: Store) -> str:
    """Where the model weights are, as the store's trainer places them (trainers/), else the root."""
    return trainers.model_subtree(store.manifest.tree, store.manifest.layout)


def _selected(store: Store, select: str | None) -> str | None:
    """`select`, but None (the default: the model) for `model` when the model's keys sit at the top level
    beside its trainer's parts (torchtitan's) and no key is called `model`."""
    if select is not None and select.strip("/") == "model" and not model_subtree(store):
        return None
    return select


def _subtree(store: Store, select: str | None) -> str:
    """The store path of what an export of tensors takes (`_model_or`'s node's)."""
    selected = _selected(store, select)
    return model_subtree(store) if selected is None else selected


def _model_or(store: Store, select: str | None) -> Node:
    """The node an export of tensors takes: `select`'s, or by default the model's (`model_node`)."""
    select = _selected(store, select)
    return node_at(store.manifest.tree, select) if select is not None \
        else model_node(store.manifest.tree, model_subtree(store))


def _scoped(status: Status, node: Node) -> Status:
    """The status of just the tensors below `node`: missing ranks matter only if they hold values there."""
    inside = {path for _, path in leaves(node)}
    partial = {p: f for p, f in status.partial.items() if p in inside}
    values_inside = any(p not in status.complete and p not in status.partial for p in inside)
    missing = status.ranks_missing if values_inside else []
    return Status(status.world_size, status.ranks_done, missing, [p for p in status.complete if p in inside], partial)


def check_request(out_dir: str | os.PathLike[str], request: ExportRequest, scheduler: str | None = None) -> Path:
    """Everything about an export that can be refused without the store: `unshard` asks this before it
    ingests anything, so a mistyped option costs nothing."""
    fmt = request.output
    if request.hf_config is not None and not fmt.describes_model:
        raise ExportError(f"--hf-config applies to --format {_those(lambda f: f.describes_model)} only")
    if request.hf_config is not None and not Path(request.hf_config).exists():
        raise ExportError(f"{request.hf_config}: no such config file or folder (--hf-config)")
    if request.single_file and not fmt.single_file:
        raise ExportError(f"--single-file applies to --format {_those(lambda f: f.single_file)} only")
    if scheduler and not fmt.takes_scheduler:
        raise ExportError(f"--scheduler exports {_those(lambda f: f.takes_scheduler)} only, not {fmt.name}")
    if request.adapter and not fmt.writes_adapter:
        raise ExportError(f"--adapter applies to --format {_those(lambda f: f.writes_adapter)} only")
    if request.merge_adapter and fmt.merged is None:
        raise ExportError(f"--merge-adapter writes a model: --format {_those(lambda f: f.merged is not None)}"
                          + ("" if fmt.subtree else f" (--format {fmt.name} writes the checkpoint as its trainer saved it)"))
    if not fmt.subtree and (request.select or request.strip_prefix or request.dtype):
        raise ExportError(f"--select, --strip-prefix and --dtype apply to {_those(lambda f: f.subtree)} output only")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ExportError(f"{out}: a part of the path is a file ({above})")
    return out


def _those(which: Callable[[OutputFormat], bool]) -> str:
    return " and ".join(name for name, f in _FORMATS.items() if which(f))


def output_bytes(store: Store, request: ExportRequest) -> int:
    """About how many bytes the export will write: its sharded tensors (small values aside)."""
    if not request.output.subtree:
        return sum(a.nbytes for a in store.manifest.arrays.values())
    inside = {path for _, path in leaves(_model_or(store, request.select))}
    dtype = request.dtype
    total = 0
    for path, entry in store.manifest.arrays.items():
        if path in inside:
            cast = dtype if dtype and entry.dtype in dtypes.CASTABLE else entry.dtype
            total += entry.nbytes // dtypes.info(entry.dtype).itemsize * dtypes.info(cast).itemsize
    return total


def preflight(store: Store, out_dir: str | os.PathLike[str], request: ExportRequest) -> None:
    """What an export of `store` can be refused for from its plan alone, before any rank is ingested
    (`unshard` asks this once the store is planned, so a mistake costs no ingest): a subtree that is not
    there, a Hugging Face export with nothing to describe the model, and an earlier export of another
    format in OUT. `export` checks the rest, exactly, once the data is in."""
    out, select, hf_config, fmt = Path(out_dir), request.select, request.hf_config, request.output
    if fmt.subtree:
        _model_or(store, select)
    if fmt.describes_model and _selected(store, select) is None:
        parts = [child.path for _, child in store.manifest.tree.children]
        if parts and set(parts) <= {paths.escape(n) for n in NOT_A_MODEL}:  # an optimizer's checkpoint of its own (optimizer_0/)
            raise ExportError(f"the checkpoint holds no model weights, only {', '.join(parts)}; give the model's "
                              f"checkpoint (pytorch_model_fsdp_0/ beside it), or --format torch/safetensors")
    if request.adapter or request.merge_adapter:
        check_adapter(store, _subtree(store, select), request)
    if fmt.describes_model and hf_config is None and not request.adapter and request.base is None \
            and not has_hf_description(store):
        raise ExportError(NO_HF_DESCRIPTION)
    if request.overwrite:
        return
    side = set(_beside(store, fmt))
    may_write = fmt.may_write
    # a format that may write any name knows its exact files from the plan alone
    exact = fmt.planner(request)(store, request, store.manifest.tree, "", 1).files if may_write is None else []
    stale = [p for p in previous_outputs(out, exact + list(side))
             if may_write is None or not re.fullmatch(may_write, p.name)]
    if stale:
        raise ExportError(_stale_message(out, stale))


def _beside(store: Store, fmt: OutputFormat) -> dict[str, str]:
    """The files an export writes beside its output: the run's config (all but folders that write their
    own) and the trainer's files to resume from (where the format writes what the trainer resumes from)."""
    facts = store.manifest.facts
    config = {n: data for n, data in facts.side_files.items() if n not in ADAPTER_FILES} if fmt.config_beside else {}
    return {**config, **(facts.resume_files if fmt.resume_beside else {})}


def _earlier_export(out: Path, planned: list[str], overwrite: bool) -> list[Path]:
    """The files of an earlier export in `out` that this one would not replace: refused, unless
    `overwrite` (they are then removed once the new export is whole)."""
    stale = previous_outputs(out, planned)
    if stale and not overwrite:
        raise ExportError(_stale_message(out, stale))
    return stale


def check_origin(out_dir: str | os.PathLike[str], identities: origin.Identities, overwrite: bool) -> None:
    """Refuse an export into an OUT holding files of an export of another checkpoint (export/origin.py),
    unless `overwrite`; `identities` gives this checkpoint's unit files' content identities by name."""
    if not overwrite and previous_outputs(Path(out_dir), []):
        origin.check(Path(out_dir), identities)


def _stale_message(out: Path, stale: list[Path]) -> str:
    names = ", ".join(p.name for p in stale[:6]) + (" ..." if len(stale) > 6 else "")
    return (f"{out}: holds files of an earlier export that this one would not replace ({names}); "
            f"use --overwrite to replace that export, or another folder")


def export(store: Store, out_dir: str | os.PathLike[str], request: ExportRequest, progress: Progress | None = None,
           scheduler: str | None = None, jobs: int = 1) -> ExportResult:
    """Write the unsharded checkpoint from `store` into `out_dir` (see docs/commands.md for the formats).

    An incomplete store is refused unless `request.allow_partial`: then missing pieces are holes (NaN, or
    zero for integer dtypes) and the output's metadata says which ranks and tensors were missing. With
    `scheduler`, each safetensors file is written by one Dask task. Files of an earlier export that this
    one would not replace are refused (they would be mistaken for part of it) unless `request.overwrite`,
    which removes them once this export is complete; files no export writes are never touched.
    `progress` hears the tensor bytes to write once the export is planned, and each file's as it goes.
    """
    out = check_request(out_dir, request, scheduler)
    fmt, select, overwrite = request.output, request.select, request.overwrite
    full = status = store.status()
    check_one_save(store.records(refresh=False))  # units that raced each other to commit
    node = _model_or(store, select) if fmt.subtree else store.manifest.tree
    if fmt.subtree:  # only the exported subtree has to be complete
        status = _scoped(full, node)
    partial = None
    if not status.ok and request.allow_partial:
        if not status.ranks_done:
            raise StoreError(f"{store.location}: no rank has been ingested; nothing to export")
        partial = {"shardstore_partial": "true",
                   "shardstore_missing_ranks": ",".join(map(str, full.ranks_missing)),
                   "shardstore_incomplete_tensors": ",".join(sorted(status.partial))}
    elif not status.ok:
        missing = ", ".join(map(str, full.ranks_missing[:20])) + (" ..." if len(full.ranks_missing) > 20 else "")
        raise StoreError(f"{store.location}: incomplete store, cannot export; ranks missing: {missing or 'none'}"
                         f"; tensors incomplete: {len(status.partial)}")
    planned = fmt.planner(request)(store, request, node, _subtree(store, select) if fmt.subtree else "", jobs)
    side_files = _beside(store, fmt)
    stale = _earlier_export(out, planned.files + list(side_files), overwrite)
    with _writing_into(out, stale, store, overwrite):
        if progress is not None:
            progress.start("export", planned.nbytes)
        files, skipped, notes = planned.write(out, progress.advance if progress is not None else None, partial,
                                              scheduler, jobs)
        if progress is not None:
            progress.end()
        result = ExportResult(files + write_side_files(side_files, out), skipped, partial, notes=notes,
                              dtypes=_dtypes(store, planned.tensors))
    result.replaced = stale
    return result


def planned(store: Store, request: ExportRequest) -> Planned:
    """What an export of `request` from `store` would write, planned and not written (see `verify`)."""
    fmt = request.output
    node = _model_or(store, request.select) if fmt.subtree else store.manifest.tree
    return fmt.planner(request)(store, request, node, _subtree(store, request.select) if fmt.subtree else "", 1)


@contextmanager
def _writing_into(out: Path, stale: list[Path], store: Store, overwrite: bool) -> Iterator[None]:
    """OUT, unless it holds an export of another checkpoint (export/origin.py; `overwrite` replaces it),
    made, swept of what a killed export left behind, and recording which checkpoint it is getting the
    export of until a failure leaves none of an export's files there; an earlier export's files removed
    only once the new one is whole; an OSError the folder causes (a full disk) turned into one line."""
    units = origin.of_store(store)
    check_origin(out, lambda names: units, overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfiles.sweep(out, recursive=False)
        origin.write(out, units)
        try:
            yield
        except BaseException:
            if not previous_outputs(out, []):
                (out / origin.RECORD).unlink(missing_ok=True)
            raise
        for path in stale:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    except OSError as exc:
        error = output_error(out, exc)
        if error is None:
            raise
        raise error from None


def plan_direct(store: Store, request: ExportRequest, jobs: int = 1) -> DirectExport | None:
    """The export laid out from the plan alone and its files prepared, for the ingest to write straight
    into; None where it cannot be (each format's `plan_direct`), and the store then feeds the export as usual."""
    if store.manifest.facts.replicas > 1 and not store.manifest.facts.group_claims or request.merge_adapter:
        return None  # (a merged weight is computed from the store)
    fmt = request.output
    node = _model_or(store, request.select) if fmt.subtree else store.manifest.tree
    subtree = _subtree(store, request.select) if fmt.subtree else ""
    direct: DirectExport | None = fmt.direct(store, request, node, subtree, jobs)
    return direct


def finish_direct(store: Store, out_dir: str | os.PathLike[str], planned: DirectExport,
                  request: ExportRequest) -> ExportResult:
    """Once every unit is in: the export sealed, its files renamed into OUT, the files beside them
    written, and an earlier export's files removed (`overwrite`)."""
    out = Path(out_dir)
    done = [rec for rec in store.records().values() if rec.direct == planned.layout.digest]
    if len(done) != store.manifest.world_size:
        raise StoreError(f"{store.location}: {len(done)} of {store.manifest.world_size} units are in; cannot finish")
    check_one_save(store.records(refresh=False))  # units that raced each other to commit
    fmt, overwrite = request.output, request.overwrite
    side_files = _beside(store, fmt)
    stale = _earlier_export(out, planned.files + list(side_files), overwrite)
    with _writing_into(out, stale, store, overwrite):
        files = []
        folder = Path(planned.layout.folder)
        moving = folder / MOVING  # a rerun after a crash mid-way knows which files moved already
        moved_before = moving.exists()
        if not moved_before:
            planned.seal(store)
            moving.touch()
        for name in planned.layout.names:
            if not (moved_before and not (folder / name).exists() and (out / name).exists()):
                (out / name).parent.mkdir(parents=True, exist_ok=True)  # (Megatron's release/__0_0.distcp)
                os.replace(folder / name, out / name)
            files.append(out / name)
        files += planned.finish(store, out) + write_side_files(side_files, out)
    return ExportResult(files, planned.skipped, replaced=stale,
                        notes=planned.notes + (flat_buckets(store.manifest.arrays) if not fmt.subtree else []),
                        dtypes=_dtypes(store, planned.tensors))
