"""The dtype table shared by every stage.

The store keeps raw bits: dtypes numpy cannot represent (bfloat16, float8) are held as unsigned integers
of the same width, and the torch dtype name is recorded beside them so export can reproduce the bits.
Keeping this in one table is what lets read/ stay free of torch: a worker process ingesting a rank file
never imports it.

The output's dtype policy lives here too: which dtypes `--dtype` names and casts (`CAST_DTYPES`,
`CASTABLE`), how a cast rounds (`cast`, as torch's `Tensor.to`), and how a mean computed in a wider type
is rounded into its output (`rounded`, for `average`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from .errors import CheckpointError, ExportError
from .ranges import Part, blocks


@dataclass(frozen=True)
class DTypeInfo:
    name: str  # torch name without the "torch." prefix, e.g. "bfloat16"
    raw: np.dtype  # what the store holds: same width, exact bits
    safetensors: str | None  # safetensors dtype code, None if it has none
    storage_class: str | None  # legacy typed storage class torch pickles (None: UntypedStorage + _v3)

    @property
    def itemsize(self) -> int:
        return self.raw.itemsize

    @property
    def floating(self) -> bool:
        return self.name.startswith(("float", "bfloat"))

    def hole(self, count: int) -> bytes:
        """`count` elements of what fills a hole in a partial export: NaN for floating dtypes, else zero."""
        if not self.floating:
            return bytes(count * self.itemsize)
        return np.full(count, _NAN_BITS[self.name], dtype=self.raw).tobytes()


_TABLE = [
    DTypeInfo("float64", np.dtype("<f8"), "F64", "DoubleStorage"),
    DTypeInfo("float32", np.dtype("<f4"), "F32", "FloatStorage"),
    DTypeInfo("float16", np.dtype("<f2"), "F16", "HalfStorage"),
    DTypeInfo("bfloat16", np.dtype("<u2"), "BF16", "BFloat16Storage"),
    DTypeInfo("float8_e4m3fn", np.dtype("u1"), "F8_E4M3", None),
    DTypeInfo("float8_e5m2", np.dtype("u1"), "F8_E5M2", None),
    DTypeInfo("float8_e4m3fnuz", np.dtype("u1"), "F8_E4M3FNUZ", None),
    DTypeInfo("float8_e5m2fnuz", np.dtype("u1"), "F8_E5M2FNUZ", None),
    DTypeInfo("float8_e8m0fnu", np.dtype("u1"), None, None),  # MX block scales; safetensors has no code for it
    DTypeInfo("int64", np.dtype("<i8"), "I64", "LongStorage"),
    DTypeInfo("int32", np.dtype("<i4"), "I32", "IntStorage"),
    DTypeInfo("int16", np.dtype("<i2"), "I16", "ShortStorage"),
    DTypeInfo("int8", np.dtype("i1"), "I8", "CharStorage"),
    DTypeInfo("uint8", np.dtype("u1"), "U8", "ByteStorage"),
    DTypeInfo("uint16", np.dtype("<u2"), "U16", None),
    DTypeInfo("uint32", np.dtype("<u4"), "U32", None),
    DTypeInfo("uint64", np.dtype("<u8"), "U64", None),
    DTypeInfo("bool", np.dtype("?"), "BOOL", "BoolStorage"),
    DTypeInfo("complex32", np.dtype("<u4"), None, None),  # torch.chalf: two float16s, held as their bits
    DTypeInfo("complex64", np.dtype("<c8"), "C64", "ComplexFloatStorage"),
    DTypeInfo("complex128", np.dtype("<c16"), None, "ComplexDoubleStorage"),
]

# Quiet-NaN bit patterns, in the raw (store) dtype of each floating dtype.
_NAN_BITS = {"float64": np.nan, "float32": np.nan, "float16": np.nan, "bfloat16": 0x7FC0, "float8_e4m3fn": 0x7F,
             "float8_e5m2": 0x7F, "float8_e4m3fnuz": 0x80, "float8_e5m2fnuz": 0x80, "float8_e8m0fnu": 0xFF}

BY_NAME: dict[str, DTypeInfo] = {d.name: d for d in _TABLE}
BY_STORAGE_CLASS: dict[str, DTypeInfo] = {d.storage_class: d for d in _TABLE if d.storage_class}
# Aliases torch also exposes as module attributes and may pickle under.
_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
            "short": "int16", "chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128"}


def info(name: str) -> DTypeInfo:
    """Look a torch dtype name up; unknown dtypes are a user-facing error, not a KeyError."""
    try:
        return BY_NAME[_ALIASES.get(name, name)]
    except KeyError:
        raise CheckpointError(f"unsupported tensor dtype torch.{name}") from None



def _fp8_table(exp_bits: int, bias: int, flavour: str) -> np.ndarray:
    """float32 value of every byte of an 8-bit float: "ieee" (e5m2: infinities and NaNs at the top
    exponent), "fn" (e4m3fn: no infinities, only S.1111.111 is NaN), "fnuz" (no infinities, no negative
    zero: 0x80 alone is NaN)."""
    mant_bits = 7 - exp_bits
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> mant_bits) & ((1 << exp_bits) - 1)
    mant = codes & ((1 << mant_bits) - 1)
    frac = mant / float(1 << mant_bits)
    value = np.where(exp == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (exp.astype(np.float64) - bias))
    top = exp == (1 << exp_bits) - 1
    if flavour == "fn":
        value = np.where(top & (mant == (1 << mant_bits) - 1), np.nan, value)
    elif flavour == "ieee":
        value = np.where(top, np.where(mant == 0, np.inf, np.nan), value)
    value = sign * value
    return (np.where(codes == 0x80, np.nan, value) if flavour == "fnuz" else value).astype(np.float32)


def _e8m0_table() -> np.ndarray:
    """float32 value of every byte of float8_e8m0fnu: an exponent alone, 2**(e - 127); 0xFF is NaN."""
    codes = np.arange(256, dtype=np.float64)
    return np.where(codes == 255, np.nan, 2.0 ** (codes - 127)).astype(np.float32)


_WIDEN = {"float8_e4m3fn": lambda: _fp8_table(4, 7, "fn"), "float8_e5m2": lambda: _fp8_table(5, 15, "ieee"),
          "float8_e4m3fnuz": lambda: _fp8_table(4, 8, "fnuz"), "float8_e5m2fnuz": lambda: _fp8_table(5, 16, "fnuz"),
          "float8_e8m0fnu": _e8m0_table}


def as_numbers(raw: np.ndarray, name: str) -> np.ndarray:
    """Store bits -> numpy values, exactly: bfloat16 and float8 widen to float32 (no torch needed)."""
    if name == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if name in _WIDEN:
        return widening(name)[raw]
    return raw


@functools.cache
def widening(name: str) -> np.ndarray:
    """The float32 value of each of the 256 bytes of the 8-bit float `name`."""
    return _WIDEN[name]()


CAST_BLOCK_BYTES = 16 << 20  # a cast holds this much of its source in memory at a time


def cast(parts: Iterable[Part], src: DTypeInfo, dst: str) -> Iterator[bytes]:
    """The bytes of `parts` (elements of `src`) cast to `dst`, block by block, rounding to nearest even as
    torch's `Tensor.to` does (it is what casts them)."""
    import torch

    for block in blocks(parts, CAST_BLOCK_BYTES - CAST_BLOCK_BYTES % src.itemsize):
        t = torch.from_numpy(np.frombuffer(block, dtype=src.raw).copy()).view(getattr(torch, src.name))
        yield t.to(getattr(torch, dst)).view(torch.uint8).numpy().tobytes()


CAST_DTYPES = ("bfloat16", "float16", "float32")  # what `--dtype` may name
# The short names users type for them (as transformers' and the trainers' configs spell them).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
CASTABLE = ("float64", "float32", "float16", "bfloat16")  # what --dtype casts; other dtypes pass unchanged


def cast_dtype(name: str | None) -> str | None:
    """A `--dtype` as its torch name ("bf16" -> "bfloat16"), or one line naming the choices."""
    if name is None:
        return None
    bare = name.lower().removeprefix("torch.")
    found = DTYPE_ALIASES.get(bare, bare)
    if found not in CAST_DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(CAST_DTYPES)} (or {', '.join(DTYPE_ALIASES)}), "
                          f"not {name!r}")
    return found


def rounded(values: np.ndarray, dtype: str) -> bytes:
    """`values` rounded to nearest even into `dtype` (bfloat16 as torch rounds it: NaN stays NaN)."""
    if dtype != "bfloat16":
        return values.astype(info(dtype).raw).tobytes()
    bits = values.astype(np.float32).view(np.uint32)
    out = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out.tobytes()
