"""Hugging Face models stored in MXFP4 (GPT-OSS as OpenAI released it: `quantization_config` `quant_method`
"mxfp4"): each layer's stacked experts `X` (`gate_up_proj`, `down_proj`) are kept as `X_blocks` (uint8,
experts × rows × groups × 16: two 4-bit E2M1 values a byte, the low nibble first, 32 values a group) and
`X_scales` (uint8, experts × rows × groups: one power of two a group, biased by 127). Dequantized on the
way out (`--dtype` of such a model, and always for `--format megatron`) as transformers'
`convert_moe_packed_tensors` computes it: each value times 2**(scale - 127) (torch's ldexp, exact), then each expert's
rows × columns transposed into the columns × rows transformers' GptOss keeps (`gate_up_proj` hidden ×
2·intermediate). Every such value is exact in bfloat16, so the output is the same whatever the order of
the work; memory holds a slab of one expert's columns at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np

from .. import dtypes
from ..errors import ExportError
from ..ranges import Part
from ..store.store import Store
from .adapters import raw_rows, rows_of
from .resolve import ArrayRef

try:
    # (absent where no compiler built it)
    from ._dequant import mxfp4 as _mxfp4_c  # type: ignore[import-not-found, unused-ignore]
    from ._dequant import mxfp4_columns as _columns_c  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # not built (no compiler at install time): numpy's, the same bytes
    _mxfp4_c = _columns_c = None
NATIVE = _mxfp4_c is not None

BLOCKS, SCALES = "_blocks", "_scales"
GROUP_BYTES = 16  # 32 values of 4 bits a group
# E2M1's sixteen values, by their 4 bits
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
PAIRS = np.stack([FP4[np.arange(256) & 15], FP4[np.arange(256) >> 4]], axis=1)  # a byte's two values, in order
SLAB_BYTES = 16 << 20  # of float32 held at a time


def quantized(config: dict[str, Any] | None) -> bool:
    """Whether `config` (a config.json's contents) says MXFP4."""
    quantization = (config or {}).get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def dequantize(items: list[Any], config: dict[str, Any] | None, dtype: str | None) -> list[Any]:
    """`items` (the safetensors writer's) with each MXFP4 pair `X_blocks`, `X_scales` replaced by `X`
    dequantized into `dtype` (in `X_blocks`' place); as they are without `dtype`, or unless the config says
    MXFP4."""
    if dtype is None or not quantized(config):
        return items
    by_key = {it.key: it for it in items}
    pairs = {k: f"{k.removesuffix(BLOCKS)}{SCALES}" for k in by_key
             if k.endswith(BLOCKS) and f"{k.removesuffix(BLOCKS)}{SCALES}" in by_key}
    scale_keys = set(pairs.values())
    out = []
    for it in items:
        if it.key in pairs:
            key = it.key.removesuffix(BLOCKS)
            source = dequantizing(it.source, by_key[pairs[it.key]].source, dtype, key)
            out.append(replace(it, key=key, source=source, dtype=dtype, shape=source.shape))
        elif it.key not in scale_keys:
            out.append(it)
    return out


@dataclass(frozen=True)
class Dequantized(ArrayRef):
    """`blocks` times `scales` (see the module), each expert (of `rows`, counted on the expert axis: all
    of them where None) as columns × rows in `dtype`."""

    blocks: ArrayRef | None = None
    scales: ArrayRef | None = None

    def parts(self, store: Store, allow_partial: bool = False) -> Iterator[Part]:
        rows, groups = self._sizes
        step = max(1, SLAB_BYTES // (rows * 2 * GROUP_BYTES * 4))  # groups (columns out) a slab, all the rows
        for first, stop in self.rows or ((0, self._experts),):
            for expert in range(first, stop):
                packed, exponents = self._expert(store, expert)
                for g in range(0, groups, step):
                    yield columns(packed, exponents, g, min(step, groups - g), self.dtype)

    def member_rows(self, store: Store, expert: int, interleave: int = 1) -> Iterator[Part]:
        """Expert `expert` as it was stored, rows × columns (Megatron's orientation, which the transposition
        into transformers' undoes), its rows gathered from the `interleave` ways they are dealt out in: rows
        way, way + interleave, ... for each way in turn (GptOss's interleaved gate and up as [gate; up])."""
        rows, groups = self._sizes
        step = max(1, SLAB_BYTES // (groups * 2 * GROUP_BYTES * 4))  # rows a slab
        packed, exponents = self._expert(store, expert)
        for way in range(interleave):
            for r in range(way, rows, step * interleave):
                picked = slice(r, min(rows, r + step * interleave), interleave)
                yield values(packed[picked], exponents[picked], self.dtype)

    @property
    def _sizes(self) -> tuple[int, int]:
        assert self.scales is not None
        return self.scales.shape[1], self.scales.shape[2]

    @property
    def _experts(self) -> int:
        assert self.blocks is not None
        return self.blocks.shape[0]

    def _expert(self, store: Store, expert: int) -> tuple[np.ndarray, np.ndarray]:
        """An expert's packed bytes (rows × groups × 16) and exponents (rows × groups), as stored."""
        assert self.blocks is not None and self.scales is not None
        rows, groups = self._sizes
        packed = np.frombuffer(raw_rows(store, rows_of(self.blocks, expert, expert + 1)), np.uint8)
        exponents = np.frombuffer(raw_rows(store, rows_of(self.scales, expert, expert + 1)), np.uint8)
        return packed.reshape(rows, groups, GROUP_BYTES), exponents.reshape(rows, groups)

    def stored_crc(self, store: Store) -> int | None:
        return None


def values(packed: np.ndarray, exponents: np.ndarray, dtype: str) -> Part:
    """Rows × groups of packed bytes and their exponents as rows × columns of `dtype`: the C extension's
    where it was built (bfloat16, float32), else numpy's, the same bytes."""
    if _mxfp4_c is not None and dtype in ("bfloat16", "float32"):
        return memoryview(_mxfp4_c(np.ascontiguousarray(packed).data, np.ascontiguousarray(exponents).data,
                                   dtype == "bfloat16"))
    return _numpy(packed, exponents, dtype, False)


def columns(packed: np.ndarray, exponents: np.ndarray, first: int, count: int, dtype: str) -> Part:
    """Of an expert's rows × groups of packed bytes and exponents, the columns of groups [first, first +
    count) as columns × rows of `dtype` (transposed, as transformers keeps them): the C extension's where
    it was built, else numpy's, the same bytes."""
    if _columns_c is not None and dtype in ("bfloat16", "float32"):
        return memoryview(_columns_c(np.ascontiguousarray(packed).data, np.ascontiguousarray(exponents).data,
                                     dtype == "bfloat16", exponents.shape[0], first, count))
    return _numpy(packed[:, first:first + count], exponents[:, first:first + count], dtype, True)


def _numpy(packed: np.ndarray, exponents: np.ndarray, dtype: str, transposed: bool) -> Part:
    """`values` (or `columns`, `transposed`) by numpy."""
    rows, groups = exponents.shape
    with np.errstate(over="ignore"):  # exactly, as torch's ldexp: past float32's range, infinity
        numbers = np.ldexp(PAIRS[packed].reshape(rows, groups, 2 * GROUP_BYTES),
                           (exponents.astype(np.int32) - 127)[:, :, None]).reshape(rows, groups * 2 * GROUP_BYTES)
    if transposed:
        numbers = np.ascontiguousarray(numbers.T)
    return numbers.reshape(-1).view(np.uint8).data if dtype == "float32" else dtypes.rounded(numbers, dtype)


def dequantizing(blocks: Any, scales: Any, dtype: str, key: str) -> Dequantized:
    """`blocks` dequantized by `scales` into `dtype`, once both are checked to be uint8 arrays of shapes
    that fit."""
    if not isinstance(blocks, ArrayRef) or not isinstance(scales, ArrayRef) or blocks.dtype != "uint8" or \
            scales.dtype != "uint8" or len(blocks.shape) != 4 or blocks.shape[-1] != GROUP_BYTES or \
            tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ExportError(f"{key}{BLOCKS}: {getattr(blocks, 'dtype', '')} {list(getattr(blocks, 'shape', ()))} with "
                          f"{getattr(scales, 'dtype', '')} scales {list(getattr(scales, 'shape', ()))}; MXFP4 takes "
                          f"uint8 blocks of experts x rows x groups x {GROUP_BYTES} and uint8 scales of experts x rows "
                          f"x groups")
    if dtype not in dtypes.CAST_DTYPES:
        raise ExportError(f"{key}: dequantized into {dtype}; one of {', '.join(dtypes.CAST_DTYPES)}")
    experts, rows, groups, _ = blocks.shape
    return Dequantized(blocks.path, dtype, (experts, groups * 2 * GROUP_BYTES, rows), None, blocks, scales)
