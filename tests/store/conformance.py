"""The storage backends' conformance suite (in the spirit of zarr's `StoreTests`): every backend's tests
subclass `BackendTests` and provide

    backend    an empty store location of that backend, opened (store/backend.py: `Backend`);

and so show what the store above relies on: an object written is read back whole and by range, from
every kind of part the ingest and the exports hand over (bytes, views, file ranges); a rewrite replaces
it whole; a failed write leaves the old object and no trace of the new; a missing key is a KeyError;
listing gives the keys below a prefix and no temporaries; objects published together (commit records)
appear whole; the Zarr store reads what was written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardstore.ranges import FileRange
from shardstore.store.backend import Backend


class _Failing(Exception):
    pass


def _failing_parts():
    yield b"first half of a new object"
    raise _Failing("the source failed mid-write")


class BackendTests:
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        raise NotImplementedError

    def test_written_objects_read_back_whole_and_by_range(self, backend: Backend, tmp_path: Path) -> None:
        source = tmp_path / "source.bin"
        source.write_bytes(bytes(range(256)) * 64)
        fd = os.open(source, os.O_RDONLY)
        try:
            backend.write("a/b/key", [b"head-", memoryview(b"view-"), FileRange(fd, 100, 900, str(source)),
                                      bytearray(b"-tail")], durable=True)
        finally:
            os.close(fd)
        want = b"head-view-" + source.read_bytes()[100:1000] + b"-tail"
        assert backend.read("a/b/key") == want and backend.size("a/b/key") == len(want)
        assert backend.read("a/b/key", 5, 20) == want[5:25] and backend.read("a/b/key", len(want) - 3) == want[-3:]
        assert backend.exists("a/b/key") and not backend.exists("a/b/other")
        backend.sync(["a/b/key"])  # durable where it was not yet: a no-op or a flush, never an error

    def test_a_missing_key_is_a_key_error(self, backend: Backend) -> None:
        with pytest.raises(KeyError):
            backend.read("nowhere")
        with pytest.raises(KeyError):
            backend.size("nowhere")
        assert backend.list("nowhere") == []

    def test_a_rewrite_replaces_and_a_failed_write_leaves_the_old_object(self, backend: Backend) -> None:
        backend.write("d/k", [b"old object"])
        backend.write("d/k", [b"new"])
        assert backend.read("d/k") == b"new"
        with pytest.raises(_Failing):
            backend.write("d/k", _failing_parts())
        assert backend.read("d/k") == b"new"  # never half of the failed one
        assert backend.list("d") == ["d/k"]  # and no trace of it
        assert backend.sweep_temporaries() == 0  # its writer is alive: nothing of another's to sweep

    def test_listing_gives_the_keys_below_a_prefix(self, backend: Backend) -> None:
        for key in ("p/x", "p/y", "q/z"):
            backend.write(key, [key.encode()])
        assert backend.list("p") == ["p/x", "p/y"] and backend.list("p/") == ["p/x", "p/y"]
        assert backend.list("q") == ["q/z"]

    def test_the_zarr_store_reads_what_was_written(self, backend: Backend) -> None:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync  # zarr's own event loop, as its synchronous API (the store's) uses

        backend.write("group/data", [b"0123456789"])
        buffer = sync(backend.zarr_store().get("group/data", prototype=default_buffer_prototype()))
        assert buffer is not None and buffer.to_bytes() == b"0123456789"

    def test_published_objects_appear_whole_after_what_they_commit(self, backend: Backend) -> None:
        backend.write("cells/a", [b"cell bytes"])
        backend.publish([("ranks/0.json", b'{"rank": 0}'), ("ranks/1.json", b'{"rank": 1}')], after=["cells/a"])
        assert backend.list("ranks") == ["ranks/0.json", "ranks/1.json"]
        assert backend.read("ranks/1.json") == b'{"rank": 1}' and backend.read("cells/a") == b"cell bytes"
        backend.publish([], after=[])  # an empty batch: nothing to do

    def test_objects_read_and_written_together_are_each_whole(self, backend: Backend) -> None:
        backend.write_many([("m/a", b"alpha"), ("m/b", b"bravo bytes"), ("m/c", b"")])
        backend.write_many([])  # an empty batch: nothing to do
        assert backend.read_many(["m/b", "m/none", "m/a", "m/c"]) == [b"bravo bytes", None, b"alpha", b""]
        assert backend.read_many(["m/a", "m/none", "m/b"], 1) == [b"a", None, b"b"]  # a first byte: is it there
        assert backend.read_many([]) == []
        assert backend.list("m") == ["m/a", "m/b", "m/c"]
