"""Following a running job: each checkpoint of RUN that becomes complete is unsharded into
`OUT/<its name>/` and published there by one rename, then `OUT/latest` (a file holding that name, as
DeepSpeed's `latest` does) is moved to it, so that a reader of OUT sees whole folders only and `latest`
always names one.

A checkpoint is complete by its trainer's own rule: no newer than the step the run's pointer names,
where the trainer keeps one (Megatron-LM's and veRL's latest_checkpointed_iteration.txt, DeepSpeed's
`latest`, OLMo's, Composer's and Lightning's links: each moved only once a save is whole); with the file
its trainer writes last, where it writes one (the HF Trainer's trainer_state.json); and, for every
trainer, no file of it changed since the previous look and its plan accepted (every rank's file there,
each whole by its format's measure). A checkpoint still being written is never read.

Restart-safe by its folders alone: a checkpoint is published when `OUT/<name>/` exists, which only the
final rename makes; the one in progress is unsharded in `OUT/.shardstore-follow/<name>/` (its scratch
store inside), which a follower started again resumes. `keep` removes the oldest published folders,
each first renamed out of sight, only once a newer one is published. A checkpoint the trainer deletes
(rotation) while it is read is skipped in one line; any other failure (a full disk) is said once and
tried again at the next look.

Rank files are taken as they land: while a checkpoint of them is still being saved, each rank's file,
once whole and still since the previous look, is ingested into its staging folder (`run.begin`), so
that once the checkpoint is complete only the last ranks are left to read. Its staging is dropped if
the trainer removes the checkpoint before it is complete.

Each look lists RUN once, and recursively only the checkpoints not yet published: its cost does not grow
with the steps published.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from .errors import ShardstoreError
from .locations import StorageOptions, filesystem, is_url, join, listing, local, name_of, service_errors, subfolders
from .read.arrival import Looks
from .read.discover import arriving
from .read.registry import get
from .read.source import pointed
from .trainers.registry import RUNS
from .trainers.contract import Steps

STAGING = ".shardstore-follow"  # inside OUT: the checkpoint being unsharded, and folders being removed
LATEST = "latest"
RANK_FILE = re.compile(r"(.+)-rank[0-9]+\.pt\Z")  # a rank's file named for its checkpoint (Composer's)
Stamp = tuple[tuple[str, int, float], ...]  # a checkpoint's files: (path, size, modification time) each


@dataclass(frozen=True)
class Following:
    """How `follow` follows: publish only steps that are multiples of `every`; keep the newest `keep`
    published folders; look at RUN every `poll` seconds; `once`: publish what is complete now and return
    (two looks `settle` seconds apart tell what is still being written, where the run keeps no pointer)."""

    every: int | None = None
    keep: int | None = None
    poll: float = 30.0
    once: bool = False
    settle: float = 1.0
    storage_options: StorageOptions | None = None


@dataclass(frozen=True)
class Published:
    """A checkpoint published: its name, step and folder; `lag`, seconds from its last file written to
    its folder published; `seconds`, those the unshard took."""

    name: str
    step: int
    folder: Path
    lag: float
    seconds: float
    early: int = 0  # its units taken as they landed, before it was complete


@dataclass(frozen=True)
class Skipped:
    """A checkpoint not published at this look, and why (one line)."""

    name: str
    why: str
    removed: bool  # deleted by its trainer: it is not tried again


@dataclass(frozen=True)
class Removed:
    """A published folder removed to keep the newest `keep`."""

    name: str


Event = Union[Published, Skipped, Removed]
# (run, staging, checkpoint name, its whole rank files) -> its units in, and its world size
Begin = Callable[[str, Path, str, list[str]], tuple[int, int]]


def checkpoints(run: str, storage_options: StorageOptions | None = None) -> list[tuple[int, str, Steps]]:
    """The run's checkpoints (its folders and files a trainer names by step, and the rank files sharing
    the run folder under one step's name: Composer's `ep0-ba10-rank0.pt`), oldest first."""
    found = []
    for path in listing(run, storage_options) + [join(run, n) for n in subfolders(run, storage_options)]:
        whole = name_of(path)
        for name in (whole, *(m[1] for m in [RANK_FILE.match(whole)] if m)):
            steps = next((s for s in RUNS if s.step(name) is not None), None)
            if steps is not None:
                found.append((steps.step(name) or 0, name, steps))
                break
    return sorted(set(found), key=lambda c: (c[0], c[1]))


def stamp(run: str, name: str, storage_options: StorageOptions | None = None) -> Stamp:
    """Every file of the run's checkpoint `name` (a folder, one file, or the rank files named for it) with
    its size and modification time."""
    own = _files(join(run, name), storage_options)
    return own or tuple(f for p in listing(run, storage_options)
                        if (m := RANK_FILE.match(name_of(p))) and m[1] == name for f in _files(p, storage_options))


def _files(path: str, storage_options: StorageOptions | None) -> Stamp:
    """Every file of a folder, or the one file, with its size and modification time (none where nothing
    is there, or no longer)."""
    if is_url(path):
        fs, base = filesystem(path, storage_options)
        try:
            found = fs.find(base, detail=True) if fs.isdir(base) else {base: fs.info(base)}
        except FileNotFoundError:
            return ()
        return tuple(sorted((p, int(d.get("size") or 0), _modified(d)) for p, d in found.items()))
    root = local(path)
    if os.path.isfile(root):
        try:
            st = os.stat(root)
        except FileNotFoundError:
            return ()
        return ((root, st.st_size, st.st_mtime),)
    files = []
    for folder, _, names in os.walk(root):
        for n in names:
            try:
                st = os.stat(os.path.join(folder, n))
            except FileNotFoundError:  # removed while listed: the next look sees it gone
                continue
            files.append((os.path.join(folder, n), st.st_size, st.st_mtime))
    return tuple(sorted(files))


def _modified(detail: dict[str, Any]) -> float:
    """An object's modification time as fsspec's file systems report it (seconds, or a datetime)."""
    value = detail.get("mtime") or detail.get("LastModified") or detail.get("last_modified") or 0
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


class Follower:
    """One follow of RUN into OUT: `look()` publishes what is complete since the previous look."""

    def __init__(self, run: str | os.PathLike[str], out: str | os.PathLike[str], how: Following,
                 unshard: Callable[[str, Path, int], Any], on_event: Callable[[Event], None],
                 begin: Begin | None = None):
        self.run, self.out, self.how = os.fspath(run), Path(out), how
        self.unshard, self.on_event, self.begin = unshard, on_event, begin
        self.looks: dict[str, Looks] = {}  # each checkpoint being saved: its files at the previous look
        self.begun: dict[str, tuple[int, int]] = {}  # each checkpoint being saved: its units in, of how many
        self.taken: dict[str, frozenset[str]] = {}  # ... and the files `begin` was last given
        self.stamps: dict[str, Stamp] = {}  # each unpublished checkpoint's at the previous look
        self.said: dict[str, str] = {}  # the failure last said of each checkpoint (said once)
        self.gone: set[str] = set()  # deleted by the trainer while read

    def published(self) -> list[tuple[int, str]]:
        """The published folders, oldest first."""
        if not self.out.is_dir():
            return []
        found = []
        for p in self.out.iterdir():
            steps = next((s for s in RUNS if s.step(p.name) is not None), None)
            if steps is not None and p.is_dir():
                found.append((steps.step(p.name) or 0, p.name))
        return sorted(found)

    def look(self) -> list[Event]:
        """Publish, oldest first, every checkpoint complete now and not yet published."""
        options = self.how.storage_options
        if is_url(self.run):  # fsspec keeps listings: each look sees the run as it is now
            filesystem(self.run, options)[0].invalidate_cache()
        events: list[Event] = []
        done = {name for _, name in self.published()}
        found = checkpoints(self.run, options)
        newest = self._pointer([name for _, name, _ in found])
        self._drop_staging({name for _, name, _ in found})
        for step, name, steps in found:
            if name in done or name in self.gone or (self.how.every and step % self.how.every):
                continue
            if newest is not None and step > newest:
                self._landing(name)
                continue  # its trainer has not finished it: its pointer names an older step
            now = stamp(self.run, name, options)
            before, self.stamps[name] = self.stamps.get(name), now
            if not now or newest is None and now != before or \
                    steps.marker and not any(name_of(p) == steps.marker for p, _, _ in now):
                self._landing(name)
                continue  # (no pointer: whole once no file of it changed since the previous look)
            if self._landing(name):
                continue  # (a pointer of one rank names it, or its rank files pause mid-write: Composer's)
            event = self._publish(step, name, now)
            if event is not None:
                events.append(event)
                self.on_event(event)
        for event in self._trim():
            events.append(event)
            self.on_event(event)
        return events

    def _landing(self, name: str) -> bool:
        """Whether rank files of `name` are still landing (one not whole, or fewer in than its world size),
        those whole and still since the previous look ingested now (local runs; `begin`). A file `begin`
        refuses is left for the run of the whole checkpoint to say."""
        if self.begin is None or is_url(self.run):
            return False
        looks = self.looks.setdefault(name, Looks())
        try:
            arrived = arriving(self.run, name, looks)
        except ShardstoreError:
            return False
        if not get(arrived.source.format).ranked:
            return False
        ready = frozenset(p for p, _ in arrived.ready)
        if ready and ready != self.taken.get(name):
            self.taken[name] = ready
            try:
                self.begun[name] = self.begin(self.run, self.out / STAGING / name, name, sorted(ready))
            except ShardstoreError:
                self.begun[name] = (0, 0)
        taken, world = self.begun.get(name, (0, 0))
        return bool(set(looks.seen) - ready) or taken < world

    def _drop_staging(self, names: set[str]) -> None:
        """The staging of each checkpoint its trainer removed before it was complete: gone."""
        staging = self.out / STAGING
        for folder in staging.iterdir() if staging.is_dir() else ():
            if not folder.name.startswith(".") and folder.name not in names:
                shutil.rmtree(folder, ignore_errors=True)
                for kept in (self.looks, self.begun, self.taken):
                    kept.pop(folder.name, None)

    def _pointer(self, names: list[str]) -> int | None:
        """The step the run's pointer names as its newest finished save, where it keeps one."""
        latest = pointed(self.run, names, self.how.storage_options) if len(names) > 0 else None
        if latest is None:
            return None
        tag, step, _ = latest
        if step is not None:
            return step
        return next((s.step(tag) for s in RUNS if tag is not None and s.step(tag) is not None), None)

    def _publish(self, step: int, name: str, now: Stamp) -> Event | None:
        staging = self.out / STAGING / name
        started = time.time()
        failures: tuple[type[BaseException], ...] = (ShardstoreError, *service_errors())
        try:
            self.unshard(self.run, staging, step)
        except failures as exc:
            after = stamp(self.run, name, self.how.storage_options)
            if after == ():
                self.gone.add(name)
                shutil.rmtree(staging, ignore_errors=True)
                return Skipped(name, "removed by its trainer while it was read", True)
            if after != now:  # written to while read (a rank's file landing after its pointer moved): again
                return None
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self.said.get(name) == why:
                return None
            self.said[name] = why
            return Skipped(name, why, False)
        final = self.out / name
        os.rename(staging, final)
        _write_atomically(self.out / LATEST, name)
        for kept in (self.said, self.stamps, self.looks, self.taken):
            kept.pop(name, None)
        return Published(name, step, final, time.time() - max(t for _, _, t in now), time.time() - started,
                         self.begun.pop(name, (0, 0))[0])

    def _trim(self) -> list[Event]:
        """The oldest published folders beyond `keep` removed, each renamed out of sight first."""
        if not self.how.keep:
            return []
        published = self.published()
        events: list[Event] = []
        for _, name in published[:max(0, len(published) - self.how.keep)]:
            trash = self.out / STAGING / f".removing-{name}"
            os.rename(self.out / name, trash)
            shutil.rmtree(trash)
            events.append(Removed(name))
        return events


def _write_atomically(path: Path, text: str) -> None:
    """`path` holding `text`, replaced in one rename: a reader sees the old name or the new, whole."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def follow(run: str | os.PathLike[str], out: str | os.PathLike[str], how: Following,
           unshard: Callable[[str, Path, int], Any],
           on_event: Callable[[Event], None] = lambda event: None, begin: Begin | None = None) -> list[Event]:
    """Follow RUN into OUT until interrupted (`how.once`: publish what is complete now, and return what
    was published, skipped and removed). `unshard(run, folder, step)` writes RUN's checkpoint of `step`
    into `folder`, refusing in one line, before reading any tensor, one that is not whole; `begin(run,
    folder, name, files)`, where given, ingests those rank files of the checkpoint `name` still being
    saved into `folder`, which `unshard` then finishes."""
    follower = Follower(run, out, how, unshard, on_event, begin)
    (Path(out) / STAGING).mkdir(parents=True, exist_ok=True)
    for leftover in (Path(out) / STAGING).glob(".removing-*"):  # a removal a kill interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    if how.once:
        events = follower.look()
        time.sleep(how.settle)
        return events + follower.look()
    while True:
        follower.look()
        time.sleep(how.poll)
