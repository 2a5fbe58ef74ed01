"""`verify SRC OUTPUT`: an unsharded output checked against the sharded checkpoint it came from.

The output is what a safetensors or Hugging Face export writes: shardstore's, or any other tool's
(`accelerate merge-weights`, a merger of veRL's, a hand-made `model.safetensors`). The checkpoint is
read through the same readers and checks as `unshard`, into a scratch store of the model's tensors
(removed afterwards). Then every tensor an export of it would write, under the names that export gives
(Hugging Face's, split weights included), is compared with the output's tensor of that name, streaming
both in blocks: there, of the same shape, and of the same bytes; or, where the output holds another
floating dtype, of the source's bytes cast to it rounding to nearest even, as torch casts. What the
output holds beyond those is named too. A converter that kept a slice of a tensor, dropped one, cast by
truncation or swapped the parts of a split weight shows up as one line per tensor.

A torch output is read back with the safe unpickler and walked beside what the export would write. A DCP
output is read through shardstore's own DCP reader into a second scratch store, and its state (its
flattened keys nested again as its `.metadata` records them) walked beside the checkpoint's the same way:
every tensor by its bytes, streamed from both stores, and plain values by value.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from . import base_folder, dtypes
from .errors import ExportError
from .export import fp8, mxfp4, planned, registry, renamed
from .export.dcp import dcp_names, dcp_state
from .export.resolve import ArrayRef, build, leaves, object_value
from .export.safetensors import INDEX, Item, tensor_bytes
from .export.hf import describe, has_hf_description
from .export.hf.megatron_inverse import mtp_copies
from .export.hf.leaves import CONFIG
from .hf_files import ADAPTER_CONFIG
from .export.torch import torch_files_in, torch_layout, torch_object
from .trainers.contract import ResumeFile
from .ingest import ingest
from .run import model_store, request as run_request
from .jsonin import loads
from .ranges import BLOCK, blocks
from .read.discover import open_source
from .read.primitives import tensors
from .read.primitives.container import TorchZip, read_small
from .read.primitives.safetensors_file import SafetensorsFile
from .read.primitives.unpickle import load
from .records import TensorRef
from .store.handle import TensorValue
from .store.store import Store
from .tree import MAX_DEPTH

MAX_INDEX_FILE = 64 << 20


@dataclass(frozen=True)
class Difference:
    """One tensor where the output is not what the checkpoint gives, in one line."""

    name: str
    what: str

    def __str__(self) -> str:
        return f"{self.name}: {self.what}"


@dataclass
class VerifyResult:
    format: str  # the output format the output was checked as
    tensors: int = 0  # compared
    nbytes: int = 0  # of the output's tensors compared
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        size = f"{self.tensors} tensors ({self.nbytes / 2**30:.2f} GiB)"
        if self.ok:
            return f"verified {size} against the checkpoint: every one equal"
        return f"{len(self.differences)} difference(s) in the output; compared {size}"


# what `verify` takes besides the two folders and the format: the export's options as it took them, and
# which checkpoint and how to read it, as for `unshard`
OPTIONS = frozenset({"select", "strip_prefix", "hf_config", "tag", "step", "jobs", "storage_options", "adapter",
                     "merge_adapter", "lora_alpha", "rslora", "base", "names"})


def verify(src: str | os.PathLike[str], output: str | os.PathLike[str], format: str | None = None,
           **options: Any) -> VerifyResult:
    """Check OUTPUT (a safetensors file, or a folder of them: a Hugging Face folder when it has a
    config.json; a model's state dict in torch files, one or pytorch_model*.bin; the torch files `--format
    torch` writes; a DCP folder) against the checkpoint in SRC. `format` (an output format's name) says
    which export to check it as [default: from the folder]; `options` are `OPTIONS`: `select`,
    `strip_prefix` and `hf_config` as the export took them, `tag`, `step`, `jobs` and `storage_options`
    as for `unshard`, and a PEFT adapter's `adapter`, `merge_adapter`, `lora_alpha`, `rslora`, `base` (an adapter
    folder, adapter_config.json and no config.json, is checked as `adapter`, its alpha and rsLoRA its
    config's)."""
    registry.known(options, OPTIONS)
    out = Path(output)
    fmt = registry.output_format(format) if format is not None else registry.recognised(out)
    if fmt.describes_model and (out / ADAPTER_CONFIG).is_file() and not (out / CONFIG).is_file():
        options = {**_adapter_options(out / ADAPTER_CONFIG), **options, "adapter": True}  # peft's adapter folder
    request = run_request(src, output, format=fmt.name, **options)
    jobs, select = request.jobs, request.export.select
    if fmt.reads_back_as_model:
        return _as_model(src, out, request, fmt.name)
    if request.export.names is not None:
        return _renamed(src, out, request)
    # the whole checkpoint, the optimizer's state too; or a model's state dict in torch files
    whole = not fmt.subtree and (fmt.reads_as_checkpoint or not state_dict_files(out))
    files, outputs = _output_tensors(out) if not whole else ([], {})
    written = open_source(out) if fmt.reads_as_checkpoint else None  # refused up front if it is none
    try:
        source = open_source(src, request.tag, request.step, request.storage_options)
        scratch = _scratch(out)
    except BaseException:
        for f in files:
            f.close()
        raise
    try:
        if written is not None:
            return _compare_dcp(ingest(scratch / "store", source, jobs=jobs), ingest(scratch / "output", written, jobs=jobs),
                                fmt.name)
        if whole:
            return _compare_torch(ingest(scratch / "store", source, jobs=jobs), out, fmt.name)
        store = model_store(scratch / "store", source, jobs, select)
        export = request.export
        if fmt.describes_model and export.hf_config is None and not export.adapter and not has_hf_description(store):
            # the folder's own config.json: what the export was given, as written
            export = replace(export, hf_config=out / CONFIG)
        # the tensors, and their names, a safetensors (or hf) export writes: a state dict's too
        export = replace(export, output=fmt if fmt.subtree else registry.TENSORS)
        with base_folder.opened(export) as export:
            tensors = planned(store, export).tensors
            dtype = _dequantized_into(tensors, outputs) if export.dtype is None else None
            if dtype is not None:  # a quantized model's export with --dtype: checked as the writer dequantized it
                tensors = planned(store, replace(export, dtype=dtype)).tensors
            return _compare(store, tensors, _views(outputs), fmt.name)
    finally:
        for f in files:
            f.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _as_model(src: str | os.PathLike[str], out: Path, request: Any, format: str) -> VerifyResult:
    """A Megatron checkpoint written from a Hugging Face model: read back (the reader takes the HF files
    beside its run folder), mapped onto transformers' names as `--format hf` maps it (the vocabulary's
    padding off), each tensor the source model's, bit for bit (a quantized model's weights as the writer
    dequantized them: into `--dtype`, by default bfloat16)."""
    with _read_back(src, out, request) as (store, written, scratch):
        output = model_store(scratch / "output", written, request.jobs, None)
        ours = replace(request.export, output=registry.output_format("hf"), vocab_multiple=None)
        items = planned(store, ours).tensors
        config = describe(store, "", ours.hf_config, ours.strip_prefix)[0].config or {}
        if ours.dtype is None and (mxfp4.quantized(config) or any(it.dtype == "float8_e4m3fn" for it in items)):
            ours = replace(ours, dtype="bfloat16")  # as the writer dequantized them
            items = planned(store, ours).tensors
        theirs = replace(ours, select=None, strip_prefix=None, hf_config=None, dtype=None, keep_dtype=())
        found: dict[str, Found] = {it.key: (it.dtype, tuple(it.shape), partial(tensor_bytes, output, it))
                                   for it in planned(output, theirs).tensors}
        # (an FP8 model's scales, and the copies of the embedding and output layer the writer leaves out)
        left_out = set(mtp_copies(config, [it.key for it in items]))
        return _compare(store, [it for it in items if not it.key.endswith(fp8.SCALE) and it.key not in left_out],
                        found, format)


@contextmanager
def _read_back(src: str | os.PathLike[str], out: Path, request: Any) -> Iterator[tuple[Store, Any, Path]]:
    """For an output read back as a checkpoint: the source's model in a scratch store beside OUT, OUT's
    source (refused up front where OUT is no checkpoint), and the scratch folder, removed afterwards."""
    written = open_source(out)
    source = open_source(src, request.tag, request.step, request.storage_options)
    scratch = _scratch(out)
    try:
        yield model_store(scratch / "store", source, request.jobs, request.export.select), written, scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _renamed(src: str | os.PathLike[str], out: Path, request: Any) -> VerifyResult:
    """A DCP folder under a trainer's names (`--names`), read back: each chunk the export plans (a source
    tensor, or its rows in the trainer's order, at its place in the trainer's tensor: an expert's index
    of a stacked one) the bytes at that place, every tensor of the folder one the plan names."""
    with _read_back(src, out, request) as (store, written, scratch):
        output = ingest(scratch / "output", written, jobs=request.jobs)
        paths = {".".join(map(str, keys)): path for keys, path in dcp_names(output).items()}
        chunks, described, _ = renamed.plan_items(store, "", request.export)
        items: list[Item] = []
        found: dict[str, Found] = {}
        for chunk in chunks:
            assert chunk.chunk is not None  # (renamed.plan_items gives tensors only)
            (offset, sizes), shape = chunk.chunk, described[chunk.fqn][2]
            whole = tuple(sizes) == tuple(shape)
            key = chunk.fqn if whole else f"{chunk.fqn}[{offset[0]}]"  # an expert of a stacked tensor
            items.append(Item(key, chunk.source, chunk.source.dtype, tuple(sizes)))
            got = _rows(output, paths.get(chunk.fqn), tuple(shape), None if whole else (offset[0], offset[0] + sizes[0]))
            if got is not None:
                found[key] = (got[0], tuple(sizes), got[1])
        result = _compare(store, items, found, "dcp")
        for fqn in sorted(set(paths) - set(described)):
            result.differences.append(Difference(fqn, "in the output, but not a tensor the export holds"))
        return result


def _rows(store: Store, path: str | None, shape: tuple[int, ...], rows: tuple[int, int] | None
          ) -> tuple[str, Callable[[], Iterator[Any]]] | None:
    """The dtype of the tensor at `path` and its bytes (rows [first, stop) of it: None, all), where it is
    a tensor of `shape`: an array streamed, or a small tensor the reader kept as a value."""
    if path is None:
        return None
    entry = store.manifest.arrays.get(path)
    if entry is not None:
        return (entry.dtype, partial(store.stream, path, rows=rows)) if tuple(entry.shape) == shape else None
    value = object_value(store, path, lean=True)
    if not isinstance(value, TensorValue) or tuple(value.shape) != shape:
        return None
    row = len(value.data) // shape[0] if shape and shape[0] else len(value.data)
    data = value.data if rows is None else value.data[rows[0] * row:rows[1] * row]
    return value.dtype, lambda: iter([data])


def _dequantized_into(tensors: list[Item], outputs: dict[str, Any]) -> str | None:
    """The dtype an export dequantized a quantized model's weights into, where the output holds none of its
    scales (FP8's `X.weight_scale_inv`, MXFP4's `X_scales`) but the weights they scale, in that dtype."""
    scaled = {it.key.removesuffix(fp8.SCALE): it.key for it in tensors if it.key.endswith(fp8.SCALE)}
    scaled.update({it.key.removesuffix(mxfp4.SCALES): it.key for it in tensors if it.key.endswith(mxfp4.SCALES)})
    if not scaled or any(scale in outputs for scale in scaled.values()):
        return None
    held = [outputs[key][1].dtype for key in scaled if key in outputs]
    return held[0] if held else None


def _views(outputs: dict[str, tuple[OutputFile, TensorRef]]) -> dict[str, Found]:
    """Each output tensor's dtype, shape and bytes (a view of its file)."""
    return {name: (ref.dtype, tuple(ref.shape), partial(f.view, name)) for name, (f, ref) in outputs.items()}


def _adapter_options(path: Path) -> dict[str, Any]:
    """What an adapter folder's own adapter_config.json says that the checkpoint may not (the HF Trainer's
    keeps none): its alpha and rsLoRA, as the export was given them."""
    config = loads(read_small(path, None, MAX_ADAPTER_CONFIG, "a PEFT adapter config"), str(path),
                   "PEFT adapter config", ExportError)
    if not isinstance(config, dict):
        raise ExportError(f"{path}: not a PEFT adapter config (a JSON object)")
    alpha: Any = config.get("lora_alpha")
    rslora: Any = config.get("use_rslora")
    return {**({"lora_alpha": float(alpha)} if type(alpha) in (int, float) else {}),
            **({"rslora": rslora} if type(rslora) is bool else {})}


MAX_ADAPTER_CONFIG = 1 << 20


def _scratch(out: Path) -> Path:
    """A scratch folder for the checkpoint's store: beside OUTPUT (its file system), or where temporary
    files go when OUTPUT's folder is not writable (a published, read-only copy)."""
    try:
        return Path(tempfile.mkdtemp(prefix=".shardstore-verify-", dir=out.absolute().parent))
    except OSError:
        return Path(tempfile.mkdtemp(prefix="shardstore-verify-"))


# An output's tensor as `_walk` compares it: (dtype, shape, its bytes: a view, or blocks streamed in order)
Found = tuple[str, tuple[int, ...], Callable[[], "memoryview | Iterator[Any]"]]


def _compare_torch(store: Store, out: Path, format: str) -> VerifyResult:
    """Every file the torch export of `store` writes, read back with the safe unpickler (nothing of it is
    called), walked beside what the export would write: every tensor of the same dtype, shape and bytes,
    every plain number and string equal; keys missing or extra named."""
    result = VerifyResult(format)
    for file, path in _torch_outputs(store, out):
        if not path.is_file():
            result.differences.append(Difference(path.name, "missing from the output"))
            continue
        with TorchZip(path) as zf:
            got = load(zf.record("data.pkl"), str(path), strict=False)

            def found(leaf: Any, zf: TorchZip = zf) -> Found | None:
                if not isinstance(leaf, TensorRef):
                    return None
                return leaf.dtype, tuple(leaf.shape), lambda: _torch_bytes(zf, leaf)

            _walk(store, found, path.name, torch_object(store, file), got, result, 0)
    return result


def _torch_outputs(store: Store, out: Path) -> list[tuple[ResumeFile, Path]]:
    """Each file of a torch OUTPUT and what it should hold. OUTPUT itself, or the one torch file of its
    folder, holds the whole state, whatever its name (torch's `dcp_to_torch_save`, `--single-file`); a
    folder of several holds the files `--format torch` writes for the checkpoint's layout, by their names."""
    held = [out] if out.is_file() else torch_files_in(out)
    if len(held) == 1:
        return [(torch_layout(store, single=True)[0], held[0])]
    split = torch_layout(store)
    if not {f.name for f in split} & {p.name for p in held}:
        raise ExportError(f"{out}: holds {', '.join(p.name for p in held) or 'no torch file'}, not the files "
                          f"--format torch writes for this checkpoint ({', '.join(f.name for f in split)}); give "
                          f"the one file that holds the whole state")
    return [(f, out / f.name) for f in split]


def _compare_dcp(store: Store, output: Store, format: str) -> VerifyResult:
    """The DCP output, read into `output`, walked beside the checkpoint's state as the DCP export writes it."""
    result = VerifyResult(format)

    def found(leaf: Any) -> Found | None:
        if isinstance(leaf, ArrayRef):
            return leaf.dtype, tuple(leaf.shape), lambda: leaf.parts(output)
        if isinstance(leaf, TensorValue):
            return leaf.dtype, tuple(leaf.shape), lambda: iter([leaf.data])
        return None

    _walk(store, found, "", dcp_state(store), build(output, output.manifest.tree, lean=True), result, 0)
    return result


def _walk(store: Store, found: Callable[[Any], Found | None], name: str, want: Any, got: Any, result: VerifyResult,
          depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ExportError(f"{name}: nested deeper than {MAX_DEPTH} levels")
    differ = result.differences.append
    if isinstance(want, (ArrayRef, TensorValue)):
        tensor = found(got)
        if tensor is None:
            differ(Difference(name, f"a tensor from the checkpoint, {type(got).__name__} in the output"))
        elif tensor[:2] != (want.dtype, tuple(want.shape)):
            differ(Difference(name, f"{tensor[0]}{list(tensor[1])} in the output, {want.dtype}{list(want.shape)} "
                                    f"from the checkpoint"))
        else:
            item = Item(name, None, want.dtype, tuple(want.shape))
            expected = want.parts(store) if isinstance(want, ArrayRef) else iter([want.data])
            result.tensors += 1
            result.nbytes += item.nbytes
            difference = _first_difference(item, expected, tensor[2]())
            if difference is not None:
                differ(Difference(name, difference))
    elif isinstance(want, dict):
        if not isinstance(got, dict):
            differ(Difference(name, f"a dict from the checkpoint, {type(got).__name__} in the output"))
            return
        for key, value in want.items():
            if key in got:
                _walk(store, found, f"{name}/{key}".lstrip("/"), value, got[key], result, depth + 1)
            else:
                differ(Difference(f"{name}/{key}".lstrip("/"), "missing from the output"))
        for key in got:
            if key not in want:
                differ(Difference(f"{name}/{key}".lstrip("/"), "in the output, but not in the checkpoint"))
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            differ(Difference(name, f"{len(want)} items from the checkpoint, not so in the output"))
            return
        for i, (a, b) in enumerate(zip(want, got)):
            _walk(store, found, f"{name}/{i}", a, b, result, depth + 1)
    elif type(want) in (int, float, str, bool, type(None)) and not (want == got or want != want and got != got):
        differ(Difference(name, f"{got!r:.60} in the output, {want!r:.60} in the checkpoint"))


def _torch_bytes(zf: TorchZip, ref: TensorRef) -> memoryview | Iterator[Any]:
    """A torch file's tensor in C order: a view of the file where it is one contiguous run of bytes, else
    (a transposed or sliced view torch.save kept with its whole storage) streamed in blocks of whole rows,
    never copied whole."""
    span = tensors.byte_range(zf, ref)
    if span is not None:
        return zf.file.view(*span)
    array = tensors.array(zf, ref)
    step = max(1, BLOCK // max(array[:1].nbytes, 1))
    return (np.ascontiguousarray(array[lo:lo + step]).data for lo in range(0, len(array), step))


BIN_INDEX = "pytorch_model.bin.index.json"


class _StateFile:
    """A torch file of one flat {name: tensor} dict (`torch.save(model.state_dict())`, zero_to_fp32's and
    the HF Trainer's pytorch_model*.bin, accelerate's --unsafe_serialization), read with the safe
    unpickler: nothing of it is called."""

    def __init__(self, path: Path):
        self.path = str(path)
        self._zf = TorchZip(path)
        try:
            state = load(self._zf.record("data.pkl"), self.path, strict=False)
            if not _is_state_dict(state):
                raise ExportError(f"{path}: not a state dict ({{name: tensor}}); a torch export of shardstore's "
                                  f"is verified as its folder")
            self.tensors: dict[str, TensorRef] = state
        except BaseException:
            self._zf.close()
            raise

    def view(self, name: str) -> memoryview | Iterator[Any]:
        return _torch_bytes(self._zf, self.tensors[name])

    def close(self) -> None:
        self._zf.close()


class _Safetensors(SafetensorsFile):
    def view(self, name: str) -> memoryview:
        return self.record(f"data/{name}")


OutputFile = _StateFile | _Safetensors


def state_dict_files(out: Path) -> bool:
    """Whether OUTPUT is a model's state dict in torch files (one file, or a folder whose torch files each
    hold {name: tensor}: the HF Trainer's pytorch_model*.bin, sharded with their index or not) rather than
    a whole checkpoint's state (torch's `dcp_to_torch_save`, shardstore's torch export: walked whole)."""
    if out.is_dir() and (out / BIN_INDEX).is_file():
        return True
    paths = [out] if out.is_file() else torch_files_in(out)
    return bool(paths) and all(_holds_state_dict(p) for p in paths)


def _holds_state_dict(path: Path) -> bool:
    with TorchZip(path) as zf:
        return _is_state_dict(load(zf.record("data.pkl"), str(path), strict=False))


def _is_state_dict(state: Any) -> bool:
    return isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, TensorRef) for k, v in state.items())


def _output_tensors(out: Path) -> tuple[list[OutputFile], dict[str, tuple[OutputFile, TensorRef]]]:
    """The output's files, open (the caller closes them), and each tensor they hold. An index names the
    files of a sharded output; else every .safetensors file of the folder is one, or else every .bin."""
    if out.is_file():
        paths = [out]
    elif (out / INDEX).is_file() or (out / BIN_INDEX).is_file():
        at = out / INDEX if (out / INDEX).is_file() else out / BIN_INDEX
        index = loads(read_small(at, None, MAX_INDEX_FILE, "an index"), str(at), "index", ExportError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ExportError(f"{at}: has no weight_map")
        paths = [out / name for name in sorted({str(v) for v in weight_map.values()})]
    else:
        paths = sorted(out.glob("*.safetensors")) or torch_files_in(out)
    if not paths:
        raise ExportError(f"{out}: no safetensors or torch file of a state dict to verify")
    files: list[OutputFile] = []
    found: dict[str, tuple[OutputFile, TensorRef]] = {}
    try:
        for path in paths:
            files.append(_Safetensors(path) if path.suffix == ".safetensors" else _StateFile(path))
            for name, ref in files[-1].tensors.items():
                if name in found:
                    raise ExportError(f"{path}: holds {name}, which {found[name][0].path} holds too")
                found[name] = (files[-1], ref)
    except BaseException:
        for f in files:
            f.close()
        raise
    return files, found


def _tied_items(store: Store, items: list[Item]) -> list[Item]:
    """The tied names (DeepSpeed's shared_params: `lm_head.weight` for `embed_tokens.weight`) under the
    names an export would give them, each its target's item: a state dict holds them (zero_to_fp32's
    does), a safetensors export does not, so they are compared where present, never missing."""
    by_path = {it.source.path: it for it in items if isinstance(it.source, ArrayRef) and it.source.rows is None}
    full = {path: ".".join(map(str, keys)) for keys, path in leaves(store.manifest.tree)}
    tied = []
    for alias, target in store.manifest.facts.tied:
        item, joined = by_path.get(target), full.get(target, "")
        if item is None or not joined.endswith(item.key):
            continue
        prefix, name = joined[:len(joined) - len(item.key)], ".".join(map(str, alias))  # the subtree, stripped
        if name.startswith(prefix) and len(name) > len(prefix):
            tied.append(replace(item, key=name[len(prefix):]))
    return tied


def _compare(store: Store, items: list[Item], outputs: dict[str, Found], format: str) -> VerifyResult:
    result = VerifyResult(format)
    left = dict(outputs)
    optional = [it for it in _tied_items(store, items) if it.key in outputs]
    for item in items + optional:
        got = left.pop(item.key, None)
        if got is None:
            result.differences.append(Difference(item.key, "missing from the output"))
            continue
        dtype, shape, view = got
        if tuple(shape) != tuple(item.shape):
            result.differences.append(Difference(item.key, f"shape {list(shape)} in the output, {list(item.shape)} "
                                                           f"from the checkpoint"))
            continue
        if dtype != item.dtype:
            if not (dtype in dtypes.CASTABLE and item.dtype in dtypes.CASTABLE):
                result.differences.append(Difference(item.key, f"{dtype} in the output, {item.dtype} in the "
                                                               f"checkpoint (not a floating cast)"))
                continue
            item = replace(item, dtype=dtype)  # checked against the source cast as torch casts
        result.tensors += 1
        result.nbytes += item.nbytes
        difference = _first_difference(item, tensor_bytes(store, item), view())
        if difference is not None:
            result.differences.append(Difference(item.key, difference))
    for name in sorted(left):
        result.differences.append(Difference(name, "in the output, but not a tensor the checkpoint's export holds"))
    if items and len(left) == len(outputs):
        result.differences.append(Difference("(all)", "no tensor name in common: was the output exported with "
                                                      "another --select, --strip-prefix or --format?"))
    return result


def _first_difference(item: Item, expected: Iterator[Any], got: memoryview | Iterator[Any]) -> str | None:
    """How the output's bytes (a view, or blocks streamed in order) differ from the expected ones: how many
    elements, and the first (its index and both values); None when they are equal. Each pair of blocks is
    compared at once as the elements' bit patterns, so a wholly different tensor costs what an equal one
    does: one vectorised comparison and count a block, the first difference taken from the first unequal
    block only. Blocks of the expected bytes hold whole elements (every part of an array is whole rows or
    elements, and `blocks` cuts parts at multiples of 16 MiB, a multiple of every itemsize), and the
    output's are taken to the same lengths, so both are cut at the same element boundaries."""
    info = dtypes.info(item.dtype)
    pos, count, first = 0, 0, None
    take = (lambda n: got[pos:pos + n]) if isinstance(got, memoryview) else _Reader(got).take
    for block in blocks(expected):
        theirs = take(len(block))
        if len(theirs) != len(block):
            return f"{item.nbytes} bytes from the checkpoint, fewer in the output"
        unequal = _unequal_elements(block, theirs, info.itemsize)
        differ = int(np.count_nonzero(unequal))
        if differ and first is None:
            at = int(np.argmax(unequal))
            first = (pos // info.itemsize + at, bytes(theirs[at * info.itemsize:(at + 1) * info.itemsize]),
                     bytes(block[at * info.itemsize:(at + 1) * info.itemsize]))
        count += differ
        pos += len(block)
    if first is None:
        return None
    element, output, source = first
    index = [int(i) for i in np.unravel_index(element, item.shape)] if item.shape else []
    value = [dtypes.as_numbers(np.frombuffer(raw, dtype=info.raw), item.dtype)[0] for raw in (output, source)]
    return (f"{count} of {int(np.prod(item.shape))} elements differ; the first, at {index}, is {value[0]} in the "
            f"output, {value[1]} from the checkpoint")


def _unequal_elements(ours: Any, theirs: Any, itemsize: int) -> np.ndarray:
    """Which elements of two equally long blocks of whole elements differ, as a bool array: their bits
    compared as unsigned integers of the element's width (two 8-byte words for a 16-byte complex), so that
    NaNs compare by their bits and one pass over the bytes does it."""
    word = np.dtype(f"<u{min(itemsize, 8)}")
    a, b = np.frombuffer(ours, dtype=word), np.frombuffer(theirs, dtype=word)
    unequal = a != b
    return unequal.reshape(-1, itemsize // word.itemsize).any(axis=1) if itemsize > word.itemsize else unequal


class _Reader:
    """Blocks streamed in order, taken again in pieces of any size (a store's cells cut an array elsewhere
    than the other store's): a piece within one block is a view of it, one across blocks is copied once
    into a buffer of its size."""

    def __init__(self, parts: Iterator[Any]):
        self._blocks = blocks(parts)
        self._pending = memoryview(b"")

    def take(self, n: int) -> memoryview:
        if len(self._pending) >= n:
            out, self._pending = self._pending[:n], self._pending[n:]
            return out
        buf, filled = bytearray(n), len(self._pending)
        buf[:filled], self._pending = self._pending, memoryview(b"")
        while filled < n:
            block = next(self._blocks, None)
            if block is None:
                return memoryview(buf)[:filled]
            view = memoryview(block).cast("B")
            used = min(len(view), n - filled)
            buf[filled:filled + used] = view[:used]
            filled += used
            self._pending = view[used:]
        return memoryview(buf)
