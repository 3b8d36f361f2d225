"""The expert-parallel MoE compiled for a TPU (core/ops/expert_parallel.py): deepseek4-tiny's MoE layer,
forward and backward, on a v5p-8's four chips as expert 4, through libtpu's compile-only client in a
child process (no TPU needed; skipped without libtpu).

- The exchange is XLA's ragged-all-to-all (the CPU suite runs its all_to_all form instead), the local
  experts run in the megablox kernels (moe_impl gmm, `tpu_custom_call`), and no all-gather moves an
  expert weight: every device keeps its own experts.
- The receive buffers are the capacity's rows: drop-free, the most one device can receive (P n
  min(k, E/P)); with a capacity factor of 1, n k, the mean.
"""

from __future__ import annotations

import importlib.util

import pytest

N = 256  # tokens per device

CHILD = r"""
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from core.model import moe
from core.parallel import sharding
from core.plan import targets as tg

devices = tg.compile_devices(tg.parse_target("v5p-8"))
mesh = Mesh(np.array(devices).reshape(1, 1, 1, 4), ("data", "fsdp", "tensor", "expert"), axis_types=(AxisType.Auto,) * 4)
rows, n = sharding.batch_sharding(mesh), int(sys.argv[1])
out = {}
for factor in (0.0, 1.0):
    spec = moe.MoESpec(emb=128, mlp=128, num_experts=16, k=4, shared=1, hash_routed=False, vocab_size=64,
                       swiglu_limit=10.0, impl="gmm", capacity_factor=factor)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: moe.MoE(spec, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
    args = (sharding.abstract_state(state, mesh), jax.ShapeDtypeStruct((4, n, 128), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((4, n), jnp.int32, sharding=rows), jax.ShapeDtypeStruct((4, n), jnp.bool_, sharding=rows))

    def loss(s, x, tok, valid):
        y, aux = nnx.merge(graphdef, s)(x, tok, valid)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux["lb_loss"]

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    ragged = re.findall(r"= (\w+\[[\d,]+\])[^ ]* ragged-all-to-all\(", text)
    gathers = re.findall(r"= (\w+\[[\d,]+\])[^ ]* all-gather(?:-start)?\(", text)
    out[str(factor)] = {"ragged": ragged, "gathers": gathers, "kernels": text.count('custom_call_target="tpu_custom_call"')}
print("__RESULT__" + json.dumps(out))
"""


@pytest.mark.slow  # libtpu's start-up and two compiles in a child process
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "dsv4[tpu]"')
def test_expert_parallel_moe_on_a_tpu_exchanges_ragged_and_keeps_its_experts():
    from tests.conftest import tpu_child

    out = tpu_child(CHILD, "v5p-8", str(N))
    k, m, f, local = 4, 128, 128, 4
    for factor, cap in (("0.0", 4 * N * min(k, local)), ("1.0", N * k)):
        case = out[factor]
        assert case["kernels"] > 0, f"capacity {factor}: the local experts should run in the megablox kernels"
        rows = {int(s.split("[")[1].split(",")[0]) for s in case["ragged"]}  # XLA:TPU may split a row's M
        assert cap in rows and max(rows) == cap, f"capacity {factor}: the exchange should be ragged into {cap} rows: {case}"
        weights = [s for s in case["gathers"] if s.endswith(f",{m},{f}]") or s.endswith(f",{f},{m}]")]
        assert not weights, f"capacity {factor}: expert weights gathered: {weights}"
