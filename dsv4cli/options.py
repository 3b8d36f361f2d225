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
CkptPath = Annotated[Path, typer.Argument(help="A run directory, its checkpoints/ directory, or one step directory.")]
