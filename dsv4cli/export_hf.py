"""`dsv4 export-hf RUN OUT`: a dsv4 checkpoint -> DeepSeek-V4 safetensors + config.json (held weights as held)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

HELP = ("Export a checkpoint as DeepSeek-V4 safetensors (config.json, shards, index) in the official or the "
        "transformers layout, loadable by transformers' DeepseekV4ForCausalLM. Weights are unquantised, except "
        "those a run holds released (frozen_weights: released): the official layout writes their FP8/FP4 codes "
        "and scales back bit for bit, the transformers layout dequantises them.")
EPILOG = "Example: dsv4 export-hf runs/sparse exported/ --layout transformers --dtype bfloat16"

Out = Annotated[Path, typer.Argument(help="Directory to create (must not exist or be empty).", show_default=False)]
Layout = Annotated[str, typer.Option("--layout", help="official (layers.N.attn.wq_a.weight, per-expert w1/w2/w3) | transformers (model.layers.N.self_attn.q_a_proj.weight, fused gate_up_proj).")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="bfloat16 | float32 for the weights (default: the run's weight_dtype); mHC, ape, sinks, router bias stay float32.")]


@handle_errors
def command(run: opt.CkptPath, out: Out, step: opt.StepOpt = None, layout: Layout = "official",
            dtype: Dtype = None, json_out: opt.Json = False) -> None:
    from dataclasses import asdict

    from rich.console import Console

    from core.hf.exporter import export_checkpoint

    summary = asdict(export_checkpoint(run, out, step=step, layout=layout, dtype=dtype))
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    Console(highlight=False, soft_wrap=True).print(
        f"exported {summary['run']} (step {summary['step']}) -> {summary['output']}  ·  {summary['layout']} layout  ·  "
        f"{summary['dtype']}  ·  {summary['tensors']} tensors in {summary['shards']} shard(s), "
        f"{summary['bytes'] / 2**20:.1f} MiB"
        + (f"  ·  {summary['released']} as held (FP8/FP4 codes and e8m0 scales)" if summary["released"] else ""))
