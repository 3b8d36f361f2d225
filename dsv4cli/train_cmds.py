"""`dsv4 warmup` and `dsv4 sparse`: the two indexer training stages of DESIGN.md's stage table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dsv4cli import options as opt
from dsv4cli.errors import fail, handle_errors

WARMUP_HELP = (
    "Dense indexer warm-up: the indexer distills the main attention by a KL loss, everything else frozen. "
    "Stage defaults: use_indexer=true indexer_loss_scaling_factor=0.01 indexer_sparse_training=false "
    "trainable_parameters_mask=['.*indexer.*'] learning_rate=1e-3 (AdamW, linear warm-up)."
)
WARMUP_EPILOG = "Example: dsv4 warmup --steps 100    |    dsv4 warmup --steps 20 indexer_topk=8 max_target_length=128"
SPARSE_HELP = (
    "Sparse pre-training: the whole model trains through the indexer's top-k. "
    "Stage defaults: indexer_loss_scaling_factor=0.1 indexer_sparse_training=true, every parameter trained."
)
SPARSE_EPILOG = "Example: dsv4 sparse --steps 100 --init-from runs/warmup"


def _resolve(stage: str, model: str, config: Optional[Path], overrides: Optional[list[str]], steps: Optional[int]):
    from core.config import load_config

    return load_config(model, overrides or (), config_file=config, stage=stage, options={"steps": steps})


@handle_errors
def warmup(
    overrides: opt.Overrides = None,
    steps: opt.Steps = None,
    output: opt.Output = None,
    model: opt.Model = "deepseek4-tiny",
    config: opt.ConfigFile = None,
) -> None:
    _resolve("warmup", model, config, overrides, steps)
    fail("dsv4 warmup is not built yet (issue 5): the configuration above is valid, but training is not implemented.")


@handle_errors
def sparse(
    overrides: opt.Overrides = None,
    steps: opt.Steps = None,
    output: opt.Output = None,
    init_from: Annotated[Optional[Path], typer.Option("--init-from", help="A warm-up run directory or checkpoint step to start from (fresh optimizer).")] = None,
    model: opt.Model = "deepseek4-tiny",
    config: opt.ConfigFile = None,
) -> None:
    _resolve("sparse", model, config, overrides, steps)
    fail("dsv4 sparse is not built yet (issue 5): the configuration is valid, but training is not implemented.")
