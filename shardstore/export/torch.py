"""`--format torch`: state dicts `torch.load` reads, written without ever holding a whole tensor set.

A checkpoint of a trainer with files of its own to resume from gets those (its `Trainer.resume_files`:
OLMo's model.pt, optim.pt and train.pt as its own unsharder writes them; the HF Trainer's, Accelerate's
and Lightning's files without FSDP); any other gets one checkpoint.pt in the input's own nesting. Where
the trainer's `rng` list holds each rank file's own state (Composer's), the whole file's lists every
rank's in rank order, as the trainer's own monolithic checkpoints do.

In one pass (`plan_direct`) each file is a torch zip whose arrays' entries are laid out first.

torch.load finds every record through the zip's central directory, so the order of the records in the
file is free. The arrays' entries (local header, then the bytes, 64-byte aligned as torch writes them)
come first, at offsets known from the plan; the workers fill them. The pickle needs the checkpoint's
values, which arrive with the data: it follows at the seal, with the small records, the tensors the
store assembled (staged pieces, plain tensors), and the central directory. Each entry's CRC-32 is
combined from the CRCs the workers recorded for what they wrote (the rank file's own where a piece is
one of its storage records whole).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import dtypes
from ..records import GlobalRef, Opaque, TorchDevice, TorchDType, TorchVersion
from ..sink.layout import Layout, Sketch, Target, entry_crc, journalled_runs, new_layout, prepare
from ..sink.output import OutputFile
from ..store.handle import TensorValue, tensor_value
from ..store.store import Store
from ..tree import Node, node_at
from .contract import Arrays, DirectExport, ExportRequest, OutputFormat, Planned, Progress, Written
from .notes import flat_buckets
from ..trainers.contract import ResumeFile
from ..trainers.registry import trainer
from .resolve import ArrayRef, build, leaves
from .torchzip import Sink, TorchZipWriter

# torch.save's own pickle protocol; also what the OLMo files are.
PROTOCOL = 2


# The pure-Python pickler, whose dispatch table and helpers the torch and DCP writers extend (they write
# globals they never import, which the C pickler cannot); typeshed does not describe it.
PythonPickler: Any = pickle._Pickler


class _Pickler(PythonPickler):  # type: ignore[misc]  # (typeshed: above)
    """Pickles tensors and ArrayRefs the way torch.save does, collecting their storages for later.

    Opaque records are written back as the opcodes that built them (the same global, arguments and
    state), which needs the Python pickler: the C one cannot name a global it has not imported."""

    dispatch = PythonPickler.dispatch.copy()

    def save_global_ref(self, ref: GlobalRef) -> None:
        self.write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode("ascii"))

    def save_opaque(self, obj: Opaque) -> None:
        if obj.kwargs:  # NEWOBJ_EX needs protocol 4; at torch.save's protocol 2 copyreg spells it
            self.save_global_ref(GlobalRef("copyreg", "__newobj_ex__"))
            self.save((GlobalRef(obj.module, obj.name), tuple(obj.args), dict(obj.kwargs)))
            self.write(pickle.REDUCE)
        else:
            self.save_global_ref(GlobalRef(obj.module, obj.name))
            self.save(tuple(obj.args))
            self.write(pickle.NEWOBJ if obj.newobj else pickle.REDUCE)
        self.memoize(obj)
        if obj.items:
            self._batch_appends(iter(obj.items))
        if obj.dictitems:
            self._batch_setitems(iter(obj.dictitems))
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[GlobalRef] = save_global_ref
    dispatch[Opaque] = save_opaque

    def __init__(self, buf: io.BytesIO, keys: dict[str, str] | None = None, placed: bool = False):
        super().__init__(buf, protocol=PROTOCOL)
        self.keys = keys or {}  # store path -> storage key of an array (`storage_keys`)
        self.placed = placed  # those arrays are written already (one pass)
        self.storages: list[tuple[str, Any]] = []  # (key, ArrayRef or TensorValue) of every storage to write
        self._next = len(self.keys)
        self._keyed: set[str] = set()
        self._rebuilt: dict[int, tuple[Any, Opaque]] = {}  # id(tensor) -> (it, its rebuild): one per tensor
        self._canonical: dict[tuple[type, Any], Any] = {}

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        """torch's objects written as torch.save writes them, from shardstore's stand-ins: no torch here.

        The pickle must not depend on where its values came from (records read back from the store, or
        still in memory from this run's units; a skimmed pickle or a whole one), yet pickle shares what
        is the same object. So equal strings and bytes are always one object (shared after the first),
        and a tensor's size and stride are always new tuples (never shared), as torch.save's are."""
        if type(obj) in (str, bytes):
            obj = self._canonical.setdefault((type(obj), obj), obj)
        elif isinstance(obj, (ArrayRef, TensorValue)):
            obj = self._rebuild(obj)
        elif isinstance(obj, TorchDType):
            obj = GlobalRef("torch", str(obj))
        elif isinstance(obj, TorchDevice):
            obj = Opaque("torch", "device", (str(obj),))
        elif isinstance(obj, TorchVersion):
            obj = Opaque("torch.torch_version", "TorchVersion", (str(obj),))
        elif type(obj).__module__ == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
            obj = self._rebuild(obj)  # a value decoded with torch (DCP's items)
        super().save(obj, save_persistent_id)

    def _rebuild(self, obj: Any) -> Opaque:
        """`torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())`, as torch.save
        pickles a contiguous tensor (v3, with the dtype, where no typed storage class exists)."""
        if id(obj) in self._rebuilt:
            return self._rebuilt[id(obj)][1]
        tensor = obj if isinstance(obj, (ArrayRef, TensorValue)) else tensor_value(obj)
        shape, dtype = tuple(int(d) for d in tensor.shape), tensor.dtype  # a new tuple: see `save`
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= max(d, 1)
        args: tuple[Any, ...] = (self._storage(tensor), 0, shape, tuple(reversed(stride)), False,
                       Opaque("collections", "OrderedDict"))
        name = "_rebuild_tensor_v2"
        if not dtypes.info(dtype).storage_class:
            args, name = args + (GlobalRef("torch", dtype),), "_rebuild_tensor_v3"
        rebuilt = Opaque("torch._utils", name, args)
        self._rebuilt[id(obj)] = (obj, rebuilt)  # (the tensor stays referenced: its id is not reused)
        return rebuilt

    def _storage(self, source: "ArrayRef | TensorValue") -> "_Storage":
        key = self.keys.get(source.path) if isinstance(source, ArrayRef) and source.rows is None else None
        if key is None:
            key, self._next = str(self._next), self._next + 1  # once per tensor (`_rebuild` keeps them)
        elif self.placed or key in self._keyed:  # written already, by the workers; or this array's again
            return _Storage(key, source)  # (a tied name as another object: still one storage)
        else:
            self._keyed.add(key)
        self.storages.append((key, source))
        return _Storage(key, source)

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _Storage):
            return None
        info = dtypes.info(obj.source.dtype)
        numel = math.prod(obj.source.shape)
        if info.storage_class:
            return ("storage", GlobalRef("torch", info.storage_class), obj.key, "cpu", numel)
        return ("storage", GlobalRef("torch.storage", "UntypedStorage"), obj.key, "cpu", numel * info.itemsize)


@dataclass(frozen=True)
class _Storage:
    key: str
    source: "ArrayRef | TensorValue"


def save(store: Store, obj: Any, path: Path, progress: Callable[[int], None] | None = None,
         force_zip64: bool = False, partial: dict[str, str] | None = None, keys: dict[str, str] | None = None) -> None:
    """Write `obj` (ArrayRefs streamed from `store`) as a torch.save-compatible file at `path`.

    `partial` allows holes in an incomplete store; it is recorded as an extra record
    (`<archive>/shardstore_partial.json`) that torch.load ignores and anyone can read with a zip tool.
    """
    with OutputFile(path, progress) as out:
        write_zip(out, path.stem, obj, store, partial, force_zip64, keys=keys)


def write_zip(out: Sink, archive: str, obj: Any, store: Store, partial: dict[str, str] | None = None,
              force_zip64: bool = False, holes: bool = False, keys: dict[str, str] | None = None) -> TorchZipWriter:
    """What torch.save writes for `obj`, at the output's current position; with `holes`, the store's
    arrays are left as holes for the one-pass export's workers to fill (sink/, each format's `plan_direct`)."""
    zw = TorchZipWriter(out, archive, force_zip64=force_zip64)
    write_entries(zw, obj, store, partial, keys=keys, holes=holes)
    zw.close()
    return zw


def write_entries(zw: TorchZipWriter, obj: Any, store: Store, partial: dict[str, str] | None = None,
                  keys: dict[str, str] | None = None, placed: bool = False, holes: bool = False) -> None:
    """The pickle and every storage of `obj`, the arrays' under their `keys` (store path -> storage key),
    but the arrays `placed` already (one pass)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, keys, placed)
    pickler.dump(obj)
    zw.add_bytes("data.pkl", buf.getvalue())
    zw.add_bytes(".format_version", b"1")
    zw.add_bytes(".storage_alignment", str(64).encode())
    zw.add_bytes("byteorder", b"little")
    for key, source in pickler.storages:
        if isinstance(source, ArrayRef) and holes:
            zw.hole(f"data/{key}", source.nbytes)
        elif isinstance(source, ArrayRef):
            known = source.stored_crc(store) if partial is None else None
            zw.add(f"data/{key}", source.parts(store, allow_partial=partial is not None), source.nbytes, known)
        else:
            zw.add_bytes(f"data/{key}", source.data)
    zw.add_bytes("version", b"3\n")
    zw.add_bytes(SERIALIZATION_ID, serialization_id())
    if partial is not None:
        zw.add_bytes("shardstore_partial.json", json.dumps(partial).encode())


SERIALIZATION_ID = ".data/serialization_id"


def serialization_id() -> bytes:
    """What torch.save writes as each file's `.data/serialization_id`: a new random one every time."""
    return secrets.token_hex(20).encode()


def torch_layout(store: Store, single: bool = False) -> list[ResumeFile]:
    """The files `export_torch` writes for this store's layout, and what each holds; `single`: the whole
    state in one checkpoint.pt, whatever the layout (ExportRequest.single_file)."""
    tree = store.manifest.tree
    if single:
        return [ResumeFile("checkpoint.pt", tree)]
    resumed = trainer(store.manifest.layout).resume_files(tree, store.manifest.facts.ranked)
    return resumed or [ResumeFile("checkpoint.pt", tree)]


def torch_files(store: Store, single: bool = False) -> list[str]:
    """The names of the files `export_torch` writes."""
    return [f.name for f in torch_layout(store, single)]


def torch_object(store: Store, file: ResumeFile) -> Any:
    """What one of the files holds, its arrays as ArrayRefs."""
    state = _tied(store, file.node, build(store, file.node, plain_dicts=file.plain_dicts, lean=True))
    if file.dropped:
        return {k: v for k, v in state.items() if k not in file.dropped}
    if file.form is not None:
        return file.form(state)
    if not trainer(store.manifest.layout).rng_per_rank or not isinstance(state.get("rng"), list):
        return state
    rng_node = node_at(file.node, "rng")
    holders = _holders(store, rng_node)
    if len(holders) > 1:  # one rank file each: every rank's one-element list, in rank order
        state["rng"] = [item for rank in holders for item in build(store, rng_node, rank=rank, lean=True)]
    # else: saved once (Composer >= 0.16's DCP keeps every rank's state in global rank 0's list): as it is
    return state


def export_torch(store: Store, out_dir: Path, progress: Callable[[int], None] | None = None,
                 partial: dict[str, str] | None = None,
                 arrays: Arrays | None = None, single: bool = False) -> list[Path]:
    """The files `--format torch` writes (`single`: as one file); `arrays` replaces each array's reference
    (`average` streams a mean of several stores in its place)."""
    written = []
    for file in torch_layout(store, single):
        obj = torch_object(store, file)
        save(store, obj if arrays is None else _replaced(obj, arrays), out_dir / file.name, progress, partial=partial,
             keys=storage_keys(store, file))
        written.append(out_dir / file.name)
    return written


def _replaced(obj: Any, arrays: Arrays) -> Any:
    """`obj` with every ArrayRef replaced by `arrays(ref, its dtype)`; the containers `build` makes are rebuilt
    alike (bounded: `obj` was built from the store's tree, MAX_DEPTH deep at most)."""
    if isinstance(obj, ArrayRef):
        return arrays(obj, obj.dtype)
    if isinstance(obj, dict):
        return type(obj)((k, _replaced(v, arrays)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_replaced(v, arrays) for v in obj)
    return obj


def _tied(store: Store, node: Node, state: Any) -> Any:
    """Tied names (DeepSpeed's shared_params) added as the very tensor they are tied to, as the trainer's
    own state dict has them: one storage, two names."""
    tied = store.manifest.facts.tied
    if not tied:
        return state
    full = {path: keys for keys, path in leaves(store.manifest.tree)}
    here = {path: keys for keys, path in leaves(node)}
    for alias, target in tied:
        if target not in here:
            continue
        depth = len(full[target]) - len(here[target])
        if list(alias[:depth]) != full[target][:depth] or len(alias) <= depth:
            continue
        value, holder = state, state
        for key in here[target]:
            value = value[key]
        for key in alias[depth:-1]:
            holder = holder[key]
        holder[alias[-1]] = value
    return state


def _holders(store: Store, node: Node) -> list[int]:
    """The ranks whose records hold every value below `node`, in rank order."""
    paths = [path for _, path in leaves(node)]
    return sorted(r for r, rec in store.records(refresh=False).items() if all(p in rec.objects for p in paths))


# ---------------------------------------------------------------------------------------------- one pass
@dataclass(frozen=True)
class TorchDirect(DirectExport):
    layout: Layout
    single: bool  # one checkpoint.pt (torch_layout)

    @property
    def files(self) -> list[str]:
        return list(self.layout.names)

    def seal(self, store: Store) -> None:
        runs = journalled_runs(store, self.layout)
        for i, file in enumerate(torch_layout(store, self.single)):
            zw, placed = _sketch(store, file)
            with OutputFile.reopen(Path(self.layout.folder) / file.name, zw.out.pos) as out:
                for name, (at, size) in zw.holes.items():
                    crc = entry_crc(runs.get(i, []), at, size, out.fd)
                    zw.set_crc(name, crc)
                    for position in zw.crc_at(name):
                        out.pwrite(struct.pack("<I", crc), position)
                zw.out = out
                write_entries(zw, torch_object(store, file), store, keys=placed, placed=True)
                zw.close()


def _sketch(store: Store, file: ResumeFile) -> tuple[TorchZipWriter, dict[str, str]]:
    """The file's array entries, sketched; and each array's storage key. The same every time it is asked,
    so the seal finds the entries where the workers wrote them."""
    zw = TorchZipWriter(Sketch(), Path(file.name).stem)
    placed = storage_keys(store, file)
    for path, key in placed.items():
        zw.hole(f"data/{key}", store.manifest.arrays[path].nbytes)
    return zw, placed


def storage_keys(store: Store, file: ResumeFile) -> dict[str, str]:
    """Each array's storage key in `file`: numbered in state-dict order before any other tensor's, in
    one pass (whose workers fill the arrays' entries before the pickle is known) and in two steps alike."""
    arrays = [path for keys, path in leaves(file.node) if path in store.manifest.arrays
              and not (keys and keys[0] in file.dropped)]  # known before any value is
    return {path: str(i) for i, path in enumerate(dict.fromkeys(arrays))}


def plan_direct(store: Store, single: bool = False) -> TorchDirect:
    targets: dict[str, list[Target]] = {}
    sizes, heads, files = [], [], torch_layout(store, single)
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
    return TorchDirect(lay, single)


def _plan(store: Store, request: ExportRequest, node: Node, subtree: str, jobs: int) -> Planned:
    def write(out: Path, progress: Progress, partial: dict[str, str] | None, scheduler: str | None,
              jobs: int) -> Written:
        return export_torch(store, out, progress, partial, request.arrays, request.single_file), [], \
            flat_buckets(store.manifest.arrays)

    return Planned(torch_files(store, request.single_file), sum(a.nbytes for a in store.manifest.arrays.values()),
                   write)


TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def torch_files_in(out: Path) -> list[Path]:
    """The torch files of an output folder: the HF Trainer's pytorch_model*.bin where it has them (not the
    training_args.bin it writes beside them), else every .pt, .pth, .bin and .ckpt file."""
    return sorted(out.glob("pytorch_model*.bin")) or sorted(p for p in out.iterdir()
                                                           if p.suffix in TORCH_SUFFIXES and p.is_file())


def _recognises(out: Path) -> bool:
    return out.suffix in TORCH_SUFFIXES or out.is_dir() and not any(out.glob("*.safetensors")) \
        and bool(torch_files_in(out))


FORMAT = OutputFormat("torch", subtree=False, may_write=None, config_beside=True, resume_beside=True,
                      describes_model=False, single_file=True, takes_scheduler=False, plan=_plan,
                      direct=lambda store, request, node, subtree, jobs: plan_direct(store, request.single_file),
                      recognises=_recognises)
