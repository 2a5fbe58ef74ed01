"""The Python API: the four things a user does. The CLI is a thin layer over exactly these."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from . import export as _export
from . import ingest as _ingest
from .average import average
from .errors import CheckpointError, ExportError, ShardstoreError
from .locations import StorageOptions, is_url, name_of, nearest_existing
from .paths import under
from .progress import Progress, size_text
from .progress import resolve as _progress
from .read.discover import open_source, source_of_files
from .read.layouts import missing_ranks, taken_among
from .read.primitives.identity import content, file_identity
from .read.registry import get
from .read.source import Source
from .runner import default_jobs
from .sink.layout import Layout
from .store.store import Store
from .verify import verify
from .watcher import watch as _watch

PathLike = str | os.PathLike[str]
SCRATCH = ".shardstore-scratch"


def open(location: PathLike, storage_options: StorageOptions | None = None) -> Store:  # noqa: A001
    """Open an existing store for reading (lazy tensors, values, status). `location` may be a URL."""
    return Store.open(location, storage_options)


def ingest(store: PathLike, files: Sequence[PathLike] | Source, jobs: int | None = None,
           on_done: Callable[[_ingest.Ingested], None] | None = None, verify_replicas: bool = False,
           storage_options: StorageOptions | None = None, scheduler: str | None = None, strict: bool = False,
           progress: Progress | bool = False, only: Callable[[Store], str | None] | None = None,
           on_created: Callable[[Store], None] | None = None,
           direct: Callable[[Store], Layout | None] | None = None, scratch: bool = False) -> Store:
    """Ingest rank files (or a DCP checkpoint's .distcp files, or a `Source`) into `store` (created on first
    use); any subset, in any order, any number of times.

    With hybrid sharding (HSDP) each shard is written once; `verify_replicas` checks the other copies match.
    `store` and `files` may be URLs (s3://...); `scheduler` ("dask", or a Dask scheduler address) runs one
    task per rank file on a Dask cluster instead of local worker processes. Objects of classes outside
    torch (a trainer's own) are kept as `Opaque` records; `strict` refuses them instead. `progress`: a
    `Progress`, or True for what the CLI shows (a bar per phase on a terminal, else one line per phase).
    A `scratch` store serves only a one-pass export (`unshard`): its arrays get their Zarr metadata only
    if anything is to be written into them.
    """
    progress = _progress(progress)

    def done(result: _ingest.Ingested) -> None:
        progress.advance(result.nbytes)
        if on_done:
            on_done(result)

    if isinstance(files, (str, os.PathLike)):  # one folder (or file), not the characters of its name
        files = [files]
    source = files if isinstance(files, Source) else source_of_files(list(files), storage_options)
    st = _ingest.ingest(store, source, jobs=jobs, on_done=done, verify_replicas=verify_replicas, scheduler=scheduler,
                        strict=strict, only=only, on_created=on_created, direct=direct, scratch=scratch,
                        on_start=lambda total, before: progress.start("ingest", total, before))
    progress.end()
    return st


def export(store: Store | PathLike, out_dir: PathLike, format: str = "safetensors", select: str | None = None,
           strip_prefix: str | None = None, dtype: str | None = None, max_shard_size: int = 5_000_000_000,
           progress: Progress | bool = False, allow_partial: bool = False, storage_options: StorageOptions | None = None,
           scheduler: str | None = None, jobs: int | None = None, overwrite: bool = False,
           hf_config: PathLike | None = None, keep_dtype: Sequence[str] = (),
           single_file: bool = False) -> _export.ExportResult:
    """Write the unsharded checkpoint: `format="safetensors"` (model weights, HF-style), `"torch"`, `"dcp"`,
    or `"hf"` (a folder transformers loads; `hf_config` for checkpoints that carry no config of their own).

    An incomplete store is refused unless `allow_partial` (holes become NaN, or zero for integers, and the
    output's metadata says so). Files an earlier export left in `out_dir` that this one would not replace
    are refused unless `overwrite` (which removes them once the new export is complete). `progress` as
    for `ingest`. `single_file`: `format="torch"` as one checkpoint.pt of the whole state in the input's
    nesting (what torch's dcp_to_torch_save writes), not the files the checkpoint's trainer resumes from."""
    progress = _progress(progress)
    st = store if isinstance(store, Store) else Store.open(store, storage_options)
    result = _export.export(st, out_dir, format=format, select=select, strip_prefix=strip_prefix, dtype=dtype,
                            max_shard_size=max_shard_size, progress=progress.advance, allow_partial=allow_partial,
                            scheduler=scheduler, jobs=jobs or default_jobs(), overwrite=overwrite, hf_config=hf_config,
                            on_start=lambda total: progress.start("export", total), keep_dtype=keep_dtype,
                            single_file=single_file)
    progress.end()
    return result


def watch(store: PathLike, src_dir: PathLike, expect: int | None = None, timeout: float | None = None,
          jobs: int | None = None, poll: float = 0.5, tag: str | None = None,
          on_done: Callable[[_ingest.Ingested], None] | None = None,
          on_world_size: Callable[[int], None] | None = None, storage_options: StorageOptions | None = None,
          strict: bool = False) -> Store:
    """Ingest rank files as they arrive in `src_dir` until the store is complete (or `timeout` passes)."""
    return _watch(store, src_dir, expect=expect, timeout=timeout, jobs=jobs, poll=poll, tag=tag, on_done=on_done,
                  on_world_size=on_world_size, storage_options=storage_options, strict=strict)


def rank_files(src_dir: PathLike, tag: str | None = None, step: int | None = None,
               storage_options: StorageOptions | None = None) -> list[str]:
    """The unit files (rank files, or a DCP checkpoint's .distcp files) of the checkpoint in `src_dir` (or
    of the one `tag`/`step` names), in order."""
    return open_source(src_dir, tag, step, storage_options).units


def scratch_location(out_dir: PathLike) -> Path:
    """Where `unshard` keeps its store when not given one: inside OUT (same file system, so copies stay
    kernel-side). It is kept when a run fails or is interrupted, so a rerun resumes, and removed after
    a run succeeds."""
    return Path(out_dir) / SCRATCH


def check_space(store: Store, units: int, only: str | None, out_dir: PathLike, output: int,
                in_store: bool = True) -> None:
    """Refuse, before the ingest, a run whose store and output cannot fit, where the file systems can
    tell (local paths; statvfs): what the store still has to take (its arrays, or the exported subtree's,
    less what committed units hold; nothing where they go straight into the output) and what the export
    will write. Small values are left out, so this errs towards letting a run start."""
    done = len(store.records()) / max(units, 1)
    stored = sum(a.nbytes for p, a in store.manifest.arrays.items() if under(p, only)) if in_store else 0
    by_device: dict[int, list[tuple[str, str, int]]] = {}
    for what, where, nbytes in (("the store", store.location, int(stored * (1 - done))),
                                ("the output", os.fspath(out_dir), output)):
        if is_url(where) or nbytes <= 0:
            continue
        existing = nearest_existing(where)
        by_device.setdefault(os.stat(existing).st_dev, []).append((what, os.fspath(existing), nbytes))
    for needs in by_device.values():
        fs = os.statvfs(needs[0][1])
        free = fs.f_bavail * fs.f_frsize
        if sum(n for *_, n in needs) > free:
            parts = " + ".join(f"{size_text(n)} for {what}" for what, _, n in needs)
            raise ExportError(f"{out_dir}: not enough disk space: this run needs about {parts}, but {needs[0][1]} "
                              f"has {size_text(free)} free; free some space, or choose another OUT (or --store)")


def _missing_folders(out_dir: PathLike) -> list[Path]:
    """OUT and those of its parents that do not exist yet, deepest first (none for a URL)."""
    if is_url(os.fspath(out_dir)):
        return []
    path, made = Path(out_dir).absolute(), []
    while not path.exists() and path != path.parent:
        made.append(path)
        path = path.parent
    return made


# the formats of a plain script's per-rank saves, several of which may share a folder (Composer's ep0-ba10-rank0.pt
# beside ep0-ba20-rank0.pt); the other formats' files of one save have several names (veRL's model_/optim_...)
PER_RANK_SAVES = ("torch-save", "dtensor-files")


def _outside_checkpoint(src_dir: PathLike, source: Source, out_dir: PathLike, store: PathLike | None) -> None:
    """Refuse an OUT or a store inside the folder the user named (a run of checkpoints, or the checkpoint)
    or the checkpoint's own folder: what is written there would be read as (part of) a checkpoint by the
    next run (a run holding `export/` beside `step2/` is no longer a run of one kind), and a rerun would
    convert its own output."""
    named = os.fspath(src_dir)
    folders = [f for f in (source.folder, named) if not is_url(f) and os.path.isdir(f)]
    for what, where in (("OUT", out_dir), ("--store", store)):
        if where is None or is_url(os.fspath(where)):
            continue
        path = os.path.realpath(where)
        for folder in folders:
            real = os.path.realpath(folder)
            if path == real or path.startswith(real.rstrip(os.sep) + os.sep):
                kind = "checkpoint's" if os.path.samefile(folder, source.folder) else "run's"
                raise ExportError(f"{where}: {what} is inside the {kind} folder {folder}; write it elsewhere, "
                                  f"so the checkpoint stays as its trainer left it")


def unshard(src_dir: PathLike, out_dir: PathLike, store: PathLike | None = None, tag: str | None = None,
            step: int | None = None, jobs: int | None = None, verify_replicas: bool = False,
            storage_options: StorageOptions | None = None, scheduler: str | None = None, strict: bool = False,
            progress: Progress | bool = False, format: str = "safetensors", select: str | None = None,
            strip_prefix: str | None = None, dtype: str | None = None, max_shard_size: int = 5_000_000_000,
            hf_config: PathLike | None = None, overwrite: bool = False,
            allow_partial: bool = False, plan: bool = False, keep_dtype: Sequence[str] = (),
            single_file: bool = False) -> _export.ExportResult | Plan:
    """Ingest every rank file in `src_dir`, then export (the export's options as for `export`). Without
    `store`, a scratch store inside `out_dir` is used: see `scratch_location`. With `plan`, nothing is
    ingested or written: the `Plan` of the run, read from what planning needs, or its refusal."""
    request = _export.ExportRequest(format, select, strip_prefix, dtype, max_shard_size, hf_config, overwrite,
                                    allow_partial, tuple(keep_dtype), single_file)
    _export.check_request(out_dir, format, select, strip_prefix, dtype, hf_config, single_file=single_file)
    progress = _progress(progress)
    source = open_source(src_dir, tag, step, storage_options)
    _outside_checkpoint(src_dir, source, out_dir, store)
    if os.path.normpath(source.folder) != os.path.normpath(src_dir):
        progress.note(f"unshard: the checkpoint in {source.folder}")
    elif tag is None and step is None and source.format in PER_RANK_SAVES \
            and (among := taken_among(source.units, storage_options)) is not None:
        progress.note(f"unshard: the checkpoint {among[0]!r} of {', '.join(map(repr, among[1]))} in {source.folder}; "
                      f"--tag or --step picks another")
    scratch = scratch_location(out_dir)
    if store is None and scratch.is_symlink():
        raise ExportError(f"{scratch}: is a symbolic link; shardstore keeps its scratch store only inside OUT")
    if store is None and Store.exists(scratch) and not plan:
        previous = Store.open(scratch)
        if _ingest.source_changed(previous, source.units):
            previous.discard()  # started on another checkpoint (a newer step saved over this one): start again
    location = store if store is not None else scratch  # may be a URL: no Path()
    fmt = _export.output_format(format)

    # One write: with a scratch store on local disk, the ingest writes the output itself where the plan
    # lays it out (each export format's `plan_direct`); the store then keeps only values, and the journal of units.
    # Under Dask the workers write into OUT too: it must be a folder they all see (local, or a cluster's
    # shared file system), as the scratch store inside it must be for the two-step path.
    one_pass = store is None and not verify_replicas and not is_url(os.fspath(out_dir))
    planned: list[_export.DirectExport | None] = [None]

    def before_ingest(st: Store) -> None:  # the store is planned and nothing is read yet
        planned[0] = _up_front(st, src_dir, source, out_dir, request, one_pass, exported_subtree(st),
                               jobs or default_jobs())[1]

    def exported_subtree(st: Store) -> str | None:
        # A scratch store only feeds this export: for safetensors, write just the tensors it takes
        # (the model, not the optimizer state, which is usually twice its size).
        if store is not None or not fmt.subtree:
            return None
        return select if select is not None else _export.model_subtree(st)

    if plan:
        return _plan(src_dir, source, out_dir, store, request, one_pass, exported_subtree, jobs or default_jobs(),
                     strict)
    made = _missing_folders(out_dir)
    try:
        st = ingest(location, source, jobs=jobs, verify_replicas=verify_replicas, storage_options=storage_options,
                    scheduler=scheduler, strict=strict, progress=progress, only=exported_subtree,
                    on_created=before_ingest, direct=lambda st: planned[0].layout if planned[0] is not None else None,
                    scratch=one_pass)
    except BaseException:
        for folder in made:  # a refusal before any unit was accepted leaves OUT as it was: not there
            try:
                os.rmdir(folder)
            except OSError:
                break  # not empty: a scratch store kept for a rerun, or files of the user's
        raise
    if planned[0] is not None:
        result = _export.finish_direct(st, out_dir, planned[0], format, overwrite)
    else:
        result = export(st, out_dir, format, select, strip_prefix, request.dtype, max_shard_size, progress, allow_partial,
                        scheduler=scheduler if fmt.takes_scheduler else None, jobs=jobs, overwrite=overwrite,
                        hf_config=hf_config, keep_dtype=keep_dtype, single_file=single_file)
    if store is None:  # done: the scratch store has served its purpose
        shutil.rmtree(scratch, ignore_errors=True)
    if not any(is_url(os.fspath(u)) for u in source.units):
        result.read = sum(os.path.getsize(u) for u in source.units)
    return result


@dataclass(frozen=True)
class Plan:
    """What `unshard` would do, read from what planning needs (`unshard(..., plan=True)`, `--dry-run`)."""

    checkpoint: str  # the folder of the checkpoint taken
    reader: str  # its format, as messages name it
    trainer: str | None  # the trainer whose resume files it has
    units: int  # its unit files
    world_size: int
    read: int | None  # bytes of its unit files (None: some on object storage)
    one_pass: bool  # the output written straight by the workers (else through the scratch store)
    files: list[tuple[str, int | None]]  # every output file the plan lays out, with its size (None: unknown yet)
    write: int  # the tensor bytes of the output
    casts: dict[str, int]  # "float32 -> bfloat16": how many tensors
    free: dict[str, int]  # a path on each file system written to -> its free bytes
    speed: float | None  # this disk's read speed, measured on a unit file (bytes/s)

    @property
    def seconds(self) -> float | None:
        """About how long the run would take at that speed: every byte read once and written once."""
        return None if not self.speed or self.read is None else (self.read + self.write) / self.speed


def _up_front(st: Store, src_dir: PathLike, source: Source, out_dir: PathLike, request: _export.ExportRequest,
              one_pass: bool, subtree: str | None, jobs: int) -> tuple[int, _export.DirectExport | None]:
    """Every check a run makes once its store is planned and before a unit is read, and the one-pass
    export's plan: (the output's tensor bytes, that plan, or None where the store is to hold the data).
    The real run (ingest's `on_created`) and the dry run both call this: what one refuses the other does."""
    if get(source.format).ranked:  # (else the checkpoint's metadata names every file, checked at planning)
        missing = missing_ranks(source.units, st.manifest.world_size)
        if missing:
            raise CheckpointError(f"{src_dir}: world size is {st.manifest.world_size} but rank files are missing "
                                  f"for ranks {', '.join(map(str, missing[:20]))}{' ...' if len(missing) > 20 else ''}")
    _export.preflight(st, out_dir, request)
    _export.check_origin(out_dir, lambda names: _unit_identities(source, names), request.overwrite)
    output = _export.output_bytes(st, request.format, request.select, request.dtype)
    # the sizes the plan declares, against the disks, before any file of that size is made
    check_space(st, len(source.units), subtree, out_dir, output, in_store=not one_pass)
    direct = _export.plan_direct(st, request, jobs=jobs) if one_pass else None
    if one_pass and direct is None:  # the store holds the data after all
        check_space(st, len(source.units), subtree, out_dir, output)
    return output, direct


def _unit_identities(source: Source, names: Iterable[str]) -> dict[str, str]:
    """The content identity of the first of `names` that is one of the checkpoint's unit files: one small
    read decides whether an export in OUT is of this checkpoint (units of one save are one save's)."""
    by_name = {name_of(u): u for u in source.units}
    name = next((n for n in names if n in by_name), None)
    return {} if name is None else {name: content(file_identity(by_name[name], source.storage_options))}


def _plan(src_dir: PathLike, source: Source, out_dir: PathLike, store: PathLike | None,
          request: _export.ExportRequest, one_pass: bool, subtree: Callable[[Store], str | None], jobs: int,
          strict: bool) -> Plan:
    """The run planned in a temporary store beside OUT (removed after), with every check a real run makes
    before its first unit is read (`planned_store`, then `_up_front`): its refusals are the real run's."""
    near = nearest_existing(Path(out_dir).absolute())
    tmp = Path(tempfile.mkdtemp(prefix=".shardstore-plan-", dir=near))
    try:
        st, unit = _ingest.planned_store(tmp / "store", source, strict, scratch=True)
        if unit is not None:
            unit.close()
        if store is not None and Store.exists(store, source.storage_options):  # the user's, as the real run opens it
            existing = Store.open(store, source.storage_options)
            if existing.records() and not get(source.format).ranked:
                existing.check_compatible(st.manifest, os.fspath(store))
            _ingest.same_format(existing, source)
        output, direct = _up_front(st, src_dir, source, out_dir, request, one_pass, subtree(st), jobs)
        if direct is not None:
            sizes = dict(zip(direct.layout.names, direct.layout.sizes))
            files: list[tuple[str, int | None]] = [(f, sizes.get(f)) for f in direct.files]
            tensors = direct.tensors
        else:
            try:
                planned = _export.planned(st, request)
                files, tensors = [(f, None) for f in planned.files], planned.tensors
            except ShardstoreError:  # what the files are depends on values only the data brings
                files, tensors = [], []
        casts: dict[str, int] = {}
        for it in tensors:
            if it.dtype != getattr(it.source, "dtype", it.dtype):
                key = f"{it.source.dtype} -> {it.dtype}"
                casts[key] = casts.get(key, 0) + 1
        local = not any(is_url(os.fspath(u)) for u in source.units)
        return Plan(source.folder, get(source.format).title, source.trainer, len(source.units), st.manifest.world_size,
                    sum(os.path.getsize(u) for u in source.units) if local else None, direct is not None, files,
                    output, casts, {str(near): shutil.disk_usage(near).free},
                    _read_speed(max(source.units, key=os.path.getsize)) if local else None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_speed(path: PathLike, limit: int = 256 << 20) -> float | None:
    """This disk's read speed (bytes/s), from reading up to `limit` bytes of `path` with its cached pages
    dropped first (what a real run would read cold); None where it reads too little to tell."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start, done = time.perf_counter(), 0
        while done < limit:
            block = os.read(fd, 8 << 20)
            if not block:
                break
            done += len(block)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return done / seconds if done >= 1 << 20 and seconds > 0 else None


__all__ = ["open", "ingest", "watch", "export", "unshard", "verify", "average", "Plan", "rank_files", "scratch_location", "Progress"]
