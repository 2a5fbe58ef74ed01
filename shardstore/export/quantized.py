"""Quantized Hugging Face models, dequantized on the way out: FP8 with block scales (DeepSeek-V3's,
Qwen3-FP8's: fp8.py) and MXFP4 (GPT-OSS's: mxfp4.py). The writers ask here, whichever a model is."""

from __future__ import annotations

from typing import Any

from . import fp8, mxfp4

# the sources whose values are computed from two arrays: written from the store, never copied in place
COMPUTED = (fp8.Dequantized, mxfp4.Dequantized)


def dequantize(items: list[Any], config: dict[str, Any] | None, dtype: str | None) -> list[Any]:
    """`items` (the safetensors writer's) with every quantized tensor dequantized into `dtype`, its scales
    left out; as they are without `dtype`."""
    return mxfp4.dequantize(fp8.dequantize(items, config, dtype), config, dtype)
