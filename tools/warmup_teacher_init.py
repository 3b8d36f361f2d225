"""Capacity probe: `dsv4 warmup --init-from SRC` with each indexer started as a copy of its teacher.

    .venv/bin/python tools/warmup_teacher_init.py SRC OUTPUT STEPS [all|keys|queries] [KEY=VALUE ...]

Only where the shapes agree (deepseek4-tiny: HI = H = 4, DI = D = 32): each CSA layer's indexer
gets the main attention's wq_b (q_I = RoPE(c_q W_qb), the teacher's queries before their per-head
RMS norm and D^-1/2) and the main compressor's wkv / wgate / ape / norm (k_I = the teacher's
compressed keys K, bitwise). weights_proj keeps the source's values (zeros after `dsv4 pretrain`:
a uniform student at step 0). So the student starts with the teacher's own q . K logits, and the
warm-up has only to learn the per-token head weights and the ReLU's cut; how far it gets in STEPS
bounds what learning the keys and queries from scratch costs the ordinary warm-up. `keys` copies
only the compressor, `queries` only wq_b (the other part keeps its random init). Not a preset:
it needs HI = H and DI = D, which no real DeepSeek-V4 has. Prints step, indexer_loss, grad_norm
every 10 steps; OUTPUT is an ordinary warm-up run (dsv4 eval-indexer OUTPUT).
Figures: docs/benchmarks.md#recipe-quality.
"""
import sys

import jax.numpy as jnp
from flax import nnx

from warmup_probe import run_edited_warmup

init_from, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rest = sys.argv[4:]
parts = rest.pop(0) if rest and rest[0] in ("all", "keys", "queries") else "all"


def teacher_init(model):
    n = 0
    for path, node in nnx.iter_graph(model):
        if path and path[-1] == "indexer":
            continue
        idx = getattr(node, "indexer", None)
        if idx is None or not hasattr(node, "compressor") or not hasattr(node, "wq_b"):
            continue
        if idx.wq_b[...].shape != node.wq_b[...].shape or idx.compressor.wkv[...].shape != node.compressor.wkv[...].shape:
            raise SystemExit("teacher init needs indexer_n_heads == heads and indexer_head_dim == head_dim")
        if parts in ("all", "queries"):  # copies: a shared buffer cannot be donated twice
            idx.wq_b[...] = jnp.copy(node.wq_b[...])
        if parts in ("all", "keys"):
            for name in ("wkv", "wgate", "ape"):
                getattr(idx.compressor, name)[...] = jnp.copy(getattr(node.compressor, name)[...])
            idx.compressor.norm.weight[...] = jnp.copy(node.compressor.norm.weight[...])
        n += 1
    return f"teacher-initialised {parts} of {n} indexer modules (a scanned segment is one)"


run_edited_warmup(init_from, out, steps, rest, teacher_init)
