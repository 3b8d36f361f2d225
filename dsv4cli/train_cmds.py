"""`dsv4 pretrain`, `dsv4 warmup` and `dsv4 sparse`: the three training stages of DESIGN.md's stage table."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

PRETRAIN_HELP = (
    "Dense pre-training (stage 1): the LM trains with every visible compressed block, the indexer idle "
    "(no indexer loss; its parameters exist but get no gradient and no optimizer state). "
    "Stage defaults: dense_pretraining=true use_indexer=true indexer_loss_scaling_factor=0 indexer_sparse_training=false "
    "trainable_parameters_mask=[] "
    "frozen_parameters_mask=['.*indexer.*'] indexer_weights_init=zeros learning_rate=1e-3 per_device_batch_size=1. "
    "Then: dsv4 warmup --init-from this run. Rerun on the same --output to resume; --steps is the run's total."
)
PRETRAIN_EPILOG = "Example: dsv4 pretrain --steps 300    |    dsv4 pretrain --steps 20 --output runs/p2 learning_rate=3e-3"
WARMUP_HELP = (
    "Dense indexer warm-up: the indexer distills the main attention by a KL loss, everything else frozen. "
    "Stage defaults: use_indexer=true indexer_loss_scaling_factor=0.01 indexer_sparse_training=false "
    "trainable_parameters_mask=['.*indexer.*'] learning_rate=3e-3 cosine_learning_rate_final_fraction=1 "
    "adam_b1=0.7 adam_weight_decay=0 adam_eps=1e-12 indexer_weights_init=zeros (AdamW, linear warm-up, then constant) "
    "indexer_init=teacher (with --init-from, each indexer starts from its own layer's main attention, once, before step 0). "
    "--init-from starts from a run's weights and router biases (a model without an indexer gets a fresh one). "
    "Rerun on the same --output to resume from its latest checkpoint; --steps is the run's total."
)
WARMUP_EPILOG = ("Example: dsv4 warmup --steps 100 --init-from runs/pretrain    |    "
                 "dsv4 warmup --steps 20 indexer_topk=8 max_target_length=128")
SPARSE_HELP = (
    "Sparse pre-training: the whole model trains through the indexer's top-k. "
    "Stage defaults: indexer_loss_scaling_factor=0.1 indexer_sparse_training=true per_device_batch_size=1, every parameter trained. "
    "--init-from starts from a run's weights and router biases (e.g. the warm-up's) with a fresh optimizer."
)
EXIT_CODES = (" Exit codes: 0 done, 2 bad input or run directory in use, 3 diverged (non-finite loss; the step was not "
              "applied, the last good checkpoint kept), 4 a write failed (disk full, permissions), 5 a multi-process run "
              "lost a process (docs/scaling.md#when-a-process-is-lost), 130 interrupted.")
WARMUP_HELP += EXIT_CODES
SPARSE_HELP += EXIT_CODES
SPARSE_EPILOG = "Example: dsv4 sparse --steps 100 --init-from runs/warmup"

InitFrom = Annotated[Optional[Path], typer.Option(
    "--init-from", help="A run directory (any stage) or checkpoint step to start from (fresh optimizer).")]


@dataclasses.dataclass(frozen=True)
class Stage:
    """What tells one training command from another: its help, its example, whether it takes --init-from."""

    help: str
    epilog: str
    init_from: bool


STAGES = {  # the order of `dsv4 --help`
    "pretrain": Stage(PRETRAIN_HELP, PRETRAIN_EPILOG, init_from=False),
    "warmup": Stage(WARMUP_HELP, WARMUP_EPILOG, init_from=True),
    "sparse": Stage(SPARSE_HELP, SPARSE_EPILOG, init_from=True),
}


def train(
    stage: str,
    overrides: opt.Overrides = None,
    steps: opt.Steps = None,
    output: opt.Output = None,
    init_from: InitFrom = None,
    model: opt.Model = "deepseek4-tiny",
    config: opt.ConfigFile = None,
    coordinator_address: opt.CoordinatorAddress = None,
    num_processes: opt.NumProcesses = None,
    process_id: opt.ProcessId = None,
) -> None:
    """`dsv4 STAGE`: the stage's config, the run directory, the cluster, then the Trainer's rows."""
    from rich.console import Console

    from core.checkpoint.run_files import check_output_dir
    from core.config.schema import load_config
    from dsv4cli.display import TrainDisplay

    cfg = load_config(model, overrides or (), config_file=config, stage=stage, options={"steps": steps})
    run_dir = output or Path(cfg.base_output_directory) / (cfg.run_name or stage)
    run_dir = check_output_dir(run_dir, "--output" if output else "run directory (base_output_directory/run_name)")
    from core.parallel.mesh import initialize_distributed, is_main_process

    # before any JAX work; a no-op for a plain single process
    if initialize_distributed(coordinator_address, num_processes, process_id):
        from core.parallel import peers
        from dsv4cli.errors import print_error

        peers.watch(print_error)  # a lost peer: one line and exit 5, not XLA's abort
    from core.train.compile_cache import enable_compilation_cache

    enable_compilation_cache(cfg.jax_cache_dir)  # before the step compiles: a rerun of this shape reads it back
    from core.train.run import Trainer

    display = TrainDisplay(None if is_main_process() else Console(quiet=True))
    display.console.print(f"[dim]building {cfg.model_name} ({cfg.num_layers} layers) and compiling...[/dim]")

    trainer = Trainer(cfg, stage=stage, run_dir=run_dir, init_from=init_from)
    display.header(trainer.info)
    try:
        with display.steps():
            for row in trainer.run():
                display.row(row)
    except KeyboardInterrupt:
        display.summary(trainer.summary(), interrupted=True)
        raise
    display.summary(trainer.summary())


def command(stage: str) -> Callable[..., None]:
    """`dsv4 STAGE`'s Typer command: `train` with the stage bound, its options `train`'s less
    --init-from where the stage takes none (Typer reads the options from the signature)."""

    @handle_errors
    def run(**options) -> None:
        train(stage, **options)

    run.__signature__ = inspect.Signature([
        p for name, p in inspect.signature(train, eval_str=True).parameters.items()
        if name != "stage" and (name != "init_from" or STAGES[stage].init_from)])
    return run
