"""torch.distributed.checkpoint (DCP) folders: `.metadata` plus `__{rank}_{i}.distcp` files.

`.metadata` is one pickle (read with the same safe unpickler as everything else) describing every tensor
of the checkpoint — dtype, global size, and its chunks as boxes (offsets, sizes) on any dimensions — and,
for every chunk and every non-tensor value, the byte range of the .distcp file that holds it. A tensor
chunk is a complete `torch.save` zip at that range; a value is one too (torch.save of the object). Both
are read in place, through the same zip reader and tensor checks as a rank file. `planner_data` gives
each flattened key its path in the original nested state dict, which the store keeps.

One .distcp file is one unit of work. Each is described entirely by `.metadata`, so a unit is checked
against the checkpoint by the metadata's digest, and every item against its chunk's dtype and size.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ...facts import CheckpointFacts
from ... import dtypes, jsonin, paths
from ...errors import CheckpointError, closed_on_error, named
from ...hf_files import ADAPTER_CONFIG, hf_model_file
from ...locations import StorageOptions, filesystem, folder_of, is_url, join, listing, local, name_of, subfolders
from ...records import TensorRef
from ...tree import KeyEncoder, Node, Skeleton
from ...trainers import composer, hf_trainer, megatron, nemo, torchtitan
from ...trainers.registry import RUNS
from ..arrival import Arrived
from ..contract import (ArrayLeaf, CheckpointSpec, LocalPiece, PlannedCheckpoint, ShardedSpec, ShardSpec,
                        whole_numbers)
from ..layouts import name_rank
from ..primitives.container import DataFile, TorchZip, parsed_once, read_small
from ..primitives.identity import identity_of
from ..primitives import transforms as stream_transforms
from ..primitives.tensors import check_view
from ..primitives.unpickle import DCP_PLACEHOLDERS, DcpBytesStorage, DcpMetadata, DcpTensorStorage, load
from ...patterns import digits
from ..source import (JSON_CONFIG, Source, check_step, config_files, hf_files, inside_run,
                      pick)
from ..unit import Place, check_leaves
from . import lightning, megatron_fsdp, megatron_torch, trainer
from .dcp_checkpoint import DcpCheckpoint, FileShare, Item
from .resume import resume_files
from .trainer import TRAIN, TrainerUnit, join_trainer_state, open_trainer

MODEL_AND_OPTIM = "model_and_optim"  # OLMo's and OLMo-core's DCP folder, beside train/

METADATA = ".metadata"
# Megatron-Core's trainers' folders: NeMo 2's checkpoint is weights/ (torch_dist) beside context/ (the
# model's config as model.yaml, its tokenizer's files in nemo_tokenizer/), its model's keys under `module.`;
# veRL's Megatron actor keeps dist_ckpt/ beside huggingface/ (model/dist_ckpt/ and model/huggingface/ in
# its layout v2, the optimizer then in a DCP folder of its own).
NEMO_WEIGHTS, NEMO_CONTEXT, NEMO_MODEL, NEMO_TOKENIZER = nemo.WEIGHTS, nemo.CONTEXT, nemo.MODEL, nemo.TOKENIZER
NEMO_PREFIX = nemo.PREFIX
VERL_DIST, VERL_HF, VERL_ADAPTER = "dist_ckpt", "huggingface", "adapter"
# Where trainers keep a DCP folder inside their checkpoint folder (OLMo's and OLMo-core's, NeMo's, veRL's
# from its actor/ folder and from the step folder above it)
INSIDE = (MODEL_AND_OPTIM, NEMO_WEIGHTS, VERL_DIST, f"model/{VERL_DIST}", f"actor/{VERL_DIST}",
          f"actor/model/{VERL_DIST}")
FSDP_MODEL = "pytorch_model_fsdp"  # the HF Trainer's and Accelerate's model folder (accelerate FSDP_MODEL_NAME)
PART = re.compile(r"(pytorch_model_fsdp|optimizer)_[0-9]+")  # its folders: each model's, each optimizer's
MEGATRON_METADATA = "metadata.json"  # Megatron-Core's: {"sharded_backend": "torch_dist", ...}
MEGATRON_COMMON = "common.pt"  # megatron-core <= 0.18's common state (>= 0.19: a bytes item in the files)
COMMON_STATE = "common_state"  # where the store keeps it
MEGATRON_ARGS = "megatron_args"  # the plan's copy of Megatron-LM's args (plain values), for --format hf
STACKED = re.compile(r"(.*?(?:^|\.)layers\.)(?=[A-Za-z_])")  # "decoder.layers." then a module name, no number
LAYER_KEY = re.compile(r"(.*?(?:^|\.)layers\.)([0-9]+)\.")  # a per-layer key: its stack, and its layer
SHARDED_OBJECT = re.compile(r".+/shard_[0-9]+(?:\.[0-9]+)*_[0-9]+(?:\.[0-9]+)*")  # Megatron's ShardedObject.unique_key
EXTRA_STATE = re.compile(r"(.*?_extra_state)/shard_([0-9]+(?:\.[0-9]+)?)_[0-9]+(?:\.[0-9]+)?")  # shard_{layer[.expert]}_{count}
MODEL_SPACE = re.compile(r"(optimizer\.state\.[A-Za-z0-9_]+\.)(.+)")  # a parameter's optimizer state, by its key
STACKED_EXPERTS = re.compile(r"(.*?(?:^|\.)experts\.)experts\.")  # a MoE layer's experts on one axis
LOCAL_EXPERTS = "local_experts."  # Megatron's own module names, expert by expert
EXPERT_MODULE = re.compile(r"(.*?local_experts\.)([0-9]+)(\..*)")
MEGATRON_OPTIMIZER = "optimizer."  # every key of Megatron's optimizers' sharded state dicts
CHAINED = re.compile(r"chained_[0-9]+\.optimizer\.")  # a ChainedOptimizer's (dense and expert) keys
MEGATRON_TOP = ("common_state", "rng_state", "rerun_state_machine_state")  # Megatron-LM's non-model keys
# The steps trainers record as bytes items, by the name they give the folder from them: torchtitan's
# f"step-{step}", Composer's f"ep{epoch}-ba{batch}"
NAMED_STEPS = {torchtitan.STEP_KEY: torchtitan.STEPS.exact, "state.timestamp.epoch": composer.EPOCH,
               "state.timestamp.batch": composer.BATCH}
MAX_METADATA = 1 << 30  # tens of MB at thousands of ranks; a gigabyte is not a .metadata
ZIP_RECORDS = 1 << 20  # what a tensor's torch.save holds beside its bytes (data.pkl, version, alignment, directory)
MAX_VALUE = 1 << 30  # a compressed value's torch.save decompressed (an optimizer's param_groups, a loader's state)


def has_metadata(folder: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> bool:
    folder = os.fspath(folder)
    if is_url(folder):
        fs, fspath = filesystem(folder, storage_options)
        return bool(fs.exists(f"{fspath.rstrip('/')}/{METADATA}"))
    return os.path.isfile(os.path.join(local(folder), METADATA))


# The last Megatron torch_dist .metadata read, by folder and digest: finding a checkpoint's files and planning
# it each read it, and one of DeepSeek-V3's (122,000 items, 35 MB) takes seconds to check and split per layer.
_LAST_TORCH_DIST: dict[tuple[str, str], DcpCheckpoint] = {}


def read_checkpoint(folder: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> DcpCheckpoint:
    """Parse and check `.metadata`: names, sizes and byte ranges that can exist, nothing outside the folder."""
    folder = os.fspath(folder)
    where = join(folder, METADATA)
    raw = read_small(where, storage_options, MAX_METADATA, "a torch.distributed.checkpoint .metadata file")
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    try:
        if (folder, digest) in _LAST_TORCH_DIST and _torch_dist(folder, storage_options):
            return _LAST_TORCH_DIST[(folder, digest)]
    except CheckpointError as exc:
        raise named(exc, where) from None
    # the same safe unpickler (torch itself would run any pickle here); Megatron's copy of the local plans,
    # which nothing reads, built as placeholders; the pickle and the unpickled objects freed once parsed
    md = load(raw, where, placeholders=DCP_PLACEHOLDERS)
    del raw
    if not isinstance(md, DcpMetadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointError(f"{where}: not a torch.distributed.checkpoint metadata file")
    try:
        ckpt = _parse(folder, md, digest)
        del md
        if not ckpt.items:
            ckpt.files = _empty_save(folder, storage_options)
        if _torch_dist(folder, storage_options):
            _LAST_TORCH_DIST.clear()
            _LAST_TORCH_DIST[(folder, digest)] = ckpt = _model_space(_per_layer(ckpt))
            return ckpt
        _without_megatron_metadata(ckpt, folder, storage_options)
        return _megatron_fsdp(ckpt) if megatron_fsdp.detect(ckpt) else ckpt
    except CheckpointError as exc:
        raise named(exc, where) from None
    except (AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: malformed metadata ({type(exc).__name__}: {str(exc)[:120]})") from None


def _dtype_name(dtype: Any) -> str:
    """A TensorProperties' dtype as torch names it: one the unpickler does not know (float8_e4m3fnuz) comes
    as a stand-in class for its global, named by it."""
    return str(dtype.global_[1]) if isinstance(dtype, type) and hasattr(dtype, "global_") else str(dtype)


def _empty_save(folder: str, storage_options: StorageOptions | None) -> list[str]:
    """The units of a save of nothing (`dcp.save({})`, a Stateful whose state is {}), which torch loads as {}:
    the empty .distcp files its ranks wrote, or its .metadata alone where there are none (a copy without
    them, which torch loads the same)."""
    found = [name_of(p) for p in listing(folder, storage_options) if p.endswith(".distcp")]
    return sorted(found, key=_file_order) or [METADATA]


def _parse(folder: str, md: DcpMetadata, digest: str) -> DcpCheckpoint:
    tensors, values = {}, []
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise CheckpointError(f"a key {fqn!r:.60} that is not a string")
        if isinstance(meta, DcpTensorStorage):
            dtype = _dtype_name(meta.properties.dtype)
            try:
                dtypes.info(dtype)
            except CheckpointError as exc:
                raise named(exc, fqn) from None
            size = whole_numbers(meta.size, f"{fqn}: sizes")
            chunks = [(whole_numbers(c.offsets, f"{fqn}: chunk offsets"), whole_numbers(c.sizes, f"{fqn}: chunk sizes"))
                      for c in meta.chunks]
            for at, extent in chunks:  # torch's planner writes none outside its tensor: a forged or damaged size
                if len(at) != len(size) or len(extent) != len(size) or \
                        any(a + e > n for a, e, n in zip(at, extent, size)):
                    raise CheckpointError(f"{fqn}: a chunk at {list(at)} of {list(extent)} lies outside its tensor "
                                          f"of {list(size)}")
            tensors[fqn] = (dtype, size, chunks)
        elif isinstance(meta, DcpBytesStorage):
            values.append(fqn)
        else:
            raise CheckpointError(f"{fqn}: unknown storage metadata {type(meta).__name__}")
    planner = md.planner_data if isinstance(getattr(md, "planner_data", None), dict) else {}
    # in the metadata's order, which is the saved state dict's (tensors and values interleaved)
    nested = {fqn: tuple(planner.get(fqn) or (fqn,)) for fqn in md.state_dict_metadata}
    for fqn, path in nested.items():
        if not path or not all(isinstance(k, (str, int)) and type(k) is not bool for k in path):
            raise CheckpointError(f"{fqn}: planner_data gives it the path {path!r:.80}")
    items, known = [], set(values)
    for index, info in md.storage_data.items():
        fqn = index.fqn
        if fqn not in tensors and fqn not in known:
            raise CheckpointError(f"storage_data names {fqn!r:.80}, which the metadata does not describe")
        steps = stream_transforms.checked(getattr(info, "transform_descriptors", None), fqn)
        name = info.relative_path
        if not isinstance(name, str) or posixpath.basename(name) != name or name in ("", ".", "..") or "\\" in name:
            raise CheckpointError(f"{fqn}: item file {name!r:.80} is not a file name inside the checkpoint folder")
        offsets = None if getattr(index, "offset", None) is None else whole_numbers(index.offset, f"{fqn}: item offsets")
        offset, length = info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise CheckpointError(f"{fqn}: item byte range {offset!r:.30}+{length!r:.30} is impossible")
        items.append(Item(fqn, offsets, name, offset, length, transforms=steps))
    seen = {(i.fqn, i.offsets) for i in items}
    for fqn, (_, _, chunks) in tensors.items():
        missing = [list(o) for o, _ in chunks if (fqn, o) not in seen]
        if missing:
            raise CheckpointError(f"{fqn}: chunk at {missing[0]} has no stored item")
    files = sorted({i.file for i in items}, key=_file_order)
    return DcpCheckpoint(folder, digest, tensors, values, nested, items, files)


def _without_megatron_metadata(ckpt: DcpCheckpoint, folder: str, storage_options: StorageOptions | None) -> None:
    """Refuses a .metadata holding Megatron-Core's own keys (its ShardedObjects', `key/shard_{offset}_{shape}`:
    the common state, every layer's extra state) in a folder without Megatron's metadata.json, or with one
    that does not say `torch_dist`: read as a plain DCP folder it would export Megatron's stacked keys under
    other names and lose its common.pt; Megatron's own load refuses such a folder too ("is not a distributed
    checkpoint")."""
    key = next((fqn for fqn in ckpt.values if SHARDED_OBJECT.fullmatch(fqn)), None)
    if key is None:
        return
    there = join(folder, MEGATRON_METADATA) in listing(folder, storage_options)
    raise CheckpointError(f"holds Megatron-Core's torch_dist keys ({key!r:.80}), but {MEGATRON_METADATA} "
                          f"{'does not name its sharded_backend torch_dist' if there else 'is missing from its folder'} "
                          f"(Megatron does not load it so either): restore it from the save")


def _megatron_fsdp(ckpt: DcpCheckpoint) -> DcpCheckpoint:
    """Megatron-FSDP's save under the torch_dist reading's names (megatron_fsdp.py), layer by layer as
    those are (its own order is Megatron-FSDP's buffers')."""
    ckpt = megatron_fsdp.named(ckpt)
    order = _layer_order({n: at for at, n in enumerate(ckpt.paths)})
    return replace(ckpt, paths={n: ckpt.paths[n] for n in order}, megatron_fsdp=True)


def _torch_dist(folder: str, storage_options: StorageOptions | None) -> bool:
    """Whether the folder is Megatron-Core's `torch_dist` checkpoint: its metadata.json says so."""
    return _megatron(folder, storage_options).get("sharded_backend") == "torch_dist"


def _megatron(folder: str, storage_options: StorageOptions | None) -> dict[str, Any]:
    """Megatron-Core's metadata.json: {} when there is none. Its `common_backend` ("torch", megatron-core
    <= 0.18) says the common state is `common.pt` beside the .distcp files; the backend must be one
    shardstore reads."""
    path = join(folder, MEGATRON_METADATA)
    if path not in listing(folder, storage_options):
        return {}
    info = jsonin.loads(read_small(path, storage_options, 1 << 16, "Megatron's metadata.json"), path,
                        "Megatron metadata", CheckpointError)
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: not Megatron's metadata (a JSON object)")
    for key, known in (("sharded_backend", ("torch_dist", None)), ("common_backend", ("torch", None))):
        if info.get(key) not in known:
            raise CheckpointError(f"{path}: {key} is {info.get(key)!r:.40}; shardstore reads torch_dist checkpoints "
                                  f"(and their common.pt)")
    if info.get("common_backend") and join(folder, MEGATRON_COMMON) not in listing(folder, storage_options):
        raise CheckpointError(f"{path}: names a common state ({MEGATRON_COMMON}) that is not in the folder")
    return info


def _per_layer(ckpt: DcpCheckpoint) -> DcpCheckpoint:
    """Megatron-Core saves a transformer's layers stacked on a leading axis, one chunk per layer
    (`decoder.layers.self_attention.linear_qkv.weight` of shape (L, ...), each pipeline stage at its
    global layer numbers) and their extra states as bytes items `..._extra_state/shard_{i}_{L}`. They
    become the per-layer keys Megatron's own non-stacked state dict has (`decoder.layers.{i}.…`): each
    chunk an item of layer i without its leading axis. The optimizer's model-shaped state
    (`optimizer.state.exp_avg.decoder.layers.…`) is split the same way."""
    tensors: dict[str, Any] = {}
    renamed: dict[tuple[str, tuple[int, ...] | None], tuple[str, tuple[int, ...] | None, int]] = {}
    for fqn, (dtype, size, chunks) in ckpt.tensors.items():
        name_of_index, k = _stacked(fqn)
        if k == 0 or len(size) <= k or any(s[:k] != (1,) * k for _, s in chunks) \
                or {o[:k] for o, _ in chunks} != set(itertools.product(*map(range, size[:k]))):
            tensors[fqn] = (dtype, size, chunks)
            continue
        per_index: dict[tuple[int, ...], list[Any]] = {}  # each index's chunks, in order (one pass: 256 experts)
        for o, s in chunks:
            per_index.setdefault(o[:k], []).append((o[k:], s[k:]))
        for index in itertools.product(*map(range, size[:k])):
            tensors[name_of_index(index)] = (dtype, size[k:], per_index[index])
        for o, _ in chunks:
            renamed[(fqn, o)] = (name_of_index(o[:k]), o[k:], k)
    values = []
    for fqn in ckpt.values:
        name = _extra_state(fqn)
        values.append(name)
        renamed[(fqn, None)] = (name, None, 0)
    if len(set(tensors) | set(values)) != len(tensors) + len(values):
        raise CheckpointError("per-layer keys that Megatron's stacked keys would share (a damaged metadata?)")
    items = [replace(i, fqn=renamed[(i.fqn, i.offsets)][0], offsets=renamed[(i.fqn, i.offsets)][1],
                     squeeze=renamed[(i.fqn, i.offsets)][2]) if (i.fqn, i.offsets) in renamed else i for i in ckpt.items]
    # layer by layer, each layer's keys in the saved order, where the first stacked key of its stack was
    first = {fqn: at for at, fqn in enumerate(ckpt.paths)}
    was = {new: first[old] for (old, _), (new, _, _) in renamed.items()}  # a key's place before the split
    was.update((n, first[n]) for n in [*tensors, *values] if n not in was)
    order = _layer_order(was)
    return DcpCheckpoint(ckpt.folder, ckpt.digest, tensors, values, {n: _part(n) for n in order}, items, ckpt.files)


def _layer_order(was: dict[str, int]) -> list[str]:
    """Megatron's names (`was`: each one's place in the saved order) layer by layer, each layer's keys in the
    saved order, where the first key of its stack was; the rest where they were."""
    layer = {n: LAYER_KEY.match(n) for n in was}
    # (stack,), (stack, module) and (stack, experts): the earliest place of any layer's; a module of the
    # experts counts as one, whichever expert, so each expert's modules come together, expert by expert
    stacks: dict[tuple[str, ...], int] = {}

    def keys(name: str, m: re.Match[str]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], int]:
        module = name[m.end():]
        e = EXPERT_MODULE.match(module)
        if e is None:
            return (m.group(1),), (m.group(1), module), (m.group(1), module), 0
        return (m.group(1),), (m.group(1), e.group(1)), (m.group(1), e.group(1) + e.group(3)), int(e.group(2))

    for name, m in layer.items():
        if m is not None:
            for key in keys(name, m)[:3]:
                stacks[key] = min(stacks.get(key, was[name]), was[name])

    def place(name: str) -> tuple[int, ...]:
        m = layer.get(name)
        if m is None:
            return (was[name], -1, 0, 0, 0)
        stack, block, module, expert = keys(name, m)
        return (stacks[stack], int(m.group(2)), stacks[block], expert, stacks[module])

    return sorted(was, key=place)


def _model_space(ckpt: DcpCheckpoint) -> DcpCheckpoint:
    """megatron-core <= 0.15's default optimizer form (`fully_sharded_model_space`) saves each parameter's
    state under `optimizer.state.{kind}.{the parameter's key}` reformulated: a parameter of shape
    [X, Y] cut into blocks [x, y] by tensor parallelism becomes [X // x, Y // y, x * y], each data-parallel
    rank holding a range of a block's flattened elements (torch_dist's `nd_flattened` form). Where the
    parameter's own key is in the checkpoint, cut into equal blocks that tile it, and the state's shape is
    exactly that grid and block size, the state is its parameter's shape again: each range the boxes it
    fills of its block, row-major. The plan's tiling check then proves every element is covered once."""
    tensors = dict(ckpt.tensors)
    boxes: dict[tuple[str, tuple[int, ...] | None], tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]] = {}
    for fqn, (dtype, size, chunks) in ckpt.tensors.items():
        m = MODEL_SPACE.fullmatch(fqn)
        if m is None or m.group(2) not in ckpt.tensors:
            continue
        _, shape, blocks = ckpt.tensors[m.group(2)]
        block = _block(shape, blocks)
        if block is None:
            continue
        grid = tuple(d // b for d, b in zip(shape, block))
        if tuple(size) != grid + (math.prod(block),) or any(s[:-1] != (1,) * len(grid) for _, s in chunks):
            continue
        placed = []
        for o, s in chunks:
            origin = tuple(g * b for g, b in zip(o[:-1], block))
            boxes[(fqn, o)] = tuple((start, tuple(a + b for a, b in zip(origin, off)), sizes)
                                    for start, off, sizes in _flat_boxes(block, o[-1], s[-1]))
            placed += [(off, sizes) for _, off, sizes in boxes[(fqn, o)]]
        tensors[fqn] = (dtype, shape, placed)
    if not boxes:
        return ckpt
    items = [replace(i, boxes=boxes[(i.fqn, i.offsets)]) if (i.fqn, i.offsets) in boxes else i for i in ckpt.items]
    return DcpCheckpoint(ckpt.folder, ckpt.digest, tensors, ckpt.values, ckpt.paths, items, ckpt.files)


def _block(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The one block shape `chunks` cut `shape` into, if they are equal blocks on a whole grid."""
    sizes = {s for _, s in chunks}
    if len(sizes) != 1:
        return None
    (block,) = sizes
    if len(block) != len(shape) or not all(block) or any(d % b for d, b in zip(shape, block)) \
            or len(chunks) != math.prod(d // b for d, b in zip(shape, block)):
        return None
    return block


def _flat_boxes(shape: tuple[int, ...], start: int, count: int
                ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, start + count) of a row-major block of `shape`, as boxes each contiguous in that
    order: (its first element's place in the range, offsets, sizes). At most 2·ndim - 1 of them."""
    out, pos, end = [], start, start + count
    if not shape or end > math.prod(shape) or start < 0:
        raise CheckpointError(f"a flattened range [{start}, {end}) outside a block of {list(shape)}")
    inner = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    while pos < end:
        index = [(pos // inner[k]) % shape[k] for k in range(len(shape))]
        k = len(shape) - 1
        while k > 0 and index[k] == 0 and end - pos >= inner[k - 1]:
            k -= 1
        n = min(shape[k] - index[k], (end - pos) // inner[k])
        out.append((pos - start, tuple(index[:k + 1]) + (0,) * (len(shape) - k - 1),
                    (1,) * k + (n,) + tuple(shape[k + 1:])))
        pos += n * inner[k]
    return out


def _part(name: str) -> tuple[str, ...]:
    """Where a Megatron key goes in the state dict, as Megatron-LM's own torch-format checkpoints nest it:
    the optimizer's keys (`optimizer.…`) under `optimizer`, the model's under `model`, and the common and
    per-rank states (`common_state/…`, `rng_state/…`) at the top. NeMo's `module.` goes: the names are
    Megatron's."""
    if name.startswith(MEGATRON_OPTIMIZER) or CHAINED.match(name):
        return ("optimizer", name)
    if name.split("/")[0] in MEGATRON_TOP:
        return (name,)
    return ("model", name.removeprefix(NEMO_PREFIX))


def _layers_split(fqn: str) -> tuple[str, str | None]:
    """("decoder.layers.", "mlp.linear_fc1.weight") for a stacked layer key; (fqn, None) for any other."""
    m = STACKED.match(fqn)
    return (m.group(1), fqn[m.end():]) if m else (fqn, None)


def _experts_split(fqn: str) -> tuple[str, str | None]:
    """("….mlp.experts.", "linear_fc1.weight") for a key of experts stacked on an axis; (fqn, None) else."""
    m = STACKED_EXPERTS.match(fqn)
    return (m.group(1), fqn[m.end():]) if m else (fqn, None)


def _stacked(fqn: str) -> tuple[Callable[[tuple[int, ...]], str], int]:
    """How many leading axes of a Megatron key index its layers and experts (0, 1 or 2), and the per-layer,
    per-expert name of each index: layers stacked under `layers.` (`decoder.layers.{i}.…`), experts stacked
    under `experts.experts.` as Megatron's own modules name them one by one (`experts.local_experts.{e}.…`)."""
    head, tail = _layers_split(fqn)
    inner, rest = _experts_split(fqn if tail is None else tail)
    if tail is not None and rest is not None:
        return (lambda i: f"{head}{i[0]}.{inner}{LOCAL_EXPERTS}{i[1]}.{rest}"), 2
    if tail is not None:
        return (lambda i: f"{head}{i[0]}.{tail}"), 1
    if rest is not None:
        return (lambda i: f"{inner}{LOCAL_EXPERTS}{i[0]}.{rest}"), 1
    return (lambda i: fqn), 0  # (no stack: its own name)


def _extra_state(fqn: str) -> str:
    """An extra state's per-layer (per-expert) name: a stack's `…_extra_state/shard_{layer}_{layers}`
    (experts': `shard_{layer}.{expert}_{layers}.{experts}`), a per-layer key's its one shard's."""
    m = EXTRA_STATE.fullmatch(fqn)
    if m is None:
        return fqn
    index = tuple(int(i) for i in m.group(2).split("."))
    name_of_index, k = _stacked(m.group(1))
    if k == len(index):
        return name_of_index(index)
    return m.group(1) if k == 0 and index == (0,) and LAYER_KEY.match(fqn) else fqn


def _file_order(name: str) -> tuple[Any, ...]:
    """__2_0.distcp before __10_0.distcp."""
    parts = name.removeprefix("__").removesuffix(".distcp").split("_")
    return (0, *map(int, parts)) if all(digits(p) for p in parts) else (1, name)


def trainer_files(folder: str, storage_options: StorageOptions | None = None) -> list[str]:
    """OLMo's `train/rank{r}.pt` (torch_new; OLMo-core trainers too) beside a `model_and_optim/` DCP folder,
    in rank order; megatron-core <= 0.18's `common.pt` in the folder; Lightning's and Fabric's `meta.pt`
    (epoch, global_step, loops, callbacks, schedulers: what is not a module or an optimizer). Empty for
    other DCP layouts."""
    parent, name = (folder.rstrip("/").rsplit("/", 1) if is_url(folder) else os.path.split(os.path.normpath(folder)))
    if name == MODEL_AND_OPTIM:
        return trainer.trainer_files(parent, storage_options)
    if _megatron(folder, storage_options).get("common_backend"):
        return [join(folder, MEGATRON_COMMON)]
    return config_files(folder, storage_options, lightning.META)


def spec(ckpt: DcpCheckpoint, encode_key: KeyEncoder, trainer_state: list[str] | None = None, strict: bool = False,
         storage_options: StorageOptions | None = None) -> CheckpointSpec:
    """The planner's view: arrays for tensors (`_array`), values for the rest; every chunk's holder is the
    index of the file that stores it. OLMo's per-rank trainer
    state files (`trainer`), if any, are units too: their values join the state dict's top level."""
    number = {f: n for n, f in enumerate(ckpt.files)}
    holder = {(i.fqn, o): number[i.file] for i in ckpt.items for o in ([b[1] for b in i.boxes] if i.boxes else [i.offsets])}
    arrays, objects = {}, []
    for fqn, (dtype, size, chunks) in ckpt.tensors.items():
        if not _array(size):
            objects.append(ckpt.store_path(fqn))
            continue
        shards = tuple(ShardSpec(o, s, holder[(fqn, o)]) for o, s in chunks)
        arrays[ckpt.store_path(fqn)] = ShardedSpec(dtype, size, shards)
    objects += [ckpt.store_path(fqn) for fqn in ckpt.values]
    tree = _tree(ckpt, encode_key)
    units = list(ckpt.files)
    if trainer_state:
        common = _is_common(trainer_state[0])
        join_trainer_state(tree, objects, trainer_state[0], encode_key, storage_options, strict,
                           COMMON_STATE if common else "")
        units += [MEGATRON_COMMON] if common else [lightning.META] if name_of(trainer_state[0]) == lightning.META \
            else [f"{TRAIN}/{os.path.basename(f.rstrip('/'))}" for f in trainer_state]
    _check_named_steps(ckpt, storage_options, strict)
    args = _megatron_args(ckpt, trainer_state or [], storage_options, strict)
    if ckpt.megatron_fsdp:
        megatron_fsdp.check_args(args, ckpt, join(ckpt.folder, METADATA))
    facts = CheckpointFacts(
        units=tuple(units), metadata=ckpt.digest, not_tensors=frozenset(ckpt.store_path(fqn) for fqn in ckpt.values),
        # OLMo's (torch_new) and OLMo-core's folder: their nesting (trainers/)
        trainer="olmo" if name_of(ckpt.folder) == MODEL_AND_OPTIM else None, megatron_args=args,
        megatron_common=next((c.path for _, c in tree.children if c.path.startswith(COMMON_STATE)
                              or (ckpt.megatron_fsdp and c.path == megatron_fsdp.ARGS)), None))
    return CheckpointSpec("dcp", len(units), len(units), tree, arrays, {}, objects, facts,
                          {join(ckpt.folder, f): end for f, end in ckpt.ends().items()})


def _check_named_steps(ckpt: DcpCheckpoint, storage_options: StorageOptions | None, strict: bool) -> None:
    """A step a trainer records as a bytes item (NAMED_STEPS) against the one its folder's name says: a
    folder holding another save's is refused (read/source.py's check_step). Read only where the name
    says a step: one small item each."""
    for item in ckpt.items:
        named = NAMED_STEPS.get(item.fqn) if item.offsets is None else None
        if named is None or not named.search(name_of(ckpt.folder)):
            continue
        where = f"{join(ckpt.folder, item.file)}: {item.fqn}"
        step = _item_value(ckpt, item, storage_options, strict, where)
        check_step(where, item.fqn.rsplit(".", 1)[-1], step, ckpt.folder, named)


def _item_value(ckpt: DcpCheckpoint, item: Item, storage_options: StorageOptions | None, strict: bool,
                what: str) -> Any:
    """A bytes item's value, read with the plan from its file (a small one: a trainer's step, Megatron's
    common state)."""
    data = DataFile(join(ckpt.folder, item.file), storage_options)
    try:
        zf = _item_zip(ckpt, data, item, f"{join(ckpt.folder, item.file)}: {item.fqn}")
        try:
            return load(zf.record("data.pkl"), what, strict)
        finally:
            zf.close()
    finally:
        data.close()


def _common_state(ckpt: DcpCheckpoint, trainer_state: list[str], storage_options: StorageOptions | None,
                  strict: bool) -> tuple[str, Any] | None:
    """(where, what) Megatron-LM's common state is: a bytes item of a .distcp file (megatron-core >= 0.19),
    common.pt (before), the top-level `args` and `iteration` values of Megatron-FSDP's save."""
    if ckpt.megatron_fsdp:
        return ckpt.folder, {i.fqn: _item_value(ckpt, i, storage_options, strict, f"{join(ckpt.folder, i.file)}: {i.fqn}")
                             for i in ckpt.items if i.offsets is None and i.fqn in megatron_fsdp.COMMON}
    item = next((i for i in ckpt.items if i.offsets is None and i.fqn.startswith(COMMON_STATE)), None)
    if item is not None:
        where = join(ckpt.folder, item.file)
        return where, _item_value(ckpt, item, storage_options, strict, f"{where}: Megatron's common state")
    common = next((p for p in trainer_state if _is_common(p)), None)
    if common is None:
        return None
    with TorchZip(common, storage_options) as zf:
        return common, load(zf.record("data.pkl"), f"{common}: Megatron's common state", strict)


def _megatron_args(ckpt: DcpCheckpoint, trainer_state: list[str], storage_options: StorageOptions | None,
                   strict: bool) -> dict[str, Any] | None:
    """Megatron-LM's `args` (their plain values), read with the plan from the common state (a small
    bytes item, or common.pt): what describes the model for --format hf, known before any unit is read."""
    found = _common_state(ckpt, trainer_state, storage_options, strict)
    if found is None:
        return None
    where, state = found
    state = state[0] if isinstance(state, list) and len(state) == 1 else state
    megatron_torch.check_iteration(f"{where}: Megatron's common state", state, ckpt.folder)
    args = getattr(state.get("args") if isinstance(state, dict) else None, "state", None)
    if not isinstance(args, dict):
        return None
    plain = (str, int, float, bool, type(None))  # and lists of them: a per-layer pattern (moe_layer_freq)
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in args.items() if isinstance(k, str) and (
        isinstance(v, plain) or isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))}


def _array(size: tuple[int, ...]) -> bool:
    """Every tensor with elements and a dimension is an array, however small (a norm's weight): then an
    export of tensors alone is laid out from the plan, and written by the ingest itself. Scalars (an
    optimizer's step) stay values."""
    return len(size) > 0 and math.prod(size) > 0


def _tree(ckpt: DcpCheckpoint, encode_key: KeyEncoder) -> Skeleton:
    """The nested state dict's skeleton from planner_data: int keys make lists, str keys dicts."""
    root: dict[Any, Any] = {}
    for fqn in ckpt.paths:
        node = root
        *parents, last = ckpt.paths[fqn]
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"{fqn}: planner_data nests it under a value")
        if last in node:
            raise CheckpointError(f"{fqn}: planner_data gives two values one path")
        node[last] = fqn

    def build(node: Any, path: str) -> Skeleton:
        if isinstance(node, str):
            return Node("leaf", path)
        keys = list(node)
        kind = "list" if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))) \
            else "dict"
        if kind == "list":
            keys = sorted(keys)
        names = [paths.escape(k) for k in keys]
        if len(set(names)) != len(names):
            raise CheckpointError(f"two keys of {path or 'the state dict'} map to the same store path")
        return Node(kind, path, [(encode_key(k), build(node[k], paths.join(path, n))) for k, n in zip(keys, names)])

    return build(root, "")


@dataclass
class DcpUnit:
    """One .distcp file, opened: its chunks as pieces of sharded leaves, its values, all still on disk."""

    path: str
    rank: int  # the file's place in the checkpoint's file order
    world_size: int
    group_rank: int
    group_size: int
    digest: str
    leaves: dict[str, Any]
    zips: dict[str, TorchZip]  # store path -> the zip its value's tensors live in
    file: DataFile
    opened: list[TorchZip] = field(default_factory=list)  # every item's zip, closed with the unit

    @property
    def size(self) -> int:
        return self.file.size

    def value_zip(self, path: str) -> TorchZip:
        return self.zips[path]

    def identity(self) -> str:
        return identity_of(self.file)

    def check(self, plan: PlannedCheckpoint) -> None:
        check_leaves(self, plan)

    def close(self) -> None:
        for zf in self.opened:
            zf.close()
        self.file.close()


def _checkpoint(folder: str, storage_options: StorageOptions | None, parts: bool = False) -> DcpCheckpoint:
    """A folder's .metadata (`parts`: its trainer's DCP folders'), read once per process."""
    return parsed_once("dcp-parts" if parts else "dcp", folder, storage_options, read_parts if parts else read_checkpoint)


def _is_common(path: str) -> bool:
    return path.replace("\\", "/").rsplit("/", 1)[-1] == MEGATRON_COMMON


def _beside_files(path: str) -> bool:
    """Megatron's common.pt or Lightning's meta.pt: one unit after a folder's .distcp files."""
    return _is_common(path) or name_of(path) == lightning.META


def open_trainer_unit(path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
                      share: FileShare | None = None) -> TrainerUnit:
    if _beside_files(path):
        share = share or share_of(path, storage_options, False)
        return open_trainer(path, Place(share.count, share.count + 1, share.ckpt.digest), storage_options, strict,
                            encode_key, COMMON_STATE if _is_common(path) else "", named=True)
    train = _join_parent(path)
    ckpt = _checkpoint(join(train, MODEL_AND_OPTIM), storage_options)
    count = len(ckpt.files) + len(trainer_files(join(train, MODEL_AND_OPTIM), storage_options))
    return open_trainer(path, Place(len(ckpt.files) + (name_rank(path) or 0), count, ckpt.digest), storage_options,
                        strict, encode_key)


def _join_parent(path: str) -> str:
    """The checkpoint folder a train/rank<N>.pt belongs to."""
    if is_url(path):
        return path.rstrip("/").rsplit("/", 2)[0]
    return os.path.dirname(os.path.dirname(os.path.abspath(path)))


def _folder_name(path: str, parts: bool) -> tuple[str, str]:
    """The checkpoint folder a .distcp file is of, and its name there (`parts`: "part/file")."""
    if parts:
        return _unit_folder(path)
    folder, name = path.rsplit("/", 1) if is_url(path) else os.path.split(path)
    return folder, name


def share_of(path: str, storage_options: StorageOptions | None, parts: bool) -> FileShare:
    """What reading the unit `path` needs of its checkpoint's .metadata (read once per process)."""
    if path.endswith(".pt"):
        share = _checkpoint(folder_of(path), storage_options).share(name_of(path))
        return replace(share, beside=COMMON_STATE if _is_common(path) else "")  # (Lightning's: the top level)
    folder, name = _folder_name(path, parts)
    return _checkpoint(folder, storage_options, parts).share(name)


def open_unit(path: str | os.PathLike[str], storage_options: StorageOptions | None = None,
              strict: bool = False, parts: bool = False, share: FileShare | None = None) -> DcpUnit:
    """Open one .distcp file of a checkpoint: from its `share` of the .metadata, as planning gave it, or
    else from the .metadata, read once per process; `parts`: a file of one of a trainer's DCP folders
    saved side by side (`trainer_parts`)."""
    path = os.fspath(path)
    folder, name = _folder_name(path, parts)
    share = share or share_of(path, storage_options, parts)
    if share.rank < 0:
        raise CheckpointError(f"{path}: not a file of the checkpoint in {folder} (its .metadata names no item in it)")
    data = DataFile(path, storage_options)
    unit = DcpUnit(path, share.rank, share.count, share.rank, share.count, share.ckpt.digest, {}, {}, data)
    with closed_on_error(unit.close, path):
        _read_items(share.ckpt, unit, name, strict)
    return unit


def _read_items(ckpt: DcpCheckpoint, unit: DcpUnit, name: str, strict: bool) -> None:
    sharded: dict[str, ArrayLeaf] = {}
    for item in ckpt.by_file.get(name, ()):
        where = f"{item.fqn}" + ("" if item.offsets is None else f" at {list(item.offsets)}")
        if item.offset + item.length > unit.file.size:
            raise CheckpointError(f"{where}: its item runs past the end of the file (truncated?)")
        zf = _item_zip(ckpt, unit.file, item, where)
        unit.opened.append(zf)
        store_path = ckpt.store_path(item.fqn)
        value = load(zf.record("data.pkl"), f"{unit.path}: {where}", strict)
        if item.offsets is None:  # a value (torch.save of the object)
            unit.leaves[store_path], unit.zips[store_path] = value, zf
            continue
        dtype, size, chunks = ckpt.tensors[item.fqn]
        if item.boxes:  # a flattened range of a block: each box a run of its elements
            leaf = sharded.setdefault(store_path, ArrayLeaf(dtype, size, []))
            leaf.pieces += _flat_pieces(zf, value, item, dtype, where)
            continue
        sizes = dict(chunks)[item.offsets]
        k = item.squeeze
        if k and isinstance(value, TensorRef) and tuple(value.shape[:k]) == (1,) * k:
            value = TensorRef(value.storage, value.offset, tuple(value.shape[k:]), tuple(value.stride[k:]), value.dtype)
        if not isinstance(value, TensorRef) or tuple(value.shape) != sizes or value.dtype != dtype:
            got = f"torch.{value.dtype}{list(value.shape)}" if isinstance(value, TensorRef) else type(value).__name__
            raise CheckpointError(f"{where}: holds {got}, the metadata says torch.{dtype}{list(sizes)}")
        check_view(zf, value, where)
        if not _array(size):
            unit.leaves[store_path], unit.zips[store_path] = value, zf
            continue
        leaf = sharded.setdefault(store_path, ArrayLeaf(dtype, size, []))
        leaf.pieces.append(LocalPiece(item.offsets, sizes, value, zf))
    unit.leaves.update(sharded)


def _item_zip(ckpt: DcpCheckpoint, data: DataFile, item: Item, where: str) -> TorchZip:
    """An item's torch.save zip: in place in its file, or, written through stream transforms (ZStandard),
    decompressed into a temporary file of its own (closed, so deleted, with the zip)."""
    if not item.transforms:
        return TorchZip(data, start=item.offset, length=item.length)
    return TorchZip(stream_transforms.decoded(data, item.offset, item.length, item.transforms, _most(ckpt, item), where),
                    owns=True)


def _most(ckpt: DcpCheckpoint, item: Item) -> int:
    """The bytes an item's torch.save can take: its tensor's (boxes') elements and the zip's other records;
    a value's, up to MAX_VALUE."""
    if item.offsets is None:
        return MAX_VALUE
    dtype, _, chunks = ckpt.tensors[item.fqn]
    count = sum(math.prod(s) for _, _, s in item.boxes) if item.boxes else math.prod(dict(chunks)[item.offsets])
    return count * dtypes.info(dtype).itemsize + ZIP_RECORDS


def _flat_pieces(zf: TorchZip, value: Any, item: Item, dtype: str, where: str) -> list[LocalPiece]:
    count = sum(math.prod(sizes) for _, _, sizes in item.boxes)
    if not isinstance(value, TensorRef) or value.dtype != dtype or math.prod(value.shape) != count \
            or value.stride[-1:] not in ((1,), ()):
        got = f"torch.{value.dtype}{list(value.shape)}" if isinstance(value, TensorRef) else type(value).__name__
        raise CheckpointError(f"{where}: holds {got}, the metadata says {count} elements of torch.{dtype}")
    check_view(zf, value, where)
    return [LocalPiece(offsets, sizes, TensorRef(value.storage, value.offset + start, sizes, _row_major(sizes), dtype), zf)
            for start, offsets, sizes in item.boxes]


def _row_major(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(sizes[k + 1:]) for k in range(len(sizes)))


# ---------------------------------------------------------------------------------------------- format
def trainer_parts(folder: str, storage_options: StorageOptions | None) -> list[str]:
    """The DCP folders the HF Trainer and Accelerate save side by side as one checkpoint (FSDP's
    SHARDED_STATE_DICT): `pytorch_model_fsdp_{i}/` (each prepared model, its state under `model`) and
    `optimizer_{i}/` (its optimizer, under `optimizer`), in that order. Empty when `folder` has a
    .metadata of its own or holds no such folder."""
    if has_metadata(folder, storage_options):
        return []
    whole = {n: has_metadata(join(folder, n), storage_options) for n in subfolders(folder, storage_options)
             if PART.fullmatch(n)}
    if not any(whole.values()):
        return []
    broken = next((n for n, there in whole.items() if not there), None)  # a trainer's: every part is whole
    if broken is not None:
        raise CheckpointError(f"{join(join(folder, broken), METADATA)}: missing: the {broken} part of the checkpoint "
                              f"in {folder} has no .metadata (an unfinished or damaged save)")
    found = list(whole)
    _optimizer_saved(folder, found, storage_options)
    return sorted(found, key=lambda n: (not n.startswith(FSDP_MODEL), int(n.rsplit("_", 1)[1])))


def _optimizer_saved(folder: str, parts: list[str], storage_options: StorageOptions | None) -> None:
    """A trainer folder whose scheduler is saved has its optimizer too: the HF Trainer and Accelerate save
    the optimizer's folder before the scheduler (`save_only_model` saves neither), so one without it is a
    damaged save, whose export would silently lack the optimizer."""
    if any(n.startswith("optimizer_") for n in parts):
        return
    there = {name_of(p) for p in listing(folder, storage_options)}
    scheduler = next((n for n in ("scheduler.pt", "scheduler.bin") if n in there), None)
    if scheduler is not None:
        raise CheckpointError(f"{join(folder, 'optimizer_0')}: missing, beside {scheduler}, which the trainer saves "
                              f"after it (an unfinished or damaged save)")


def read_parts(folder: str, storage_options: StorageOptions | None = None) -> DcpCheckpoint:
    """One checkpoint of a trainer's DCP folders (`trainer_parts`): each folder's metadata read and
    checked on its own, its files named `part/file`; the keys of two parts must not meet."""
    parts = trainer_parts(folder, storage_options)
    if not parts:
        raise CheckpointError(f"{folder}: holds no DCP folder of a trainer (pytorch_model_fsdp_N/, optimizer_N/)")
    tensors: dict[str, Any] = {}
    values: list[str] = []
    paths_: dict[str, tuple[Any, ...]] = {}
    items: list[Item] = []
    files: list[str] = []
    digests = []
    for part in parts:
        ckpt = _numbered(read_checkpoint(join(folder, part), storage_options), int(part.rsplit("_", 1)[1]))
        taken = set(tensors) | set(values)
        clash = next((fqn for fqn in [*ckpt.tensors, *ckpt.values] if fqn in taken), None)
        if clash is not None:
            raise CheckpointError(f"{join(folder, part)}: holds {clash!r:.80}, which an earlier part holds too")
        tensors.update(ckpt.tensors)
        values += ckpt.values
        paths_.update(ckpt.paths)
        items += [replace(i, file=f"{part}/{i.file}") for i in ckpt.items]
        files += [f"{part}/{f}" for f in ckpt.files]
        digests.append(ckpt.digest)
    digest = hashlib.blake2b(repr(digests).encode(), digest_size=16).hexdigest()
    return DcpCheckpoint(folder, digest, tensors, values, paths_, items, files)


def _numbered(ckpt: DcpCheckpoint, index: int) -> DcpCheckpoint:
    """A second prepared model's or optimizer's folder (`pytorch_model_fsdp_1/`, `optimizer_1/`): accelerate
    saves each under the same key (`model`, `optimizer`), kept here as `model_1`, `optimizer_1`, as its
    per-rank files of the same save are (read/formats/accelerate.py)."""
    if not index:
        return ckpt

    def fqn(name: str) -> str:
        top = str(ckpt.paths[name][0])
        return f"{top}_{index}{name[len(top):]}" if name.startswith(top) else f"{top}_{index}.{name}"

    return DcpCheckpoint(ckpt.folder, ckpt.digest, {fqn(k): v for k, v in ckpt.tensors.items()},
                         [fqn(k) for k in ckpt.values],
                         {fqn(k): (f"{p[0]}_{index}", *p[1:]) for k, p in ckpt.paths.items()},
                         [replace(i, fqn=fqn(i.fqn)) for i in ckpt.items], ckpt.files)


def _inside(folder: str, storage_options: StorageOptions | None) -> str | None:
    """The folder holding .metadata: `folder`, or one of the places a trainer keeps it in (INSIDE); or
    `folder` itself when it holds a trainer's DCP folders side by side (`trainer_parts`)."""
    for place in ("", *INSIDE):
        path = join(folder, place) if place else folder
        if has_metadata(path, storage_options):
            return path
    return folder if trainer_parts(folder, storage_options) else None


def _read(folder: str, storage_options: StorageOptions | None) -> DcpCheckpoint:
    """The checkpoint in `folder`: its .metadata, or its trainer's DCP folders as one."""
    return _checkpoint(folder, storage_options, parts=not has_metadata(folder, storage_options))


def _unit_folder(path: str) -> tuple[str, str]:
    """(the checkpoint folder, the unit's name in it) of a .distcp file: `part/file` inside a trainer's
    DCP folder (its facts list units so), else the file's own folder and name."""
    folder, name = folder_of(path), name_of(path)
    part = name_of(folder)
    return (folder_of(folder), f"{part}/{name}") if PART.fullmatch(part) else (folder, name)


def _resolved(folder: str, storage_options: StorageOptions | None) -> str:
    return _inside(folder, storage_options) or join(folder, MODEL_AND_OPTIM)


def _beside(folder: str, storage_options: StorageOptions | None) -> list[str]:
    """The files a trainer keeps next to its DCP folder that describe the model: OLMo's config.yaml, a
    config.json (the HF Trainer's: in its output_dir above checkpoint-N/, or in another checkpoint-M/ of
    the run); NeMo 2's context/model.yaml and the tokenizer in context/nemo_tokenizer/; Megatron-Bridge's
    run_config.yaml; the Hugging Face files in a Megatron-LM run folder, above its iter_N/ or release/; those
    in veRL's huggingface/ next to its Megatron actor's dist_ckpt/
    (and a LoRA run's adapter config in huggingface/adapter/); those of the transformers model
    Lightning's hparams.yaml names (read/formats/lightning.py)."""
    name, parent = name_of(folder), folder_of(folder)
    if name == MODEL_AND_OPTIM:
        return config_files(parent, storage_options, "config.yaml", JSON_CONFIG)
    found = config_files(folder, storage_options, "config.yaml", JSON_CONFIG, ADAPTER_CONFIG, megatron.RUN_CONFIG)
    if not found and hf_trainer.STEPS.step(name) is not None and trainer_parts(folder, storage_options):
        # the HF Trainer writes no config.json into a sharded checkpoint-N/; its final save_model writes
        # the model's Hugging Face files into the run's output_dir, the folder above, and a save of a
        # full state dict (another checkpoint-M/ of the run) writes them into its folder
        found = hf_files(parent, storage_options)
        steps = sorted((n for n in subfolders(parent, storage_options) if hf_trainer.STEPS.step(n) is not None
                        and n != name), key=lambda n: -(hf_trainer.STEPS.step(n) or 0))
        for step in steps if not found else []:
            found = hf_files(join(parent, step), storage_options)
            if found:
                break
    if config_files(folder, storage_options, lightning.META):
        found += lightning.model_files(folder, storage_options)
    if name == NEMO_WEIGHTS:
        context = join(parent, NEMO_CONTEXT)
        found += config_files(context, storage_options, NEMO_MODEL)
        found += [p for p in listing(join(context, NEMO_TOKENIZER), storage_options) if hf_model_file(name_of(p))]
    elif megatron.STEPS.step(name) is not None or name == megatron.RELEASE:
        # a Megatron-LM run folder that keeps the model's Hugging Face files (shardstore's --format megatron
        # writes them there: its tokenizer, and the vocabulary's unpadded size)
        found += hf_files(parent, storage_options)
    elif name == VERL_DIST:
        found += [p for p in listing(join(parent, VERL_HF), storage_options) if hf_model_file(name_of(p))]
        # a LoRA run's adapter as Megatron-Bridge exports it for veRL (huggingface/adapter/): its config
        found += config_files(join(join(parent, VERL_HF), VERL_ADAPTER), storage_options, ADAPTER_CONFIG)
    return found


def dcp_folder(src: str, tag: str | None, step: int | None, storage_options: StorageOptions | None) -> str | None:
    """The DCP checkpoint folder `src` is, or holds (OLMo's model_and_optim/, Composer's ep*-ba*/ and its
    latest-rank0.pt link, step*/), or None when `src` holds no DCP checkpoint (`watch` asks this while a
    checkpoint may still be arriving, so nothing of it is read)."""
    if FORMAT.detect(src, storage_options):
        return _resolved(src, storage_options)
    newest = FORMAT.latest(src, storage_options) if tag in (None, "latest") and step is None else None
    if newest is not None:
        return _resolved(newest, storage_options)
    below = [n for n in subfolders(src, storage_options) if FORMAT.detect(join(src, n), storage_options)]
    return _resolved(join(src, pick(src, below, tag, step, storage_options)), storage_options) if below else None


def _parts(facts: dict[str, Any]) -> bool:
    """Whether the store's units are files of a trainer's DCP folders side by side ("part/file"): all of
    them are or none (`spec`), so the first says; asked once a unit, it must not cost one a unit (W^2)."""
    return "/" in next((u for u in facts.get("units", ()) if u.endswith(".distcp")), "")


class DcpFormat:
    name, title, ranked = "dcp", "DCP", False
    group_claims, keeps_empty_values = False, False  # DCP stores nested values key by key
    any_script, shares_folder = True, False

    def detect(self, folder: str, storage_options: StorageOptions | None) -> bool:
        return _inside(folder, storage_options) is not None

    def source(self, folder: str, storage_options: StorageOptions | None) -> Any:
        folder = _resolved(folder, storage_options)
        ckpt = _read(folder, storage_options)
        units = [join(folder, f) for f in ckpt.files]
        found = resume_files(folder, storage_options)  # the HF Trainer's, beside its DCP folders
        beside = trainer_files(folder, storage_options)
        lightning.check_meta_there(folder, {str(p[0]) for p in ckpt.paths.values() if p},
                                   any(name_of(p) == lightning.META for p in beside))
        return Source(self.name, units + beside, storage_options,
                      _beside(folder, storage_options), *((found.trainer, found.files) if found is not None else ()))

    def latest(self, folder: str, storage_options: StorageOptions | None) -> str | None:
        """A trainer's link to the newest checkpoint folder (trainers' `RUNS`): Composer's `latest-rank0.pt`,
        Lightning's `last.ckpt` (ModelCheckpoint's save_last: that link, or a copy of the newest save),
        OLMo's `latest`."""
        if is_url(folder):
            return None
        for steps in RUNS:
            link = os.path.join(local(folder), steps.latest)
            if steps.points == "link" and os.path.isdir(link) and self.detect(link, storage_options):
                return inside_run(folder, link)
        return None

    def of_files(self, files: list[str], storage_options: StorageOptions | None) -> Any:
        """.distcp files of one checkpoint, with any of the files of values its trainer keeps beside them
        (Lightning's meta.pt, Megatron's common.pt, OLMo's train/rank<N>.pt)."""
        distcp = [f for f in files if f.endswith(".distcp")]
        if not distcp:
            return None
        beside = {os.path.normpath(p) for p in trainer_files(_unit_folder(distcp[0])[0], storage_options)}
        if any(not f.endswith(".distcp") and os.path.normpath(f) not in beside for f in files):
            raise CheckpointError("give .distcp files of one DCP checkpoint (and the files of values beside "
                                  "them), or rank files, not both")
        return Source(self.name, sorted(files, key=lambda f: not f.endswith(".distcp")), storage_options)

    def plan(self, source: Any, encode_key: KeyEncoder, strict: bool) -> tuple[CheckpointSpec, None]:
        trainer_state = [u for u in source.units if u.endswith(".pt")]
        folder, name = _unit_folder(source.units[0])
        # the parse that found the checkpoint, which the units' shares are cut from too
        ckpt = _checkpoint(folder, source.storage_options, parts=True) if "/" in name else None
        distcp = [u for u in source.units if u.endswith(".distcp")]
        if ckpt is None or sorted(join(folder, f) for f in ckpt.files) != sorted(distcp):  # one folder of them
            ckpt = _checkpoint(folder_of(source.units[0]), source.storage_options)
        return spec(ckpt, encode_key, trainer_state, strict, source.storage_options), None

    def unit_share(self, path: str, storage_options: StorageOptions | None, facts: dict[str, Any]) -> FileShare | None:
        """A .distcp file's share of the .metadata (`DcpCheckpoint.share`), and the unit count and digest
        for the file of values beside them; None for OLMo's train/rank<N>.pt."""
        if path.endswith(".pt") and not _beside_files(path):
            return None
        return share_of(path, storage_options, _parts(facts))

    def open_unit(self, path: str, storage_options: StorageOptions | None, strict: bool, encode_key: KeyEncoder,
                  facts: dict[str, Any], share: Any = None) -> Any:
        if path.endswith(".pt"):  # Megatron's common.pt, Lightning's meta.pt, OLMo's train/rank<N>.pt
            return open_trainer_unit(path, storage_options, strict, encode_key, share)
        return open_unit(path, storage_options, strict, _parts(facts), share)

    def arrivals(self, folder: str, tag: str | None, looks: Any) -> Any:
        """A DCP folder counts once its .metadata reads (torch writes it last; a copy may bring it first),
        then each .distcp file once it reaches the end of the last item .metadata places in it."""
        found = dcp_folder(folder, tag, None, None)
        if found is None:
            return None
        if not has_metadata(found):
            raise CheckpointError(f"{found}: a trainer's DCP folders side by side ({', '.join(trainer_parts(found, None))})"
                                  f"; watch does not follow them yet: unshard it once it is saved")
        ckpt = looks.parse(os.path.join(found, METADATA), lambda path: read_checkpoint(found))
        if ckpt is None:
            return Arrived(Source(self.name, []), [])  # still being written: look again
        ends = ckpt.ends()
        units = [os.path.join(found, f) for f in ckpt.files]
        return Arrived(Source(self.name, units), [
            (path, i) for i, path in enumerate(units)
            if looks.still(path, lambda p, size: size >= ends.get(os.path.basename(p), 0))])  # (an empty save's)

    def unit_kind(self, name: str) -> str:
        if name.endswith(".distcp"):
            return ".distcp files"
        if name_of(name) == METADATA:
            return "DCP metadata (of an empty save)"
        if name_of(name) == lightning.META:
            return "Lightning's meta.pt"
        return "Megatron's common state" if _is_common(name) else "trainer-state files"


FORMAT = DcpFormat()
