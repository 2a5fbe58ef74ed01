"""PEFT's LoRA and DoRA adapters in a checkpoint's model: found by their names, written as the adapter
folder peft saves (`--adapter`), or merged into the base weights (`--merge-adapter`).

A PEFT-wrapped model's state dict (what FSDP, DCP and the trainers save of it) names each adapted module's
weight `<module>.base_layer.weight` and its adapter `<module>.lora_A.<adapter>.weight`,
`<module>.lora_B.<adapter>.weight` (DoRA adds `<module>.lora_magnitude_vector.<adapter>.weight`); a module
trained whole (`modules_to_save`) is kept twice, `<module>.original_module.*` and
`<module>.modules_to_save.<adapter>.*`; the model itself is under `base_model.model.`. An adapter-only
save (a frozen or quantized base not saved) holds the adapters alone.

`peft.get_peft_model_state_dict` saves the adapter's tensors with the adapter's name taken out
(`_remove_adapter_name_from_state_dict_key`), DoRA's magnitude as `lora_magnitude_vector` (no `.weight`),
and a trained module's copy under the module's own name: `saved_name` is that mapping.

A merge is peft's `merge_and_unload` computed in float32 row block by row block, rounded once into the
output's dtype: W + s·(B·A), with s = alpha/r (rsLoRA: alpha/√r); DoRA scales each row of that by its
magnitude over the row's norm.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .. import dtypes
from ..errors import ExportError
from ..patterns import matcher
from ..ranges import Part, blocks
from ..store.store import Store
from .resolve import ArrayRef

PREFIX = "base_model.model."  # where PeftModel keeps the model it wraps
BASE = ".base_layer."
ORIGINAL = ".original_module."
SAVED = ".modules_to_save."
# <module>.lora_A.<adapter>.weight, <module>.lora_magnitude_vector.<adapter>.weight, and the embeddings'
# parameters <module>.lora_embedding_A.<adapter>; or, saved by peft already, without the adapter's name
LORA = re.compile(r"(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_magnitude_vector|lora_embedding_A|lora_embedding_B)"
                  r"(?:\.(?P<adapter>[^.]+))?(?P<weight>\.weight)?\Z")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MERGE_BLOCK = 8 << 20  # bytes of a base weight's rows merged at a time (float32)
MAX_RANK = 1 << 16


@dataclass(frozen=True)
class Lora:
    """One adapted module: the names (in the model subtree) of its adapter's tensors and of its base weight."""

    module: str
    a: str
    b: str
    magnitude: str | None = None  # DoRA's
    base: str | None = None  # None in an adapter-only save


@dataclass(frozen=True)
class Peft:
    """What of a checkpoint's model is PEFT's: its one adapter's name, the adapted modules, the trained
    copies of whole modules, and every name, as found."""

    adapter: str | None  # None: named as peft saves an adapter, without its name
    loras: tuple[Lora, ...]
    saved: tuple[str, ...]  # modules_to_save copies' names
    names: tuple[str, ...]

    @property
    def adapter_only(self) -> bool:
        """Whether the checkpoint holds the adapter alone (its base not saved): peft's saved names (what
        the HF Trainer saves of a PeftModel under FSDP), or adapter tensors only."""
        return self.adapter is None or all(LORA.match(n) is not None or SAVED in n for n in self.names)

    def adapter_tensors(self) -> dict[str, str]:
        """PEFT's saved name -> the checkpoint's name, for every tensor of adapter_model.safetensors (under
        PeftModel's `base_model.model.`, where the checkpoint's names are the wrapped model's own)."""
        out = {}
        for name in [n for lora in self.loras for n in (lora.a, lora.b, lora.magnitude) if n] + list(self.saved):
            saved = saved_name(name, self.adapter)
            out[saved if saved.startswith(PREFIX) else PREFIX + saved] = name
        return out

    def merged_names(self) -> dict[str, str]:
        """The plain model's name -> the checkpoint's name, for every tensor of the merged model: a base
        layer's weight under its module's name (its bytes merged: `merging`), a trained module's copy in
        place of the original, the rest as they are; the adapters themselves are gone."""
        out: dict[str, str] = {}
        for name in self.names:
            if LORA.match(name) or ORIGINAL in name:
                continue
            plain = name.replace(BASE, ".").replace(f"{SAVED}{self.adapter}.", ".").removeprefix(PREFIX)
            if out.setdefault(plain, name) != name:
                raise ExportError(f"{name}: would be {plain!r} in the merged model, as {out[plain]} would")
        return out


def saved_name(name: str, adapter: str | None) -> str:
    """A tensor's name as `peft.get_peft_model_state_dict` saves it: the adapter's name taken out, DoRA's
    magnitude without `.weight`, a trained copy under its module's name (`adapter` None: saved so already)."""
    if adapter is None:
        return name
    if f"{SAVED}{adapter}." in name:
        return name.replace(f"{SAVED}{adapter}.", ".")
    if name.endswith(f".lora_magnitude_vector.{adapter}.weight"):
        name = name.removesuffix(".weight")
    if name.endswith(f".{adapter}"):
        return name.removesuffix(f".{adapter}")
    head, _, last = name.rpartition(".")
    return f"{head.removesuffix(f'.{adapter}')}.{last}"


def found(names: Iterable[str]) -> Peft | None:
    """The PEFT adapter among a model's names, or None where it has none. Refused: several adapters, a
    module with lora_A and no lora_B (or the other way), DoRA's magnitude without its pair."""
    names = tuple(names)
    parts: dict[str, dict[str, str]] = {}
    adapters: set[str | None] = set()
    for name in names:
        m = LORA.match(name)
        if m is not None:
            saved = m["adapter"] == "weight" and m["weight"] is None  # <module>.lora_A.weight: peft's saved name
            adapters.add(None if saved or m["adapter"] is None else m["adapter"])
            if parts.setdefault(m["module"], {}).setdefault(m["part"], name) != name:
                raise ExportError(f"{name}: a second {m['part']} of {m['module']}")
        elif SAVED in name:
            adapters.add(name.split(SAVED, 1)[1].split(".", 1)[0])
    if not adapters:
        return None
    if len(adapters) > 1:
        raise ExportError(f"the model holds the adapters {', '.join(sorted(map(str, adapters)))}; only a model of "
                          f"one adapter is read")
    adapter = adapters.pop()
    loras = []
    for module, have in sorted(parts.items()):
        if "lora_embedding_A" in have or "lora_embedding_B" in have:
            raise ExportError(f"{module}: a LoRA of an embedding; only linear layers' adapters are read yet")
        missing = next((p for p in ("lora_A", "lora_B") if p not in have), None)
        if missing is not None:
            raise ExportError(f"{module}: its adapter has {', '.join(sorted(have))} but no {missing}")
        base = f"{module}{BASE}weight"
        loras.append(Lora(module, have["lora_A"], have["lora_B"], have.get("lora_magnitude_vector"),
                          base if base in names else None))
    # trained whole modules: under modules_to_save.<adapter>, or, in peft's saved names, every other tensor
    saved = tuple(n for n in names if (f"{SAVED}{adapter}." in n if adapter is not None else LORA.match(n) is None))
    return Peft(adapter, tuple(loras), saved, names)


@dataclass(frozen=True)
class LoraConfig:
    """What adapter_config.json says of a LoRA, as peft's LoraConfig writes it."""

    r: int
    alpha: float
    rslora: bool
    dora: bool
    fields: dict[str, Any]  # the whole config, as written

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    def __str__(self) -> str:
        return f"{'DoRA' if self.dora else 'LoRA'} adapter (r={self.r}, alpha={self.alpha:g}{', rsLoRA' if self.rslora else ''})"


def config_of(raw: dict[str, Any] | None, peft: Peft, shapes: dict[str, tuple[int, ...]],
              alpha: float | None, rslora: bool | None, base_model: str | None, where: str) -> LoraConfig:
    """The adapter's config: the trainer's own adapter_config.json (`raw`), checked against the tensors;
    else one made from the tensors' shapes, `alpha` (`--lora-alpha`) and `rslora` (`--rslora` or
    `--no-rslora`), refused where those are not given: the tensors do not say them. Every module's rank
    must be the config's (or, made, one rank)."""
    ranks = {shapes[lora.a][0] for lora in peft.loras}
    for lora in peft.loras:
        a, b = shapes[lora.a], shapes[lora.b]
        if len(a) != 2 or len(b) != 2 or b[1] != a[0]:
            raise ExportError(f"{lora.module}: lora_A {list(a)} and lora_B {list(b)} are no LoRA pair")
        if lora.base is not None and shapes.get(lora.base) != (b[0], a[1]):
            raise ExportError(f"{lora.module}: its base weight is {list(shapes.get(lora.base, ()))}, but its "
                              f"adapter makes {[b[0], a[1]]}: an adapter of another model")
        if lora.magnitude is not None and shapes[lora.magnitude] != (b[0],):
            raise ExportError(f"{lora.magnitude}: {list(shapes[lora.magnitude])}, not DoRA's magnitude of {b[0]} rows")
    dora = any(lora.magnitude is not None for lora in peft.loras)
    if dora and not all(lora.magnitude is not None for lora in peft.loras):
        raise ExportError("some adapted modules have DoRA's magnitude and others not: not one DoRA adapter")
    if raw is not None:
        return _checked(raw, peft, ranks, dora, where)
    if alpha is None or rslora is None:
        raise ExportError(f"the checkpoint keeps no {CONFIG}: its LoRA's alpha{', and whether it is rsLoRA,' if rslora is None else ''}"
                          f" cannot be known; give {'them' if rslora is None else 'it'} as trained: --lora-alpha A"
                          f"{', and --rslora or --no-rslora' if rslora is None else ''}")
    if len(ranks) != 1:
        raise ExportError(f"its adapted modules have ranks {sorted(ranks)} and no {CONFIG} says how")
    r = ranks.pop()
    targets = sorted({lora.module.rsplit(".", 1)[-1] for lora in peft.loras})
    saved = sorted({saved_name(n, peft.adapter).removeprefix(PREFIX).rsplit(".", 1)[0].rsplit(".", 1)[-1]
                    for n in peft.saved})
    fields = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": targets,
              "lora_dropout": 0.0, "bias": "none", "use_dora": dora, "use_rslora": rslora, "fan_in_fan_out": False,
              "modules_to_save": saved or None, "base_model_name_or_path": base_model, "inference_mode": True}
    return LoraConfig(r, alpha, rslora, dora, fields)


def from_verl(meta: Any, where: str) -> tuple[int, float]:
    """The rank and alpha veRL's record of its LoRA says (veRL builds its LoraConfig from them alone: no
    rsLoRA, no DoRA, no bias)."""
    if not isinstance(meta, dict) or type(meta.get("r")) is not int or type(meta.get("lora_alpha")) not in (int, float):
        raise ExportError(f"{where}: not veRL's record of a LoRA (r and lora_alpha)")
    return meta["r"], float(meta["lora_alpha"])


def _checked(raw: dict[str, Any], peft: Peft, ranks: set[int], dora: bool, where: str) -> LoraConfig:
    """The trainer's adapter_config.json, refused where the tensors say otherwise or where it asks for what
    is not merged here (a rank or alpha per module, bias, fan_in_fan_out)."""
    if raw.get("peft_type") != "LORA":
        raise ExportError(f"{where}: a {raw.get('peft_type')!r} adapter; only LoRA (and DoRA) are read")
    r: Any = raw.get("r")
    alpha: Any = raw.get("lora_alpha")
    if type(r) is not int or not 0 < r <= MAX_RANK or type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise ExportError(f"{where}: r and lora_alpha are not a rank and a number")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise ExportError(f"{where}: a rank or alpha per module (rank_pattern, alpha_pattern) is not read yet")
    if raw.get("fan_in_fan_out") or raw.get("bias", "none") != "none":
        raise ExportError(f"{where}: fan_in_fan_out and a trained bias are not read yet")
    if ranks != {r}:
        raise ExportError(f"{where}: r is {r}, but the adapter's lora_A have {sorted(ranks)} rows")
    if bool(raw.get("use_dora")) != dora:
        raise ExportError(f"{where}: use_dora is {bool(raw.get('use_dora'))}, but the adapter "
                          f"{'has' if dora else 'has no'} DoRA magnitudes")
    untargeted = next((lora.module for lora in peft.loras if not _targets(raw.get("target_modules"), lora.module)), None)
    if untargeted is not None:
        raise ExportError(f"{where}: its target_modules ({str(raw.get('target_modules'))[:80]}) do not name "
                          f"{untargeted}, which the checkpoint adapts: the config of another run")
    return LoraConfig(r, float(alpha), bool(raw.get("use_rslora")), dora, raw)


def _targets(targets: Any, module: str) -> bool:
    """Whether a LoraConfig's target_modules name `module` as peft matches them: a list by the module's
    name or its last parts, a string as a regular expression of the whole name in the base model (RE2:
    linear in the name), "all-linear" every linear layer."""
    name = module.removeprefix(PREFIX)
    if isinstance(targets, list):
        return any(isinstance(t, str) and (name == t or name.endswith(f".{t}")) for t in targets)
    if isinstance(targets, str):
        return targets == "all-linear" or matcher(f"re:{targets}", "target_modules", ExportError)(name)
    return targets is None


def config_bytes(config: LoraConfig) -> bytes:
    return json.dumps(config.fields, indent=2, sort_keys=True).encode() + b"\n"


def float32_rows(store: Store, ref: ArrayRef, rows: tuple[int, int] | None = None) -> np.ndarray:
    """A tensor (or its rows [first, stop)) as float32 numbers, exactly (export/fp8.py's too)."""
    if rows is not None:
        ref = rows_of(ref, *rows)
    raw = np.frombuffer(raw_rows(store, ref), dtypes.info(ref.dtype).raw)
    return dtypes.as_numbers(raw, ref.dtype).astype(np.float32, copy=False).reshape(ref.shape)


def raw_rows(store: Store, ref: ArrayRef) -> bytes:
    """A tensor's bytes, in one buffer."""
    return b"".join(blocks(ref.parts(store)))


def rows_of(ref: ArrayRef, first: int, stop: int) -> ArrayRef:
    """Rows [first, stop) of `ref`, counted in its blocks of rows where it has them (a Megatron weight's
    rows a Hugging Face module is)."""
    picked, at = [], 0
    for a, b in ref.rows or ((0, ref.shape[0]),):
        lo, hi = max(a, a + first - at), min(b, a + stop - at)
        if lo < hi:
            picked.append((lo, hi))
        at += b - a
    return replace(ref, rows=tuple(picked), shape=(stop - first,) + tuple(ref.shape[1:]))


@dataclass(frozen=True)
class FileTensor(ArrayRef):
    """A tensor of a Hugging Face model's safetensors file (a base an adapter merges onto), read in place:
    `read(offset, length)` gives the file's bytes there, zero copy where the file is local."""

    offset: int = 0  # of its first byte in the file
    read: Callable[[int, int], Part] | None = field(default=None, compare=False, repr=False)

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        assert self.read is not None
        row = math.prod(self.shape[1:]) * dtypes.info(self.dtype).itemsize if self.shape else 0
        for first, stop in self.rows or ((0, self.shape[0] if self.shape else 1),):
            yield self.read(self.offset + first * row, (stop - first) * row if self.shape else self.nbytes)

    def stored_crc(self, store: Store) -> int | None:
        return None


@dataclass(frozen=True)
class BaseModel:
    """A Hugging Face model folder read in place: the base an adapter-only checkpoint is merged onto
    (`--base`). Its tensors by name; its config and tokenizer files as they are."""

    folder: str
    tensors: dict[str, FileTensor]
    files: dict[str, bytes]


@dataclass(frozen=True)
class MergedRef(ArrayRef):
    """A base weight with its adapter merged in, in the output's dtype (`dtype`): streamed row block by row
    block, A (r × in) held whole, B and W a block of rows at a time. Each part is an array of the store,
    or a base model's file (`FileTensor`)."""

    base: ArrayRef | None = None
    a: ArrayRef | None = None
    b: ArrayRef | None = None
    magnitude: ArrayRef | None = None
    scaling: float = 1.0

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        assert self.base is not None and self.a is not None and self.b is not None
        rows, columns = self.shape[0], math.prod(self.shape[1:])
        a = float32_rows(store, self.a)
        step = max(1, MERGE_BLOCK // max(1, columns * 4))
        for first in range(0, rows, step):
            block = (first, min(rows, first + step))
            merged = np.matmul(float32_rows(store, self.b, block), a)  # W + (B·A)·s, as peft adds it
            merged *= np.float32(self.scaling)
            merged += float32_rows(store, self.base, block).reshape(block[1] - block[0], columns)
            if self.magnitude is not None:
                norm = np.linalg.norm(merged, axis=1).astype(np.float32)
                merged *= (float32_rows(store, self.magnitude, block) / norm).reshape(-1, 1)
            yield merged.reshape(-1).view(np.uint8).data if self.dtype == "float32" else \
                dtypes.rounded(merged, self.dtype)

    def stored_crc(self, store: Store) -> int | None:
        return None


def merging(peft: Peft, config: LoraConfig, where: Callable[[str], tuple[str, Any]],
            ref: Callable[[str], ArrayRef]) -> Any:
    """`ExportRequest.arrays` for the merged model: each adapted module's base weight (by its store path
    and rows: `where` of its name) read merged with its adapter (`ref` of their names), into the output's
    dtype."""
    by_place = {where(lora.base): lora for lora in peft.loras if lora.base is not None}

    def arrays(array: ArrayRef, dtype: str) -> ArrayRef:
        lora = by_place.get((array.path, array.rows))
        return array if lora is None else merged(array, dtype, lora, config, ref)
    return arrays


def stored(store: Store, path: str, rows: tuple[tuple[int, int], ...] | None = None) -> ArrayRef:
    """The store's array at `path` (those blocks of its `rows`, one after another, where given)."""
    entry = store.manifest.arrays[path]
    ref = ArrayRef(path, entry.dtype, entry.shape)
    if rows is None:
        return ref
    return replace(ref, rows=rows, shape=(sum(b - a for a, b in rows),) + tuple(entry.shape[1:]))


def merged(base: ArrayRef, dtype: str, lora: Lora, config: LoraConfig, ref: Callable[[str], ArrayRef]) -> MergedRef:
    """`base` with `lora` merged in, into `dtype`; `ref` gives the adapter's tensors by their names."""
    if dtype not in dtypes.CASTABLE or base.dtype not in dtypes.CASTABLE:
        raise ExportError(f"{lora.module}: its base weight is not floating; it is not merged")
    return MergedRef(base.path, dtype, base.shape, None, base, ref(lora.a), ref(lora.b),
                     ref(lora.magnitude) if lora.magnitude else None, config.scaling)
