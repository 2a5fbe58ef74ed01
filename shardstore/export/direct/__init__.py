"""One read, one write: `unshard` with every shard written straight into its place in the output, no copy
of it in the scratch store.

Every output byte's place is known once the checkpoint is planned: each format lays its files out
(safetensors: the headers and each tensor's byte range, or for `hf` each row block of a split weight;
torch: a zip entry per array, 64-byte aligned as torch writes them; DCP: a .distcp item per chunk). The
coordinator prepares the files (layout.py), each worker writes the pieces of its unit into them
(writer.py), makes them durable, and only then commits its unit in the scratch store, which keeps its
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

from abc import ABC, abstractmethod
from pathlib import Path

from ...store.store import Store
from .layout import CLAIMS, FOLDER, MOVING, Layout, Target
from .writer import DirectWriter


class DirectExport(ABC):
    """An export the ingest writes itself, one module per format (safetensors.py, torch.py, dcp.py).

    The call sequence: the format's `plan` lays the files out and prepares them (before any rank is read);
    the ingest's workers fill them (`layout` is what they are told); once every unit is journalled,
    `seal` writes what could only follow the data, in the files where they are (it may run again after a
    crash, and must then give the same files); the files are renamed into OUT; `finish` writes the files
    that go beside them, each atomically, the one that makes the folder loadable last.
    """

    layout: Layout

    @property
    @abstractmethod
    def files(self) -> list[str]:
        """Every file it leaves in OUT."""

    @property
    def skipped(self) -> list[str]:
        """Leaves it cannot hold (a safetensors file holds tensors only)."""
        return []

    @property
    def notes(self) -> list[str]:
        """What the user should know about the output."""
        return []

    def seal(self, store: Store) -> None:
        """The files' last bytes, once every unit is in (a torch zip's pickle and directory, the CRCs);
        nothing for safetensors."""

    def finish(self, store: Store, out: Path) -> list[Path]:
        """The files beside the laid-out ones, in OUT (the run's side files aside)."""
        return []


__all__ = ["CLAIMS", "DirectExport", "DirectWriter", "FOLDER", "Layout", "MOVING", "Target"]
