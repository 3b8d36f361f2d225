"""`dsv4 plan --search`: the progress bar over the compiles, the table of what fits, the best (dsv4cli/plan.py's half)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Sequence

import typer

from dsv4cli import display

COMPILE_NOTE = "a full-size TPU compile takes ~3.5 min here, a GPU one 30-45 s"


def run(model: str, stage: str, target: str, overrides: Sequence[str], *, config_file: str | None, max_batch: int,
        cache: Path, timeout_s: float, top: int, json_out: bool) -> int:
    """Search, print the table (or the JSON list of candidates), and return the exit code: 0 if any fits."""
    from core.plan.search import search

    with contextlib.ExitStack() as stack:
        bars: dict[str, display.ProgressBar] = {}

        def progress(done: int, total: int, what: str) -> None:
            if "bar" not in bars:
                bars["bar"] = stack.enter_context(display.ProgressBar(total, "compiles", console=display.console(stderr=True), quiet=json_out))
            bars["bar"].update(done, description=what if done == total else f"{what} · {total - done} left · {COMPILE_NOTE}")

        result = search(model, stage, target, overrides, config_file=config_file, max_batch=max_batch, cache_dir=cache,
                        timeout_s=timeout_s, top=top, progress=progress)
    if json_out:
        typer.echo(json.dumps(result["candidates"], indent=2))
    else:
        render(display.console(), result)
    return 0 if result["best"] else 1


def mesh_text(rec: dict[str, Any]) -> str:
    """'fsdp 16 x expert 4 (dcn 2)': the axes over 1, with their dcn part."""
    axes = [f"{a} {n}" + (f" (dcn {rec['dcn'][a]})" if rec["dcn"][a] > 1 else "") for a, n in rec["mesh"].items() if n > 1]
    return " x ".join(axes) or "single device"


def _rate(rec: dict[str, Any]) -> str:
    if rec["estimated_tokens_per_s"]:
        return f"{rec['estimated_tokens_per_s']:,.0f}"
    return "-" if rec["rank_value"] is None else f"{rec['rank_value'] * 1e9:,.1f}"


def render(console, result: dict[str, Any]) -> None:
    """The candidates that fit, best first; the counts; the best with its overrides; the failures."""
    from rich.markup import escape
    from rich.table import Table

    cands, counts = result["candidates"], result["counts"]
    console.print(f"[bold]{result['model']} {result['stage']} step on {result['target']}[/bold]  ·  {result['devices']} "
                  f"{result['platform']} devices, T {result['max_target_length']}  ·  {counts['candidates']} "
                  f"candidate{'s' * (counts['candidates'] != 1)}, "
                  f"ranked by {result['ranked_by']}")
    cpu = result["platform"] == "cpu"
    table = Table(box=None, pad_edge=False, header_style="bold")
    for title in ("#", "mesh", "batch", "state", "total per device", "headroom", "tokens/GFLOP" if cpu else "est. tokens/s"):
        table.add_column(title, justify="left" if title == "mesh" else "right")
    for i, rec in enumerate(r for r in cands if r["status"] == "fits"):
        table.add_row(str(i + 1), mesh_text(rec), str(rec["per_device_batch_size"]), display.fmt_bytes(rec["state_bytes"]),
                      display.fmt_bytes(rec["total_bytes"]), display.fmt_bytes(rec["headroom_bytes"]), _rate(rec))
    if counts["fits"]:
        console.print(table)
    console.print(f"fits {counts['fits']} · does not fit {counts['does not fit']} · pruned {counts['pruned']} (state "
                  f"alone over the usable {display.fmt_bytes(result['usable_bytes'])}, or a smaller batch on the mesh does "
                  f"not fit) · failed {counts['failed']}  ·  compiled now {counts['compiled']}, from the cache {counts['cached']}")
    best = result["best"]
    if best is not None:
        console.print(f"[green]best[/green]: {mesh_text(best)}, batch {best['per_device_batch_size']} per device "
                      f"({_rate(best)} {'tokens/GFLOP' if cpu else 'tokens/s, estimated'}); its overrides: "
                      f"{escape(' '.join(best['overrides']))}")
    else:
        console.print("[red]nothing fits[/red]: shard further (fsdp, expert), lower the batch or "
                      "max_target_length, or use a larger target")
    for rec in [r for r in cands if r["status"] == "failed"][:5]:
        console.print(f"[dim]failed: {mesh_text(rec)}, batch {rec['per_device_batch_size']}: {escape(str(rec['reason']))}[/dim]")
