"""Rich rendering of training runs: a header, a live table of steps, a closing summary, and the
one progress helper every command uses (`ProgressBar`).

On a terminal the step table updates in place (`rich.live.Live`), keeping the first step of the
session (the compile step) and the most recent ones, with a progress bar under it (steps done /
total, elapsed, ETA, tokens/s); elsewhere (CI, pipes) every step is one plain line ending in the
same progress figures. Other commands reuse `fmt_count`, `ProgressBar` and `TrainDisplay`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Mapping

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
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
# shown after COLUMNS when a row has the key: model TFLOP/s per device and MFU (core/train/flops.py over
# core/parallel/chips.py's peak)
METRIC_COLUMNS = (
    ("tflops_per_device", "TFLOP/s/dev", "{:.3g}"),
    ("mfu", "MFU", "{:.1%}"),
)
RECENT_ROWS = 15


def fmt_count(n: int) -> str:
    """12345678 -> '12.35M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    """Work done of a known total, elapsed time, ETA and an optional rate.

    On a terminal a Rich progress bar, either standalone (`with ProgressBar(...) as bar:`, transient)
    or drawn inside another live display (`renderable`); elsewhere `advance` prints one plain line
    per update (`plain_text()` gives the same figures for a caller's own line); `quiet` prints nothing.
    The ETA extrapolates from the updates after the first (which usually includes compilation).

    Args:
      total: units of work (steps, batches, timing rounds).
      label: what is counted, e.g. "steps", "eval batches".
      console: where to draw (default: stderr).
      completed: units already done (a resumed run).
      rate_unit: e.g. "tokens/s": `advance(rate=...)` shows it.
      live: draw the bar on a terminal (False: plain lines only, e.g. when a caller has its own Live).
    """

    def __init__(self, total: int, label: str, console: Console | None = None, *, completed: int = 0,
                 rate_unit: str | None = None, quiet: bool = False, live: bool | None = None):
        self.console = console or Console(stderr=True, highlight=False)
        self.total, self.label, self.done, self.rate_unit, self.quiet = total, label, completed, rate_unit, quiet
        self.rate: float | None = None
        self.is_live = (not quiet and self.console.is_terminal) if live is None else live
        self.start = time.perf_counter()
        self._first: tuple[float, int] | None = None  # (time, done) after the first update
        columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("·"),
                   TimeElapsedColumn(), TextColumn("· ETA"), TimeRemainingColumn()]
        if rate_unit:
            columns.append(TextColumn("· {task.fields[rate]}"))
        self.progress = Progress(*columns, console=self.console, transient=True)
        self.task = self.progress.add_task(label, total=total, completed=completed, rate="")

    @property
    def renderable(self):
        """The bar, to draw inside the caller's own `rich.live.Live`."""
        return self.progress.get_renderable()

    def __enter__(self) -> "ProgressBar":
        if self.is_live:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.is_live:
            self.progress.stop()

    def eta_s(self) -> float | None:
        if self._first is None or self.done <= self._first[1]:
            return None
        t0, d0 = self._first
        return (time.perf_counter() - t0) / (self.done - d0) * max(self.total - self.done, 0)

    def plain_text(self) -> str:
        eta = self.eta_s()
        text = (f"[{self.done}/{self.total} {self.label}  elapsed {_clock(time.perf_counter() - self.start)}  "
                f"ETA {'-:--:--' if eta is None else _clock(eta)}")
        return text + (f"  {self.rate:,.0f} {self.rate_unit}]" if self.rate_unit and self.rate is not None else "]")

    def advance(self, n: int = 1, *, description: str | None = None, rate: float | None = None,
                print_plain: bool = True) -> None:
        """Count `n` more units done (`description` replaces the label on the bar)."""
        self.done += n
        self.rate = rate if rate is not None else self.rate
        if self._first is None:
            self._first = (time.perf_counter(), self.done)
        fields = {"rate": f"{self.rate:,.0f} {self.rate_unit}"} if self.rate_unit and self.rate is not None else {}
        self.progress.update(self.task, completed=self.done, description=description or self.label, **fields)
        if not self.is_live and not self.quiet and print_plain:
            self.console.print(self.plain_text() + (f"  {description}" if description else ""))

    def update(self, completed: int, **kwargs: Any) -> None:
        """Set the units done to `completed` (see `advance`)."""
        self.advance(completed - self.done, **kwargs)


def columns(rows) -> tuple[tuple[str, str, str], ...]:
    """COLUMNS, then the METRIC_COLUMNS that one of `rows` has."""
    return COLUMNS + tuple(c for c in METRIC_COLUMNS if any(c[0] in row for row in rows))


def _cells(row: Mapping[str, Any], shown) -> list[str]:
    """One row's cells under the `shown` columns ("-" where the row lacks a metric column's key)."""
    cells = [fmt.format(row[key]) if key in row else "-" for key, _, fmt in shown]
    if row.get("compile"):
        cells[[key for key, _, _ in shown].index("step_time_s")] += " (compile)"
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
        self.bar: ProgressBar | None = None

    def header(self, info: Mapping[str, Any]) -> None:
        c = self.console
        c.print(f"[bold]dsv4 {info['stage']}[/bold]  model {info['model_name']}  ·  params "
                f"{info['params_total']:,} ({fmt_count(info['params_total'])}) total, "
                f"{info['params_trainable']:,} trainable  ·  "
                f"tokens/step {info['tokens_per_step']:,} ({info['batch_size']} x {info['max_target_length']})  ·  "
                f"devices {info['mesh']}")
        mfu = f"  ·  MFU over the {info['peak_source']}" if info.get("peak_source") else ""
        c.print(f"run {info['run_dir']}  ·  data {info['data']}  ·  steps {info['start_step']}..{info['steps'] - 1}{mfu}")
        if info["resumed_from"] is not None:
            c.print(f"resuming from checkpoint step {info['resumed_from']}, continuing to step {info['steps'] - 1}"
                    + ("  (--init-from ignored: the run already has checkpoints)" if info["init_from_ignored"] else ""))
        elif info["init_from"]:
            c.print(f"initialised from {info['init_from']} (step {info['init_step']}), fresh optimizer")
        for notice in info.get("notices", ()):
            c.print(f"[yellow]notice:[/yellow] {escape(notice)}")
        for warning in info.get("warnings", ()):  # e.g. a top-k that cannot bind
            c.print(f"[yellow]warning:[/yellow] {escape(warning)}")
        if info["start_step"] >= info["steps"]:
            c.print(f"nothing to do: the run already has {info['steps']} steps (raise --steps to continue)")
        self.bar = ProgressBar(info["steps"], "steps", c, completed=min(info["start_step"], info["steps"]),
                               rate_unit="tokens/s", live=self.live_mode)

    def _view(self):
        return self._table() if self.bar is None else Group(self._table(), self.bar.renderable)

    def _table(self) -> Table:
        table = Table(box=None, pad_edge=False, header_style="bold")
        rows = ([self.first] if self.first and self.first not in self.recent else []) + self.recent
        shown = columns(rows)
        for _, title, _ in shown:
            table.add_column(title, justify="right")
        for i, row in enumerate(rows):
            if i == 1 and rows[0] is self.first and row["step"] > self.first["step"] + 1:
                table.add_row(*["⋮"] + [""] * (len(shown) - 1))
            table.add_row(*_cells(row, shown))
        return table

    @contextlib.contextmanager
    def steps(self) -> Iterator["TrainDisplay"]:
        """Context for `row()` calls: a live table on a terminal, nothing otherwise."""
        if not self.live_mode:
            yield self
            return
        with Live(self._view(), console=self.console, refresh_per_second=4) as live:
            self._live = live
            try:
                yield self
            finally:
                live.update(self._table())  # the final table stays on screen, the bar goes
                self._live = None

    def row(self, row: Mapping[str, Any]) -> None:
        if self.first is None:
            self.first = row
        if self.bar is not None:
            self.bar.advance(rate=row.get("tokens_per_s"), print_plain=False)
        if not self.live_mode:
            shown = columns([row])
            line = "  ".join(f"{title} {cell}" for (_, title, _), cell in zip(shown, _cells(row, shown)))
            self.console.print(line + (f"  {self.bar.plain_text()}" if self.bar is not None else ""))
            return
        self.recent = (self.recent + [row])[-RECENT_ROWS:]
        if self._live is not None:
            self._live.update(self._view())

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


# ----------------------------------------------------------------------------- shared formatting

GIB = 2**30


def int_list(text: str, option: str, example: str) -> list[int]:
    """'256,1024' -> [256, 1024]; ConfigError naming the option otherwise."""
    from core.errors import ConfigError

    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise ConfigError(f"{option} {text!r} is not a comma-separated list of positive integers: use e.g. {option} {example}.")
    return values


def console(*, stderr: bool = False):
    """A Rich console (on stderr with `stderr`); off a terminal, one that never wraps (lines stay greppable)."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    return console if console.is_terminal else Console(stderr=stderr, highlight=False, width=1000, soft_wrap=True)


def fmt_bytes(n: float) -> str:
    """Bytes in binary units (B, KiB, MiB, GiB at most), with two decimals above a KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def fmt_value(value: Any, spec: str, missing: str = "-") -> str:
    """`value` formatted by `spec`, or `missing` for None."""
    return missing if value is None else format(value, spec)
