"""`dsv4 import-hf SRC`: a DeepSeek-V4 checkpoint (official FP8/FP4 or transformers layout) -> a dsv4 run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

HELP = ("Import a DeepSeek-V4 checkpoint: a directory (config.json + *.safetensors, official FP8/FP4 or "
        "transformers layout) or a hub id. Streams shard by shard; writes a run directory that "
        "--init-from, eval-indexer, inspect-ckpt and export-hf accept.")
EPILOG = ("Example: dsv4 import-hf path/to/DeepSeek-V4-Flash --output runs/base    |    "
          "dsv4 import-hf deepseek-ai/DeepSeek-V4-Flash -o runs/flash --keep-quantized")

Source = Annotated[str, typer.Argument(help="Checkpoint directory or hub id (e.g. deepseek-ai/DeepSeek-V4-Flash).", show_default=False)]
Output = Annotated[Optional[Path], typer.Option("--output", "-o", help="Run directory to create (default: runs/<source name>); must not exist or be empty.")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="bfloat16 | float32 (default: bfloat16 above 1B parameters, float32 below).")]
KeepQuantized = Annotated[bool, typer.Option("--keep-quantized", help="Store the FP8/FP4 weights the warm-up freezes as the release stores them (codes + e8m0 scales, bit for bit; frozen_weights: released in config.yml); official layout only.")]


class ShardProgress:
    """Shards and bytes: a Rich bar on a terminal, one plain line per shard elsewhere."""

    def __init__(self, console, what: str = "shards"):
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        self.console, self.what, self.shard = console, what, 0
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                                 console=console, transient=True, disable=not console.is_terminal)
        self.task = None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def update(self, p: dict) -> None:
        if self.task is None:
            self.task = self.progress.add_task("", total=p["total_bytes"])
        self.progress.update(self.task, completed=p["bytes"], description=f"{self.what} {p['shard']}/{p['shards']}")
        if not self.console.is_terminal and p["shard"] != self.shard:
            self.shard = p["shard"]
            self.console.print(f"{self.what} {p['shard']}/{p['shards']}  ({_size(p['bytes'])} of {_size(p['total_bytes'])} read)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@handle_errors
def command(src: Source, output: Output = None, dtype: Dtype = None, keep_quantized: KeepQuantized = False,
            json_out: opt.Json = False) -> None:
    from dataclasses import asdict

    from rich.console import Console

    from core.errors import ConfigError
    from core.hf.importer import import_checkpoint

    if dtype not in (None, "bfloat16", "float32"):
        raise ConfigError(f"--dtype {dtype!r} is not supported: use bfloat16 or float32.")
    output = output or Path("runs") / Path(src.rstrip("/")).name
    err = Console(stderr=True, highlight=False)
    with ShardProgress(err) as bar:
        summary = import_checkpoint(src, output, dtype=dtype, keep_quantized=keep_quantized, on_progress=bar.update)
    s = asdict(summary)
    if json_out:
        typer.echo(json.dumps(s, indent=2))
        return
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"imported {s['source']} ({s['layout']} layout, {_size(s['source_bytes'])}) -> {s['output']}")
    console.print(f"model {s['model_name']}  ·  {s['params']:,} parameters  ·  dtype {s['dtype']} ({s['dtype_reason']})")
    kept = (f"kept as released: FP8 {s['kept_fp8']}, FP4 {s['kept_fp4']}, {_size(s['kept_bytes'])}; "
            if s["keep_quantized"] else "")
    console.print(f"tensors {s['tensors']} ({kept}FP8 dequantised {s['fp8']}, FP4 dequantised {s['fp4']})  ·  "
                  f"mtp.* skipped {s['mtp_skipped']}  ·  indexer {'yes' if s['use_indexer'] else 'none (use_indexer=false)'}  ·  "
                  f"router bias {'yes' if s['routed_bias'] else 'none'}")
    if s["keep_quantized"]:  # the held weights are frozen: only the warm-up can start from them
        console.print(f"frozen_weights: released  ·  next: dsv4 warmup --init-from {s['output']} "
                      f"--model {s['output']}/config.yml")
    else:
        console.print(f"next: dsv4 warmup (or sparse) --init-from {s['output']} --model {s['output']}/config.yml")
