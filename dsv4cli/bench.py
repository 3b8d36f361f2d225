"""`dsv4 bench`: speed and memory of the CSA indexer loss (direct vs chunked) and of training."""

from __future__ import annotations

from dsv4cli import options as opt
from dsv4cli.errors import fail, handle_errors

HELP = "Benchmark the CSA indexer loss (direct, head-chunked, query-chunked): time, XLA peak memory, parity, GFLOP/s."
EPILOG = "Example: dsv4 bench --chunk 8 --seq 1024,4096"


@handle_errors
def command(json_out: opt.Json = False) -> None:
    fail("dsv4 bench is not built yet (issue 7).")
