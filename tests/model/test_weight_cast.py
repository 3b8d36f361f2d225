"""core/model/moe.py's `cast_per_layer`: the routed experts' float32 -> bfloat16 weight cast, run as
integer arithmetic so that XLA:TPU cannot hoist it out of a scan of layers.

- On the CPU: bit for bit `astype`'s (normal, subnormal, halfway, overflowing and non-finite values),
  with `astype`'s gradient, and the MoE layer reads its expert weights through it.
- Compiled for a v5e (libtpu's compile-only client, in a child process; skipped without libtpu): the
  gradient of a remat'd scan of layers over stacked float32 weights. With `astype` the program holds a
  convert of the whole stack (the hoist, so the check can fail); with `cast_per_layer` none, and its
  temporaries are smaller by at least that stack's bf16 bytes.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core.model import moe



def _bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


def test_cast_is_astype_bit_for_bit_with_its_gradient():
    scale = 10.0 ** jax.random.randint(jax.random.key(1), (20000,), -40, 39).astype(jnp.float32)
    x = jnp.concatenate([jax.random.normal(jax.random.key(0), (20000,)) * scale,
                         jnp.array([jnp.inf, -jnp.inf, 3.4e38, -3.4e38, 0.0, -0.0, 1e-40, -3e-39,
                                    1.00390625, 1.01171875, 1.0 + 2.0 ** -8 + 2.0 ** -20], jnp.float32)])
    got, want = moe.cast_per_layer(x, jnp.bfloat16), x.astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    mismatch = np.flatnonzero(_bits(got) != _bits(want))
    assert mismatch.size == 0, f"{mismatch.size} values differ, e.g. {np.asarray(x)[mismatch[:3]]}"
    assert bool(jnp.isnan(moe.cast_per_layer(jnp.array([jnp.nan, -jnp.nan]), jnp.bfloat16)).all())

    def loss(cast):
        return lambda w: jnp.sum(jnp.sin(cast(w).astype(jnp.float32)) * jnp.arange(w.size, dtype=jnp.float32))

    w = x[:512] / scale[:512]
    g_got = jax.grad(loss(lambda v: moe.cast_per_layer(v, jnp.bfloat16)))(w)
    g_want = jax.grad(loss(lambda v: v.astype(jnp.bfloat16)))(w)
    assert g_got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g_got), np.asarray(g_want))
    same = jnp.ones((3,), jnp.float32)
    assert moe.cast_per_layer(same, jnp.float32) is same


def test_moe_reads_its_expert_weights_through_the_cast():
    from flax import nnx

    spec = moe.MoESpec(emb=16, mlp=8, num_experts=4, k=2, shared=1, hash_routed=False, vocab_size=32,
                       swiglu_limit=0.0, impl="tiled", capacity_factor=0.0)
    layer = moe.MoE(spec, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(2), (1, 8, 16), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda x: layer(x, jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), bool)))(x))
    assert jaxpr.count("bitcast_convert_type") >= 6, "the three expert weights are not cast by cast_per_layer"


CHILD = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from core.model import moe
from core.plan import targets as tg

mesh = Mesh(np.array(tg.compile_devices(tg.parse_target("v5e-1"))[:1]), ("x",))
L, E, M, F = 12, 2, 1024, 1024
one = NamedSharding(mesh, PartitionSpec())
out = {}
for name, cast in (("astype", lambda w: w.astype(jnp.bfloat16)), ("cast_per_layer", lambda w: moe.cast_per_layer(w, jnp.bfloat16))):
    def body(x, w):
        w1, w2 = (cast(v) for v in w)
        return (x + jnp.einsum("etf,efm->tm", jax.nn.silu(jnp.einsum("tm,emf->etf", x, w1)), w2)).astype(x.dtype), None

    def loss(ws, x):
        y, _ = jax.lax.scan(jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable), x, ws)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    ws = (jax.ShapeDtypeStruct((L, E, M, F), jnp.float32, sharding=one), jax.ShapeDtypeStruct((L, E, F, M), jnp.float32, sharding=one))
    compiled = jax.jit(jax.grad(loss)).lower(ws, jax.ShapeDtypeStruct((1024, M), jnp.bfloat16, sharding=one)).compile()
    out[name] = {"stacked": re.findall(rf"= (bf16\[{L},[\d,]+\])[^ ]* convert\(", compiled.as_text()),
                 "temp": compiled.memory_analysis().temp_size_in_bytes}
print("__RESULT__" + json.dumps(out))
"""


@pytest.mark.slow  # libtpu's start-up and two compiles in a child process
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "dsv4[tpu]"')
def test_xla_tpu_hoists_astype_out_of_the_scan_but_not_the_cast():
    from tests.conftest import tpu_child

    out = tpu_child(CHILD, "v5e-1")
    stack = 12 * 2 * 1024 * 1024 * 2  # one weight's stack in bf16
    assert sorted(out["astype"]["stacked"]) == ["bf16[12,2,1024,1024]"] * 2, out
    assert out["cast_per_layer"]["stacked"] == [], out
    assert out["astype"]["temp"] - out["cast_per_layer"]["temp"] >= stack, out
