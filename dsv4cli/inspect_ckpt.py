"""`dsv4 inspect-ckpt CKPT`: what is in a checkpoint, without loading any array."""

from __future__ import annotations

from dsv4cli import options as opt
from dsv4cli.errors import fail, handle_errors

HELP = "Show a checkpoint's steps, stage, settings, metrics and parameter tree without loading arrays."
EPILOG = "Example: dsv4 inspect-ckpt runs/warmup --depth 2"


@handle_errors
def command(ckpt: opt.CkptPath, step: opt.StepOpt = None, json_out: opt.Json = False) -> None:
    fail("dsv4 inspect-ckpt is not built yet (issue 6).")
