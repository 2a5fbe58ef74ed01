"""torch.distributed.checkpoint's Hugging Face safetensors (torch >= 2.8 `HuggingFaceStorageWriter`).

Two forms, told apart by their files:
- sharded (`save_distributed=True`): every rank writes `shard-{r:05}-model-{i:05}-of-{N:05}.safetensors`
  holding its local pieces; each header's `__metadata__` has `DCP_SHARDING_INFO`, JSON giving every
  tensor's `saved_offsets` (the piece's offset in the whole tensor). A tensor's whole shape is the
  furthest extent of its pieces. torchtitan's and NeMo Automodel's HF saves write this.
- consolidated (`consolidate_safetensors_files`, or `enable_consolidation=True`): a plain Hugging Face
  folder, `model-{i:05}-of-{N:05}.safetensors` (+ `model.safetensors.index.json`), every tensor whole in
  one file. Any Hugging Face safetensors folder reads the same way.

Each file is one unit. Its pieces are read in place (safetensors_file.py). The plan keeps a digest of each
file's header, and a worker refuses a file whose header is not the one planned.
The model's own files beside the weights (config.json, generation_config.json, tokenizer files) are
kept as side files, so `--format hf` needs no flag.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ...facts import CheckpointFacts
from ... import jsonin, paths
from ...errors import CheckpointError, closed_on_error
from ...hf_files import hf_model_file
from ...locations import StorageOptions, join, listing
from ...tree import KeyEncoder, Node
from ..contract import ArrayLeaf, CheckpointSpec, LocalPiece, ShardedSpec, ShardSpec
from ..primitives.container import read_small
from ..primitives.safetensors_file import SafetensorsFile, tensor_names
from ..unit import FileUnit, HeldPaths, planned_place

FORMAT = "dcp-hf"
SHARDED = re.compile(r"shard-[0-9]+-model-[0-9]+-of-[0-9]+\.safetensors\Z")
CONSOLIDATED = re.compile(r"model(-[0-9]+-of-[0-9]+)?\.safetensors\Z")
INFO = "DCP_SHARDING_INFO"
INDEX = "model.safetensors.index.json"
MAX_INDEX = 256 << 20  # a weight map of millions of tensors


def _name(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _weights(folder: str, storage_options: StorageOptions | None) -> list[str]:
    found = listing(folder, storage_options)
    sharded = [p for p in found if SHARDED.match(_name(p))]
    return sharded or [p for p in found if CONSOLIDATED.match(_name(p))]


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    return bool(_weights(folder, storage_options))


def run_of(unit: str) -> str:
    """The checkpoint folder of one of its files: the files lie in it, not in sub-folders."""
    return unit.replace("\\", "/").rsplit("/", 1)[0]


def unit_kind(name: str) -> str:
    return "safetensors files"


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    return _weights(folder, storage_options)


def side_files(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The model's config, generation config and tokenizer files beside the weights (or, for torchtitan's
    `sharded/` folder, beside it)."""
    places = [folder] + ([run_of(folder.rstrip("/"))] if _name(folder.rstrip("/")) == "sharded" else [])
    for place in places:
        found = [p for p in listing(place, storage_options)
                 if hf_model_file(_name(p))]
        if any(_name(p) == "config.json" for p in found):
            return found
    return []


def _pieces(st: SafetensorsFile) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """name -> (offsets in the whole tensor, local shape) of every tensor the file holds."""
    raw = st.metadata.get(INFO)
    offsets: dict[str, Any] = {}
    if raw is not None:
        info = jsonin.loads(raw, str(st.path), f"{INFO} metadata", CheckpointError)
        try:
            offsets = {name: d["saved_offsets"] for name, d in info.items()}
        except (TypeError, KeyError, AttributeError):
            raise CheckpointError(f"{st.path}: unreadable {INFO} metadata (forged or damaged)") from None
        if set(offsets) != set(st.tensors):
            stray = sorted(set(offsets) ^ set(st.tensors))[0]
            raise CheckpointError(f"{st.path}: {INFO} and the header disagree about {stray!r:.80}")
    out = {}
    order = list(offsets) or list(st.tensors)  # DCP's list keeps the state dict's order; the header sorts
    for name in order:
        ref = st.tensors[name]
        o = offsets.get(name, [0] * len(ref.shape))
        if not isinstance(o, list) or len(o) != len(ref.shape) or not all(type(v) is int and v >= 0 for v in o):
            raise CheckpointError(f"{st.path}: {name}: saved offsets {o!r:.80} do not fit its {len(ref.shape)}-d shape")
        out[name] = (tuple(o), tuple(ref.shape))
    return out


def _header_digest(st: SafetensorsFile, pieces: dict[str, tuple[Any, ...]]) -> str:
    described = sorted((n, st.tensors[n].dtype, o, s) for n, (o, s) in pieces.items())
    return hashlib.blake2b(repr(described).encode(), digest_size=16).hexdigest()


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    """Every file's header (its tensors' dtypes, shapes and offsets): the pieces of every tensor."""
    names = [_name(u) for u in unit_paths]
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {}
    dtype_of: dict[str, str] = {}
    headers = []
    for index, path in enumerate(unit_paths):
        with SafetensorsFile(path, storage_options) as st:
            pieces = _pieces(st)
            headers.append(_header_digest(st, pieces))
            for name, (o, s) in pieces.items():
                dtype = st.tensors[name].dtype
                if dtype_of.setdefault(name, dtype) != dtype:
                    raise CheckpointError(f"{path}: {name} is {dtype} here but {dtype_of[name]} in another file")
                boxes.setdefault(name, []).append((o, s, index))
    sharded = bool(SHARDED.match(names[0]))
    if not sharded:
        _check_index(folder, unit_paths, boxes, storage_options)
    for name, held in boxes.items():
        first: dict[tuple[Any, ...], int] = {}
        for o, s, index in held:
            twin = first.setdefault((o, s), index)
            if twin != index and sharded:  # DCP's planner saves every replicated piece once
                raise CheckpointError(f"{unit_paths[index]}: holds the piece of {name} at {list(o)} that "
                                      f"{names[twin]} holds (one rank's file copied over another's?)")
            if twin != index:
                _same_piece(unit_paths[twin], unit_paths[index], name, storage_options)
    if not boxes:
        raise CheckpointError(f"{folder}: its safetensors files hold no tensors")
    arrays, objects = {}, []
    for name, held in boxes.items():
        ndims = {len(o) for o, _, _ in held}
        if len(ndims) != 1:
            raise CheckpointError(f"{folder}: {name}: pieces of different numbers of dimensions")
        shape = tuple(max(o[d] + s[d] for o, s, _ in held) for d in range(ndims.pop()))
        path = paths.escape(name)
        if not shape:  # a 0-d tensor: a value, from the file holding it
            objects.append(path)
            continue
        arrays[path] = ShardedSpec(dtype_of[name], shape, tuple(ShardSpec(o, s, i) for o, s, i in held if all(s)))
    tree = Node("dict", "", [(encode_key(name), Node("leaf", paths.escape(name))) for name in boxes])
    digest = hashlib.blake2b("".join(headers).encode(), digest_size=16).hexdigest()
    shapes = {p: list(a.shape) for p, a in arrays.items()}  # a worker sees only its pieces
    facts = CheckpointFacts(units=tuple(names), metadata=digest, reader={"dcp_hf": {"headers": headers, "shapes": shapes}})
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, facts)


def _check_index(folder: str, unit_paths: list[str], boxes: dict[str, list[Any]], storage_options: StorageOptions | None) -> None:
    """A folder's model.safetensors.index.json, where it has one, names the file of every tensor: each
    file must hold exactly the tensors it maps to it (a shard copied over another, or missing tensors,
    would otherwise export as if the folder were whole)."""
    index = join(folder, INDEX)
    if index not in listing(folder, storage_options):
        return
    raw = read_small(index, storage_options, MAX_INDEX, "a safetensors index")
    weight_map = jsonin.loads(raw, index, "safetensors index", CheckpointError)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: no weight_map of tensor names to files (damaged)")
    by_file: dict[str, set[str]] = {}
    for name, held in boxes.items():
        for _, _, i in held:
            by_file.setdefault(_name(unit_paths[i]), set()).add(name)
    mapped: dict[str, set[str]] = {}  # (grouped once: each file's scan of the whole map was files x tensors)
    for n, f in weight_map.items():
        mapped.setdefault(f, set()).add(n)
    for path in unit_paths:
        want = mapped.get(_name(path), set())
        have = by_file.get(_name(path), set())
        if want != have:
            stray = sorted(want ^ have)[0]
            raise CheckpointError(f"{path}: {'holds' if stray in have else 'lacks'} {stray!r:.80}, which "
                                  f"{INDEX} maps to {weight_map.get(stray, 'no file')!s:.80} (a shard of another "
                                  f"save, or copied over another?)")
    unmapped = sorted(set(weight_map.values()) - {_name(p) for p in unit_paths})
    if unmapped:
        raise CheckpointError(f"{join(folder, unmapped[0])}: {INDEX} maps tensors to it, but the folder lacks it")


def _same_piece(a: str, b: str, name: str, storage_options: StorageOptions | None, block: int = 16 << 20) -> None:
    """Two files hold the same piece of `name` (a tensor whole in two shards of a folder): taken once if
    their bytes are equal, else refused, since which one is the model's cannot be told."""
    with SafetensorsFile(a, storage_options) as x, SafetensorsFile(b, storage_options) as y:
        ex, ey = x.entries[f"data/{name}"], y.entries[f"data/{name}"]
        for at in range(0, ex.size, block):
            n = min(block, ex.size - at)
            if x.file.read(ex.offset + at, n) != y.file.read(ey.offset + at, n):
                raise CheckpointError(f"{b}: holds {name} as {_name(a)} does, with other bytes; which is the "
                                      f"model's cannot be told (two exports mixed in one folder?)")


def unit_share(path: str, storage_options: StorageOptions | None, facts: dict[str, Any]) -> HeldPaths:
    """The store paths of the tensors the file's header lists (read again here, its names alone: the worker
    checks the whole header against the planned one before it trusts a piece of it)."""
    return HeldPaths(tuple(paths.escape(name) for name in tensor_names(path, storage_options)))


def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> FileUnit:
    index, count = planned_place(_name(path), path, facts, "dcp_hf", "safetensors")
    st = SafetensorsFile(path, storage_options)
    unit = FileUnit(path, index, count, index, count, facts["metadata"], {}, st)
    with closed_on_error(unit.close, path):
        pieces = _pieces(st)
        if _header_digest(st, pieces) != facts["dcp_hf"]["headers"][index]:
            raise CheckpointError(f"{path}: its header differs from the one the store was planned from (a file of "
                                  f"another checkpoint, or changed since)")
        for name, (o, s) in pieces.items():
            ref = st.tensors[name]
            if not s:
                unit.leaves[paths.escape(name)] = ref
                continue
            shape = tuple(facts["dcp_hf"]["shapes"][paths.escape(name)])
            unit.leaves[paths.escape(name)] = ArrayLeaf(ref.dtype, shape, [LocalPiece(o, s, ref, st)] if all(s) else [])
    return unit
