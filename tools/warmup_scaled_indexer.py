"""`dsv4 warmup --init-from SRC` with every indexer's weights_proj multiplied by SCALE after loading.

    .venv/bin/python tools/warmup_scaled_indexer.py SRC OUTPUT STEPS SCALE [KEY=VALUE ...]

SCALE 0 is the warm-up from an indexer with weights_init="zeros" (core.model.layers.Indexer): the
pre-training stage never reads or trains the indexer, so its checkpoint with weights_proj zeroed
is what a pre-training with that init would have written. Prints step, indexer_loss, grad_norm,
step time every 10 steps; OUTPUT is an ordinary warm-up run (dsv4 eval-indexer OUTPUT).
Figures: docs/benchmarks.md#why-the-defaults (the warm-up preset).
"""
import sys

from flax import nnx

from warmup_probe import run_edited_warmup

init_from, out, steps, wp_scale = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])


def rescale(model):
    n = 0
    for path, node in nnx.iter_graph(model):
        if path and path[-1] == "indexer":
            node.weights_proj[...] = node.weights_proj[...] * wp_scale
            n += 1
    return f"rescaled {n} indexers by {wp_scale}"


run_edited_warmup(init_from, out, steps, sys.argv[5:], rescale)
