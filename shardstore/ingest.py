"""Ingestion: units of work in (rank files, .distcp files), shards written straight into their cells.

The coordinator plans the store from the checkpoint's spec (read/discover.py); each worker then opens one
unit (memory-mapped, safely unpickled, checked), checks it against the plan, copies every piece into the
cells it owns (kernel-side where the bytes are contiguous), stages small pieces, and commits a record.
No chunk has two writers, so workers never coordinate. The workers are the runner's (runner.py).
"""

from __future__ import annotations

import functools
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import values
from .paths import under
from .errors import CheckpointError, StoreError, closed_on_error, named
from .locations import StorageOptions, filesystem, is_url, local
from .plan import plan_checkpoint
from .progress import Progress
from .read.contract import LocalPiece, PlannedCheckpoint, Unit
from .read.discover import open_unit, unit_shares
from .read.discover import plan as plan_source
from .read.primitives import tensors
from .read.primitives.container import Container
from .read.primitives.identity import content, file_identity, file_stamp, stamp
from .gcpause import gc_paused
from .read.registry import get
from .read.source import Source
from .records import TensorRef
from .runner import Pool, default_jobs
from .sink import Sink
from .sink.cells import UnitWriter
from .sink.files import DirectWriter
from .sink.layout import Layout
from .store.manifest import CommitRecord, Manifest
from .store.onesave import OneSave
from .store.store import Store


BATCH_FILES = 32  # a worker's task: at most this many units, synced once ...
BATCH_BYTES = 64 << 20  # ... holding at most this many bytes of local files ...
TASKS_PER_WORKER = 4  # ... and at least this many tasks for each worker


@dataclass(frozen=True)
class Ingested:
    rank: int
    path: str
    nbytes: int
    # its commit record, as committed: the coordinator keeps it rather than read it back from the store
    # (a request per unit on object storage; a JSON decode each at W=1024)
    record: CommitRecord = field(repr=False, compare=False)
    # its staging file's bytes, if small (sink/cells.py): the coordinator assembles from them, not a read
    staging: bytes | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class IngestOptions:
    """What every worker of one run is told besides its file."""

    verify_replicas: bool = False  # hybrid sharding: compare every replica's copy bit for bit
    only: str | None = None  # write only this subtree's tensors (a scratch store that feeds one export)
    strict: bool = False  # refuse every global outside the allowlist, instead of keeping opaque records
    format: str = "torch-save"  # how to open a unit of work (read/discover.py)
    direct: Layout | None = None  # the arrays it places go straight into these output files (sink/files.py)


def _planned(store: Store) -> PlannedCheckpoint:
    """What each unit is checked against: the store's plan."""
    m = store.manifest
    return PlannedCheckpoint(m.world_size, m.facts.group_size, m.tree, m.arrays, frozenset(m.objects), m.facts.metadata,
                             get(m.facts.format).title)


def _encode_tensor(writer: UnitWriter, zf: Container) -> Callable[[TensorRef], Any]:
    def encode(ref: TensorRef) -> Any:
        data = np.ascontiguousarray(tensors.array(zf, ref)).tobytes()
        out: dict[str, Any] = {"dtype": ref.dtype, "shape": list(ref.shape)}
        if len(data) <= values.INLINE_TENSOR_BYTES:
            out["data"] = values._b64(data)
        else:
            out["blob"] = writer.put_blob(data)
        return out

    return encode


def _encoded(value: Any, encode_tensor: Callable[[TensorRef], Any], where: str) -> Any:
    try:
        return values.encode(value, tensor=encode_tensor)
    except RecursionError:
        raise CheckpointError(f"{where}: a value nested too deeply, or containing itself") from None
    except StoreError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def ingest_file(store: Store, path: str | os.PathLike[str], options: IngestOptions = IngestOptions(),
                unit: Unit | None = None) -> Ingested:
    """Ingest one unit (a rank file, a .distcp file, a model file) into an existing store.

    Under hybrid sharding every shard exists once per replica group: the first copy to arrive is written,
    later ones are skipped (or, with `verify_replicas`, compared bit for bit). With `only`, tensors outside
    that subtree are not written (values still are): for a scratch store that only feeds one export.
    `unit` is the file already open (the one planning read); it is closed here either way.
    """
    return ingest_files(store, [path], options, unit)[0]


def ingest_files(store: Store, paths: Sequence[str | os.PathLike[str]], options: IngestOptions = IngestOptions(),
                 unit: Unit | None = None, shares: dict[str, Any] | None = None) -> list[Ingested]:
    """Ingest several units as one batch, the whole job of one worker task (`ingest_file` for each).

    Each unit is written in turn; then everything they wrote is made durable at once and their commit
    records are written together (Store.commit_ranks). At world size 256 a rank file is a few milliseconds
    of work and a sync of the disk costs as much again, so a batch pays it once. A unit that fails ends
    the batch: the units before it are committed first, then its error is raised. `unit` is the first
    file already open; `shares`, the units' shares of what planning parsed (`Format.unit_share`).
    """
    _prefetch(paths[1:])
    with gc_paused():
        _read_records(store)
        direct = DirectWriter(options.direct) if options.direct is not None else None
        done: list[tuple[Ingested, list[str]]] = []
        replicas: dict[str, set[int]] = {}  # replica cells the batch wrote: its later copies are skipped
        try:
            for i, path in enumerate(paths):
                done.append(_write_unit(store, path, options, unit if i == 0 else None, direct,
                                        {ingested.rank: ingested.path for ingested, _ in done}, replicas,
                                        (shares or {}).get(os.fspath(path))))
        finally:
            try:
                if done:
                    if direct is not None:
                        direct.sync()  # durable before the commits that journal it
                    store.commit_ranks([ingested.record for ingested, _ in done], [k for _, keys in done for k in keys])
            finally:
                store.abandon_pack()  # (a pack the commit did not close: nothing names it)
                if direct is not None:
                    direct.close()
        return [ingested for ingested, _ in done]


def _prefetch(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Have the kernel start reading the batch's later local files (at most BATCH_BYTES) while the first is
    worked on: a small rank file is read in a few scattered requests (its end records, local headers,
    pickle, storages), each waiting on the disk when cold; read ahead whole, they come from memory. At
    W=256, caches dropped: 2.8-3.1 s -> 2.4-2.8 s for `--format torch`. Only a hint: a file that cannot be
    opened is left for its own read to report (non-blocking: a FIFO put in a file's place never hangs it)."""
    for path in paths:
        if is_url(os.fspath(path)):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _write_unit(store: Store, path: str | os.PathLike[str], options: IngestOptions, unit: Unit | None,
                direct: DirectWriter | None, batch: dict[int, str],
                replicas: dict[str, set[int]], share: Any = None) -> tuple[Ingested, list[str]]:
    """One unit's pieces and values written, not yet durable: what it ingested, the record that will
    commit it, and the store keys it wrote. `batch` holds the ranks of the batch's units before it, and
    `replicas` the replica cells they wrote (hybrid sharding: a later copy is skipped, or verified)."""
    verify_replicas, only = options.verify_replicas, options.only
    unit = unit if unit is not None else open_unit(options.format, os.fspath(path), store.storage_options,
                                                   options.strict, values.encode, store.manifest.facts.reader_view(),
                                                   share)
    try:
        if options.format != store.manifest.facts.format:
            raise CheckpointError(f"{unit.path}: the store holds a {store.manifest.facts.format} checkpoint, this "
                                  f"file is not part of one")
        unit.check(_planned(store))
        if unit.rank in batch:
            raise CheckpointError(f"two files hold rank {unit.rank}: {batch[unit.rank]} and {unit.path}")
        identity = unit.identity()
        _check_identity(store, unit, identity)
        writer = UnitWriter(store, unit.path, verify_replicas, replicas)
        arrays = store.manifest.arrays
        for leaf_path, leaf in unit.leaves.items():  # values first: one that cannot be stored refuses the file
            if leaf_path not in arrays:  # before any tensor byte is written
                encoded = _encoded(leaf, _encode_tensor(writer, unit.value_zip(leaf_path)), f"{unit.path}: {leaf_path}")
                writer.value(leaf_path, encoded)
        # before any tensor byte: a unit of another save than the units seen is refused
        saves = _SAVES.setdefault(store, OneSave())
        name = os.path.basename(unit.path)
        saves.check(name, writer.objects)
        writes = direct is not None and direct.claim(unit.group_rank, unit.rank)  # hybrid: one copy per group rank
        for leaf_path, leaf in unit.leaves.items():
            entry = arrays.get(leaf_path)
            if entry is None or not under(leaf_path, only):
                continue
            sink: Sink = direct if direct is not None and direct.places(leaf_path) else writer
            if sink is direct and (not writes or entry.replicated and unit.group_rank != 0):
                continue  # another unit writes this copy (every unit holds a plain tensor whole)
            pieces = ([LocalPiece((0,) * len(entry.shape), entry.shape, leaf, unit.value_zip(leaf_path))]
                      if entry.replicated else leaf.pieces)
            for piece in pieces:
                sink.piece(entry, piece)
        if direct is not None:
            direct.flush()
        record = writer.record(unit, only, identity, options.direct.digest if options.direct is not None else None,
                               direct.take_runs() if direct is not None else None)
        saves.add(name, writer.objects)  # the batch's later units are checked against it too
        return Ingested(unit.rank, unit.path, unit.size, record, writer.staging), writer.written
    finally:
        unit.close()


def _read_records(store: Store) -> None:
    """What a batch needs of what other units committed, from one listing of the store: the record of
    each rank it may hold again (`_check_identity`), one committed unit to check its units are of the same
    save (`OneSave`), and under replication every record, since they say which replica cells are in
    (sink/cells.py). The coordinator checks every record against the others as they arrive (`_run`):
    reading them all in every worker was 0.75 requests per rank file on S3 at world size 256."""
    m = store.manifest
    if m.facts.replicas > 1 or any(entry.replicated for entry in m.arrays.values()):
        held = store.records()
    else:
        held = store.records_of(sorted(store.committed())[:1])
    _SAVES.setdefault(store, OneSave()).add_records(held)


def _check_identity(store: Store, unit: Any, identity: str) -> None:
    """A rank committed from one file is never overwritten by another: the store would then hold two
    checkpoints (a committed cell is never rewritten, so the old tensors would stay beside new values).
    The rank's record is read only if the batch's listing (`_read_records`) found it."""
    record = store.records_of([unit.rank]).get(unit.rank)
    if record is not None and record.identity is not None and content(record.identity) != content(identity):
        raise CheckpointError(
            f"{unit.path}: {store.location} already holds rank {unit.rank} from another file ({record.file}, "
            f"with other contents): the store holds another checkpoint; ingest into a new store, or delete "
            f"{store.location} first")


_WORKER_STORES: dict[str, Store] = {}
# a store -> the values of the units it holds, as this process has seen them committed
_SAVES: "weakref.WeakKeyDictionary[Store, OneSave]" = weakref.WeakKeyDictionary()


def _worker(location: str, paths: list[str], options: IngestOptions, storage_options: StorageOptions | None = None,
            shares: dict[str, Any] | None = None, part: Manifest | None = None) -> list[Ingested]:
    """One task: a worker process (or a Dask worker) ingests a batch of units, from their `shares` of what
    planning parsed, and its `part` of the manifest where the shares say what the units hold."""
    if part is not None:
        return ingest_files(Store.with_part(location, storage_options, part), paths, options, shares=shares)
    key = f"{location} {sorted((storage_options or {}).items())}"
    store = _WORKER_STORES.get(key)
    if store is None:
        store = _WORKER_STORES[key] = Store.open(location, storage_options)
    return ingest_files(store, paths, options, shares=shares)


def create_store(location: str | os.PathLike[str], source: Source, strict: bool = False) -> Store:
    """Create (or reopen, after checking it matches) the store for the checkpoint `source` reads.

    A store of rank files that holds a committed rank is only opened: planning would unpickle a rank file
    that a worker reads again, and each worker checks its own file against the plan anyway. A store that
    holds nothing committed was planned by a run whose files were all refused (a damaged first file): if
    today's files plan it differently, it is planned again rather than refusing the genuine files."""
    store, unit = planned_store(location, source, strict, arriving=True)
    if unit is not None:
        unit.close()
    return store


def planned_store(location: str | os.PathLike[str], source: Source, strict: bool,
                  scratch: bool = False, arriving: bool = False) -> tuple[Store, Any | None]:
    """`create_store`, also handing back the unit planning opened (Source.plan), which the caller closes.
    Every check of the unit files that can be made before one is read is made here, where the real run and
    the dry run (`unshard(plan=True)`) both plan; `arriving`: the files are still being written (`watch`),
    and each is checked as it is ingested."""
    if not source.units:
        raise CheckpointError("no rank files to ingest")
    if not arriving:
        _check_readable(source.units)
    existing = Store.open(location, source.storage_options) if Store.exists(location, source.storage_options) else None
    if existing is not None and get(source.format).ranked and existing.records():
        return existing, None
    try:
        spec, unit = plan_source(source, values.encode, strict)
    except CheckpointError as exc:
        raise named(exc, source.units[0]) from None
    with closed_on_error(unit.close if unit is not None else lambda: None, source.units[0]):
        if not arriving:
            _check_sizes(source.units, spec.least_sizes)
        manifest = plan_checkpoint(spec)
        if existing is not None and not existing.records():
            try:
                existing.check_compatible(manifest, str(location))
            except StoreError:
                existing.discard()
        # A scratch store is read by nothing but its own export, and is removed once that is done: packed
        # wherever it is. DeepSeek-V3's structure to --format megatron, 92k cells: 101.8 s -> 54.8 s.
        return Store.create(location, manifest, source.storage_options, array_metadata=not scratch,
                            packed=True if scratch else None), unit


@dataclass
class Session:
    """An ingest under way (`session`): its workers, the store planned for its checkpoint, and the unit
    planning opened, which `ingest` takes from what planning read. Between planning and `ingest` the
    caller decides, from the planned store, what to write (`only`) and where (`direct`): `unshard`'s run
    plan, `inspect`'s one key, `verify`'s model."""

    pool: Pool
    store: Store
    source: Source
    strict: bool
    held: Unit | None

    def ingest(self, only: str | None = None, direct: Layout | None = None, verify_replicas: bool = False,
               progress: Progress | None = None, on_done: Callable[[Ingested], None] | None = None) -> Store:
        """Every unit not yet in, on the pool: with `only`, the tensors of that subtree alone (a scratch store
        that feeds one export; values are always written); with `direct`, the arrays that layout places go
        straight into its output files (sink/files.py), and only what it does not place into the store.
        `verify_replicas` compares every replica's copy bit for bit. `progress` hears the bytes of the
        unit files (and of those already in) and each unit's as it is done; so does `on_done`, per unit.
        Ranks already committed from a file of the same name and size are skipped, so a rerun does only
        what is missing."""
        options = IngestOptions(verify_replicas, only, self.strict, self.source.format, direct)
        _run(self.store, self.pool, list(self.source.units), options, progress, on_done, self.held)
        if progress is not None:
            progress.end()
        self.store.assemble_ready(verify=verify_replicas)
        return self.store


@contextmanager
def session(location: str | os.PathLike[str], source: Source, jobs: int | None = None, scheduler: str | None = None,
            strict: bool = False, scratch: bool = False) -> Iterator[Session]:
    """The store for the checkpoint `source` reads, created from its spec (or reopened, once checked to
    match), with `jobs` workers (default: one per core; jobs=1 runs everything in this process) started
    first, so their start-up overlaps planning. With `scheduler` ("dask" for a local cluster, or a
    scheduler address) the units run as Dask tasks. `strict` refuses every pickled global outside the
    allowlist. A `scratch` store (a one-pass export's) gets its arrays' Zarr metadata only if the export
    turns out to write into the store after all.

    A failure before any unit is accepted, planning's refusal included, leaves no store it created."""
    jobs = max(1, min(jobs or default_jobs(), len(source.units)))
    created, store, held = not Store.exists(location, source.storage_options), None, None
    try:
        with Pool(jobs, scheduler) as pool:  # workers start now: their start-up overlaps creating the store
            store, held = planned_store(location, source, strict, scratch)
            same_format(store, source)  # before a unit is opened with another's facts
            yield Session(pool, store, source, strict, held)
    except BaseException:
        # Nothing was accepted: leave no store planned from refused files. Only once the pool is shut down
        # (every task that was running has ended), and never on Dask, whose tasks may outlive this run.
        if created and store is not None and scheduler is None and not store.records():
            store.discard()
        raise
    finally:
        if held is not None:
            held.close()


def ingest(location: str | os.PathLike[str], source: Source, jobs: int | None = None, verify_replicas: bool = False,
           scheduler: str | None = None, strict: bool = False, progress: Progress | None = None,
           on_done: Callable[[Ingested], None] | None = None) -> Store:
    """Ingest a checkpoint's units of work (rank files, .distcp files) into the store at `location`
    (created from the checkpoint's spec if it does not exist): a `session`, all of it ingested."""
    with session(location, source, jobs, scheduler, strict) as s:
        return s.ingest(verify_replicas=verify_replicas, progress=progress, on_done=on_done)


def local_bytes(files: Sequence[str | os.PathLike[str]]) -> int | None:
    """The bytes of `files`, where all are local (asking object storage would cost a request per file)."""
    if any(is_url(os.fspath(f)) for f in files):
        return None
    return sum(os.path.getsize(f) for f in files)


def same_format(store: Store, source: Source) -> None:
    """Refuse a store that holds a checkpoint of another format than `source`'s."""
    if store.manifest.facts.format != source.format:
        raise CheckpointError(f"{source.units[0]}: the store at {store.location} holds a "
                              f"{get(store.manifest.facts.format).title} checkpoint, and this is a file of a "
                              f"{get(source.format).title} one; ingest it into another store")


def _check_readable(files: Sequence[str | os.PathLike[str]]) -> None:
    """Every local unit file is there and is a regular file, before a store is made or a worker starts:
    a .distcp file that .metadata names but the folder lacks, a symbolic-link loop, a directory."""
    import stat

    for f in files:
        if is_url(os.fspath(f)):
            continue  # a request each: the worker opening it reports it
        try:
            mode = os.stat(f).st_mode
        except FileNotFoundError:
            raise CheckpointError(f"{f}: no such file (the checkpoint names it)") from None
        except OSError as exc:
            raise CheckpointError(f"{f}: cannot read ({exc.strerror or exc})") from None
        if stat.S_ISDIR(mode):
            raise CheckpointError(f"{f}: is a directory, not a rank file")
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{f}: is not a regular file")


def _check_sizes(units: Sequence[str], least: dict[str, int]) -> None:
    """Every local unit file holds at least the bytes the checkpoint's metadata places in it."""
    if not least:
        return
    ends = {os.path.abspath(local(p)): n for p, n in least.items() if not is_url(p)}
    for path in units:
        need = None if is_url(path) else ends.get(os.path.abspath(local(path)))
        if need is not None and (size := os.path.getsize(local(path))) < need:
            raise CheckpointError(f"{path}: its items run past the end of the file: the checkpoint's metadata "
                                  f"places them up to byte {need}, the file has {size} bytes (truncated?)")


def _run(store: Store, pool: Pool, files: list[str | os.PathLike[str]], options: IngestOptions,
         progress: Progress | None, on_done: Callable[[Ingested], None] | None, held: Unit | None) -> None:
    """The ingest itself, once the store is open: every file not yet in, on the pool. The unit planning
    opened (`held`), if still to do, is ingested here, beside the workers, from what planning read."""
    store.sweep_temporaries()  # what writers killed mid-write left behind
    layout = options.direct
    if layout is None:  # pieces go into the store's own arrays: Zarr must be able to read them
        store.ensure_array_metadata()
    todo = _not_yet_done(store, files, options.only, layout.digest if layout is not None else None)
    if progress is not None:
        total = local_bytes(files)
        progress.start("ingest", total, total - sum(os.path.getsize(f) for f in todo) if total is not None else 0)
    seen: dict[int, str] = {}
    # Every committed unit against the others: a worker compares its units with one committed unit only
    # (`_read_records`), so two saves whose units differ in a value that unit lacks are caught here, and
    # two workers' first units of two saves (both committed before either saw the other) too.
    saves = _SAVES.setdefault(store, OneSave()).add_records(store.records(refresh=False))

    def done(results: list[Ingested]) -> None:  # a task's: its batch's units
        for result in results:
            if result.rank in seen and seen[result.rank] != result.path:
                raise CheckpointError(f"two files hold rank {result.rank}: {seen[result.rank]} and {result.path}")
            seen[result.rank] = result.path
            store.remember(result.record, result.staging)
            try:
                saves.add_records({result.rank: result.record})
            except CheckpointError as exc:
                raise CheckpointError(f"{exc}; {store.location} now holds units of both: delete it, then ingest "
                                      f"the files of one save") from None
            if progress is not None:
                progress.advance(result.nbytes)
            if on_done:
                on_done(result)

    paths = [os.fspath(f) for f in todo]
    here = None
    if held is not None and held.path in paths and pool.scheduler is None:
        paths.remove(held.path)
        here = functools.partial(ingest_files, store, [held.path], options, held)
    batches = _batches(paths, pool.jobs)
    names = [f"ingest-{b[0].rsplit('/', 1)[-1]}" + (f"+{len(b) - 1}" if len(b) > 1 else "") for b in batches]

    if pool.inline:  # this process: the store just opened, not one cached by an earlier run
        pool.run(lambda b: ingest_files(store, b, options), [(b,) for b in batches], names, done, here)
    else:
        pool.run(_worker, (_task(store, b, options) for b in batches), names, done, here)


def _task(store: Store, batch: list[str], options: IngestOptions) -> tuple:
    """A worker's task: its units, each with its share of what planning parsed where its format has one;
    where every unit has one, only the part of the manifest, and the places in the output, of what they
    can hold."""
    shares = unit_shares(options.format, batch, store.storage_options, store.manifest.facts.reader_view())
    if len(shares) < len(batch):
        return store.location, batch, options, store.storage_options, shares
    held = {p for s in shares.values() for p in s.store_paths()}
    below = frozenset(p for s in shares.values() for p in s.subtrees())
    if options.direct is not None:
        options = replace(options, direct=options.direct.part(held, below))
    return store.location, batch, options, store.storage_options, shares, store.manifest.part(held, below)


def _batches(paths: list[str], jobs: int) -> list[list[str]]:
    """The tasks: runs of consecutive units, each synced once (ingest_files). A task holds at most
    BATCH_FILES units and BATCH_BYTES of local files (a large file is a task of its own: its own sync
    costs little beside its bytes), and every worker gets TASKS_PER_WORKER tasks or more, so none is
    left with a long last task while the others idle."""
    most = max(1, min(BATCH_FILES, len(paths) // (jobs * TASKS_PER_WORKER)))
    batches: list[list[str]] = []
    held = 0
    for path in paths:
        size = 0 if is_url(path) else os.path.getsize(path)
        if not batches or len(batches[-1]) >= most or held + size > BATCH_BYTES:
            batches.append([])
            held = 0
        batches[-1].append(path)
        held += size
    return batches


def _not_yet_done(store: Store, files: Sequence[str | os.PathLike[str]], subtree: str | None,
                  direct: str | None = None) -> list[str | os.PathLike[str]]:
    """The files not committed yet, with at least the tensors this run needs (a rank ingested for a
    safetensors-only scratch store lacks the optimizer). A file counts as committed only when a record
    names the same file with the same identity (read/primitives/identity.py): a file replaced by another of the same
    name and size, a newer step saved over it, is ingested again, and its worker refuses it if its rank
    holds the other file. Records from before identities fall back to the name and size. A unit whose
    pieces went into output files counts only for a run writing that same layout (`direct`), and one
    whose pieces went into the store only for a run that reads them from there."""
    records = [rec for rec in store.records().values() if rec.direct == direct
               and (rec.only is None or (subtree is not None and under(subtree, rec.only)))]
    if not records:
        return list(files)
    known = [(rec.file, rec.identity) for rec in records if rec.identity is not None]
    stamped = {(file, stamp(identity)) for file, identity in known if stamp(identity) is not None}
    unstamped = {(file, identity) for file, identity in known if stamp(identity) is None}
    sized = {(rec.file, rec.bytes) for rec in records if rec.identity is None}
    names = {file for file, _ in known}
    todo = []
    for f in files:
        name = os.path.basename(os.fspath(f))
        if sized and (name, _size(f, store.storage_options)) in sized:
            continue
        if name in names and (name, file_stamp(f, store.storage_options)) in stamped:
            continue  # untouched since it was ingested: no read
        if name not in names or (name, content(file_identity(f, store.storage_options))) not in unstamped:
            todo.append(f)  # new, changed since (read again: its worker checks it), or another file
    return todo


def source_changed(store: Store, files: Sequence[str | os.PathLike[str]]) -> bool:
    """Whether any unit the store has committed is no longer among `files` as it was (same name, same
    identity): the checkpoint was replaced (a newer step saved over it) since the store was started."""
    records = [rec for rec in store.records().values() if rec.identity is not None]
    if not records:
        return False
    by_name: dict[str, list[str | os.PathLike[str]]] = {}
    for f in files:
        by_name.setdefault(os.path.basename(os.fspath(f)), []).append(f)
    identities: dict[str, set[str | None]] = {}  # read only for the names a record needs, once each
    for rec in records:
        if rec.file not in by_name:
            return True
        assert rec.identity is not None
        recorded = stamp(rec.identity)
        if recorded is not None:  # what the file system says: a file changed in place is another file
            now = {file_stamp(f, store.storage_options) for f in by_name[rec.file]}
            if recorded not in now:
                return True
            continue
        if rec.file not in identities:
            identities[rec.file] = {content(file_identity(f, store.storage_options)) for f in by_name[rec.file]}
        if rec.identity not in identities[rec.file]:
            return True
    return False


def _size(path: str | os.PathLike[str], storage_options: StorageOptions) -> int:
    if is_url(os.fspath(path)):
        fs, fspath = filesystem(os.fspath(path), storage_options)
        return int(fs.size(fspath))
    return os.path.getsize(path)
