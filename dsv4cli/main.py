"""`dsv4`: the Typer application. Commands import jax lazily so `dsv4 --help` is instant."""

from __future__ import annotations

import glob
import os
from typing import Annotated, Optional

import typer

from core.process import tune_garbage_collector
from dsv4cli import __version__
from dsv4cli.errors import DEBUG

app = typer.Typer(
    name="dsv4",
    help="Train and evaluate the lightning indexer of DeepSeek-V4 Compressed Sparse Attention (JAX).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dsv4 {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks for errors.")] = False,
) -> None:
    DEBUG["on"] = debug


def _register() -> None:
    from dsv4cli import bench, eval_indexer, export_hf, import_hf, inspect_ckpt, plan, train_cmds

    for name, stage in train_cmds.STAGES.items():
        app.command(name, help=stage.help, short_help=stage.help.split(":")[0] + ".", epilog=stage.epilog)(
            train_cmds.command(name))
    app.command("eval-indexer", help=eval_indexer.HELP, short_help=eval_indexer.HELP.split(":")[0] + ".", epilog=eval_indexer.EPILOG)(eval_indexer.command)
    app.command("inspect-ckpt", help=inspect_ckpt.HELP, short_help=inspect_ckpt.HELP.split(":")[0] + ".", epilog=inspect_ckpt.EPILOG)(inspect_ckpt.command)
    app.command("bench", help=bench.HELP, short_help=bench.HELP.split(":")[0] + ".", epilog=bench.EPILOG)(bench.command)
    app.command("import-hf", help=import_hf.HELP, short_help=import_hf.HELP.split(":")[0] + ".", epilog=import_hf.EPILOG)(import_hf.command)
    app.command("export-hf", help=export_hf.HELP, short_help=export_hf.HELP.split(" (")[0] + ".", epilog=export_hf.EPILOG)(export_hf.command)
    app.command("plan", help=plan.HELP, short_help=plan.HELP.split(":")[0] + ".", epilog=plan.EPILOG)(plan.command)


_register()


# device files of the accelerators whose JAX plugins the tpu and cuda extras install
ACCELERATOR_DEVICES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")


def pin_cpu_without_accelerators() -> None:
    """Pin JAX to the CPU on a machine with no TPU or NVIDIA device, unless JAX_PLATFORMS is set.

    With the tpu or cuda extra installed (for `dsv4 plan`), JAX's start-up on a machine without
    those devices tries each plugin and prints its failure (a cuInit traceback, libtpu's warnings)
    to stderr: noise before every command's output and inside its one-line errors. The planner
    compiles for those targets in child processes of its own, so the commands lose nothing.
    """
    if not os.environ.get("JAX_PLATFORMS") and not any(glob.glob(p) for p in ACCELERATOR_DEVICES):
        os.environ["JAX_PLATFORMS"] = "cpu"


def main() -> None:
    pin_cpu_without_accelerators()
    tune_garbage_collector()
    app()


if __name__ == "__main__":
    main()
