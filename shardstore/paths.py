"""Store paths for state-dict leaves: "optim/state/transformer.wte.weight/exp_avg".

A key becomes one path component that is safe on every file system and object store, and distinct keys
always become distinct components (the map is injective), whatever the key holds:
- letters, digits, ".", "_" and "-" stay as they are; every other character is percent-encoded from its
  UTF-8 bytes (lone surrogates too, by "surrogatepass"), so keys that differ only by Unicode form stay
  apart and no file system's normalisation can merge them, and "/" or NUL never reach a path;
- names Zarr or shardstore reserve are encoded further: empty, starting with "." (all-dots, hidden and
  temporary names, ".zarray"), starting with "__", and "zarr.json";
- a component longer than 200 characters keeps its first 150 and adds a digest of the whole key.
The real keys, with their types, live in the manifest's tree; paths only need to be distinct. An int key
and the string of its digits share a component: the rank-file reader refuses a container holding both.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Mapping, TypeVar

T = TypeVar("T")

_SAFE = re.compile(r"[A-Za-z0-9._-]*")
# Each UTF-8 byte's text in a component: itself if it is one of _SAFE's, else percent-encoded.
_BYTE = [chr(b) if re.fullmatch(rb"[A-Za-z0-9._-]", bytes([b])) else f"%{b:02X}" for b in range(256)]
MAX_COMPONENT = 200


def escape(key: object) -> str:
    text = str(key)
    raw = text.encode("utf-8", "surrogatepass")
    if not _SAFE.fullmatch(text):  # most keys are safe as they are: a rank file has thousands
        text = "".join([_BYTE[b] for b in raw])
    if text == "":
        return "%"
    if text.startswith("."):
        text = "%2E" + text[1:]
    elif text.lower() == "zarr.json":  # (any case: some file systems ignore it)
        text = text.replace(".", "%2E")
    elif text.startswith("__"):
        text = "%5F" + text[1:]
    if len(text) > MAX_COMPONENT:
        digest = hashlib.blake2b(raw, digest_size=12).hexdigest()
        text = f"{text[:150]}~{digest}"
    return text


def join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def under(path: str, subtree: str | None) -> bool:
    """Whether the store path `path` is `subtree` or lies below it (None or "": every path)."""
    return subtree is None or subtree == "" or path == subtree or path.startswith(subtree.rstrip("/") + "/")


def within(path: str, subtrees: frozenset[str]) -> bool:
    """Whether the store path `path` is `under` one of `subtrees`."""
    return any(under(path, s) for s in subtrees)


def pick(mapping: Mapping[str, T], exact: Iterable[str], subtrees: frozenset[str]) -> dict[str, T]:
    """The entries of `mapping` (by store path) at the paths `exact` or `within` `subtrees`: looked up,
    and scanned for only where there are subtrees (rare: a file of values beside sharded ones)."""
    got = {p: mapping[p] for p in exact if p in mapping}
    if subtrees:
        got.update((p, v) for p, v in mapping.items() if within(p, subtrees))
    return got
