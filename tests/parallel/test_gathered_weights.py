"""A CSA layer's query up-projections and output projection on 8 fake CPU devices: gathered once a
layer, not once a block.

The layer's W_qb and the indexer's W_Iq are sharded over `expert` by their q_lora axis, W_oa and
W_ob by their o_lora axis (the rules). The indexer's top-k chunks and the streamed indexer loss's
blocks read the first two in a loop, the attention's chunks (`projections: chunked`) the output
projection; gathered before it (core.ops.placement.gather_weight), no step of those loops moves a
weight (a TPU ran an all-reduce of each up-projection per block, docs/planning.md#v4-flash, and in
the warm-up gathered every device's rows of a chunk for the output projection instead). The loss's
gradient of W_Iq is one pull-back over every row after the blocks (core/loss/indexer_kl_streamed.py
`_finish`), not a sum of one per block, which a mesh would reduce over the devices once a block.

The compiled program is read by core.plan.hlo (each computation's executions per call), and the
same layer's loss and gradients on the mesh are checked against one device. This pytest process
has already started JAX with one device, so the case runs in a subprocess (this very file as its
entry point, as tests/model/test_expert_parallel.py does) that prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
B, T, BLOCK = 8, 32, 8  # one row per device; four streamed-loss blocks and top-k chunks of 8 rows


@pytest.fixture(scope="module")
def worker():
    from tests.conftest import device_worker  # here: the worker runs this file as __main__, without conftest

    return device_worker(HERE, devices=8, timeout=600)


def test_no_loop_step_moves_a_projection_weight(worker):
    """Every collective on W_qb's, W_Iq's, W_oa's or W_ob's shape (or a tuple holding one) runs once
    per call, not once per block: (shape, executions) of each."""
    assert worker["weight_collectives"], "the weights are sharded, so some collective gathers them"
    per_block = [c for c in worker["weight_collectives"] if c[1] > 1]
    assert not per_block, f"collectives of the projection weights inside the block loops: {per_block}"


def test_the_mesh_equals_one_device(worker):
    """The loss and every parameter's gradient on the expert-8 mesh equal one device's (float32)."""
    assert worker["loss_rel"] < 1e-5, worker["loss_rel"]
    assert worker["grad_rel"] < 1e-4, worker["grad_rel"]


def _case() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from core.model.attention import Attention
    from core.parallel.sharding import state_shardings
    from core.plan import hlo
    from tests.model.test_attention import packed, spec

    s = spec(4, loss_scale=0.1, query_chunk=BLOCK, attention_chunk=BLOCK, indexer_gradient="local")
    layer = Attention(s, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    pos, seg = (jnp.asarray(a) for a in packed([[T], [20, 9]] * (B // 2), T))
    x = jax.random.normal(jax.random.key(1), (B, T, s.emb), jnp.float32)

    def loss(p, x):
        out, aux = nnx.merge(graphdef, p, rest)(x, pos, seg, indexer_loss=True)
        return jnp.mean(out ** 2) + aux["indexer_loss"]

    step = jax.jit(jax.value_and_grad(loss))
    want_value, want_grads = step(params, x)
    mesh = Mesh(np.array(jax.devices()).reshape(1, 1, 1, 8), ("data", "fsdp", "tensor", "expert"))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, state_shardings(params, mesh))
        x_sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("expert")))
        compiled = step.lower(sharded, x_sharded).compile()
        value, grads = compiled(sharded, x_sharded)
    module = hlo.parse(compiled.as_text())
    runs = hlo.runs(module)
    shapes = {f"[{s.q_lora_rank},{s.heads},{s.head_dim}]", f"[{s.q_lora_rank},{s.indexer_heads},{s.indexer_head_dim}]",
              f"[{s.o_groups},{s.heads * s.head_dim // s.o_groups},{s.o_lora_rank}]",
              f"[{s.o_groups * s.o_lora_rank},{s.emb}]"}
    found = [(inst.type_text, runs.get(comp, 1)) for comp, insts in module.computations.items()
             for inst in insts if inst.opcode.removesuffix("-start") in hlo._COLLECTIVES
             and any(shape in inst.type_text for shape in shapes)]
    rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))  # noqa: E731
    grad_rel = max(rel(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    return {"weight_collectives": found, "loss_rel": rel(value, want_value), "grad_rel": grad_rel}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_case()))
