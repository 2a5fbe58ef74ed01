"""The safe unpickler and the light stand-ins it builds.

A rank file is a pickle, and a pickle is a program. Nothing in it is ever imported or called: every
global resolves, by policy, to one of three things.
- `ALLOWED` globals map to inert stand-ins (no torch, no torch.distributed, no process group); with
  `strict=False`, so do `pathlib` paths and `TorchVersion` (`SAFE_EXTRAS`), which are only strings.
- Globals that exist to run code or reach the system (`opaque.refusal`) are refused with one line.
- Any other global (a trainer's own class) becomes an `Opaque` record of how it was built, unless
  `strict`, which refuses everything outside `ALLOWED`.
Storages become `StorageRef`s that point into the zip, so tensor bytes stay on disk until copied.
"""

from __future__ import annotations

import _codecs
import _compat_pickle
import collections
import datetime
import io
import pathlib
import pickle
from typing import Any, Callable, NamedTuple

import numpy as np

from ... import dtypes
from ...errors import CheckpointError, UnsafePickleError, named
from ...gcpause import gc_paused
from ...records import Building, StorageRef, TensorRef, TorchDevice, TorchDType, TorchVersion, building_class, refusal
from .pickle_scan import ScanError, scan

# Distinct opaque globals one pickle may name: far above any real trainer state, and it bounds the
# classes a hostile file can make us create.
MAX_OPAQUE_GLOBALS = 4096


class _Record:
    """Base for stand-ins that pickle rebuilds with NEWOBJ + BUILD. Deliberately without __setstate__:
    the C unpickler then applies dict state, or (dict, slots) state, itself, which is what keeps hundreds
    of thousands of ShardMetadata per file cheap."""


class RemoteDevice(_Record):
    """torch.distributed._remote_device: "rank:R/device"."""

    def rank(self) -> int | None:
        return self.__dict__.get("_rank")

    def device(self) -> str:
        return str(self.__dict__.get("_device"))


class ShardMetadata(_Record):
    shard_offsets: list[int]
    shard_sizes: list[int]
    placement: RemoteDevice | None


class Shard(_Record):
    tensor: TensorRef
    metadata: ShardMetadata


class TensorProperties(_Record):
    dtype: TorchDType

    def __setstate__(self, state: Any) -> None:
        # TensorProperties pickles a bare tuple: (dtype, layout, requires_grad, memory_format, pin_memory).
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype = state[0]
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            raise CheckpointError("unexpected pickled state for TensorProperties")


class ShardedTensorMetadata(_Record):
    shards_metadata: list[ShardMetadata]
    size: tuple[int, ...]
    tensor_properties: TensorProperties


class ProcessGroupState(_Record):
    local_rank: int
    global_rank: int
    local_world_size: int
    global_world_size: int


class ChunkShardingSpec(_Record):
    pass


class EnumerableShardingSpec(_Record):
    pass


class ShardedTensor(_Record):
    """The stand-in for torch's ShardedTensor: its local shards, the global metadata, the group state."""

    local_shards: list[Shard]
    metadata: ShardedTensorMetadata
    pg_state: ProcessGroupState | None

    ProcessGroupState = ProcessGroupState

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) >= 2):
            raise CheckpointError("unexpected pickled state for ShardedTensor")
        self.local_shards = list(state[0])
        self.metadata = state[1]
        self.pg_state = state[2] if len(state) > 2 else None


class DTensor(_Record):
    """The stand-in for torch's DTensor: `_local_tensor` (a TensorRef) and `_spec` (a DTensorSpec)."""

    _local_tensor: Any
    _spec: Any

    def __setstate__(self, state: Any) -> None:
        # torch pickles a tensor subclass's state as its __dict__, or as (dict, slots) where it has slots.
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if part is not None and not isinstance(part, dict):
                raise CheckpointError("unexpected pickled state for DTensor")
            self.__dict__.update(part or {})


class DTensorSpec(_Record):
    """DTensorSpec: mesh, placements (one per mesh dimension), tensor_meta (global shape, stride, dtype)."""


class DeviceMesh(_Record):
    """DeviceMesh, as data: its ranks (`mesh`, or `_rank_map` with `_layout` since torch 2.10), dimension
    names and this rank's coordinate. Its process groups are names only; nothing is looked up or joined."""


class MeshLayout(_Record):
    """torch's private `_MeshLayout` / `_FlatLayout` (shape and stride of a mesh over its rank map)."""


class Placement(_Record):
    """A DTensor placement: `Shard` (dim), `_StridedShard` (dim, split_factor), `Replicate`, `Partial`."""

    kind = ""


def _placement(kind: str) -> type:
    return type(kind, (Placement,), {"kind": kind, "__module__": __name__})


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any


class ShardOrderEntry(NamedTuple):
    tensor_dim: int
    mesh_dims: tuple[int, ...]


class DcpMetadata(_Record):
    """torch.distributed.checkpoint's Metadata: state_dict_metadata, planner_data, storage_data, ..."""

    state_dict_metadata: Any  # as pickled: checked where read (read/formats/dcp.py)
    planner_data: Any
    storage_data: Any


class DcpTensorStorage(_Record):
    """TensorStorageMetadata: properties, size, chunks."""

    properties: Any  # as pickled: checked where read (read/formats/dcp.py)
    size: Any
    chunks: Any


class DcpBytesStorage(_Record):
    """BytesStorageMetadata: a pickled object."""


class _Adopting(_Record):
    """A stand-in of which a .metadata holds one or more per item: it takes its pickled state dict as its
    `__dict__` rather than copying it. The unpickler's memo keeps that dict alive until the load ends
    anyway, so a copy held every attribute twice (W=4096 FSDP2: 8 MB of the 48 MB a 4.6 MB .metadata
    took to load)."""

    def __setstate__(self, state: Any) -> None:
        if type(state) is dict:
            self.__dict__ = state
            return
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:  # (dict, slots): what a dataclass with slots pickles
            if part is not None and not isinstance(part, dict):
                raise CheckpointError(f"unexpected pickled state for {type(self).__name__}")
            self.__dict__.update(part or {})


class DcpChunk(_Adopting):
    """ChunkStorageMetadata: offsets, sizes."""


class DcpIndex(_Adopting):
    """MetadataIndex: fqn, offset, index (a key of storage_data)."""


class DcpStorageInfo(_Adopting):
    """_StorageInfo: relative_path, offset, length, transform_descriptors (torch's, or OLMo-core's twin)."""


class DcpStorageMeta(_Record):
    """StorageMeta: checkpoint_id, save_id, load_id, modules."""


class Unread:
    """What a value shardstore never reads is built as: one shared object, whatever its arguments, its state
    dropped. Megatron-Core keeps every rank's local save plan in its .metadata (`all_local_plans`, as many
    write items again as `storage_data` holds); as opaque records those were 136 MB of DeepSeek-V3's 233.
    The unpickler still resolves (and refuses) every global inside them."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> "Unread":
        return UNREAD

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # REDUCE (an enum's value) calls the class
        pass

    def __setstate__(self, state: Any) -> None:  # BUILD
        pass


UNREAD = object.__new__(Unread)
# torch's save-plan classes, which only a .metadata's copy of the local plans holds (`DCP_PLACEHOLDERS`)
DCP_PLACEHOLDERS: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.planner", name): Unread
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")}


class ShardParamInfo(NamedTuple):
    """FSDP1's `_ShardParamInfo` (torch 2.1+): where an original parameter's piece lies in a rank's flat
    slice. A NamedTuple, pickled as its five fields; OLMo's `local` model files hold one per parameter."""

    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None  # inclusive


class _TensorType:
    """Marker for `torch.Tensor` / `torch.nn.Parameter` when they appear as rebuild targets."""


def _wrapper_subclass(cls: Any, dtype: Any, size: Any, *rest: Any) -> Any:
    if cls is ShardedTensor or cls is DTensor:
        return cls.__new__(cls)
    raise UnsafePickleError(f"tensor subclass {getattr(cls, '__name__', cls)!r} is not supported")


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: tuple[Any, ...], state: Any) -> Any:
    ret = func(*args)
    if isinstance(ret, (ShardedTensor, DTensor)):
        ret.__setstate__(state)
    return ret


def _rebuild_tensor_v2(storage: StorageRef, storage_offset: int, size: Any, stride: Any, *rest: Any) -> TensorRef:
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_tensor_v3(storage: StorageRef, storage_offset: int, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, dtype: TorchDType, *rest: Any) -> TensorRef:
    # v3 pairs an untyped (byte) storage with an explicit dtype; offsets are in elements of that dtype.
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride), str(dtype))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _safe_getattr(obj: Any, name: str) -> Any:
    if obj is ShardedTensor and name == "ProcessGroupState":
        return ProcessGroupState
    raise UnsafePickleError(f"refusing getattr({getattr(obj, '__name__', type(obj).__name__)}, {name!r}) "
                            f"(nothing was run)")


def _device(kind: str, index: int | None = None) -> TorchDevice:
    return TorchDevice(kind if index is None else f"{kind}:{index}")


def _mem_format(value: int) -> int:
    return int(value)


def _bytearray(*args: Any) -> bytearray:
    """bytearray from the data a pickle carries (bytes, or a str and its codec), never from a count: pickle
    writes bytearrays as their contents, and `bytearray(2**30)` would allocate a gigabyte from five bytes."""
    if not args or isinstance(args[0], int):
        raise UnsafePickleError("refusing bytearray(<count>): a checkpoint carries a bytearray's contents")
    return bytearray(*args)


class _NDArrayType:
    """`numpy.ndarray` as a pickle names it: only ever the subtype handed to `_reconstruct`."""


def _np_reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy pickles an array as `_reconstruct(ndarray, (0,), b"b")` followed by its state (shape, dtype and
    the data, whose length numpy checks); only that empty start is allowed, so no size written in the pickle
    allocates memory the pickle does not carry."""
    if subtype is not _NDArrayType or not (isinstance(shape, tuple) and all(isinstance(d, int) and d == 0 for d in shape)):
        raise UnsafePickleError("refusing numpy _reconstruct of anything but an empty ndarray")
    return np.empty(shape, dtype=np.dtype(dtype))


class _StorageType:
    """A storage class global (torch.FloatStorage, torch.UntypedStorage): only its dtype matters."""

    def __init__(self, dtype: str):
        self.dtype = dtype


_SHARD = "torch.distributed._shard"
ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "getattr"): _safe_getattr,
    ("datetime", "timedelta"): datetime.timedelta,
    ("datetime", "datetime"): datetime.datetime,
    ("datetime", "date"): datetime.date,
    ("_codecs", "encode"): _codecs.encode,
    # An in-memory buffer (torchtitan keeps torch.save'd loss histories in its train state): built from the
    # bytes the pickle carries, it runs no code and touches no file. The rest of `io` stays refused.
    ("_io", "BytesIO"): io.BytesIO,
    ("io", "BytesIO"): io.BytesIO,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._tensor", "_rebuild_from_type"): lambda func, new_type, args, state: func(*args),
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("torch", "Size"): tuple,
    ("torch", "device"): _device,
    ("torch.serialization", "_get_layout"): str,
    # Layouts and memory formats pickle by name (older torch wrote them into TensorProperties).
    **{("torch", n): f"torch.{n}" for n in ("strided", "sparse_coo", "contiguous_format", "channels_last",
                                             "channels_last_3d", "preserve_format")},
    ("torch.storage", "UntypedStorage"): _StorageType("uint8"),
    ("torch", "UntypedStorage"): _StorageType("uint8"),
    (f"{_SHARD}.sharded_tensor.api", "ShardedTensor"): ShardedTensor,
    (f"{_SHARD}.sharded_tensor", "ShardedTensor"): ShardedTensor,
    (f"{_SHARD}.sharded_tensor.shard", "Shard"): Shard,
    (f"{_SHARD}.metadata", "ShardMetadata"): ShardMetadata,
    (f"{_SHARD}.sharded_tensor.metadata", "ShardedTensorMetadata"): ShardedTensorMetadata,
    (f"{_SHARD}.sharded_tensor.metadata", "TensorProperties"): TensorProperties,
    (f"{_SHARD}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): _mem_format,
    (f"{_SHARD}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"): ChunkShardingSpec,
    (f"{_SHARD}.sharding_spec.api", "EnumerableShardingSpec"): EnumerableShardingSpec,
    ("torch.distributed.remote_device", "_remote_device"): RemoteDevice,
    # torch.distributed.checkpoint's .metadata (and OLMo-core's copy of _StorageInfo, never imported)
    ("torch.distributed.checkpoint.metadata", "Metadata"): DcpMetadata,
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"): DcpTensorStorage,
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"): DcpBytesStorage,
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"): DcpChunk,
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"): DcpIndex,
    ("torch.distributed.checkpoint.metadata", "StorageMeta"): DcpStorageMeta,
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): TensorProperties,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DcpStorageInfo,
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): DcpStorageInfo,
    # DTensors (FSDP2, FSDP1 with a device mesh) in per-rank torch.save files; the modules moved in torch 2.4
    **{(f"torch.distributed.{m}", "DTensor"): DTensor for m in ("tensor", "_tensor", "_tensor.api", "tensor._api")},
    **{(f"torch.distributed.{m}", n): c for m in ("tensor._dtensor_spec", "_tensor._dtensor_spec",
                                                  "_tensor.placement_types", "tensor.placement_types")
       for n, c in (("DTensorSpec", DTensorSpec), ("TensorMeta", TensorMeta), ("ShardOrderEntry", ShardOrderEntry))},
    **{(f"torch.distributed.{m}", n): _placement(n) for m in ("tensor.placement_types", "_tensor.placement_types")
       for n in ("Shard", "_StridedShard", "Replicate", "Partial", "_Partial")},
    ("torch.distributed.device_mesh", "DeviceMesh"): DeviceMesh,
    ("torch.distributed._tensor.device_mesh", "DeviceMesh"): DeviceMesh,
    ("torch.distributed._mesh_layout", "_MeshLayout"): MeshLayout,
    ("torch.distributed._mesh_layout", "_FlatLayout"): MeshLayout,
    # FSDP1 flat-parameter metadata in OLMo's `local` model files (the module moved in torch 2.1)
    ("torch.distributed.fsdp._flat_param", "_ShardParamInfo"): ShardParamInfo,
    ("torch.distributed.fsdp.flat_param", "_ShardParamInfo"): ShardParamInfo,
}
try:
    from numpy._core import multiarray as _multiarray
except ImportError:  # numpy 1.x
    from numpy.core import multiarray as _multiarray  # type: ignore[no-redef]
for _np in ("numpy.core", "numpy._core"):
    ALLOWED[(f"{_np}.multiarray", "_reconstruct")] = _np_reconstruct
    ALLOWED[(f"{_np}.multiarray", "scalar")] = _multiarray.scalar
ALLOWED[("numpy", "ndarray")] = _NDArrayType
ALLOWED[("numpy", "dtype")] = np.dtype
for _info in dtypes.BY_NAME.values():
    ALLOWED[("torch", _info.name)] = TorchDType(_info.name)
    if _info.storage_class:
        ALLOWED[("torch", _info.storage_class)] = _StorageType(_info.name)
for _alias, _name in dtypes._ALIASES.items():
    ALLOWED[("torch", _alias)] = TorchDType(_name)
# numpy dtype classes numpy 2 pickles for dtypes (numpy.dtypes.Float64DType and friends).
for _cls in ("Float64DType", "Float32DType", "Float16DType", "Int64DType", "Int32DType", "Int16DType", "Int8DType",
             "UInt64DType", "UInt32DType", "UInt16DType", "UInt8DType", "BoolDType"):
    if hasattr(np, "dtypes") and hasattr(np.dtypes, _cls):
        ALLOWED[("numpy.dtypes", _cls)] = getattr(np.dtypes, _cls)


class _PickledPath:
    """Mixin for the stand-ins of pathlib's classes: pure paths that remember which class was pickled."""

    kind = "PurePosixPath"


def _path_class(kind: str) -> type:
    pure = pathlib.PureWindowsPath if "Windows" in kind else pathlib.PurePosixPath
    return type(kind, (_PickledPath, pure), {"kind": kind})


_PATH_KINDS = ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "PurePath")
# Safe without being torch's own: allowed unless strict.
SAFE_EXTRAS: dict[tuple[str, str], Any] = {
    ("torch.torch_version", "TorchVersion"): TorchVersion,
    **{(module, kind): _path_class({"Path": "PosixPath", "PurePath": "PurePosixPath"}.get(kind, kind))
       for module in ("pathlib", "pathlib._local") for kind in _PATH_KINDS},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: io.BytesIO, source: str, strict: bool, placeholders: dict[tuple[str, str], Any]):
        super().__init__(data)
        self._source = source
        self._strict = strict
        self._placeholders = placeholders
        self._opaque: dict[tuple[str, str], type[Building]] = {}

    def find_class(self, module: str, name: str) -> Any:
        # Protocol-2 pickles use Python 2 names (__builtin__); the C unpickler hands them over raw.
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = (module, name)
        if key in ALLOWED:
            return ALLOWED[key]
        if key in self._placeholders:
            return self._placeholders[key]
        if not self._strict and key in SAFE_EXTRAS:
            return SAFE_EXTRAS[key]
        why = "not on the allowlist; --strict" if self._strict else refusal(module, name)
        if why:
            raise UnsafePickleError(f"{self._source}: refusing to load global {module}.{name} ({why}; nothing was run)")
        cls = self._opaque.get(key)
        if cls is None:
            if len(self._opaque) >= MAX_OPAQUE_GLOBALS:
                raise CheckpointError(f"{self._source}: names more than {MAX_OPAQUE_GLOBALS} distinct classes "
                                      f"outside torch (corrupt or hostile pickle)")
            cls = self._opaque[key] = building_class(module, name)
        return cls

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self._source}: unknown persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointError(f"{self._source}: storage of unknown type {storage_type!r:.80}")
        return StorageRef(str(key), storage_type.dtype, int(numel))


def load(data: bytes | memoryview, source: str, strict: bool = False,
         placeholders: dict[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle `data` by the policy above (`strict`: allowlist only). `source` names the file in errors.
    `placeholders` are globals of the caller's own making (read/primitives/skim.py), which no file can name,
    or globals whose values the caller never reads (`DCP_PLACEHOLDERS`), checked after `ALLOWED`.

    The opcode stream is bounds-checked first (`pickle_scan`), so what the unpickler allocates stays within
    a small multiple of the data's own size whatever numbers the pickle holds."""
    try:
        scan(data)
    except ScanError as exc:
        raise CheckpointError(f"{source}: corrupt or hostile pickle ({exc})") from None
    with gc_paused(collect=False):
        unpickler = _Unpickler(io.BytesIO(data), source, strict, placeholders or {})
        try:
            return unpickler.load()
        except CheckpointError as exc:  # raised by a stand-in, which does not know the file: name it
            raise named(exc, source) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
                LookupError, OverflowError, RecursionError) as exc:
            raise CheckpointError(f"{source}: corrupt pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
        finally:
            # The unpickler and its own bound methods form a cycle; its memo would keep every object of
            # the file alive until a GC pass. Emptying it lets reference counting free them on time.
            unpickler.memo.clear()
