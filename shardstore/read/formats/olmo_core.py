"""OLMo-core 0.1 checkpoints (OLMo's `olmo_core` checkpointer, ai2-olmo-core 0.1.x; OLMo 2-era runs).

    model/metadata.json + model/rank_{r}.safetensors     the model state, one flat file per rank
    optim/metadata.json + optim/rank_{r}.safetensors     the flattened optimizer state
    train/rank{r}.pt, config.yaml

metadata.json: {"tensors": {name: {"shape", "dtype", "is_sharded", "shard_spec_per_file": {file:
{"flattened_offsets": [[start, end), ...]} | {"local_shape", "global_offset"}}}}} (older files:
"flattened_offsets_per_file"). Each file holds, under every name it is listed for, the 1-D concatenation
of its pieces: element ranges of the flattened tensor (FSDP1 flat parameters) or one box (a DTensor's
local shard). A file may hold zero-size tensors for what its rank lacks, and tensors the metadata does not
list for it (a replica group's copy, a rank's own `step`): only what the metadata names is read.

Optimizer names are `state.{param}.__{key}`; `num_param_groups`, `param_group{i}` and `state_keys` are
uint8 tensors holding pickles (read with the safe unpickler). A scalar (`step`) is listed with shape []
and stored as [1], in the first file holding it. The export is what OLMo-core's `unshard_optim_state`
returns: state by parameter id (from each group's `_param_names`), groups without `_param_names`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from ...facts import CheckpointFacts
from ... import dtypes, jsonin
from ...errors import CheckpointError, closed_on_error
from ...locations import StorageOptions, join, listing
from ...patterns import digits
from ...records import TensorRef
from ...tree import KeyEncoder, Node
from ..contract import (SMALL_TENSOR_BYTES, ArrayLeaf, CheckpointSpec, LocalPiece, ShardedSpec, ShardSpec,
                        replica_count, whole_numbers)
from ..primitives.container import parsed_once, read_small
from ..primitives.safetensors_file import SafetensorsFile
from ..primitives.tensors import check_view
from ..primitives.unpickle import load
from ..unit import FileUnit, Place, flat_spec, relative
from .olmo import MODEL, OPTIM, PARAM_GROUPS, model_path, model_tree, open_olmo_unit, optim_tree, state_path
from .trainer import join_trainer_state, trainer_files

FORMAT = "olmo-core"
METADATA = "metadata.json"
MAX_METADATA = 1 << 30
CONSUMED = ("num_param_groups", "state_keys")  # folded into optim/param_groups and the tree


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    files: dict[str, tuple[Any, ...]]  # file -> (("flat", ((start, stop), ...)) | ("box", offsets, sizes))

    def numel_in(self, file: str) -> int:
        spec = self.files[file]
        return sum(b - a for a, b in spec[1]) if spec[0] == "flat" else math.prod(spec[2])


@dataclass
class Part:
    """model/ or optim/: its metadata.json, parsed and checked."""

    folder: str
    digest: str
    tensors: dict[str, Tensor]
    files: list[str]  # every file the metadata names, in rank order


def detect(folder: str, storage_options: StorageOptions | None = None) -> bool:
    return join(join(folder, MODEL), METADATA) in listing(join(folder, MODEL), storage_options)


def _read_json(path: str, storage_options: StorageOptions | None) -> tuple[Any, str]:
    raw = read_small(path, storage_options, MAX_METADATA, "an OLMo-core metadata file")
    return jsonin.loads(raw, path, "JSON", CheckpointError), hashlib.blake2b(raw, digest_size=16).hexdigest()


def _file_order(name: str) -> tuple[Any, ...]:
    stem = name.removeprefix("rank_").removesuffix(".safetensors")
    return (0, int(stem)) if digits(stem) else (1, name)


def _shard(name: str, file: str, spec: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    where = f"{name} in {file}"
    if not isinstance(spec, dict):
        raise CheckpointError(f"{where}: malformed shard spec")
    if spec.get("flattened_offsets") is not None:
        ranges = spec["flattened_offsets"]
        if ranges and isinstance(ranges[0], int):  # an old single [start, end)
            ranges = [ranges]
        out = tuple(whole_numbers(r, f"{where}: offsets") for r in ranges)
        total = math.prod(shape)
        if any(len(r) != 2 or r[0] > r[1] or r[1] > total for r in out):
            raise CheckpointError(f"{where}: flattened offsets {list(out)!r:.80} outside its {total} elements")
        return ("flat", out)
    local_shape, offset = spec.get("local_shape"), spec.get("global_offset")
    if local_shape is None or offset is None:
        raise CheckpointError(f"{where}: its shard spec has neither flattened_offsets nor local_shape/global_offset")
    sizes, offsets = whole_numbers(local_shape, f"{where}: local_shape"), whole_numbers(offset, f"{where}: global_offset")
    if len(sizes) != len(shape) or len(offsets) != len(shape) \
            or any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
        raise CheckpointError(f"{where}: box at {list(offsets)} of {list(sizes)} outside {list(shape)}")
    return ("box", offsets, sizes)


def read_part(folder: str, storage_options: StorageOptions | None) -> Part:
    path = join(folder, METADATA)
    raw, digest = _read_json(path, storage_options)
    tensors_json = raw.get("tensors") if isinstance(raw, dict) else None
    if not isinstance(tensors_json, dict):
        raise CheckpointError(f"{path}: not an OLMo-core checkpoint metadata file (no \"tensors\")")
    tensors: dict[str, Any] = {}
    files: set[str] = set()
    try:
        for name, t in tensors_json.items():
            shape = whole_numbers(t["shape"], f"{name}: shape")
            code = t["dtype"]
            dtype = next((i.name for i in dtypes.BY_NAME.values() if i.safetensors == code), None)
            if dtype is None:
                raise CheckpointError(f"{name}: unknown dtype {code!r:.20}")
            per_file = t.get("shard_spec_per_file")
            if per_file is None:  # older files: {file: [start, end) or [[start, end), ...]}
                per_file = {f: {"flattened_offsets": o} for f, o in t["flattened_offsets_per_file"].items()}
            specs = {}
            for file, spec in per_file.items():
                if not isinstance(file, str) or "/" in file or "\\" in file or file in ("", ".", ".."):
                    raise CheckpointError(f"{name}: file {file!r:.60} is not a file name inside the folder")
                specs[file] = _shard(name, file, spec, shape)
            files.update(specs)
            tensors[name] = Tensor(name, shape, dtype, specs)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: malformed metadata ({type(exc).__name__}: {str(exc)[:80]})") from None
    return Part(folder, digest, tensors, sorted(files, key=_file_order))


def _part(folder: str, storage_options: StorageOptions | None) -> Part:
    """A metadata.json, parsed once per process."""
    return parsed_once("olmo-core", folder, storage_options, read_part)


def _parts(folder: str, storage_options: StorageOptions | None) -> dict[str, Part]:
    names = {n.rsplit("/", 1)[-1] for n in listing(join(folder, OPTIM), storage_options)}
    kinds = [MODEL] + ([OPTIM] if METADATA in names else [])
    return {k: _part(join(folder, k), storage_options) for k in kinds}


def units(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Every file the metadata names (under HSDP, one replica group's), then the trainer-state files."""
    return [join(p.folder, f) for p in _parts(folder, storage_options).values() for f in p.files] \
        + trainer_files(folder, storage_options)


# ---------------------------------------------------------------------------------------------- the spec
def _is_value(t: Tensor) -> bool:
    """Held whole by one file, and small: a value (a `step`, a scalar), not an array."""
    (file, *rest) = t.files or [""]
    return not rest and bool(file) and t.numel_in(file) == math.prod(t.shape) \
        and math.prod(t.shape) * dtypes.info(t.dtype).itemsize <= SMALL_TENSOR_BYTES


def _array_or_value(t: Tensor, holder: dict[str, int]) -> ShardedSpec | None:
    """The planner's view of a tensor: None for a value."""
    kinds = {spec[0] for spec in t.files.values()}
    if len(kinds) > 1:
        raise CheckpointError(f"{t.name}: some files hold element ranges of it and others boxes")
    if _is_value(t):
        return None
    if kinds == {"flat"}:
        return flat_spec(t.dtype, t.shape, [(holder[f], a, b - a) for f, spec in t.files.items() for a, b in spec[1]])
    return ShardedSpec(t.dtype, t.shape, tuple(ShardSpec(spec[1], spec[2], holder[f]) for f, spec in t.files.items()
                                              if all(spec[2])))


def _param_groups(optim: Part, storage_options: StorageOptions | None, strict: bool) -> tuple[list[dict[str, Any]], list[Any], str]:
    """(the groups with their `_param_names`, the state keys, the file holding them), read from that file."""
    count = optim.tensors.get("num_param_groups")
    if count is None or "state_keys" not in optim.tensors:
        raise CheckpointError(f"{optim.folder}/{METADATA}: no num_param_groups / state_keys; not OLMo-core optimizer state")
    (file,) = count.files
    with SafetensorsFile(join(optim.folder, file), storage_options) as st:
        values = _pickled_values(st, optim, file, strict)
    if "groups" not in values:
        raise CheckpointError(f"{join(optim.folder, file)}: holds num_param_groups but not the param groups")
    return values["groups"], values["state_keys"], file


def _pickled_values(st: SafetensorsFile, optim: Part, file: str, strict: bool) -> dict[str, Any]:
    """What a file holds of num_param_groups, param_group{i} and state_keys, decoded."""
    out: dict[str, Any] = {}
    count = optim.tensors.get("num_param_groups")
    if count is None or file not in count.files:
        return out
    n = int(_whole(st, count, file).values().reshape(-1)[0])
    if not 0 <= n <= 1 << 16:
        raise CheckpointError(f"{st.path}: num_param_groups is {n}")
    groups = []
    for i in range(n):
        t = optim.tensors.get(f"param_group{i}")
        if t is None or file not in t.files:
            raise CheckpointError(f"{st.path}: param_group{i} is not in the same file as num_param_groups")
        group = _unpickle(st, t, file, strict)
        if not isinstance(group, dict) or not isinstance(group.get("_param_names"), list) \
                or not isinstance(group.get("params"), list) or len(group["params"]) != len(group["_param_names"]):
            raise CheckpointError(f"{st.path}: param_group{i} has no matching params and _param_names")
        groups.append(group)
    out["groups"] = groups
    keys = optim.tensors["state_keys"]
    out["state_keys"] = _unpickle(st, keys, file, strict) if file in keys.files else None
    if not isinstance(out["state_keys"], list):
        raise CheckpointError(f"{st.path}: state_keys is not a list")
    return out


def _whole(st: SafetensorsFile, t: Tensor, file: str) -> LocalPiece:
    """A tensor file `file` (st) holds whole, as a piece (checked against the metadata)."""
    ref = _stored(st, t, file)
    return LocalPiece((0,), (ref.shape[0],), ref, st)


def _unpickle(st: SafetensorsFile, t: Tensor, file: str, strict: bool) -> Any:
    if t.dtype != "uint8":
        raise CheckpointError(f"{st.path}: {t.name} is {t.dtype}, not the uint8 bytes of a pickle")
    return load(bytes(_whole(st, t, file).values()), f"{st.path}: {t.name}", strict)


def _stored(st: SafetensorsFile, t: Tensor, file: str) -> TensorRef:
    """The 1-D tensor a file holds for `t`, checked: present, of the metadata's dtype and element count."""
    ref = st.tensors.get(t.name)
    count = t.numel_in(file)
    if ref is None:
        raise CheckpointError(f"{st.path}: no tensor {t.name!r:.80}, which its metadata.json lists in it")
    if ref.dtype != t.dtype or math.prod(ref.shape) != count:
        raise CheckpointError(f"{st.path}: {t.name} is {ref.dtype}{list(ref.shape)}, the metadata says {count} "
                              f"elements of {t.dtype}")
    check_view(st, ref, t.name)
    return TensorRef(ref.storage, 0, (count,), (1,), ref.dtype)


def _split(name: str) -> tuple[str, str] | None:
    """`state.{param}.__{key}` -> (param, key)."""
    if not name.startswith("state.") or ".__" not in name:
        return None
    param, key = name[len("state."):].rsplit(".__", 1)
    return param, key


def spec(folder: str, unit_paths: list[str], encode_key: KeyEncoder, strict: bool,
         storage_options: StorageOptions | None) -> CheckpointSpec:
    parts = _parts(folder, storage_options)
    names = [relative(u) for u in unit_paths]
    holder = {f"{kind}/{f}": names.index(f"{kind}/{f}") for kind, p in parts.items() for f in p.files}
    arrays: dict[str, ShardedSpec] = {}
    objects: list[str] = []
    model = parts[MODEL]
    for t in model.tensors.values():
        planned = _array_or_value(t, {f: holder[f"{MODEL}/{f}"] for f in t.files})
        if planned is None:
            objects.append(model_path(t.name))
        else:
            arrays[model_path(t.name)] = planned
    tree = Node("dict", "", [(encode_key(MODEL), model_tree(list(model.tensors), encode_key))])
    ids: dict[str, Any] = {}
    if OPTIM in parts:
        optim = parts[OPTIM]
        groups, state_keys, _ = _param_groups(optim, storage_options, strict)
        for group in groups:
            ids.update(zip(group["_param_names"], group["params"]))
        state = []
        for param, pid in ids.items():
            keys = [k for k in state_keys if f"state.{param}.__{k}" in optim.tensors]
            if keys:
                state.append((pid, keys))
            for key in keys:
                t = optim.tensors[f"state.{param}.__{key}"]
                planned = _array_or_value(t, {f: holder[f"{OPTIM}/{f}"] for f in t.files})
                if planned is None:
                    objects.append(state_path(pid, key))
                else:
                    arrays[state_path(pid, key)] = planned
        stray = [n for n in optim.tensors if n not in CONSUMED and not n.startswith("param_group")
                 and (_split(n) is None or _split(n)[0] not in ids)]  # type: ignore[index]
        if stray:
            raise CheckpointError(f"{optim.folder}/{METADATA}: {stray[0]!r:.80} belongs to no parameter of the param groups")
        tree.children.append((encode_key(OPTIM), optim_tree(state, encode_key)))
        objects.append(PARAM_GROUPS)
    train = trainer_files(folder, storage_options)
    if train:
        join_trainer_state(tree, objects, train[0], encode_key, storage_options, strict)
    digest = hashlib.blake2b("".join(p.digest for p in parts.values()).encode(), digest_size=16).hexdigest()
    facts = CheckpointFacts(units=tuple(names), metadata=digest, replicas=replica_count(arrays),
                            reader={"olmo_core": {"ids": list(ids.items()),
                                                  "parts": {k: p.digest for k, p in parts.items()}}})
    return CheckpointSpec(FORMAT, len(names), len(names), tree, arrays, {}, objects, facts)


# ---------------------------------------------------------------------------------------------- units
def open_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
              facts: dict[str, Any]) -> Any:
    return open_olmo_unit(path, storage_options, strict, encode_key, facts, "olmo_core", "OLMo-core", _open_file)


def _open_file(path: str, kind: str, file: str, place: Place, facts: dict[str, Any],
               storage_options: StorageOptions | None, strict: bool) -> FileUnit:
    folder = path[: -len(file)].rstrip("/\\")
    part = _part(folder, storage_options)
    planned = facts["olmo_core"].get("parts", {}).get(kind)  # (stores planned before it was kept: not checked)
    if planned is not None and part.digest != planned:
        raise CheckpointError(f"{path}: its {kind}/{METADATA} differs from the one the store was planned from "
                              f"(a file of another checkpoint)")
    ids = dict((name, pid) for name, pid in facts["olmo_core"]["ids"])
    st = SafetensorsFile(path, storage_options)
    unit = FileUnit(path, place.index, place.count, place.index, place.count, place.digest, {}, st)
    with closed_on_error(unit.close, path):
        if kind == OPTIM:
            decoded = _pickled_values(st, part, file, strict)
            if "groups" in decoded:
                unit.leaves[PARAM_GROUPS] = [{k: v for k, v in g.items() if k != "_param_names"}
                                             for g in decoded["groups"]]
        for t in part.tensors.values():
            if file not in t.files or t.name in CONSUMED or t.name.startswith("param_group"):
                continue
            if kind == MODEL:
                where = model_path(t.name)
            else:
                param, key = _split(t.name) or (None, None)
                if param not in ids:
                    raise CheckpointError(f"{path}: {t.name!r:.80} belongs to no parameter of the param groups")
                where = state_path(ids[param], key)
            unit.leaves[where] = _leaf(st, t, file)
    return unit


def _leaf(st: SafetensorsFile, t: Tensor, file: str) -> Any:
    """A file's share of one tensor: its pieces, or the whole (small) tensor as a value in its real shape.
    A share of no elements may be absent (an optimizer file has no state for parameters its rank lacks)."""
    if t.numel_in(file) == 0 and t.name not in st.tensors and not _is_value(t):
        return ArrayLeaf(t.dtype, t.shape, [])
    data = _stored(st, t, file)
    spec = t.files[file]
    if _is_value(t):
        return TensorRef(data.storage, 0, t.shape, tuple(math.prod(t.shape[i + 1:]) for i in range(len(t.shape))),
                         t.dtype)
    if spec[0] == "box":
        strides = tuple(math.prod(spec[2][i + 1:]) for i in range(len(spec[2])))
        view = TensorRef(data.storage, 0, spec[2], strides, t.dtype)
        return ArrayLeaf(t.dtype, t.shape, [LocalPiece(spec[1], spec[2], view, st)] if all(spec[2]) else [])
    pieces, done = [], 0
    for a, b in spec[1]:
        if b > a:
            pieces.append(LocalPiece((a,), (b - a,), TensorRef(data.storage, done, (b - a,), (1,), t.dtype), st))
        done += b - a
    return ArrayLeaf(t.dtype, t.shape, pieces)
