"""The output side's contract: what an export is asked for, and what an output format is.

The call sequence, for `export` (two steps: the store holds the data) and for `unshard`'s one pass (the
ingest writes straight into the output):

    check_request(out, request)                before the store exists: options that do not apply
                                                (export/__init__.py, from the formats' flags)
    planned = format.plan(store, request, ...)  once the data is in: the exact files, the bytes to write
    planned.write(out, progress, partial, ...)  the files, each atomically
or
    direct = format.direct(store, request, ...) once the store is planned, before any unit is read: the
                                                files laid out for the workers (None: two steps instead)
    direct.seal(store); direct.finish(store, out)  once every unit is in (`DirectExport`)

Both are described by frozen data (`ExportRequest`, `OutputFormat`); the formats are listed in
export/registry.py, from which the command line takes its choices.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import dtypes
from ..errors import ExportError
from ..patterns import matcher
from ..sink.layout import Layout
from ..store.store import Store
from ..tree import Node
from .resolve import ArrayRef

if TYPE_CHECKING:
    from .adapters import BaseModel

Arrays = Callable[[ArrayRef, str], ArrayRef]  # an array's reference and its output dtype -> where its bytes come from


# Megatron-LM's --transformer-impl: the layer specs whose checkpoints' keys differ (export/hf/megatron_inverse.py)
TRANSFORMER_IMPLS = ("transformer_engine", "local")


@dataclass(frozen=True)
class ExportRequest:
    """What the user asked of one export, as the CLI and the API take it: the only way export options
    travel. It carries its output format resolved (export/registry.py `request` builds it from a name)."""

    output: OutputFormat
    select: str | None = None  # a subtree (default: the model)
    strip_prefix: str | None = None
    dtype: str | None = None  # one of dtypes.CAST_DTYPES, for floating tensors
    max_shard_size: int = 5_000_000_000
    hf_config: str | os.PathLike[str] | None = None
    overwrite: bool = False  # replace an earlier export's files in OUT
    allow_partial: bool = False  # holes for what an incomplete store lacks, said in the output's metadata
    # output names kept in their source dtype when `dtype` casts the rest: globs, or regexes as "re:PATTERN"
    keep_dtype: tuple[str, ...] = ()
    # `--format torch`: the whole state in one checkpoint.pt in the input's nesting (what torch's
    # dcp_to_torch_save writes), instead of the files the checkpoint's trainer resumes from
    single_file: bool = False
    # a PEFT model's LoRA (DoRA) adapter: written alone as the folder peft saves (`adapter`), or merged into
    # its base weights (`merge_adapter`); `lora_alpha` and `rslora` where the checkpoint keeps no
    # adapter_config.json
    adapter: bool = False
    merge_adapter: bool = False
    lora_alpha: float | None = None
    rslora: bool | None = None
    # a merge's base model, where the checkpoint holds the adapter only: a Hugging Face folder, or a model
    # in the local Hugging Face cache (`base`); opened by the run (`base_model`, base_folder.py), no option
    base: str | os.PathLike[str] | None = None
    base_model: BaseModel | None = field(default=None, compare=False, repr=False)
    # `--format megatron`: the vocabulary's rows padded to a multiple of this (Megatron-LM's
    # make_vocab_size_divisible_by times the tensor-parallel size it loads at); None: 128
    vocab_multiple: int | None = None
    # `--format megatron` or `nemo`: the layer spec of the model that loads it (Megatron-LM's
    # --transformer-impl), whose keys it holds: "transformer_engine" (None: Megatron-LM's default) or "local"
    transformer_impl: str | None = None
    # `--format dcp`: the tensors under a trainer's names: a built-in mapping ("torchtitan")
    # or a JSON file of renames (export/renamed.py)
    names: str | os.PathLike[str] | None = None
    # where each sharded array's bytes come from instead of the store, given the dtype the output holds it
    # in (`average` puts the checkpoints' mean there, rounded once into that dtype); no user option
    arrays: Arrays | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtypes.cast_dtype(self.dtype))
        object.__setattr__(self, "keep_dtype", tuple(self.keep_dtype))
        if self.keep_dtype and self.dtype is None:
            raise ExportError("--keep-dtype goes with --dtype: it names what the cast leaves in its own dtype")
        for pattern in self.keep_dtype:
            matcher(pattern, "--keep-dtype", ExportError)  # one line for a pattern that cannot be matched
        if self.adapter and self.merge_adapter:
            raise ExportError("--adapter writes the adapter alone, --merge-adapter the model with it merged: one of them")
        if self.base is not None and not self.merge_adapter:
            raise ExportError("--base goes with --merge-adapter: the model an adapter-only checkpoint is merged onto")
        if (self.lora_alpha is not None or self.rslora is not None) and not (self.adapter or self.merge_adapter):
            raise ExportError("--lora-alpha and --rslora go with --adapter or --merge-adapter")
        if self.vocab_multiple is not None and (not self.output.pads_vocabulary or type(self.vocab_multiple) is not int
                                                or self.vocab_multiple < 1):
            raise ExportError("--vocab-multiple is a count of rows of at least 1, and goes with --format megatron or "
                              "nemo")
        if self.transformer_impl is not None and (not self.output.pads_vocabulary
                                                  or self.transformer_impl not in TRANSFORMER_IMPLS):
            raise ExportError("--transformer-impl is transformer_engine or local, and goes with --format megatron or "
                              "nemo")
        if self.names is not None and (self.output.name != "dcp" or not isinstance(self.names, (str, os.PathLike))):
            raise ExportError("--names goes with --format dcp: a built-in name or a JSON file of renames")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ExportError(f"--lora-alpha: {self.lora_alpha} is no LoRA alpha (a positive number)")

    @property
    def format(self) -> str:
        return self.output.name

    def cast_of(self, key: str) -> str | None:
        """The dtype output tensor `key` is cast to (floating tensors only): `dtype`, unless a `keep_dtype`
        pattern matches the whole name."""
        if self.dtype is None or any(matcher(p, "--keep-dtype", ExportError)(key) for p in self.keep_dtype):
            return None
        return self.dtype

    def metadata(self) -> dict[str, str]:
        """What a safetensors header records of the dtype policy (only when there is one beyond `dtype`)."""
        return {"shardstore_dtype": self.dtype or "", "shardstore_keep_dtype": " ".join(self.keep_dtype)} \
            if self.keep_dtype else {}


Progress = Callable[[int], None] | None
Written = tuple[list[Path], list[str], list[str]]  # files, leaves left out, notes


@dataclass
class Planned:
    """An export laid out once the data is in: its exact files (beside-files aside), the tensor bytes it
    writes, and how it writes them: `write(out, progress, partial, scheduler, jobs)` gives the files
    written, what it left out, and its notes."""

    files: list[str]
    nbytes: int
    write: Callable[[Path, Progress, dict[str, str] | None, str | None, int], Written]
    # a tensors-only format's tensors, in the order it writes them, each with where its bytes come from in
    # the store (safetensors.Item): what `verify` checks an output of it against; empty for the others
    tensors: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class OutputFormat:
    """One output format: what it takes, what it may write, and its two ways of writing.

    `plan(store, request, node, subtree, jobs)` lays the two-step export out (`node` is the subtree a
    tensors-only format takes, and its store path); `direct(store, request, node, subtree, jobs)` lays the
    one-pass export out, or says None."""

    name: str
    subtree: bool  # writes one subtree of tensors (the model by default), not the whole store
    may_write: str | None  # the names it may write, before the data says which exactly (None: known up front)
    config_beside: bool  # the run's own config files go beside it (not into a folder with its own config)
    resume_beside: bool  # the trainer's files to resume from go beside it (read/formats/resume.py)
    describes_model: bool  # a folder that describes its model (config, tokenizer): it needs a description
    # (from the checkpoint, or --hf-config) and a model's weights
    single_file: bool  # has a one-file form of the whole state (`ExportRequest.single_file`)
    takes_scheduler: bool  # one Dask task per output file
    plan: Callable[[Store, ExportRequest, Node, str, int], Planned]
    direct: Callable[[Store, ExportRequest, Node, str, int], DirectExport | None]
    # whether a folder (or file) looks like an export of this format (`verify` without --format asks the
    # formats in the registry's `RECOGNISED` order); it looks at names only
    recognises: Callable[[Path], bool]
    # `verify` reads it back as a checkpoint (through the readers, into a store) rather than file by file
    reads_as_checkpoint: bool = False
    # `verify` reads it back as a checkpoint and compares its model under transformers' names (a model
    # written under another trainer's names and layout, which the readers map back)
    reads_back_as_model: bool = False
    # writes a PEFT adapter alone, as peft saves it (`ExportRequest.adapter`)
    writes_adapter: bool = False
    # pads the vocabulary's rows to a multiple (`ExportRequest.vocab_multiple`), as Megatron's models do
    pads_vocabulary: bool = False
    # how it lays out a model with its PEFT adapter merged in (`ExportRequest.merge_adapter`), as `plan`
    # does the checkpoint's tensors; None: it writes no merged model
    merged: Callable[[Store, ExportRequest, Node, str, int], Planned] | None = None

    def planner(self, request: ExportRequest) -> Callable[[Store, ExportRequest, Node, str, int], Planned]:
        """`plan`, or `merged` for a request to merge an adapter (which it must have)."""
        if request.merge_adapter:
            assert self.merged is not None
            return self.merged
        return self.plan


class DirectExport(ABC):
    """An export the ingest writes itself (each format module's `plan_direct`; the sink/ package writes it).

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

    @property
    def tensors(self) -> list[Any]:
        """A tensors-only format's tensors (as `Planned.tensors`); empty for the others."""
        return []

    def seal(self, store: Store) -> None:
        """The files' last bytes, once every unit is in (a torch zip's pickle and directory, the CRCs);
        nothing for safetensors."""

    def finish(self, store: Store, out: Path) -> list[Path]:
        """The files beside the laid-out ones, in OUT (the run's side files aside)."""
        return []
