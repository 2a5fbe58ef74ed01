"""`python -m shardstore`: the same command line as `shardstore`."""

from .cli import main

main(prog_name="shardstore")
