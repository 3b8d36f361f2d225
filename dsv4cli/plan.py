"""`dsv4 plan`: will a training run fit on a target, and how fast might it go (the step compiled ahead of time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from dsv4cli import display
from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

HELP = ("Plan a training run: compile the training command's own step ahead of time for a TPU slice, NVIDIA GPUs "
        "or fake CPU devices, and report per device the exact state bytes, the compiler's temporaries and code, "
        "the verdict against the usable memory, the largest temporaries, FLOPs and a step-time estimate. "
        "Exit codes: 0 fits, 1 does not fit, 2 bad input (unknown target, a mesh that does not divide, "
        "a missing extra: pip install \"dsv4\\[tpu]\" or \"dsv4\\[cuda]\"). With --search: every mesh "
        "(data x fsdp x tensor x expert over ici, and dcn across slices) and per-device batch the model's sharding allows, "
        "pruned on exact state bytes, the rest compiled one by one and cached, a table of those that fit by estimated "
        "tokens/s; exit 0 if any fits, 1 if none.")
EPILOG = ("Example: dsv4 plan --target cpu:8 ici_fsdp_parallelism=-1    |    "
          "dsv4 plan --model deepseek4-284b --stage warmup --target v5p-128 ici_fsdp_parallelism=-1 --top 5    |    "
          "dsv4 plan --model deepseek4-284b --stage warmup --target v5p-128 --search ici_tensor_parallelism=1")

Target = Annotated[str, typer.Option("--target", "-t", help="v4-N, v5e-N, v5p-N, v6e-N (MaxText's TPU names), h100xN, h200xN, b200xN (8 per host) or cpu:N.")]
Stage = Annotated[str, typer.Option("--stage", help="The training command whose step is planned: pretrain, warmup or sparse; or eval, the step of dsv4 eval-indexer.")]
Top = Annotated[int, typer.Option("--top", min=0, help="How many of the largest temporaries to list.")]
Search = Annotated[bool, typer.Option("--search", help="Search the meshes and per-device batches (ici_*, dcn_*, per_device_batch_size given as overrides stay fixed).")]
MaxBatch = Annotated[int, typer.Option("--max-batch", help="--search: the largest per-device batch tried (1, 2, 4, ... up to it).")]
Cache = Annotated[Path, typer.Option("--cache", help="--search: a directory with one JSON per candidate; a rerun reads them instead of compiling.")]
CompileTimeout = Annotated[float, typer.Option("--compile-timeout", help="--search: seconds each compile may take (a full-size TPU compile takes ~3.5 min here).")]


@handle_errors
def command(target: Target, overrides: opt.Overrides = None, model: opt.Model = "deepseek4-tiny", stage: Stage = "sparse",
            config: opt.ConfigFile = None, top: Top = 5, json_out: opt.Json = False, search: Search = False,
            max_batch: MaxBatch = 8, cache: Cache = Path("runs/plan-cache"), compile_timeout: CompileTimeout = 900.0,
            batch_rows: opt.BatchRows = None) -> None:
    from core.config.files import STAGES
    from core.errors import ConfigError
    from core.plan import compile as plan_compile

    if stage not in (*STAGES, plan_compile.EVAL):
        raise ConfigError(f"--stage {stage!r}: use one of {', '.join(STAGES)}, {plan_compile.EVAL}.")
    plan_compile.check_eval_batch(stage, overrides or [], batch_rows)
    if search and stage == plan_compile.EVAL:
        raise ConfigError("--search plans training steps: drop --search, or plan --stage eval on a mesh you give (ici_*=...).")
    if search:
        from dsv4cli import plan_search

        raise typer.Exit(plan_search.run(model, stage, target, overrides or [], config_file=None if config is None else str(config),
                                         max_batch=max_batch, cache=cache, timeout_s=compile_timeout, top=top, json_out=json_out))
    def started() -> None:
        if not json_out:
            display.console().print(f"[dim]compiling {model} {stage} for {target} (a TPU compile of a full-size "
                                    "model takes minutes, a GPU one 5-15 here)...[/dim]")

    result = plan_compile.plan(model, stage, target, overrides or [], config_file=None if config is None else str(config),
                               top=top, batch_rows=batch_rows, on_start=started)
    typer.echo(json.dumps(result, indent=2)) if json_out else render(display.console(), result)
    raise typer.Exit(0 if result["fits"] else 1)


def _bytes(n: Any) -> str:
    return "-" if n is None else display.fmt_bytes(n)


def render(console, r: dict[str, Any]) -> None:
    """The plan as a table per device, the verdict, the largest temporaries and the estimate."""
    from rich.table import Table

    mesh = " x ".join(f"{a} {n}" for a, n in r["mesh"].items() if n > 1) or "single device"
    console.print(f"[bold]{r['model']} {r['stage']} step on {r['target']}[/bold]  ·  {r['devices']} {r['platform']} "
                  f"devices, mesh {mesh}  ·  batch {r['per_device_batch_size']} x {r['max_target_length']} per device"
                  + (f"  ·  remat {r['remat_policy']}" if r.get("remat_policy") else ""))
    d = r["per_device"]
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
    table.add_column("per device")
    table.add_column("bytes", justify="right")
    table.add_column("from")
    rows = (("parameters, trainable", d["trainable_parameter_bytes"], "shapes and shardings (exact)"),
            ("parameters, frozen", d["frozen_parameter_bytes"], "shapes and shardings (exact)"),
            ("router biases, other model state", d["other_model_bytes"], "shapes and shardings (exact)"),
            ("optimizer state", d["optimizer_bytes"], "shapes and shardings (exact)"),
            ("batch", d["batch_bytes"], "shapes and shardings (exact)"),
            ("arguments", d["argument_bytes"], "the compiler"), ("temporaries", d["temp_bytes"], "the compiler"),
            ("generated code", d["code_bytes"], "the compiler"), ("total", d["total_bytes"], "the compiler"),
            ("usable", d["usable_bytes"], r["usable_rule"]))
    for name, value, source in rows:
        table.add_row(name, _bytes(value), source)
    console.print(table)
    if r.get("eval_programs"):  # --stage eval: two programs, one after the other
        temps = ", ".join(f"{part} {_bytes(n)}" for part, n in r["eval_programs"].items())
        console.print(f"eval-indexer runs two programs one after the other (temporaries: {temps}); the table is the "
                      f"{r['eval_program']} one's, the larger")
    if r.get("refused"):
        console.print(f"[red]does not fit[/red]: the compiler refused the step: {r['refused']['message']}")
    elif r["fits"]:
        console.print(f"[green]fits[/green]: headroom {_bytes(r['headroom_bytes'])}"
                      + (" (approximate: fake CPU devices)" if r["approximate"] else ""))
    else:
        console.print(f"[red]does not fit[/red]: {_bytes(-r['headroom_bytes'])} over the usable memory")
    if r["top_temporaries"]:
        top = Table(box=None, pad_edge=False, header_style="bold")
        for title in ("largest temporaries", "bytes", "shape", "component"):
            top.add_column(title, justify="right" if title == "bytes" else "left")
        for t in r["top_temporaries"]:
            top.add_row(t.get("instruction") or t.get("op_name", "")[-60:], _bytes(t["bytes"]), t["shape"], t["component"])
        console.print(top)
    _estimate(console, r)


def _estimate(console, r: dict[str, Any]) -> None:
    if r.get("flops_per_step") is None:
        return
    gf = lambda key: "none" if r.get(key) is None else f"{r[key] / 1e9:.2f}"  # noqa: E731
    console.print(f"FLOPs per step per device: {r['flops_per_step'] / 1e9:.2f} GFLOP of matmuls in the compiled "
                  f"program, loops counted (analytic: {gf('analytic_matmul_flops_per_device')} GFLOP of matmuls, "
                  f"{gf('analytic_flops_per_device')} in all; XLA's cost analysis: {gf('xla_cost_analysis_flops')}, "
                  "each loop body once)")
    if r.get("flops_rule"):
        console.print(f"[dim]{r['flops_rule']}[/dim]")
    if r.get("collective_bytes"):
        moved = ", ".join(f"{axis} {_bytes(n)}" for axis, n in sorted(r["collective_bytes"].items()))
        console.print(f"collectives per step per device, by mesh axis: {moved}")
    parts = r.get("step_estimate")
    if isinstance(parts, dict):
        mfu = "" if r.get("model_mfu") is None else (
            f", model MFU {100 * r['model_mfu']:.1f} % ({r['model_tflops_per_device']:.1f} TFLOP/s of model FLOPs "
            "per device)")
        console.print(f"estimated step {r['estimated_step_s']:.4f} s, {r['estimated_tokens_per_s']:,.0f} tokens/s{mfu} "
                      f"(matmul-bound {parts['compute_s']:.4f} s, memory-bound {parts['memory_s']:.4f} s, gathers "
                      f"{parts['gather_s']:.4f} s, per-op overhead {parts['overhead_s']:.4f} s, copy waits "
                      f"{parts['dma_wait_s']:.4f} s, collectives {parts['collective_s']:.4f} s); {parts['model']}")
        if rows := parts.get("ragged_rows"):
            console.print(f"[dim]grouped matmuls priced at {rows['priced_rows']:,} rows, not their buffers' "
                          f"{rows['static_rows']:,}: {rows['rule']}[/dim]")
    elif parts:
        console.print(parts)


if __name__ == "__main__":  # python -m dsv4cli.plan ... (the command before dsv4cli/main.py registers it)
    from core.process import tune_garbage_collector

    tune_garbage_collector()
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(help=HELP, epilog=EPILOG)(command)
    app()
