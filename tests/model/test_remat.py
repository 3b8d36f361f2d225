"""Remat policies in the sparse stage: same loss and gradients, and the named values are not recomputed.

The layer-body policies (core/model/transformer.py, `remat_policy`) keep SAVED_NAMES: the CSA top-k
selection, the streamed indexer loss's gradients and the MoE routing; `projections` also keeps
PROJECTION_NAMES and keeps (CPU) or offloads (TPU, GPU) each layer's input, `experts` EXPERT_NAMES. A
shrunken sparse-stage model (two scanned CSA layers, learned routing, four attention chunks of 8, indexer
loss on) must give the loss and gradients of `none` (no remat) under `full`, `projections` and `experts`
(also with the TPU's fused attention kernels, in interpret mode, and grouped experts), and the backward
must run no top-k again: the differentiated program has as many top_k as the forward.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config.schema import load_config
from core.loss.lm import lm_loss_from_hidden
from core.model.transformer import Transformer
from core.spec.resolve import resolve
from tests.conftest import init_model

CFG = ["vocab_size=512", "sliding_window_size=8", "indexer_topk=4", "first_num_hash_layers=0",
       "hc_sinkhorn_iters=3", "compress_ratios=[4,4]", "base_num_decoder_layers=2",
       "max_target_length=32", "attention_query_chunk_size=8",
       "indexer_loss_scaling_factor=0.1", "indexer_sparse_training=true"]


# the TPU's paths, run here in interpret mode: the fused kernels over the whole-sequence projections,
# the top-k as a mask, the experts as grouped matmuls (core/spec/platform.py)
TPU_PATHS = ("attention=fused", "csa_topk_attention=mask", "attention_projections=whole", "moe_impl=ragged")


@functools.lru_cache(maxsize=None)
def _params(*extra):
    cfg = load_config("deepseek4-tiny", CFG + ["remat_policy=none", *extra])
    return nnx.state(init_model(cfg, 5))


def _loss_fn(policy: str, *extra):
    """(loss function of the parameters, parameters) for a model under `policy` (shared parameters)."""
    cfg = load_config("deepseek4-tiny", CFG + [f"remat_policy={policy}", *extra])
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, _params(*extra))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(7), (2, 32), 0, 512)
    pos = jnp.stack([jnp.arange(32), jnp.concatenate([jnp.arange(18), jnp.arange(14)])]).astype(jnp.int32)
    seg = jnp.stack([jnp.ones(32), jnp.concatenate([jnp.ones(18), 2 * jnp.ones(14)])]).astype(jnp.int32)
    targets, mask = jnp.roll(tokens, -1, axis=1), jnp.ones((2, 32), jnp.int32).at[:, -1].set(0)

    def loss(p):
        m = nnx.merge(graphdef, p, rest, copy=True)
        h, aux = m.hidden(tokens, pos, seg, mode="train")
        return lm_loss_from_hidden(h, m.head[...], targets, mask, chunk=7) + aux["indexer_loss"] + aux["moe_lb_loss"]

    return loss, params


@functools.lru_cache(maxsize=None)
def _value_and_grads(policy: str, *extra):
    loss, params = _loss_fn(policy, *extra)
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("policy, extra", [("full", ()), ("projections", ()), ("projections", TPU_PATHS),
                                           ("experts", TPU_PATHS)],
                         ids=["full", "projections", "projections-tpu-paths", "experts-tpu-paths"])
def test_remat_equals_no_remat_in_the_sparse_stage(policy, extra):
    """Value to float32 rounding; gradients to float32 rounding of the largest gradient entry (the
    programs fuse and order their sums differently: see test_lm_loss's remat test, which covers
    every policy on SWA layers; `minimal` keeps the same names, checked by structure below)."""
    (va, ga), (vb, gb) = _value_and_grads(policy, *extra), _value_and_grads("none", *extra)
    np.testing.assert_allclose(va, vb, rtol=1e-6)
    assert ga.keys() == gb.keys()
    scale = max(float(np.abs(g).max()) for g in gb.values())
    assert any(np.any(ga[k] != 0) for k in ga if "indexer" in k)  # the indexer loss reaches its side
    for k in ga:
        diff = float(np.abs(ga[k] - gb[k]).max())
        assert diff <= 1e-6 * scale, f"{k}: max diff {diff} (largest gradient entry {scale})"


def _count(fn, args, primitive: str) -> int:
    return len(re.findall(rf"= {primitive}\[", str(jax.make_jaxpr(fn)(*args))))


@pytest.mark.parametrize("policy", ["full", "minimal", "projections", "experts"])
def test_backward_recomputes_no_selection(policy):
    """Every top_k (indexer selection, the indexer loss's own selection, MoE routing) runs once
    per step: the gradient program has exactly the forward's count (recomputing them doubled it)."""
    loss, params = _loss_fn(policy)
    forward = _count(loss, (params,), "top_k")
    assert forward == 3  # the scanned CSA body: its selection, the loss's selection, the router
    assert _count(jax.value_and_grad(loss), (params,), "top_k") == forward


def _saved(policy: str, *extra) -> list[tuple]:
    """(shape, memory space, what) of each value the backward keeps from the forward under `policy`."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' list, public in name only

    loss, params = _loss_fn(policy, *extra)
    return [(aval.shape, str(getattr(aval, "memory_space", "")), what) for aval, what in saved_residuals(loss, params)]


def test_projections_keeps_the_named_products():
    """Under `projections` the backward keeps every named product (the TPU's paths make all of them),
    and under `full` none of them."""
    from core.model.transformer import PROJECTION_NAMES

    for policy, kept in (("projections", set(PROJECTION_NAMES)), ("full", set())):
        named = {n for *_, what in _saved(policy, *TPU_PATHS, "scan_layers=false") for n in PROJECTION_NAMES
                 if f"named '{n}'" in what}
        assert named == kept, (policy, named)


def test_experts_keeps_its_names_and_runs_no_grouped_matmul_again():
    """Under `experts` the backward keeps EXPERT_NAMES and none of the attention's other products, and its
    grouped matmuls are the forward's and their two transposes each: `full` runs the forward's again."""
    from core.model.transformer import EXPERT_NAMES, PROJECTION_NAMES

    saved = [what for *_, what in _saved("experts", *TPU_PATHS, "scan_layers=false")]
    assert {n for n in EXPERT_NAMES if any(f"named '{n}'" in w for w in saved)} == set(EXPERT_NAMES)
    assert not [n for n in set(PROJECTION_NAMES) - set(EXPERT_NAMES) if any(f"named '{n}'" in w for w in saved)]
    counts = {}
    for policy in ("experts", "full"):
        loss, params = _loss_fn(policy, *TPU_PATHS)
        counts[policy] = (_count(loss, (params,), "ragged_dot_general"),
                          _count(jax.value_and_grad(loss), (params,), "ragged_dot_general"))
    forward = counts["full"][0]
    assert forward == counts["experts"][0] > 0
    assert counts["experts"][1] == 3 * forward, counts    # forward, and each product's two transposes
    assert counts["full"][1] == 4 * forward, counts       # and the forward's again


@pytest.mark.parametrize("platform, host", [("cpu", False), ("gpu", True), ("tpu", True)])
def test_projections_offloads_the_layer_input_where_the_platform_has_host_memory(monkeypatch, platform, host):
    """The layer's input [B, T, n, M] is kept in the device's memory on a CPU and copied to the host's
    pinned memory on a TPU or GPU (the platform as the trace's mesh names it)."""
    import core.model.transformer as transformer

    monkeypatch.setattr(transformer, "mesh_platform_of", lambda mesh: platform)
    inputs = [(space, what) for shape, space, what in _saved("projections", "scan_layers=false")
              if shape == (2, 32, 4, 64) and ("decoder_layer_input" in what or "device_put" in what)]
    assert inputs and all(("host" in space.lower()) == host for space, _ in inputs), inputs
