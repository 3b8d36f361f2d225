"""dsv4cli/display.py's live table: the model TFLOP/s per device and MFU columns appear only for rows that carry them."""

from __future__ import annotations

import io

from rich.console import Console

from dsv4cli import display

ROW = dict(step=0, total_loss=1.0, lm_loss=0.9, indexer_loss=0.01, moe_lb_loss=4e-4, step_time_s=0.5,
           tokens_per_s=128.0, compile=False)


def _table_text(rows) -> str:
    view = display.TrainDisplay(Console(force_terminal=True, width=200))
    with view.steps():
        for row in rows:
            view.row(row)
        screen = Console(record=True, width=200, force_terminal=True)
        screen.print(view._view())
    return screen.export_text()


def test_metric_columns_show_only_with_their_keys():
    plain = _table_text([{**ROW, "step": s} for s in range(3)])
    assert "MFU" not in plain and "TFLOP/s/dev" not in plain, plain
    rows = [{**ROW, "step": s, "compile": s == 0, "tflops_per_device": 85.24, "mfu": 0.4327} for s in range(3)]
    text = _table_text(rows)
    assert "TFLOP/s/dev" in text and "MFU" in text and "85.2" in text and "43.3%" in text, text
    assert "(compile)" in text  # the step-time cell is still found by its key


def test_plain_lines_carry_the_metrics_of_their_row():
    view = display.TrainDisplay(Console(file=io.StringIO(), width=80))
    with view.steps():
        view.row({**ROW, "step": 1})
        view.row({**ROW, "step": 2, "tflops_per_device": 0.0123, "mfu": 0.051})
    first, second = view.console.file.getvalue().splitlines()
    assert "MFU" not in first and "TFLOP/s/dev 0.0123" in second and "MFU 5.1%" in second, (first, second)
