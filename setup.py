"""Only the optional C extensions live here; everything else is in pyproject.toml.

`optional=True`: where no compiler is found the install still succeeds and shardstore uses the
pure-Python scanner and numpy's FP8 dequantization, which give identical results
(shardstore.read.primitives.pickle_scan.NATIVE and shardstore.export.fp8.NATIVE say which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shardstore.read.primitives._pickle_scan", ["shardstore/read/primitives/_pickle_scan.c"], optional=True),
                   Extension("shardstore.export._dequant", ["shardstore/export/_dequant.c"], optional=True)])
