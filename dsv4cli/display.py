"""Rich rendering of training runs: a header, a live table of steps, a closing summary.

On a terminal the step table updates in place (`rich.live.Live`), keeping the first step of the
session (the compile step) and the most recent ones; elsewhere (CI, pipes) every step is one plain
line. Other commands can reuse `fmt_count` and `TrainDisplay`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

COLUMNS = (  # (key, title, format)
    ("step", "step", "{:d}"),
    ("total_loss", "total_loss", "{:.3f}"),
    ("lm_loss", "lm_loss", "{:.3f}"),
    ("indexer_loss", "indexer_loss", "{:.4g}"),
    ("moe_lb_loss", "moe_lb_loss", "{:.3g}"),
    ("step_time_s", "step time", "{:.2f}s"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
)
RECENT_ROWS = 15


def fmt_count(n: int) -> str:
    """12345678 -> '12.35M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _cells(row: Mapping[str, Any]) -> list[str]:
    cells = [fmt.format(row[key]) for key, _, fmt in COLUMNS]
    if row.get("compile"):
        cells[5] += " (compile)"
    return cells


class TrainDisplay:
    """Header, per-step rows and summary of one `dsv4 warmup|sparse` run."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(highlight=False)
        self.live_mode = self.console.is_terminal
        if not self.live_mode:
            self.console.soft_wrap = True  # logs keep one line per message, whatever their width
        self.first: Mapping[str, Any] | None = None
        self.recent: list[Mapping[str, Any]] = []
        self._live: Live | None = None

    def header(self, info: Mapping[str, Any]) -> None:
        c = self.console
        c.print(f"[bold]dsv4 {info['stage']}[/bold]  model {info['model_name']}  ·  params "
                f"{info['params_total']:,} ({fmt_count(info['params_total'])}) total, "
                f"{info['params_trainable']:,} trainable  ·  "
                f"tokens/step {info['tokens_per_step']:,} ({info['batch_size']} x {info['max_target_length']})  ·  "
                f"devices {info['mesh']}")
        c.print(f"run {info['run_dir']}  ·  data {info['data']}  ·  steps {info['start_step']}..{info['steps'] - 1}")
        if info["resumed_from"] is not None:
            c.print(f"resuming from checkpoint step {info['resumed_from']}, continuing to step {info['steps'] - 1}"
                    + ("  (--init-from ignored: the run already has checkpoints)" if info["init_from_ignored"] else ""))
        elif info["init_from"]:
            c.print(f"initialised from {info['init_from']} (step {info['init_step']}), fresh optimizer")
        if info["start_step"] >= info["steps"]:
            c.print(f"nothing to do: the run already has {info['steps']} steps (raise --steps to continue)")
        for notice in info.get("notices", ()):
            c.print(f"[yellow]notice:[/yellow] {escape(notice)}")

    def _table(self) -> Table:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for _, title, _ in COLUMNS:
            table.add_column(title, justify="right")
        rows = ([self.first] if self.first and self.first not in self.recent else []) + self.recent
        for i, row in enumerate(rows):
            if i == 1 and rows[0] is self.first and row["step"] > self.first["step"] + 1:
                table.add_row(*["⋮"] + [""] * (len(COLUMNS) - 1))
            table.add_row(*_cells(row))
        return table

    @contextlib.contextmanager
    def steps(self) -> Iterator["TrainDisplay"]:
        """Context for `row()` calls: a live table on a terminal, nothing otherwise."""
        if not self.live_mode:
            yield self
            return
        with Live(self._table(), console=self.console, refresh_per_second=4) as live:
            self._live = live
            try:
                yield self
            finally:
                live.update(self._table())
                self._live = None

    def row(self, row: Mapping[str, Any]) -> None:
        if self.first is None:
            self.first = row
        if not self.live_mode:
            self.console.print("  ".join(f"{title} {cell}" for (_, title, _), cell in zip(COLUMNS, _cells(row))))
            return
        self.recent = (self.recent + [row])[-RECENT_ROWS:]
        if self._live is not None:
            self._live.update(self._table())

    def summary(self, summary: Mapping[str, Any], interrupted: bool = False) -> None:
        c = self.console
        first, last = summary["first"], summary["last"]
        if first and last:
            def losses(r):
                return (f"total {r['total_loss']:.4f}  lm {r['lm_loss']:.4f}  indexer {r['indexer_loss']:.5g}  "
                        f"lb {r['moe_lb_loss']:.3g}")

            c.print(f"step {first['step']}: {losses(first)}  ->  step {last['step']}: {losses(last)}")
        if interrupted:
            c.print("[yellow]interrupted[/yellow]: the last finished step was saved; rerun the same command to resume.")
        c.print(f"checkpoint {summary['checkpoint'] or '(none yet)'}  ·  metrics {summary['run_dir']}/metrics.jsonl")
