"""`dsv4 eval-indexer CKPT`: how good is the indexer (KL, recall@k, overlap@k, baselines)."""

from __future__ import annotations

from dsv4cli import options as opt
from dsv4cli.errors import fail, handle_errors

HELP = "Measure the indexer against the dense teacher: KL, recall@k, overlap@k, recency/random baselines, LM-loss gap."
EPILOG = "Example: dsv4 eval-indexer runs/warmup --batches 8 --topk 4,8,16"


@handle_errors
def command(ckpt: opt.CkptPath, step: opt.StepOpt = None, json_out: opt.Json = False) -> None:
    fail("dsv4 eval-indexer is not built yet (issue 6).")
