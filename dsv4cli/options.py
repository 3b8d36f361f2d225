"""Options shared by several commands, as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

Model = Annotated[
    str, typer.Option("--model", "-m", help="Model config: a name in configs/ (deepseek4-tiny, deepseek4-284b, deepseek4-1.6t) or a YAML path.")
]
ConfigFile = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="Extra YAML file of KEY: VALUE overrides, applied after the model file.")
]
Overrides = Annotated[
    Optional[list[str]], typer.Argument(help="KEY=VALUE config overrides (MaxText names, values parsed as YAML), e.g. indexer_topk=8.", show_default=False)
]
Steps = Annotated[Optional[int], typer.Option("--steps", help="Total optimizer steps of the run (default: config `steps`).")]
Output = Annotated[Optional[Path], typer.Option("--output", "-o", help="Run directory (default: runs/<command>).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
StepOpt = Annotated[Optional[int], typer.Option("--step", help="Checkpoint step to read (default: the latest).")]
BatchRows = Annotated[Optional[int], typer.Option("--batch-rows", help="Evaluation rows per step (default: one per data/fsdp/expert shard), whatever the run's training batch; the figures do not depend on it.")]
CkptPath = Annotated[Path, typer.Argument(help="A run directory, its checkpoints/ directory, or one step directory.")]

# Multi-host (jax.distributed): give all three on every process, or none under SLURM / Open MPI /
# DSV4_DISTRIBUTED=1, where JAX detects them. See docs/scaling.md.
CoordinatorAddress = Annotated[Optional[str], typer.Option(
    "--coordinator-address", help="Multi-host: HOST:PORT of process 0's coordinator (jax.distributed), the same on every process.",
    rich_help_panel="Multi-host")]
NumProcesses = Annotated[Optional[int], typer.Option(
    "--num-processes", min=1, help="Multi-host: how many processes take part (one per host or per accelerator).",
    rich_help_panel="Multi-host")]
ProcessId = Annotated[Optional[int], typer.Option(
    "--process-id", min=0, help="Multi-host: this process's index, 0 .. --num-processes - 1 (0 prints and writes metrics).",
    rich_help_panel="Multi-host")]
