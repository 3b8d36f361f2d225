"""How many ragged exchanges the expert-parallel MoE (core/ops/expert_parallel.py) traces: the tokens out
and their outputs back, forward and backward, and beside the tokens their combine weights (one float32
a slot: the destination scales the hidden by them, as the one-device MoE does, so nothing at the source
needs the returned rows again in the backward). Traced on an abstract 8-device expert mesh, nothing compiled, so the
TPU's form of the exchange (`lax.ragged_all_to_all`) is what is counted. Values and gradients against
the one-device MoE: tests/model/test_expert_parallel.py.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core  # noqa: F401  (jaxprs_in_params)
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from core.model import moe
from core.ops.expert_parallel import Exchange, expert_parallel_experts
from core.model.moe import tiled_experts

B, T, M, F, E, K = 8, 16, 8, 16, 16, 2


def _exchanges(jaxpr) -> list[str]:
    """The shapes of the ragged_all_to_all results of a jaxpr, in order."""
    return [str(eqn.outvars[0].aval) for eqn in _eqns(jaxpr.jaxpr) if eqn.primitive.name == "ragged_all_to_all"]


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_the_combine_weights_travel_with_the_rows():
    """Forward: two exchanges of [rows, M] (the slots out, their outputs back) and one of the [rows]
    weights beside the slots; value and gradient (x, weights, w1, w2, w3): each once more backward, four
    of [rows, M] and two of [rows]."""
    mesh = AbstractMesh((1, 1, 1, 8), ("data", "fsdp", "tensor", "expert"), axis_types=(AxisType.Auto,) * 4)
    local = functools.partial(tiled_experts, tile=8, empty_slots=True,
                              hidden=functools.partial(moe.swiglu_hidden, limit=10.0))
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    args = (f32((B, T, M)), jax.ShapeDtypeStruct((B, T, K), jnp.int32), f32((B, T, K)), f32((E, M, F)),
            f32((E, F, M)), f32((E, M, F)))

    def loss(x, idx, weights, w1, w2, w3):
        return jnp.sum(expert_parallel_experts(x, idx, weights, w1, w2, w3, Exchange(mesh), experts=local)[0])

    with jax.sharding.use_abstract_mesh(mesh):
        forward = _exchanges(jax.make_jaxpr(loss)(*args))
        both = _exchanges(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5)))(*args))
    out, back = (s.split("[")[1].split(",")[0] for s in (forward[0], forward[2]))  # C rows out, S slots back
    assert forward == [f"float32[{out},{M}]", f"float32[{out}]", f"float32[{back},{M}]"], forward
    # backward: the rows' cotangents out and back, and the weights' gradient back to its source's slots
    assert len(both) == 6 and sum(s.endswith(f",{M}]") for s in both) == 4, both
    assert sorted(s for s in both if "," not in s) == sorted([f"float32[{out}]", f"float32[{back}]"]), both
