"""JSON from a checkpoint or its run (safetensors headers, metadata files, a model's config.json), parsed
with bounds: a forged file gets one line naming it, never a RecursionError or a parse of gigabytes.

json's C parser recurses once per nesting level and stops at the interpreter's recursion limit (about a
thousand levels) with RecursionError: that bounds the work by the input; this turns it, and every other
way the text can be wrong, into the caller's error type with `where` in front.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ShardstoreError


def loads(raw: bytes | str, where: str, what: str = "JSON", error: type[ShardstoreError] = ShardstoreError,
          max_bytes: int | None = None) -> Any:
    """`raw` parsed, or `error` with one line: "<where>: <what> ...". `max_bytes` refuses longer input."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise error(f"{where}: {what} of {len(raw)} bytes, more than the {max_bytes} such a file can need")
    try:
        return json.loads(raw)
    except RecursionError:
        raise error(f"{where}: {what} nested too deeply (forged or damaged)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{where}: unreadable {what} ({str(exc)[:80]})") from None
