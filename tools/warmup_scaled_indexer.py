"""`dsv4 warmup --init-from SRC` with every indexer's weights_proj multiplied by SCALE after loading.

    .venv/bin/python tools/warmup_scaled_indexer.py SRC OUTPUT STEPS SCALE [KEY=VALUE ...]

SCALE 0 is the warm-up from an indexer with weights_init="zeros" (core.indexer.Indexer): the
pre-training stage never reads or trains the indexer, so its checkpoint with weights_proj zeroed
is what a pre-training with that init would have written. Prints step, indexer_loss, grad_norm,
step time every 10 steps; OUTPUT is an ordinary warm-up run (dsv4 eval-indexer OUTPUT).
Figures: docs/benchmarks.md, issue 11.
"""
import sys, json
from pathlib import Path
import jax, jax.numpy as jnp
from flax import nnx
from core.config import load_config
from core.train import Trainer

init_from, out, steps, wp_scale = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
overrides = sys.argv[5:]
cfg = load_config("deepseek4-tiny", overrides, stage="warmup", options={"steps": steps})
tr = Trainer(cfg, stage="warmup", run_dir=Path(out), init_from=init_from)
model, opt = nnx.merge(tr.graphdef, tr.state)
n = 0
for path, node in nnx.iter_graph(model):
    if path and path[-1] == "indexer":
        node.weights_proj[...] = node.weights_proj[...] * wp_scale
        n += 1
print("rescaled", n, "indexers by", wp_scale, flush=True)
tr.graphdef, tr.state = nnx.split((model, opt))
for row in tr.run():
    if row["step"] % 10 == 0 or row["step"] == steps - 1:
        print(row["step"], f"{row['indexer_loss']:.7f}", f"{row.get('grad_norm', 0):.3e}", f"{row['step_time_s']:.2f}", flush=True)
