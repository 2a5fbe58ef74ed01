"""Store paths for state-dict leaves: "optim/state/transformer.wte.weight/exp_avg".

A path component is the key's string form, escaped so it is a valid Zarr node name ("/" and "%" are
percent-encoded, and so are names Zarr reserves: empty, all dots, or starting with "__"). The real keys,
with their types, live in the manifest's tree, so paths only need to be unique, not reversible.
"""

from __future__ import annotations


def escape(key: object) -> str:
    text = str(key).replace("%", "%25").replace("/", "%2F")
    if text == "":
        return "%"
    if set(text) == {"."}:
        return "%2E" * len(text)
    if text.startswith("__"):
        return "%5F" + text[1:]
    return text


def join(*parts: str) -> str:
    return "/".join(p for p in parts if p)
