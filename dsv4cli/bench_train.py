"""`dsv4 bench --train` and `--profile`: the training-step sweep and per-component FLOPs, rendered."""

from __future__ import annotations

import json
from typing import Any

import typer

from dsv4cli import display


def run(*, seq: str | None, batch: str | None, stage: str | None, steps: int, profile: bool, timed: bool,
        overrides: list[str], json_out: bool) -> None:
    from core.bench import train as bench_train
    from core.config.files import STAGES
    from core.config.schema import load_config
    from core.errors import ConfigError, DsvError

    if stage is None:
        stage = "sparse" if profile else "warmup,sparse"
    stages = [s.strip() for s in stage.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise ConfigError(f"--stage {stage!r}: use one or more of {', '.join(STAGES)}, comma-separated.")
    if profile:
        seqs, batches = display.int_list(seq or "256", "--seq", "256"), display.int_list(batch or "1", "--batch", "1")
        if len(seqs) > 1 or len(batches) > 1 or len(stages) > 1:
            raise ConfigError("--profile takes one shape: give one --stage, one --seq and one --batch.")
        result = bench_train.profile_step(stages[0], seqs[0], batches[0], steps=steps, timed=timed,
                                          overrides=overrides)
        if "error" in result:  # the measuring child failed (out of memory, a device another process holds)
            raise DsvError(f"bench --profile: the step's process failed: {result['error']}")
        typer.echo(json.dumps(result, indent=2)) if json_out else render_profile(display.console(), result)
        return
    defaults = load_config("deepseek4-tiny", overrides)
    seqs = display.int_list(seq or str(defaults.max_target_length), "--seq", "256,1024")
    batches = display.int_list(batch or str(defaults.per_device_batch_size), "--batch", "1,4")
    from dsv4cli.display import ProgressBar

    with ProgressBar(len(stages) * len(seqs) * len(batches), "shapes", quiet=json_out) as bar:
        result = bench_train.run_train_sweep(stages, seqs, batches, steps=steps, overrides=overrides,
                                             on_progress=lambda label: bar.advance(description=label))
    typer.echo(json.dumps(result, indent=2)) if json_out else render_sweep(display.console(), result)


def render_sweep(console, r: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(f"[bold]{r['model']} training step[/bold]  ·  one subprocess per shape  ·  median of {r['steps']} "
                  "steps after the first  ·  XLA temp: compiled memory analysis  ·  peak RSS: that process's max RSS")
    metric = {key: fmt for key, _, fmt in display.METRIC_COLUMNS}
    titles = ("stage", "B x T", "tokens/s", "step", "TFLOP/s/dev", "MFU", "compile", "first step", "XLA temp",
              "peak RSS", "lm_loss")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for title in titles:
        table.add_column(title, justify="left" if title == "stage" else "right")
    for row in r["rows"]:
        shape = f"{row['batch']} x {row['seq']}"
        if "error" in row:
            table.add_row(row["stage"], shape, row["error"], *[""] * (len(titles) - 3))
            continue
        table.add_row(row["stage"], shape, f"{row['tokens_per_s']:.1f}", f"{row['step_time_s']:.3f}s",
                      metric["tflops_per_device"].format(row["tflops_per_device"]), metric["mfu"].format(row["mfu"]),
                      f"{row['compile_s']:.1f}s", f"{row['first_step_s']:.2f}s", display.fmt_bytes(row["temp_bytes"]),
                      f"{row['peak_rss_bytes'] / display.GIB:.2f} GiB", display.fmt_value(row["last"].get("lm_loss"), ".3f"))
    console.print(table)
    peaks = {(row["peak_source"], row["peak_flops"]) for row in r["rows"] if "peak_source" in row}
    if peaks:
        console.print("TFLOP/s/dev: the step's model FLOPs (docs/benchmarks.md#how-mfu-is-counted) per second and device; "
                      "MFU: that over the peak, " + "; ".join(f"{peak / 1e12:.3g} TFLOP/s ({source})" for source, peak in sorted(peaks)))


def render_profile(console, r: dict[str, Any]) -> None:
    from rich.table import Table

    measured, ceiling = r.get("measured") or {}, r.get("matmul_gflops")
    total, timed = r["total_flops"], (r.get("measured") or {}).get("time")
    console.print(f"[bold]{r['model']} {r['stage']} step, {r['batch']} x {r['seq']}: FLOPs per component[/bold]  "
                  f"(counted from the step's jaxpr, backward and remat included)")
    table = Table(box=None, pad_edge=False, header_style="bold")
    titles = ("component", "matmul GFLOP", "other GFLOP", "share", "MFLOP/token", "at ceiling", "model GFLOP")
    for title in titles + (("time", "time share", "GFLOP/s") if timed else ()):
        table.add_column(title, justify="left" if title == "component" else "right")
    for name, c in r["components"].items():
        flops = c["matmul_flops"] + c["other_flops"]
        cells = [name, f"{c['matmul_flops'] / 1e9:.3f}", f"{c['other_flops'] / 1e9:.3f}",
                 f"{100 * flops / total:.1f}%", f"{flops / r['tokens_per_step'] / 1e6:.1f}",
                 display.fmt_value(None if not ceiling else c["matmul_flops"] / ceiling / 1e9, ".3f") + ("s" if ceiling else ""),
                 display.fmt_value(None if name not in r["model_flops"] else r["model_flops"][name] / 1e9, ".3f")]
        if timed:
            seconds = timed["components"][name]
            cells += [f"{seconds:.3f}s", f"{100 * seconds / max(timed['op_s'], 1e-12):.1f}%",
                      display.fmt_value(flops / seconds / 1e9 if seconds > 0 else None, ".1f")]
        table.add_row(*cells)
    console.print(table)
    console.print(f"total {total / 1e9:.2f} GFLOP ({total / r['tokens_per_step'] / 1e6:.1f} MFLOP/token); XLA cost "
                  f"analysis of the compiled step: {r['xla_flops'] / 1e9:.2f} GFLOP; XLA temp {display.fmt_bytes(r['temp_bytes'])}")
    model = r["model_flops"]
    console.print(f"model FLOPs (analytic, docs/benchmarks.md#how-mfu-is-counted: matmuls of the model, attended area, "
                  f"no remat): {model['total'] / 1e9:.2f} GFLOP ({model['total'] / model['tokens'] / 1e6:.1f} MFLOP/token)")
    if "error" in measured:
        console.print(f"measured step: {measured['error']}")
    elif measured:
        matmul = sum(c["matmul_flops"] for c in r["components"].values())
        console.print(f"measured step {measured['step_time_s']:.3f}s ({measured['tokens_per_s']:.1f} tokens/s, "
                      f"{total / measured['step_time_s'] / 1e9:.1f} GFLOP/s); f32 matmul ceiling {ceiling:.1f} GFLOP/s: "
                      f"the matmuls alone would take {matmul / ceiling / 1e9:.3f}s")
        mfu = r["mfu"]
        console.print(f"MFU: model {mfu['model']:.1%}, compiled {mfu['compiled']:.1%} (the matmul GFLOP above: remat and "
                      f"recomputation included) of {mfu['peak_flops'] / 1e12:.3g} TFLOP/s per device ({mfu['peak_source']})")
    if timed:
        render_time(console, timed)


def render_time(console, t: dict[str, Any]) -> None:
    """The traced time's summary lines and its costliest ops (core.bench.trace.trace_step's dict)."""
    from rich.table import Table

    op_s, step = max(t["op_s"], 1e-12), "Steps line" if t["platform"] == "tpu" else "wall time"
    console.print(f"time: exclusive time of the step's XLA ops per component, jax.profiler trace of {t['steps']} "
                  f"step{'s' * (t['steps'] != 1)} on the {t['platform'].upper()}: {t['op_s']:.3f}s of ops per step against {t['traced_step_s']:.3f}s "
                  f"per traced step ({step}); {100 * (1 - t['named_share']):.1f}% in other")
    console.print(f"ops without a stack frame of their own: {t['no_frame_s']:.3f}s per step "
                  f"({100 * t['no_frame_s'] / op_s:.1f}%); after attributing them by their fused body "
                  f"({t['by_how']['body']:.3f}s) or nearest framed producers ({t['by_how']['producers']:.3f}s) "
                  f"or users ({t['by_how']['users']:.3f}s): {t['unattributed_s']:.3f}s without an owner")
    if t["other_sources"]:
        console.print("other: " + ", ".join(f"{k} {v:.3f}s" for k, v in list(t["other_sources"].items())[:5]))
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                  title=f"costliest {len(t['top_ops'])} ops (seconds per step)")
    for title in ("op", "component", "time", "share", "attributed by", "op_name"):
        table.add_column(title, justify="right" if title in ("time", "share") else "left")
    for name, component, seconds, op_name, how in t["top_ops"]:
        table.add_row(name, component, f"{seconds:.4f}s", f"{100 * seconds / op_s:.1f}%", how,
                      op_name if len(op_name) <= 60 else "..." + op_name[-57:])
    console.print(table)
