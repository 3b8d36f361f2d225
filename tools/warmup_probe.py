"""Shared by the warm-up probes (tools/warmup_*.py): a `dsv4 warmup --init-from SRC` whose
indexers are edited in memory before step 0, then trained as the preset says.

`edit(model)` changes the merged model in place and returns the line to print. The run prints
step, indexer_loss and grad_norm every 10 steps and at the last one.
"""
from pathlib import Path
from typing import Callable

from flax import nnx

from core.config.schema import load_config
from core.train.run import Trainer


def run_edited_warmup(init_from: str, out: str, steps: int, overrides: list[str],
                      edit: Callable[[nnx.Module], str]) -> None:
    """Build the warm-up Trainer, apply `edit` to its model, then run it to `steps`."""
    cfg = load_config("deepseek4-tiny", overrides, stage="warmup", options={"steps": steps})
    tr = Trainer(cfg, stage="warmup", run_dir=Path(out), init_from=init_from)
    model, opt = nnx.merge(tr.graphdef, tr.state)
    print(edit(model), flush=True)
    tr.graphdef, tr.state = nnx.split((model, opt))
    for row in tr.run():
        if row["step"] % 10 == 0 or row["step"] == steps - 1:
            print(row["step"], f"{row['indexer_loss']:.7f}", f"{row.get('grad_norm', 0):.3e}",
                  f"{row['step_time_s']:.2f}", flush=True)
