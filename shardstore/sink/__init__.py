"""Where a worker's pieces are written: one writer interface under ingest and export.

- `cells.py`: the Zarr store's cells (and staged small pieces, values, blobs), then the unit's commit
  record, which names its file's identity: the two-step path, and the journal of the one-pass path.
- `files.py`: the output files' byte ranges, laid out before any unit is read (`layout.py`).
- `output.py`: an output file written atomically (the exporters' too).

Both writers take `piece(entry, piece)`: the array's manifest entry and a box of it with its bytes
still in the unit's file (`Piece`); neither knows anything of pickles or of the input format.

One read, one write: `unshard` with every shard written straight into its place in the output, no copy
of it in the scratch store.

Every output byte's place is known once the checkpoint is planned: each format lays its files out
(safetensors: the headers and each tensor's byte range, or for `hf` each row block of a split weight;
torch: a zip entry per array, 64-byte aligned as torch writes them; DCP: a .distcp item per chunk). The
coordinator prepares the files (layout.py), each worker writes the pieces of its units into them
(files.py), makes them durable, and only then commits its units in the scratch store, which keeps their
values and is the journal a rerun resumes from. Once every unit is in, the export is sealed where the
files are (a torch file's pickle and directory, each entry's CRC-32 combined from what the workers
recorded), the files are renamed into OUT, and the files beside them follow (an index, a config,
`.metadata` last). A run killed at any moment leaves nothing in OUT that looks finished.

Under hybrid sharding every replica group's files hold every byte, and the units of one rank in the
shard group hold the same pieces. The first unit of each group rank to start claims it (a file created
exclusively) and writes; the others only check and commit. A claim counts only once its unit is
journalled: a run that starts again voids the claims of units that never committed, so their pieces are
written by whichever unit of that group rank comes next.

Where this does not apply the two-step path runs (ingest into the scratch store, then export from it):
safetensors tensors the plan cannot place before the data is read (plain values under the model: their
shapes come with the data; a Composer model's config lives in its values), hybrid sharding of other
formats than rank files, `--verify-replicas`, `--store`, and OUT on object storage. Dask workers write
into OUT as local ones do: it must be a folder they all see.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..ranges import Part
from ..store.manifest import ArrayEntry


class Piece(Protocol):
    """A box of an array, still in its source file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def rows(self, first: int, count: int) -> Part | None:
        """Rows [first, first + count) of the box as one contiguous byte range, or None if not contiguous."""

    def values(self) -> np.ndarray:
        """The box as an array of the store's raw dtype (a view where possible)."""

    def crc(self) -> int | None:
        """The CRC-32 its file stores for exactly the box's bytes, if it stores one."""


class Sink(Protocol):
    """Where a unit's pieces go: the store's cells (`cells.UnitWriter`) or the output files
    (`files.DirectWriter`)."""

    def piece(self, entry: ArrayEntry, piece: Piece) -> None:
        """Write one box of the array `entry` describes where it belongs."""
