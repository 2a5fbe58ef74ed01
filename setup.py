"""Only the optional C extension lives here; everything else is in pyproject.toml.

`optional=True`: where no compiler is found the install still succeeds and shardstore uses the
pure-Python scanner, which gives identical results (shardstore.read.primitives.pickle_scan.NATIVE says which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shardstore.read.primitives._pickle_scan", ["shardstore/read/primitives/_pickle_scan.c"], optional=True)])
