"""The indexer's gradient taken in each layer's forward (indexer_gradient: local) and the scan that
carries no weights.

- One CSA layer in float64: the local gradient of the streamed indexer loss equals autodiff through
  the layer ("backward"), in the dense warm-up and the sparse stage, for both teachers: to float32
  rounding, since the indexer scores in float32 whatever the dtype (core/ops/topk.py), and the two
  sum its gradient in different orders.
- One CSA layer in float64, the dense warm-up's chunked attention feeding the loss its teacher (one
  loss block per chunk, core/loss/indexer_kl.py `csa_indexer_loss_tap`): the loss and the
  indexer's gradient equal the streamed loss's own teacher's and autodiff's, the layer's output is
  unchanged, nothing outside the indexer gets a gradient, and the step's jaxpr lacks exactly the
  teacher's second query projection and logits.
- The whole model in the warm-up (the attention's teacher: one chunk per loss block): the loss is
  the same; every indexer gradient equals the whole-stack backward's to float32 rounding; every
  other parameter gets exactly zero.
- The compiled warm-up step of deepseek4-tiny (one CPU, 4 x 256) holds neither a stacked copy of a
  scanned segment's weights nor its layers' inputs: no temporary has the shape of a scanned
  expert stack or of the residual stream stacked over a segment's repeats, and the temporaries stay
  below what the stacked layer inputs alone took (20 MiB).
"""

from __future__ import annotations

import functools
import pytest
from tests.conftest import init_model
from tests.model.test_attention import ROWS, T, make_layer, packed, spec

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.config.schema import load_config
from core.model.attention import Attention
from core.spec.resolve import resolve


@pytest.mark.parametrize("teacher,dense", [("compressed", True), ("compressed", False), ("joint", True)])
def test_layer_local_gradient_equals_backward_float64(x64, teacher, dense):
    base, _ = make_layer(spec(4), jnp.float64, seed=11)
    state = nnx.state(base)
    pos, seg = (jnp.asarray(a) for a in packed(ROWS, T))
    x = jax.random.normal(jax.random.key(5), (2, T, 16), jnp.float64)
    grads = {}
    for how in ("local", "backward"):
        s = spec(4, loss_scale=0.1, teacher=teacher, query_chunk=8, indexer_gradient=how)
        layer = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Attention(s, rngs=nnx.Rngs(0)))), state)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(p):
            _, aux = nnx.merge(graphdef, p, rest)(x, pos, seg, dense=dense, indexer_loss=True)
            return 3.0 * aux["indexer_loss"]  # a cotangent other than 1 reaches the surrogate

        value, g = jax.jit(jax.value_and_grad(loss))(params)
        grads[how] = float(value), {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(g)}
    (va, ga), (vb, gb) = grads["local"], grads["backward"]
    assert va > 0
    np.testing.assert_allclose(va, vb, rtol=1e-12)
    assert ga.keys() == gb.keys()
    for k in ga:
        if "indexer" in k:
            assert np.any(gb[k] != 0), k
            np.testing.assert_allclose(ga[k], gb[k], rtol=1e-5, atol=1e-5 * np.abs(gb[k]).max(), err_msg=k)
        else:  # nothing outside the indexer: exactly zero either way
            assert not np.any(ga[k]) and not np.any(gb[k]), k


def _layer_grads(teacher: str, **kw):
    """(3 x the indexer loss, {parameter: gradient}, the output, the jaxpr's matmul FLOPs per component) of
    test_attention's CSA layer on the packed rows in float64, dense."""
    from core.bench.train import jaxpr_flops, live_jaxpr

    state = nnx.state(make_layer(spec(4), jnp.float64, seed=11)[0])
    pos, seg = (jnp.asarray(a) for a in packed(ROWS, T))
    x = jax.random.normal(jax.random.key(5), (2, T, 16), jnp.float64)
    s = spec(4, loss_scale=0.1, teacher=teacher, attention_chunk=8, **kw)
    layer = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Attention(s, rngs=nnx.Rngs(0)))), state)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(p):
        out, aux = nnx.merge(graphdef, p, rest)(x, pos, seg, dense=True, indexer_loss=True)
        return 3.0 * aux["indexer_loss"], out

    fn = jax.value_and_grad(loss, has_aux=True)
    (value, out), g = jax.jit(fn)(params)
    flops = {c: f["matmul_flops"] for c, f in jaxpr_flops(live_jaxpr(jax.make_jaxpr(fn)(params))).items()}
    grads = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(g)}
    return float(value), grads, np.asarray(out), flops


@pytest.mark.parametrize("teacher", ["compressed", "joint"])
def test_attention_fed_teacher_equals_the_losses_own_float64(x64, teacher):
    fed = _layer_grads(teacher, query_chunk=0)  # blocks of the chunk's 8 rows: the attention's logits
    hd, rows, w = 4 * 8, 2 * T, T // 4
    for how, query_chunk in (("local", 4), ("backward", 0)):
        value, grads, out, flops = _layer_grads(teacher, query_chunk=query_chunk, indexer_gradient=how)
        np.testing.assert_allclose(fed[0], value, rtol=1e-6)
        np.testing.assert_array_equal(fed[2], out)
        assert fed[1].keys() == grads.keys()
        for k, g in grads.items():
            if "indexer" in k:
                assert np.any(g != 0), k
                np.testing.assert_allclose(fed[1][k], g, rtol=1e-5, atol=1e-5 * np.abs(g).max(), err_msg=k)
            else:  # nothing outside the indexer: exactly zero either way
                assert not np.any(fed[1][k]) and not np.any(g), k
        # the loss's own teacher: the queries c_q W_qb and the logits over every block again (joint: every raw key)
        again = 2 * rows * 8 * hd + 2 * rows * w * hd + (2 * rows * T * hd if teacher == "joint" else 0)
        assert flops["indexer"] + flops["attention"] - again == fed[3]["indexer"] + fed[3]["attention"], (flops, fed[3])
        assert {c: f for c, f in flops.items() if c not in ("indexer", "attention")} == \
            {c: f for c, f in fed[3].items() if c not in ("indexer", "attention")}


CFG = ["vocab_size=512", "sliding_window_size=8", "first_num_hash_layers=1", "hc_sinkhorn_iters=3",
       "compress_ratios=[0,4,4,4,4,4]", "base_num_decoder_layers=6", "max_target_length=32",
       "attention_query_chunk_size=8", "indexer_topk=4"]


@functools.lru_cache(maxsize=None)
def _warmup_grads(how: str):
    cfg = load_config("deepseek4-tiny", CFG + [f"indexer_gradient={how}"], stage="warmup")
    model = init_model(cfg.replace(indexer_weights_init="fan_in"), 3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(7), (2, 32), 0, 512)
    pos = jnp.stack([jnp.arange(32), jnp.concatenate([jnp.arange(18), jnp.arange(14)])]).astype(jnp.int32)
    seg = jnp.stack([jnp.ones(32), jnp.concatenate([jnp.ones(18), 2 * jnp.ones(14)])]).astype(jnp.int32)

    def loss(p):
        _, aux = nnx.merge(graphdef, p, rest, copy=True).hidden(tokens, pos, seg, mode="train")
        return aux["indexer_loss"]

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)}


def test_warmup_local_gradient_equals_whole_stack_backward():
    (va, ga), (vb, gb) = _warmup_grads("local"), _warmup_grads("backward")
    assert va > 0
    np.testing.assert_allclose(va, vb, rtol=1e-6)
    assert ga.keys() == gb.keys()
    scale = max(float(np.abs(g).max()) for g in gb.values())
    indexer = [k for k in ga if "indexer" in k]
    assert indexer and all(np.any(gb[k] != 0) for k in indexer)
    for k in ga:
        if k in indexer:
            assert float(np.abs(ga[k] - gb[k]).max()) <= 1e-6 * scale, k
        else:
            assert not np.any(ga[k]), k


def test_compiled_warmup_keeps_no_stacked_weights_nor_layer_inputs():
    """Before: 79.7 MiB of temporaries, of which six 5 MiB stacked copies of the scanned experts
    (nnx.scan returned every variable) and two 20 MiB stacks of the segment's layer inputs (the
    backward through the stack); now 15.4 MiB. Either regression alone passes the bound."""
    from core.model.transformer import layer_plan
    from core.parallel.mesh import make_mesh
    from core.train.program import lowered_step

    cfg = load_config("deepseek4-tiny", [], stage="warmup")
    mesh = make_mesh(cfg)
    compiled = lowered_step(resolve(cfg, "cpu", mesh.shape), mesh)[0].compile()
    reps = max(r for _, _, r in layer_plan(resolve(cfg, "cpu").model.blocks, True))
    b, t, n, m = cfg.per_device_batch_size, cfg.max_target_length, cfg.mhc_expansion_rate, cfg.emb
    stacked_inputs = reps * b * t * n * m * 4                             # 20 MiB
    stacked_experts = 6 * reps * cfg.num_experts * m * cfg.moe_mlp_dim * 4   # w1, w2, w3 of both unit layers: 30 MiB
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < min(stacked_inputs, stacked_experts), (temp, stacked_inputs, stacked_experts)
