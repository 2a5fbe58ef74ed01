"""`--format dcp` in one pass: every chunk's .distcp item laid out whole but for its tensor bytes.

A chunk is a store cell, as in the two-step export: its item is a small torch zip (the pickle of one
tensor, its one storage entry) known entirely from the plan, except the storage's bytes, which the
workers write, and its CRC-32, patched in at the seal from what they recorded. The values (and the
tensors the store assembles) arrive with the data: they go into one more .distcp file at the finish,
and `.metadata`, which makes the folder a checkpoint, is written last.
"""

from __future__ import annotations

import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ...store.store import Store
from ..dcp import METADATA, CellRef, Written, dcp_names, describe, distcp_name, metadata, spread, write_items
from ..output import OutputFile
from ..resolve import leaves
from ..torch import write_zip
from . import DirectExport
from .layout import Layout, Sketch, Target, entry_crc, journalled_runs, new_layout, prepare

# Where a chunk's item is: its file, its start and length there, its storage bytes' start and length,
# and the positions of its CRC-32 (local header, central directory).
Laid = tuple[int, int, int, int, int, list[int]]


@dataclass(frozen=True)
class DcpDirect(DirectExport):
    layout: Layout
    values: bool  # whether anything is left for the last .distcp file (values, assembled tensors)
    laid: dict[tuple[str, tuple[int, ...]], Laid]  # (store path, cell) -> where its item is

    @property
    def files(self) -> list[str]:
        return list(self.layout.names) + ([distcp_name(len(self.layout.names))] if self.values else []) + [METADATA]

    def seal(self, store: Store) -> None:
        runs = journalled_runs(store, self.layout)
        with ExitStack() as stack:  # each file made durable, or left for the rerun, as it exits
            files = [stack.enter_context(OutputFile.reopen(Path(self.layout.folder) / name, size))
                     for name, size in zip(self.layout.names, self.layout.sizes)]
            for file, _, _, at, size, positions in self.laid.values():
                crc = struct.pack("<I", entry_crc(runs.get(file, []), at, size, files[file].fd))
                for position in positions:
                    files[file].pwrite(crc, position)

    def finish(self, store: Store, out: Path) -> list[Path]:
        described, mappings, items = describe(store)
        results: dict[str, list] = {name: [] for name in self.layout.names}
        rest = []
        for item in items:
            where = self.laid.get((item.source.path, item.source.index)) if isinstance(item.source, CellRef) else None
            if where is None:
                rest.append(item)
            else:
                results[self.layout.names[where[0]]].append((item, where[1], where[2]))
        written: list[Written] = list(results.items())
        files = []
        if rest:
            name = distcp_name(len(self.layout.names))
            written.append(write_items(store, out / name, rest, False))
            files.append(out / name)
        with OutputFile(out / METADATA) as f:
            f.write(metadata(described, mappings, written))
        return files + [out / METADATA]


def _laid_out(store: Store, jobs: int) -> tuple[list[Sketch], dict[tuple[str, tuple[int, ...]], Laid]]:
    """Each .distcp file sketched, and where each chunk's item is."""
    cells = []
    for _, path in leaves(store.manifest.tree):
        entry = store.manifest.arrays.get(path)
        if entry is None or entry.staged:  # a value, or an array the store assembles: at the finish
            continue
        for flat in range(entry.ncells):
            index = entry.cell_index(flat)
            sizes = tuple(hi - lo for lo, hi in entry.cell_bounds(index))
            if 0 not in sizes:
                cells.append(CellRef(path, entry.dtype, sizes, index=index))
    sketches, laid = [], {}
    for file, refs in enumerate(spread(cells, jobs) if cells else []):
        sketch = Sketch()
        for ref in refs:
            start = sketch.pos
            zw = write_zip(sketch, "archive", ref, store, holes=True)
            (at, size), = zw.holes.values()
            laid[(ref.path, ref.index)] = (file, start, sketch.pos - start, at, size, zw.crc_at(next(iter(zw.holes))))
        sketches.append(sketch)
    return sketches, laid


def plan(store: Store, jobs: int) -> DcpDirect:
    dcp_names(store)  # two leaves DCP would name alike: refused before the ingest, not after it
    sketches, laid = _laid_out(store, jobs)
    targets: dict[str, list[Target]] = {}
    for (path, index), (file, _, _, at, _, _) in laid.items():
        entry = store.manifest.arrays[path]
        bounds = entry.cell_bounds(index)
        box = (tuple(lo for lo, _ in bounds), tuple(hi - lo for lo, hi in bounds))
        targets.setdefault(path, []).append(Target(file, at, box, entry.dtype, crc=True))
    lay = new_layout(store, [distcp_name(i) for i in range(len(sketches))], [s.pos for s in sketches], targets)
    prepare(store, lay, [s.writes for s in sketches])
    values = any(path not in targets for _, path in leaves(store.manifest.tree))
    return DcpDirect(lay, values, laid)
