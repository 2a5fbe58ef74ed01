"""A run is one value: `plan_run` plans it, `execute` runs it.

`unshard` is the two steps in a row; `--dry-run` is the first and a print of its `Plan`. Every check a
run can make before it reads a unit is made while planning, once, so what the dry run refuses the real
run refuses, and the other way round. The call sequence:

    request = RunRequest(src, out, export=registry.request(format, ...), ...)
    with plan_run(request) as plan:       the source opened, the store planned (for a dry run, in a
                                          temporary folder), every up-front check made, the output laid
                                          out where the workers can write it (one pass)
        plan.summary()                    what the run would do: files, sizes, casts, free space
        result = execute(plan, progress)  the units ingested (straight into the output, or into the
                                          store), then the export finished, or made from the store

A run crosses each layer once: this module asks ingest for a session and the export for its plan, and
ingest is told what to write and where (`Session.ingest`), never called back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Collection, Iterable, Iterator

from . import base_folder
from .export import (ExportResult, check_origin, check_request, finish_direct, model_subtree, output_bytes, plan_direct,
                     preflight)
from .export import planned as planned_files
from .export import export as export_store
from .ingest import Session, local_bytes, planned_store, same_format, source_changed
from .ingest import session as ingest_session
from .errors import CheckpointError, ExportError, ShardstoreError
from .export import registry
from .export.contract import DirectExport, ExportRequest
from .locations import StorageOptions, is_url, name_of, nearest_existing
from .paths import under
from .progress import QUIET, Progress, size_text
from .read.discover import beside, open_source
from .read.layouts import missing_ranks, taken_among
from .read.primitives.identity import content, file_identity
from .read.registry import get
from .read.source import Source
from .runner import default_jobs
from .store.store import Store

SCRATCH = ".shardstore-scratch"


def scratch_location(out_dir: str | os.PathLike[str]) -> Path:
    """Where `unshard` keeps its store when not given one: inside OUT (same file system, so copies stay
    kernel-side). It is kept when a run fails or is interrupted, so a rerun resumes, and removed after
    a run succeeds."""
    return Path(out_dir) / SCRATCH


@dataclass(frozen=True)
class RunRequest:
    """What one `unshard` is asked: the checkpoint, OUT, how to read it, and the export (`export`)."""

    src: str | os.PathLike[str]
    out: str | os.PathLike[str]
    export: ExportRequest
    store: str | os.PathLike[str] | None = None  # keep the store here (else a scratch store inside OUT)
    tag: str | None = None  # which checkpoint of a folder of several
    step: int | None = None
    jobs: int | None = None  # worker processes (default: one per core)
    verify_replicas: bool = False  # hybrid sharding: compare every replica's copy bit for bit
    storage_options: StorageOptions | None = None
    scheduler: str | None = None  # "dask", or a Dask scheduler's address
    strict: bool = False  # refuse every pickled global outside the allowlist

    @property
    def location(self) -> str | os.PathLike[str]:
        """The store's: the user's, or the scratch store inside OUT (the user's may be a URL: no Path())."""
        return self.store if self.store is not None else scratch_location(self.out)

    @property
    def one_pass(self) -> bool:
        """Whether the workers may write the output themselves, where the export lays it out: with a scratch
        store, on local disk. Under Dask the workers write into OUT too, so it must be a folder they all see
        (local, or a cluster's shared file system), as the scratch store inside it must be for two steps."""
        return self.store is None and not self.verify_replicas and not is_url(os.fspath(self.out))


def request(src: str | os.PathLike[str], out: str | os.PathLike[str], **options: Any) -> RunRequest:
    """The `RunRequest` of `options`: the run's own fields, and the export's (export/registry.py `request`)."""
    own = frozenset(f.name for f in fields(RunRequest)) - {"src", "out", "export"}
    registry.known(options, own | registry.OPTIONS)
    export = registry.request(**{k: v for k, v in options.items() if k not in own})
    return RunRequest(src, out, export, **{k: v for k, v in options.items() if k in own})


@dataclass(frozen=True)
class Plan:
    """What a run would do, read from what planning needs (`unshard(..., plan=True)`, `--dry-run`)."""

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
    speed: float | None  # this disk's read speed, measured on a unit file (bytes/s); a dry run's only

    @property
    def seconds(self) -> float | None:
        """About how long the run would take at that speed: every byte read once and written once."""
        return None if not self.speed or self.read is None else (self.read + self.write) / self.speed


@dataclass(frozen=True)
class RunPlan:
    """One run, planned: everything `execute` needs, and what it would do (`summary`)."""

    request: RunRequest
    source: Source
    store: Store  # planned (for a dry run, in a temporary folder removed after)
    subtree: str | None  # the one subtree whose tensors the store takes (a scratch store's export), or all
    direct: DirectExport | None  # the output laid out for the workers to write (one pass), or None: two steps
    output: int  # the tensor bytes the export writes
    session: Session | None  # the workers and the unit planning opened; a dry run has none

    def summary(self) -> Plan:
        """What the run would do, as `--dry-run` shows it (a two-step export planned on the empty store)."""
        return _summary(self.request, self.source, self.store, self.direct, self.output)


@contextmanager
def plan_run(request: RunRequest, dry: bool = False, progress: Progress = QUIET,
             arrived: Collection[str] | None = None) -> Iterator[RunPlan]:
    """The run planned: the checkpoint opened and placed, its store planned, and every check a run makes
    before its first unit is read, made. With `dry`, the store is planned in a temporary folder beside
    OUT and nothing of the run is written. Leaving the block ends the run's workers (and closes a merge's
    base model); a failure leaves no store that holds nothing, and no folder it made for OUT. `arrived`:
    the run of a checkpoint still being saved, of those of its units only (`begin`)."""
    with base_folder.opened(request.export) as export:
        with _planned_run(replace(request, export=export), dry, progress, arrived) as plan:
            yield plan


def begin(request: RunRequest, arrived: Collection[str]) -> tuple[int, int]:
    """Of a checkpoint of rank files still being saved, the files `arrived` (each whole) ingested where
    the run of the whole checkpoint, planned with the same request once it is saved, finishes it: that
    run takes only the rest (the records of these name the output's layout, `ingest._not_yet_done`).
    Returns the units in, and the world size. What the rest disagree with is refused by that run, or the store discarded and
    started again (`_opened`). A checkpoint whose units are not rank files, or not yet found, is left to
    that run: CheckpointError."""
    with plan_run(request, arrived=arrived) as plan:
        assert plan.session is not None
        plan.session.ingest(plan.subtree, plan.direct.layout if plan.direct is not None else None,
                            request.verify_replicas)
        return len(plan.store.records()), plan.store.manifest.world_size


@contextmanager
def _planned_run(request: RunRequest, dry: bool, progress: Progress,
                 arrived: Collection[str] | None = None) -> Iterator[RunPlan]:
    source = _opened(request, progress, dry)
    if arrived is not None:
        if not get(source.format).ranked:
            raise CheckpointError(f"{source.folder}: a {get(source.format).title} checkpoint is taken once saved, "
                                  f"not file by file")
        taken = {os.path.abspath(a) for a in arrived}
        source = replace(source, units=[u for u in source.units if os.path.abspath(u) in taken])
        if not source.units:
            raise CheckpointError(f"{source.folder}: none of its rank files is whole yet")
    if dry:
        with _dry_store(request, source) as store:
            yield _planned(request, source, store, None)
        return
    made = _missing_folders(request.out)
    try:
        with ingest_session(request.location, source, request.jobs, request.scheduler, request.strict,
                            scratch=request.one_pass) as session:
            yield _planned(request, source, session.store, session, whole=arrived is None)
    except BaseException:
        for folder in made:  # a refusal before any unit was accepted leaves OUT as it was: not there
            try:
                os.rmdir(folder)
            except OSError:
                break  # not empty: a scratch store kept for a rerun, or files of the user's
        raise


def execute(plan: RunPlan, progress: Progress = QUIET) -> ExportResult:
    """Run `plan` (not a dry run's): every unit ingested, then the export finished where the workers wrote
    it, or made from the store; a scratch store removed once it has served."""
    session, request = plan.session, plan.request
    if session is None:
        raise ValueError("a dry run's plan is not run")
    layout = plan.direct.layout if plan.direct is not None else None
    store = session.ingest(plan.subtree, layout, request.verify_replicas, progress)
    session.pool.close()  # the ingest's workers are done: the export has its own
    if plan.direct is not None:
        result = finish_direct(store, request.out, plan.direct, request.export)
    else:
        result = export_store(store, request.out, request.export, progress,
                                request.scheduler if request.export.output.takes_scheduler else None,
                                request.jobs or default_jobs())
    if request.store is None:  # done: the scratch store has served its purpose
        shutil.rmtree(request.location, ignore_errors=True)
    result.read = local_bytes(plan.source.units)
    return result


def model_store(location: str | os.PathLike[str], source: Source, jobs: int | None, select: str | None) -> Store:
    """The checkpoint `source` reads ingested into a new store at `location`: its values, and the tensors
    of `select`'s subtree, or by default of the model (what `verify` and `average` compare and average)."""
    with ingest_session(location, source, jobs) as session:
        return session.ingest(select if select is not None else model_subtree(session.store))


def _opened(request: RunRequest, progress: Progress, dry: bool) -> Source:
    """The checkpoint the run takes, once everything about the run that needs no store is checked: the
    export's options, where OUT and the store are, a scratch store begun on another checkpoint."""
    check_request(request.out, request.export)
    source = open_source(request.src, request.tag, request.step, request.storage_options)
    _outside_checkpoint(request, source)
    if os.path.normpath(source.folder) != os.path.normpath(request.src):
        progress.note(f"unshard: the checkpoint in {source.folder}")
    elif request.tag is None and request.step is None and get(source.format).shares_folder \
            and (among := taken_among(source.units, request.storage_options)) is not None:
        progress.note(f"unshard: the checkpoint {among[0]!r} of {', '.join(map(repr, among[1]))} in {source.folder}; "
                      f"--tag or --step picks another")
    scratch = scratch_location(request.out)
    if request.store is None and scratch.is_symlink():
        raise ExportError(f"{scratch}: is a symbolic link; shardstore keeps its scratch store only inside OUT")
    if request.store is None and Store.exists(scratch) and not dry:
        previous = Store.open(scratch)
        if source_changed(previous, source.units) or _beside_changed(previous, source):
            previous.discard()  # started on another checkpoint (a newer step saved over this one), or begun
            # before the files beside its units were all there (`begin`): start again
    return source


def _beside_changed(store: Store, source: Source) -> bool:
    """Whether the files the store keeps from beside the units (the run's config, the trainer's resume
    files: the export writes them back) are not, byte for byte, those `source` has now (what planning
    would keep of them: read/discover.py `beside`)."""
    facts = store.manifest.facts
    return any(getattr(facts, name) != value for name, value in beside(source).items())


def _outside_checkpoint(request: RunRequest, source: Source) -> None:
    """Refuse an OUT or a store inside the folder the user named (a run of checkpoints, or the checkpoint)
    or the checkpoint's own folder: what is written there would be read as (part of) a checkpoint by the
    next run (a run holding `export/` beside `step2/` is no longer a run of one kind), and a rerun would
    convert its own output."""
    named = os.fspath(request.src)
    folders = [f for f in (source.folder, named) if not is_url(f) and os.path.isdir(f)]
    for what, where in (("OUT", request.out), ("--store", request.store)):
        if where is None or is_url(os.fspath(where)):
            continue
        path = os.path.realpath(where)
        for folder in folders:
            real = os.path.realpath(folder)
            if path == real or path.startswith(real.rstrip(os.sep) + os.sep):
                kind = "checkpoint's" if os.path.samefile(folder, source.folder) else "run's"
                raise ExportError(f"{where}: {what} is inside the {kind} folder {folder}; write it elsewhere, "
                                  f"so the checkpoint stays as its trainer left it")


def _missing_folders(out_dir: str | os.PathLike[str]) -> list[Path]:
    """OUT and those of its parents that do not exist yet, deepest first (none for a URL)."""
    if is_url(os.fspath(out_dir)):
        return []
    path, made = Path(out_dir).absolute(), []
    while not path.exists() and path != path.parent:
        made.append(path)
        path = path.parent
    return made


@contextmanager
def _dry_store(request: RunRequest, source: Source) -> Iterator[Store]:
    """The store planned in a temporary folder beside OUT (removed after), checked against the user's
    `--store` as the real run's session checks it."""
    tmp = Path(tempfile.mkdtemp(prefix=".shardstore-plan-", dir=nearest_existing(Path(request.out).absolute())))
    try:
        store, unit = planned_store(tmp / "store", source, request.strict, scratch=True)
        if unit is not None:
            unit.close()
        if request.store is not None and Store.exists(request.store, source.storage_options):
            existing = Store.open(request.store, source.storage_options)
            if existing.records() and not get(source.format).ranked:
                existing.check_compatible(store.manifest, os.fspath(request.store))
            same_format(existing, source)
        yield store
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _planned(request: RunRequest, source: Source, store: Store, session: Session | None,
             whole: bool = True) -> RunPlan:
    """Every check a run makes once its store is planned and before a unit is read, and the export laid
    out: for the workers to write (one pass), or as the store will feed it. Not `whole`: some of its rank
    files only (`begin`)."""
    export = request.export
    if get(source.format).ranked and whole:  # (else the checkpoint's metadata names every file, checked at planning)
        missing = missing_ranks(source.units, store.manifest.world_size)
        if missing:
            raise CheckpointError(f"{request.src}: world size is {store.manifest.world_size} but rank files are "
                                  f"missing for ranks {', '.join(map(str, missing[:20]))}"
                                  f"{' ...' if len(missing) > 20 else ''}")
    preflight(store, request.out, export)
    check_origin(request.out, lambda names: _unit_identities(source, names), export.overwrite)
    # A scratch store only feeds this export: for safetensors, write just the tensors it takes
    # (the model, not the optimizer state, which is usually twice its size).
    subtree = None
    if request.store is None and export.output.subtree:
        subtree = export.select if export.select is not None else model_subtree(store)
    output = output_bytes(store, export)
    # the sizes the plan declares, against the disks, before any file of that size is made
    check_space(store, len(source.units), subtree, request.out, output, in_store=not request.one_pass)
    direct = plan_direct(store, export, jobs=request.jobs or default_jobs()) if request.one_pass else None
    if request.one_pass and direct is None:  # the store holds the data after all
        check_space(store, len(source.units), subtree, request.out, output)
    return RunPlan(request, source, store, subtree, direct, output, session)


def _summary(request: RunRequest, source: Source, store: Store, direct: DirectExport | None, output: int) -> Plan:
    """What the planned run would do, as `--dry-run` shows it."""
    if direct is not None:
        sizes = dict(zip(direct.layout.names, direct.layout.sizes))
        files: list[tuple[str, int | None]] = [(f, sizes.get(f)) for f in direct.files]
        tensors = direct.tensors
    else:
        try:
            planned = planned_files(store, request.export)
            files, tensors = [(f, None) for f in planned.files], planned.tensors
        except ShardstoreError:  # what the files are depends on values only the data brings
            files, tensors = [], []
    casts: dict[str, int] = {}
    for it in tensors:
        if it.dtype != getattr(it.source, "dtype", it.dtype):
            key = f"{it.source.dtype} -> {it.dtype}"
            casts[key] = casts.get(key, 0) + 1
    near = nearest_existing(Path(request.out).absolute())
    return Plan(source.folder, get(source.format).title, source.trainer, len(source.units), store.manifest.world_size,
                local_bytes(source.units), direct is not None, files, output, casts,
                {str(near): shutil.disk_usage(near).free}, None)


def dry_run(request: RunRequest) -> Plan:
    """What `request`'s run would do (nothing written), with this disk's read speed measured for the
    estimate; or its refusal, as the real run would refuse it."""
    with plan_run(request, dry=True) as plan:
        summary = plan.summary()
    local = summary.read is not None
    return replace(summary, speed=_read_speed(max(plan.source.units, key=os.path.getsize)) if local else None)


def check_space(store: Store, units: int, only: str | None, out_dir: str | os.PathLike[str], output: int,
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


def _unit_identities(source: Source, names: Iterable[str]) -> dict[str, str]:
    """The content identity of the first of `names` that is one of the checkpoint's unit files: one small
    read decides whether an export in OUT is of this checkpoint (units of one save are one save's)."""
    by_name = {name_of(u): u for u in source.units}
    name = next((n for n in names if n in by_name), None)
    return {} if name is None else {name: content(file_identity(by_name[name], source.storage_options))}


def _read_speed(path: str | os.PathLike[str], limit: int = 256 << 20) -> float | None:
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
