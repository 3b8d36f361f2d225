"""`dsv4 inspect-ckpt CKPT`: what is in a checkpoint, without loading any array."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

HELP = "Show a checkpoint's steps, stage, settings, metrics and parameter tree without loading arrays."
EPILOG = "Example: dsv4 inspect-ckpt runs/warmup --depth 2    |    dsv4 inspect-ckpt runs/warmup/checkpoints/99 --json"

Depth = Annotated[Optional[int], typer.Option("--depth", min=1, help="Fold the parameter tree to this many path components (default: every leaf).")]


@handle_errors
def command(ckpt: opt.CkptPath, step: opt.StepOpt = None, depth: Depth = None, json_out: opt.Json = False) -> None:
    from rich.console import Console

    from core.checkpoint.inspect import summarize_checkpoint

    result = summarize_checkpoint(ckpt, step)
    summary = result.to_dict(depth)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    console = Console(highlight=False)
    _render(console if console.is_terminal else Console(width=1000, soft_wrap=True, highlight=False), summary,
            result.held())


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _value(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


KIND_NOTES = {"router_bias": "router bias", "hash_table": "hash table", "held_fp8": "held FP8 e4m3",
              "held_fp4": "held FP4 e2m1, 2 per byte", "scales": "e8m0 scales"}


def _render(console, s: dict[str, Any], held: dict[str, int]) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    console.print(f"[bold]{escape(s['checkpoint'])}[/bold]  ·  steps present: {', '.join(map(str, s['steps']))}")
    console.print(f"model {s['model_name']}  ·  stage {s['stage']}  ·  step {s['step']}  ·  dsv4 {s['version']}")
    ix = s["indexer"]
    console.print(escape("indexer  " + "  ".join(f"{k}={_value(v)}" for k, v in ix.items())))
    if s["metrics"]:
        console.print(escape("metrics  " + "  ".join(f"{k}={_value(v)}" for k, v in s["metrics"].items())))
    table = Table(box=box.SIMPLE_HEAD if console.is_terminal else None)
    for name in ("path", "shape", "dtype", "count", "bytes", "trainable"):
        table.add_column(name, justify="left" if name in ("path", "dtype") else "right")
    for g in s["tree"]:
        shape = f"{g['leaves']} leaves" if g["shape"] is None else "(" + ", ".join(map(str, g["shape"])) + ")"
        trainable = KIND_NOTES.get(g["kind"], f"{g['trainable']:,}")
        table.add_row(escape(g["path"]), shape, ",".join(g["dtypes"]), f"{g['count']:,}", _size(g["bytes"]), trainable)
    console.print(table)
    t = s["totals"]
    console.print(f"parameters {t['parameters']:,} ({_size(t['parameter_bytes'])}; nnx.Params + router biases, "
                  "the official inventory's count)")
    width = len(f"{t['parameters']:,}")
    frozen = "other nnx.Params"
    if held["leaves"]:
        frozen += (f"; {held['elements']:,} of them held released in {held['leaves']} leaves "
                   f"(FP8 e4m3 / FP4 e2m1 codes + e8m0 scales, {_size(held['bytes'])})")
    for name, key, note in (("trainable", "trainable", "gradient-trained (trainable_parameters_mask)"),
                            ("frozen", "frozen", frozen),
                            ("router bias", "router_bias", "moved by the load-balance update, not by gradients"),
                            ("hash table", "hash_table", "token -> experts table, not a parameter (not in the total)")):
        console.print(f"  {name:<12}{t[key]:>{width},}  {note}")
    console.print(f"optimizer state {t['optimizer_state']:,} ({_size(t['optimizer_bytes'])})  ·  "
                  f"on disk {_size(t['disk_bytes'])}")
