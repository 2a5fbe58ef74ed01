"""Hugging Face models stored in FP8 with block scales (DeepSeek-V3's and Qwen3-FP8's `quantization_config`:
`quant_method` "fp8", `fmt` "e4m3", `weight_block_size` [128, 128]): each quantized `X.weight` (float8_e4m3fn)
has `X.weight_scale_inv` (float32, one per block of 128 rows × 128 columns), and its value is the weight
times its block's scale. Dequantized on the way out (`--dtype bfloat16` of such a model, and always for
`--format megatron`), block row by block row in bounded memory, as DeepSeek's own `weight_dequant` computes
it: the FP8 value widened to float32, times the scale in float32, rounded once to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator

import numpy as np

from .. import dtypes
from ..errors import ExportError
from ..ranges import Part
from ..store.store import Store
from .adapters import float32_rows, raw_rows, rows_of
from .resolve import ArrayRef

try:
    from ._dequant import fp8_block as _fp8_block_c  # type: ignore[import-not-found, unused-ignore]  # (absent where no compiler built it)
except ImportError:  # not built (no compiler at install time): numpy's, the same bytes
    _fp8_block_c = None
NATIVE = _fp8_block_c is not None

SCALE = "_scale_inv"
BLOCK_BYTES = 16 << 20  # of float32 held at a time


def scales(keys: Iterable[str]) -> dict[str, str]:
    """Each block-quantized weight among `keys`, and its scales' key."""
    keys = set(keys)
    return {k: f"{k}{SCALE}" for k in keys if f"{k}{SCALE}" in keys}


def dequantize(items: list[Any], config: dict[str, Any] | None, dtype: str | None) -> list[Any]:
    """`items` (the safetensors writer's) with each FP8 block-quantized weight dequantized into `dtype` and
    its scales left out; as they are without `dtype`, or where none is quantized."""
    by_key = {it.key: it for it in items}
    scaled = scales(by_key) if dtype is not None else {}
    if not scaled:
        return items
    assert dtype is not None
    block = block_size(config, "the model's config.json")
    scale_keys = set(scaled.values())
    out = []
    for it in items:
        if it.key in scaled:
            out.append(replace(it, source=dequantizing(it.source, by_key[scaled[it.key]].source, dtype, block, it.key),
                               dtype=dtype))
        elif it.key not in scale_keys:
            out.append(it)
    return out


def block_size(config: dict[str, Any] | None, where: str) -> tuple[int, int]:
    """The blocks the scales cover, from the config's quantization_config; refused by name where the config
    says another quantization."""
    quantization = (config or {}).get("quantization_config") or {}
    method, fmt = quantization.get("quant_method", "fp8"), quantization.get("fmt", "e4m3")
    block = quantization.get("weight_block_size", [128, 128])
    if method != "fp8" or fmt != "e4m3" or quantization.get("scale_fmt", "float") != "float" or \
            not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ExportError(f"{where}: quantization_config {quantization!r:.120}: shardstore dequantizes FP8 e4m3 "
                          f"weights with float32 scales per block of rows and columns (quant_method fp8)")
    return block[0], block[1]


@dataclass(frozen=True)
class Dequantized(ArrayRef):
    """`weight` (FP8, rows × columns) times `scale` (float32, one per `block`), in `dtype`; rows [first_row,
    first_row + shape[0]) of the weight, streamed a run of rows at a time."""

    weight: ArrayRef | None = None
    scale: ArrayRef | None = None
    block: tuple[int, int] = (128, 128)
    first_row: int = 0

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        assert self.weight is not None and self.scale is not None
        rows, columns = self.shape[-2], self.shape[-1]  # (a Megatron chunk's leading axes are 1s)
        scale = float32_rows(store, self.scale)
        step = max(1, BLOCK_BYTES // max(1, columns * 4))
        native = _fp8_block_c is not None and self.dtype in ("bfloat16", "float32")
        for first in range(0, rows, step):
            stop = min(rows, first + step)
            if native:
                raw = raw_rows(store, rows_of(self.weight, first, stop))
                yield _fp8_block_c(raw, dtypes.widening(self.weight.dtype), scale, stop - first, columns,
                                   scale.shape[1], *self.block, self.first_row + first, self.dtype == "bfloat16")
            else:
                yield dequantized(float32_rows(store, self.weight, (first, stop)).reshape(stop - first, columns),
                                  scale, self.block, self.first_row + first, self.dtype)

    def stored_crc(self, store: Store) -> int | None:
        return None

    def rows_of(self, first: int, stop: int) -> Dequantized:
        """Rows [first, stop) of it."""
        assert self.weight is not None
        return replace(self, shape=(stop - first, self.shape[-1]), weight=rows_of(self.weight, first, stop),
                       first_row=self.first_row + first)


def dequantized(values: np.ndarray, scale: np.ndarray, block: tuple[int, int], first_row: int, dtype: str) -> Part:
    """Rows of a weight (float32 `values`, the first of them row `first_row`) times their blocks' `scale`,
    in `dtype`: numpy's way (the C extension's where it was built, the same bytes)."""
    at = np.arange(first_row, first_row + values.shape[0]) // block[0]
    with np.errstate(over="ignore", invalid="ignore"):  # infinities and NaNs are values here, as in torch
        values *= np.repeat(scale, block[1], axis=1)[at, :values.shape[1]]
    return values.reshape(-1).view(np.uint8).data if dtype == "float32" else dtypes.rounded(values, dtype)


def dequantizing(weight: Any, scale: Any, dtype: str, block: tuple[int, int], key: str) -> Dequantized:
    """`weight` dequantized by `scale` into `dtype`, once both are checked to be arrays of shapes that fit."""
    if not isinstance(weight, ArrayRef) or not isinstance(scale, ArrayRef) or weight.dtype != "float8_e4m3fn" or scale.dtype != "float32" or len(weight.shape) != 2:
        raise ExportError(f"{key}: a {getattr(weight, 'dtype', '')} weight of shape {list(weight.shape)} with {scale.dtype} scales; "
                          f"FP8 dequantization takes a 2-D float8_e4m3fn weight and float32 scales")
    want = tuple(-(-n // b) for n, b in zip(weight.shape, block))
    if tuple(scale.shape) != want:
        raise ExportError(f"{key}{SCALE}: shape {list(scale.shape)}, but {key} of shape {list(weight.shape)} in blocks "
                          f"of {list(block)} needs {list(want)}")
    if dtype not in dtypes.CAST_DTYPES:
        raise ExportError(f"{key}: dequantized into {dtype}; one of {', '.join(dtypes.CAST_DTYPES)}")
    return Dequantized(weight.path, dtype, weight.shape, None, weight, scale, block)
