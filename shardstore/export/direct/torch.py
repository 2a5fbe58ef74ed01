"""`--format torch` in one pass: each file a torch zip whose arrays' entries are laid out first.

torch.load finds every record through the zip's central directory, so the order of the records in the
file is free. The arrays' entries (local header, then the bytes, 64-byte aligned as torch writes them)
come first, at offsets known from the plan; the workers fill them. The pickle needs the checkpoint's
values, which arrive with the data: it follows at the seal, with the small records, the tensors the
store assembled (staged pieces, plain tensors), and the central directory. Each entry's CRC-32 is
combined from the CRCs the workers recorded for what they wrote (the rank file's own where a piece is
one of its storage records whole).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from ...store.store import Store
from ..output import OutputFile
from ..torch import TorchFile, torch_layout, torch_object, write_entries
from ..torchzip import TorchZipWriter
from . import DirectExport
from .layout import Layout, Sketch, Target, entry_crc, journalled_runs, new_layout, prepare


@dataclass(frozen=True)
class TorchDirect(DirectExport):
    layout: Layout

    @property
    def files(self) -> list[str]:
        return list(self.layout.names)

    def seal(self, store: Store) -> None:
        runs = journalled_runs(store, self.layout)
        for i, file in enumerate(torch_layout(store)):
            zw, placed = _sketch(store, file)
            with OutputFile.reopen(Path(self.layout.folder) / file.name, zw.out.pos) as out:
                for name, (at, size) in zw.holes.items():
                    crc = entry_crc(runs.get(i, []), at, size, out.fd)
                    zw.set_crc(name, crc)
                    for position in zw.crc_at(name):
                        out.pwrite(struct.pack("<I", crc), position)
                zw.out = out
                write_entries(zw, torch_object(store, file), store, placed=placed)
                zw.close()


def _sketch(store: Store, file: TorchFile) -> tuple[TorchZipWriter, dict[str, str]]:
    """The file's array entries, sketched; and each array's storage key. The same every time it is asked,
    so the seal finds the entries where the workers wrote them."""
    zw = TorchZipWriter(Sketch(), Path(file.name).stem)
    placed: dict[str, str] = {}
    for path in file.arrays(store):
        entry = store.manifest.arrays[path]
        if path not in placed and not entry.staged:  # a staged array is assembled in the store
            placed[path] = str(len(placed))
            zw.hole(f"data/{placed[path]}", entry.nbytes)
    return zw, placed


def plan(store: Store) -> TorchDirect:
    targets: dict[str, list[Target]] = {}
    sizes, heads, files = [], [], torch_layout(store)
    for i, file in enumerate(files):
        zw, placed = _sketch(store, file)
        for path, key in placed.items():
            at, _ = zw.holes[f"data/{key}"]
            targets.setdefault(path, []).append(Target(i, at, None, store.manifest.arrays[path].dtype, crc=True))
        assert isinstance(zw.out, Sketch)
        sizes.append(zw.out.pos)
        heads.append(zw.out.writes)
    lay = new_layout(store, [f.name for f in files], sizes, targets)
    prepare(store, lay, heads)
    return TorchDirect(lay)
