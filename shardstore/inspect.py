"""Looking into a checkpoint without ingesting it first (`ls` and `show` given a checkpoint, not a store):
the checkpoint is planned in a scratch store in a temporary folder, removed afterwards, and only what is
asked for is read into it."""

from __future__ import annotations

import difflib
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import StoreError
from .ingest import session
from .locations import StorageOptions, is_url
from .read.discover import open_source
from .store.handle import TensorHandle
from .store.store import Store

# The subtree a scratch store for `ls` writes the tensors of: none (no key is empty, nor starts with "/")
NO_TENSORS = "/"


@dataclass(frozen=True)
class Inspected:
    """What `inspect` opened: a store to read, and the checkpoint's folder where it is a scratch plan of one."""

    store: Store
    checkpoint: str | None  # None: `location` was a store, read as it is


@contextmanager
def inspect(location: str | os.PathLike[str], key: str | None = None, selection: Any = None,
            tag: str | None = None, step: int | None = None, storage_options: StorageOptions | None = None,
            strict: bool = False, jobs: int | None = None) -> Iterator[Inspected]:
    """The store at `location`; or, where `location` holds no store, the checkpoint there (what `unshard`
    takes, `tag` and `step` as for it) planned in a scratch store in a temporary folder, removed on leaving
    the block, by an error or Ctrl-C too. The units' values (small: what `ls` previews) are read into it,
    and of the tensors only `key`'s, so listing a checkpoint copies no tensor byte and showing one tensor
    copies that tensor's. A `key` the store or checkpoint lacks, or a `selection` of it that reaches
    outside it (`TensorHandle.check_bounds`), is refused before any unit is read, in one line naming the
    keys nearest to it, or the dimension and its size."""
    if Store.exists(location, storage_options):
        if tag is not None or step is not None:
            raise StoreError(f"{location}: is a shardstore store, which holds one checkpoint; --tag and --step "
                             f"pick one of a folder's checkpoints")
        st = Store.open(location, storage_options)
        if key is not None:
            check_key(st, key, selection, os.fspath(location))
        yield Inspected(st, None)
        return
    if not is_url(os.fspath(location)) and not os.path.lexists(location):
        raise StoreError(f"{location}: no such store or checkpoint")
    source = open_source(location, tag, step, storage_options)
    where = source.folder or os.fspath(location)
    tmp = Path(tempfile.mkdtemp(prefix="shardstore-inspect-"))
    try:
        with session(tmp / "store", source, jobs, strict=strict) as planned:
            if key is not None:
                check_key(planned.store, key, selection, where)
            st = planned.ingest(only=key if key in planned.store.manifest.arrays else NO_TENSORS)
        yield Inspected(st, where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_key(st: Store, key: str, selection: Any, where: str) -> None:
    """Refuse a key `st` does not hold, in one line naming `where` and the keys a typo most likely meant,
    and a `selection` (None: the whole) of its tensor that reaches outside it."""
    entry = st.manifest.arrays.get(key)
    if entry is not None and selection is not None:
        TensorHandle(st, entry).check_bounds(selection)
    if key in st:
        return
    keys = st.keys()
    close = [k for k in keys if key in k][:5] or difflib.get_close_matches(key, keys, n=5, cutoff=0.6)
    raise StoreError(f"{where}: no key {key!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))
