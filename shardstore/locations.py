"""Where things are: a local path, or a URL (s3://, gs://, file://, ...) reached through fsspec.

Object storage is configured the usual way (AWS_* environment variables, AWS_ENDPOINT_URL for
S3-compatible services), plus `storage_options` (the CLI's `--storage-options JSON`), which travel with
every task so worker processes and Dask workers see what the caller sees.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

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

    from .errors import ShardstoreError

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise ShardstoreError(f"{url}: cannot open ({exc}); for s3:// install shardstore[s3]") from None
    except TypeError as exc:  # an option the file system does not take
        raise ShardstoreError(f"{url}: --storage-options not accepted ({exc})") from None


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

