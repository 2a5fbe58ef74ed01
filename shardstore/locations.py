"""Where things are: a local path, or a URL (s3://, gs://, file://, ...) reached through fsspec.

Object storage is configured the usual way (AWS_* environment variables, AWS_ENDPOINT_URL for
S3-compatible services), plus `storage_options` (the CLI's `--storage-options JSON`), which travel with
every task so worker processes and Dask workers see what the caller sees.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from .errors import ShardstoreError

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

StorageOptions = dict[str, Any]


def is_url(location: str | os.PathLike[str]) -> bool:
    return isinstance(location, str) and bool(_URL.match(location)) and not location.startswith("file://")


def local(location: str | os.PathLike[str]) -> str:
    """A local location as a plain path (file:// URLs included)."""
    text = os.fspath(location)
    return text[len("file://"):] if text.startswith("file://") else text


def filesystem(url: str, storage_options: StorageOptions | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for a URL."""
    import fsspec


    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise ShardstoreError(f"{url}: cannot open ({exc}); for s3:// install shardstore[s3]") from None
    except TypeError as exc:  # an option the file system does not take
        raise ShardstoreError(f"{url}: --storage-options not accepted ({exc})") from None
    loop = getattr(fs, "loop", None)
    if loop is not None and loop.get_exception_handler() is not _unawaited_failure:
        loop.set_exception_handler(_unawaited_failure)
    return fs, path


def _unawaited_failure(loop: Any, context: dict[str, Any]) -> None:
    """The exception handler of fsspec's event loop. When a connection is cut, aiohttp's task sending a
    request body fails beside the request that is awaited; the awaited one reaches the caller (and the
    CLI's one error line), the other is logged with a traceback by asyncio when collected ("Task
    exception was never retrieved"). That second report of the same service failure is dropped; anything
    else goes to asyncio's default handler."""
    exc = context.get("exception")
    if exc is not None and "future" in context and isinstance(exc, service_errors()):
        return
    loop.default_exception_handler(context)


def service_errors() -> tuple[type[BaseException], ...]:
    """What a call to object storage raises when the service or the network fails (as opposed to a bug
    here, which must crash loudly): reported in one line, and a rerun continues."""
    errors: list[type[BaseException]] = [OSError, TimeoutError, EOFError]
    asyncio = sys.modules.get("asyncio")  # loaded with fsspec's async file systems, when one is in use
    if asyncio is not None:
        errors.append(asyncio.TimeoutError)
    botocore = sys.modules.get("botocore.exceptions")  # loaded with s3fs, when it is in use
    if botocore is not None:
        errors += [botocore.BotoCoreError, botocore.ClientError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        errors.append(aiohttp.ClientError)
    return tuple(errors)


def name_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path.rstrip("/\\"))


def folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def join(folder: str, name: str) -> str:
    """`name` inside `folder`, a URL or a local path (file:// URLs become plain paths)."""
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(local(folder), name)


def listing(folder: str, storage_options: StorageOptions | None) -> list[str]:
    """The paths of the files in `folder` (empty if it does not exist)."""
    if is_url(folder):
        fs, base = filesystem(folder, storage_options)
        return [join(folder, p.rstrip("/").rsplit("/", 1)[-1])
                for p in (fs.ls(base, detail=False) if fs.isdir(base) else [])]
    folder = local(folder)
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder))] if os.path.isdir(folder) else []


def subfolders(src: str, storage_options: StorageOptions | None) -> list[str]:
    """The names of `src`'s sub-folders, sorted (none if `src` is not a folder)."""
    if is_url(src):
        fs, base = filesystem(src, storage_options)
        if not fs.isdir(base):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False) if fs.isdir(p))
    root = local(src)
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """`path` itself if it exists, else its nearest ancestor that does: where a folder not made yet will
    be, for its file system's free space and for scratch files beside it."""
    return next(p for p in [Path(path), *Path(path).absolute().parents] if p.exists())
