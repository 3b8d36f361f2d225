"""`dsv4 bench`: speed and memory of the CSA indexer loss (direct vs chunked) and of training."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

HELP = "Benchmark the CSA indexer loss (direct, head-chunked, query-chunked, streamed): time, XLA memory, parity, GFLOP/s."
EPILOG = ("Example: dsv4 bench --chunk 8 --query-chunk 256 --seq 1024,4096,32768    |    "
          "dsv4 bench --shape tiny --seq 64 --json    |    dsv4 bench --train")

Chunk = Annotated[Optional[int], typer.Option("--chunk", min=0, help="Heads per scan step in the chunked paths (divides H and HI; 0 = off; default H/8, i.e. 8 at flash shapes).", show_default=False)]
QueryChunk = Annotated[Optional[int], typer.Option("--query-chunk", min=0, help="Query positions per scan step in the query-chunked and streamed paths (0 = off; default min(256, T/4)).", show_default=False)]
Seqs = Annotated[str, typer.Option("--seq", help="Comma-separated sequence lengths T (multiples of 4 and of --query-chunk).")]
Shape = Annotated[str, typer.Option("--shape", help="Attention shapes: flash (deepseek4-284b: H=64, D=512, indexer 64x128, top-k 512) or tiny (deepseek4-tiny).")]
Repeats = Annotated[int, typer.Option("--repeats", min=1, help="Timing rounds after one warm-up step; each round times a matmul and one step of every path (medians reported).")]
Budget = Annotated[float, typer.Option("--budget-gib", min=0, help="Memory budget in GiB; lengths whose direct path needs more are compiled only (default: device limit or available RAM).")]
Train = Annotated[bool, typer.Option("--train", help="Instead: tokens/s and step time of the deepseek4-tiny training step, warm-up and sparse.")]
TrainSteps = Annotated[int, typer.Option("--train-steps", min=1, help="Timed training steps per stage with --train.")]

GIB = 2**30


@handle_errors
def command(chunk: Chunk = None, query_chunk: QueryChunk = None, seq: Seqs = "1024,4096", shape: Shape = "flash",
            repeats: Repeats = 3, budget_gib: Budget = 0.0, train: Train = False, train_steps: TrainSteps = 5,
            json_out: opt.Json = False) -> None:
    from core import bench
    from core.errors import ConfigError

    if train:
        result = bench.run_train_bench(train_steps)
        if json_out:
            typer.echo(json.dumps(result, indent=2))
        else:
            _render_train(_console(), result)
        return
    try:
        seqs = [int(s) for s in seq.split(",") if s.strip()]
    except ValueError:
        seqs = []
    if not seqs:
        raise ConfigError(f"--seq {seq!r} is not a comma-separated list of lengths: use e.g. --seq 1024,4096.")
    loss_shape = bench.loss_shape(shape)
    budget = int(budget_gib * GIB) if budget_gib else None
    from dsv4cli.display import ProgressBar

    with ProgressBar(bench.progress_units(len(seqs), repeats), "compiling and timing", quiet=json_out) as bar:
        result = bench.run_loss_bench(loss_shape, seqs, head_chunk=chunk, query_chunk=query_chunk, repeats=repeats,
                                      budget_bytes=budget, on_progress=lambda label: bar.advance(description=label))
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _render_loss(_console(), result.to_dict())


def _console():
    from rich.console import Console

    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=1000, soft_wrap=True)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _render_loss(console, r: dict[str, Any]) -> None:
    from rich.table import Table

    s = r["shape"]
    console.print(f"[bold]CSA indexer loss, fwd+bwd[/bold]  {s['name']} ({s['model']}): B={s['batch']} H={s['heads']} "
                  f"D={s['head_dim']} indexer {s['indexer_heads']}x{s['indexer_head_dim']} top-k {s['topk']}  ·  "
                  f"chunks: {r['head_chunk']} heads, {r['query_chunk'] or 'min(256, T/4)'} queries  ·  {r['device']}")
    matmuls = ", ".join(f"{row['matmul_gflops']:.1f}" for row in r["seqs"])
    console.print(f"f32 matmul {matmuls} GFLOP/s  ·  memory budget {r['budget_bytes'] / GIB:.1f} GiB  ·  median of "
                  f"{r['repeats']} round-robin rounds (each: the matmul, then one step of every path) after a warm-up")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for title in ("T", "path", "heads/q", "compile", "step", "vs direct", "XLA temp", "|Δloss|", "|Δgrad|", "GFLOP/s", "% matmul"):
        table.add_column(title, justify="left" if title == "path" else "right")
    for row in r["seqs"]:
        for v in row["variants"]:
            table.add_row(
                str(row["seq"]), v["variant"], f"{v['head_chunk'] or '-'}/{v['query_chunk'] or '-'}",
                f"{v['compile_s']:.1f}s", _fmt(v["step_s"], ".3f", "compile only") + ("s" if v["ran"] else ""),
                _fmt(v["speed_vs_direct"], ".2f") + ("x" if v["ran"] else ""), _bytes(v["temp_bytes"]),
                _fmt(v["loss_abs_diff"], ".1e"), _fmt(v["grad_abs_diff"], ".1e"), _fmt(v["gflops"], ".1f"),
                _fmt(None if v["matmul_share"] is None else 100 * v["matmul_share"], ".0f"))
    console.print(table)
    for row in r["seqs"]:
        if not row["fits"]:
            console.print(f"T={row['seq']}: the direct path needs {_bytes(row['direct_bytes'])} > the budget, so every "
                          "path was compiled (XLA temp reported) but not run.")


def _render_train(console, result: dict[str, Any]) -> None:
    from rich.table import Table

    console.print("[bold]deepseek4-tiny training step[/bold] (median step after the compile step)")
    first = next(iter(result.values()))
    keys = [k for k, v in first.items() if k != "stage" and not isinstance(v, dict)]
    table = Table("stage", *keys, box=None, pad_edge=False, header_style="bold")
    for stage, stats in result.items():
        table.add_row(stage, *(_fmt(stats.get(k), ".4g") if isinstance(stats.get(k), float) else str(stats.get(k, "-"))
                               for k in keys))
    console.print(table)
    for stage, stats in result.items():
        nested = {k: v for k, v in stats.items() if isinstance(v, dict)}
        for name, values in nested.items():
            console.print(f"{stage} {name}: " + "  ".join(f"{k}={_fmt(v, '.4g')}" for k, v in values.items()))
