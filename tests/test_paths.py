"""Store paths: every key becomes a valid Zarr node name, and distinct keys stay distinct."""

from __future__ import annotations

import pytest

from shardstore import paths


@pytest.mark.parametrize("key, want", [
    ("wte.weight", "wte.weight"), (3, "3"), ("a/b", "a%2Fb"), ("50%", "50%25"), ("", "%"), (".", "%2E"),
    ("..", "%2E."), (".hidden", "%2Ehidden"), ("__metadata__", "%5F_metadata__"), ("_private", "_private"),
    ("zarr.json", "zarr%2Ejson"), ("Zarr.JSON", "Zarr%2EJSON"), ("a\x00b", "a%00b"), ("sp ace", "sp%20ace"),
    ("é", "%C3%A9"), ("e\u0301", "e%CC%81"), ("\udcc3\udca9", "%ED%B3%83%ED%B2%A9"),
])
def test_escape(key: object, want: str) -> None:
    assert paths.escape(key) == want


def test_escaped_names_of_distinct_keys_differ() -> None:
    keys = ["a/b", "a%2Fb", "", "%", ".", "%2E", "__x", "%5F_x", "_x", "zarr.json", "zarr%2Ejson", "é", "e\u0301",
            "\udcc3\udca9", "x" * 300, "x" * 299 + "y", "x" * 150 + "~", ".a", "%2Ea"]
    names = [paths.escape(k) for k in keys]
    assert len(set(names)) == len(keys)
    assert all(len(n) <= paths.MAX_COMPONENT and n.isascii() and "/" not in n for n in names)


def test_join_skips_the_root() -> None:
    assert paths.join("", "model", "wte.weight") == "model/wte.weight"
