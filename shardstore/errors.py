"""Errors a user can cause.

Every one of them carries a single line that names the file or key involved, so the CLI can print it
without a traceback. Anything else escaping the API is a bug in shardstore, and is left to crash loudly.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator


class ShardstoreError(Exception):
    """Base class: the message is one complete, user-facing line."""


class CheckpointError(ShardstoreError):
    """The rank files are missing, corrupt, truncated, or do not belong together."""


class UnsafePickleError(CheckpointError):
    """A pickle asked for a global outside the allowlist; nothing from it was run."""


class StoreError(ShardstoreError):
    """The store is missing, incomplete for the requested operation, or from another version."""


class ExportError(ShardstoreError):
    """The export cannot be produced as requested (bad selection, dtype, output path)."""


def named(exc: ShardstoreError, name: str) -> ShardstoreError:
    """The same error with `name` (the file or store it concerns) in front, unless it names it, or another
    file of the same checkpoint, already."""
    first = str(exc).split(": ", 1)[0]
    names_a_file = "://" in first or os.path.isfile(first)  # a key ("model/w: ...") is not a file
    return exc if str(exc).startswith(name) or names_a_file else type(exc)(f"{name}: {exc}")


@contextlib.contextmanager
def closed_on_error(close: Callable[[], None], name: str) -> Iterator[None]:
    """A block reading the file `name`: on any error, close what it opened first, and name the file in a
    user-facing error that does not already name it."""
    try:
        yield
    except ShardstoreError as exc:
        close()
        raise named(exc, name) from None
    except BaseException:
        close()
        raise
