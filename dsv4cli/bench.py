"""`dsv4 bench`: speed and memory of the CSA indexer loss (direct vs chunked) and of training."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from dsv4cli import display
from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

HELP = "Benchmark the CSA indexer loss (direct, head-chunked, query-chunked, streamed): time, XLA memory, parity, GFLOP/s."
EPILOG = ("Example: dsv4 bench --chunk 8 --query-chunk 256 --seq 1024,4096,32768    |    "
          "dsv4 bench --shape tiny --seq 64 --json    |    dsv4 bench --train --seq 256,1024 --batch 1,4 --stage sparse"
          "    |    dsv4 bench --train --profile")

Chunk = Annotated[Optional[int], typer.Option("--chunk", min=0, help="Heads per scan step in the chunked paths (divides H and HI; 0 = off; default H/8, i.e. 8 at flash shapes).", show_default=False)]
QueryChunk = Annotated[Optional[int], typer.Option("--query-chunk", min=0, help="Query positions per scan step in the query-chunked and streamed paths (0 = off; default min(256, T/4)).", show_default=False)]
Seqs = Annotated[Optional[str], typer.Option("--seq", help="Comma-separated sequence lengths T (multiples of 4 and of --query-chunk; default 1024,4096; with --train: the config's, 256).", show_default=False)]
Shape = Annotated[str, typer.Option("--shape", help="Attention shapes: flash (deepseek4-284b: H=64, D=512, indexer 64x128, top-k 512) or tiny (deepseek4-tiny).")]
Repeats = Annotated[int, typer.Option("--repeats", min=1, help="Timing rounds after one warm-up step; each round times a matmul and one step of every path (medians reported).")]
Budget = Annotated[float, typer.Option("--budget-gib", min=0, help="Memory budget in GiB; lengths whose direct path needs more are compiled only (default: device limit or available RAM).")]
Train = Annotated[bool, typer.Option("--train", help="Instead: the deepseek4-tiny training step per stage and shape (one subprocess each): tokens/s, step and compile time, XLA temp memory, peak RSS.")]
TrainSteps = Annotated[int, typer.Option("--train-steps", min=1, help="Timed training steps per shape with --train (after one untimed first step).")]
Batches = Annotated[Optional[str], typer.Option("--batch", help="With --train: comma-separated batch sizes (default: the config's, 4).", show_default=False)]
Stages = Annotated[Optional[str], typer.Option("--stage", help="With --train: comma-separated stages (pretrain, warmup, sparse; default warmup,sparse, with --profile sparse).", show_default=False)]
Profile = Annotated[bool, typer.Option("--profile", help="With --train: FLOPs of the step per component (attention, compressor, indexer, MoE, mHC, head, optimizer) for one stage and shape (default sparse 1 x 256), its measured step time and each component's measured time (jax.profiler trace of --train-steps steps).")]
NoTime = Annotated[bool, typer.Option("--no-time", help="With --profile: count FLOPs only; do not run or trace the step.")]



@handle_errors
def command(chunk: Chunk = None, query_chunk: QueryChunk = None, seq: Seqs = None, shape: Shape = "flash",
            repeats: Repeats = 3, budget_gib: Budget = 0.0, train: Train = False, train_steps: TrainSteps = 3,
            batch: Batches = None, stage: Stages = None, profile: Profile = False, no_time: NoTime = False,
            overrides: opt.Overrides = None, json_out: opt.Json = False) -> None:
    from core.bench import loss as bench

    if train or profile:
        from dsv4cli import bench_train

        bench_train.run(seq=seq, batch=batch, stage=stage, steps=train_steps, profile=profile, timed=not no_time,
                        overrides=overrides or [], json_out=json_out)
        return
    if overrides:
        from core.errors import ConfigError

        raise ConfigError(f"{overrides[0]!r}: KEY=VALUE overrides apply to the training step only; add --train.")
    seqs = display.int_list(seq or "1024,4096", "--seq", "1024,4096")
    loss_shape = bench.loss_shape(shape)
    budget = int(budget_gib * display.GIB) if budget_gib else None
    from dsv4cli.display import ProgressBar

    with ProgressBar(bench.progress_units(len(seqs), repeats), "compiling and timing", quiet=json_out) as bar:
        result = bench.run_loss_bench(loss_shape, seqs, head_chunk=chunk, query_chunk=query_chunk, repeats=repeats,
                                      budget_bytes=budget, on_progress=lambda label: bar.advance(description=label))
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _render_loss(display.console(), result.to_dict())


def _render_loss(console, r: dict[str, Any]) -> None:
    from rich.table import Table

    s = r["shape"]
    console.print(f"[bold]CSA indexer loss, fwd+bwd[/bold]  {s['name']} ({s['model']}): B={s['batch']} H={s['heads']} "
                  f"D={s['head_dim']} indexer {s['indexer_heads']}x{s['indexer_head_dim']} top-k {s['topk']}  ·  "
                  f"chunks: {r['head_chunk']} heads, {r['query_chunk'] or 'min(256, T/4)'} queries  ·  {r['device']}")
    matmuls = ", ".join(f"{row['matmul_gflops']:.1f}" for row in r["seqs"])
    console.print(f"f32 matmul {matmuls} GFLOP/s  ·  memory budget {r['budget_bytes'] / display.GIB:.1f} GiB  ·  median of "
                  f"{r['repeats']} round-robin rounds (each: the matmul, then one step of every path) after a warm-up")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for title in ("T", "path", "heads/q", "compile", "step", "vs direct", "XLA temp", "|Δloss|", "|Δgrad|", "GFLOP/s", "% matmul"):
        table.add_column(title, justify="left" if title == "path" else "right")
    for row in r["seqs"]:
        for v in row["variants"]:
            table.add_row(
                str(row["seq"]), v["variant"], f"{v['head_chunk'] or '-'}/{v['query_chunk'] or '-'}",
                f"{v['compile_s']:.1f}s", display.fmt_value(v["step_s"], ".3f", "compile only") + ("s" if v["ran"] else ""),
                display.fmt_value(v["speed_vs_direct"], ".2f") + ("x" if v["ran"] else ""), display.fmt_bytes(v["temp_bytes"]),
                display.fmt_value(v["loss_abs_diff"], ".1e"), display.fmt_value(v["grad_abs_diff"], ".1e"), display.fmt_value(v["gflops"], ".1f"),
                display.fmt_value(None if v["matmul_share"] is None else 100 * v["matmul_share"], ".0f"))
    console.print(table)
    for row in r["seqs"]:
        if not row["fits"]:
            console.print(f"T={row['seq']}: the direct path needs {display.fmt_bytes(row['direct_bytes'])} > the budget, so every "
                          "path was compiled (XLA temp reported) but not run.")
