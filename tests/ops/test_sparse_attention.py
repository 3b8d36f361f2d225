"""Chunked attention and chunked top-k (core.ops.chunked_attention, core.ops.topk) vs the dense masked path.

Every case checks value AND gradient against `softmax_attention` with the dense masks, on packed
documents with padding, T not a multiple of the chunk, and T < S.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.model.attention import Attention, collect
from core.ops.chunked_attention import Keys, RowQueries, band_run, chunked_attention
from core.ops.masked_attention import compressed_visibility, selection_mask, sliding_window_mask, softmax_attention
from core.ops.topk import IndexerInputs, indexer_scores, select_topk, select_topk_chunked, topk_mask
from core.spec.resolve import resolve
from tests.attention_memory import layer_train_temp_bytes
from tests.model.test_attention import make_layer, packed, spec

H, D = 3, 8
# (name, row document lengths, T, window S, chunk C, ratio, gathered top-k)
CASES = [
    ("swa packed, T % C != 0", [[9, 8], [13]], 22, 5, 4, 0, 0),
    ("csa top-k packed", [[9, 8], [13]], 22, 5, 4, 4, 2),
    ("hca-like ratio 8", [[17, 5], [22]], 22, 5, 4, 8, 0),
    ("T < S, several chunks", [[7], [4, 3]], 7, 9, 3, 4, 1),
    ("T < ratio: no block", [[6], [2, 3]], 6, 5, 4, 8, 0),
    # the banded window (band_run): runs of u >= S - 1 queries, at least two per chunk
    ("banded window u = S - 1, top-k", [[11, 13], [30]], 30, 3, 8, 4, 2),
    ("banded window u > S - 1, T % C != 0", [[17, 9], [26]], 26, 4, 12, 4, 0),
    ("banded window, hca-like, S - 1 = u", [[20, 12], [5, 27]], 32, 5, 8, 8, 0),
]


def _inputs(rows, t, ratio, dtype, seed):
    rng = np.random.default_rng(seed)
    pos, seg = (jnp.asarray(a) for a in packed(rows, t))
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    w = t // ratio if ratio else 0
    return pos, seg, arr(2, t, H, D), arr(2, t, D), arr(2, w, D) if ratio else None, arr(H), arr(2, t, H, D)


def _selection(pos, seg, ratio, k, seed):
    """A top-k selection of random scores (the attention does not care where it came from)."""
    vis = compressed_visibility(pos, seg, ratio)
    scores = jax.random.normal(jax.random.key(seed), vis.shape)
    return vis, select_topk(scores, vis, k)


def _both(case, dtype, seed=0, as_mask=False):
    """(chunked, dense) loss functions of (q, kv, ckv, sink) and the inputs; `as_mask` hands the chunked
    path the top-k as a mask (every block, masked) instead of indices (gathered blocks)."""
    _, rows, t, window, chunk, ratio, k = case
    pos, seg, q, kv, ckv, sink, cot = _inputs(rows, t, ratio, dtype, seed)
    win = sliding_window_mask(pos, seg, window)
    sel, allowed = None, None
    if ratio:
        allowed = compressed_visibility(pos, seg, ratio)
        if k:
            _, sel = _selection(pos, seg, ratio, k, seed)
            allowed = allowed & selection_mask(*sel, allowed.shape[-1])
            sel = allowed if as_mask else sel

    def chunked(q, kv, ckv, sink):
        o = chunked_attention(RowQueries.given(q), Keys(kv, sink, window, ckv, ratio), pos, seg, sel,
                              chunk=chunk)
        return jnp.sum(o * cot), o

    def dense(q, kv, ckv, sink):
        o = softmax_attention(q, kv, win, sink, ckv, allowed)
        return jnp.sum(o * cot), o

    return chunked, dense, (q, kv, ckv, sink)


def _compare(case, dtype, tol, as_mask=False):
    chunked, dense, args = _both(case, dtype, as_mask=as_mask)
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    (_, o_c), g_c = grad(chunked)
    (_, o_d), g_d = grad(dense)
    seg = packed(case[1], case[2])[1]
    np.testing.assert_array_equal(np.asarray(o_c)[seg == 0], 0.0)  # padding rows see nothing
    err = float(jnp.max(jnp.abs(o_c - o_d)))
    assert err < tol, f"{case[0]}: value max diff {err}"
    for name, a, b in zip(("q", "kv", "ckv", "sink"), g_c, g_d):
        if b is not None and b.size:
            err = float(jnp.max(jnp.abs(a - b)))
            assert err < tol, f"{case[0]}: d{name} max diff {err}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunked_attention_equals_dense_float32(case):
    _compare(case, jnp.float32, 1e-5)


@pytest.mark.parametrize("as_mask", [False, True], ids=["gathered", "mask"])
def test_chunked_attention_equals_dense_float64(x64, as_mask):
    _compare(CASES[1], jnp.float64, 1e-12, as_mask=as_mask)


def test_banded_window_equals_dense_float64(x64):
    _compare(CASES[5], jnp.float64, 1e-12, as_mask=True)


def test_band_run_is_the_smallest_divisor_covering_the_window():
    """Run u >= S - 1 dividing C with two runs at least; 0 (the shared band) where none exists; the
    cases above take the banded path."""
    assert [band_run(c, s) for c, s in ((512, 128), (128, 32), (12, 4), (8, 5), (4, 5), (8, 9), (6, 1))] == \
        [128, 32, 3, 4, 0, 0, 1]
    assert all(band_run(c[4], c[3]) for c in CASES[5:]) and not any(band_run(c[4], c[3]) for c in CASES[:5])


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[CASES[1][0], CASES[3][0]])
def test_chunked_attention_over_a_topk_mask_equals_dense(case):
    """The top-k as a mask over every block (no gather) gives the gathered path's value and gradient."""
    _compare(case, jnp.float32, 1e-5, as_mask=True)


def test_topk_mask_is_the_scattered_selection_with_ties_and_short_rows():
    """`topk_mask` equals selection_mask(select_topk(...)) exactly: integer scores tie often; rows with
    fewer visible blocks than k take them all; rows with none take nothing."""
    rng = np.random.default_rng(3)
    for t, k in ((22, 3), (40, 1), (40, 8)):
        pos, seg = (jnp.asarray(a) for a in packed([[t - 9, 6], [t]], t))
        vis = compressed_visibility(pos, seg, 4)
        scores = jnp.asarray(rng.integers(-2, 3, vis.shape), jnp.float32)
        want = selection_mask(*select_topk(scores, vis, k), vis.shape[-1])
        np.testing.assert_array_equal(jax.jit(topk_mask, static_argnums=2)(scores, vis, k), want)
        assert np.any(np.asarray(jnp.sum(vis, -1)) < k) and np.any(np.asarray(jnp.sum(vis, -1)) > k)


@pytest.mark.parametrize("t,chunk", [(22, 4), (24, 24), (9, 5)])
def test_select_topk_chunked_equals_dense(t, chunk):
    """Same indices and validity as select_topk of the dense scores, ties to the lower index.

    Integer-valued inputs make equal scores common, so the tie rule is exercised.
    """
    rng = np.random.default_rng(t)
    pos, seg = (jnp.asarray(a) for a in packed([[t - 6, 5], [t]], t))
    w = t // 4
    q = jnp.asarray(rng.integers(-1, 2, (2, t, 2, 4)), jnp.float32)
    k = jnp.asarray(rng.integers(-1, 2, (2, w, 4)), jnp.float32)
    wt = jnp.asarray(rng.integers(0, 2, (2, t, 2)), jnp.float32)
    vis = compressed_visibility(pos, seg, 4)
    want_idx, want_valid = select_topk(indexer_scores(q, k, wt, vis), vis, 3)
    chunked = lambda q, k, wt, pos, seg: select_topk_chunked(  # noqa: E731
        IndexerInputs(RowQueries.given(q), k, wt), pos, seg, ratio=4, k=3, chunk=chunk, head_chunk=1)
    got_idx, got_valid = jax.jit(chunked)(q, k, wt, pos, seg)
    np.testing.assert_array_equal(got_valid, want_valid)
    np.testing.assert_array_equal(jnp.where(got_valid, got_idx, -1), jnp.where(want_valid, want_idx, -1))
    np.testing.assert_array_equal(got_idx, want_idx)  # invalid slots agree too (same top_k order)
    as_mask = lambda q, k, wt, pos, seg: select_topk_chunked(  # noqa: E731
        IndexerInputs(RowQueries.given(q), k, wt), pos, seg, ratio=4, k=3, chunk=chunk, head_chunk=1,
        as_mask=True)
    got_mask = jax.jit(as_mask)(q, k, wt, pos, seg)
    assert got_mask.shape == (2, t, w) and got_mask.dtype == jnp.bool_
    np.testing.assert_array_equal(got_mask, selection_mask(want_idx, want_valid, w))


def _layer_pair(ratio, seed, attention="chunked", **kw):
    """The same random layer as `attention` (chunks of 5) and as the masked implementation."""
    base, _ = make_layer(spec(ratio, attention="masked", **kw), jnp.float32, seed=seed)
    state = nnx.state(base)
    other_spec = spec(ratio, attention=attention, attention_chunk=5, **kw)
    other = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Attention(other_spec, rngs=nnx.Rngs(0)))), state)
    return other, base


LAYER_CASES = [  # (ratio, dense, indexer_loss, extra spec fields); SWA and HCA: CASES
    (4, False, True, dict(loss_scale=0.1)),  # csa_query_chunk_size=0: streams in blocks of 4 (24 % 5)
    (4, True, True, dict(loss_scale=0.1, query_chunk=8, teacher="joint")),
    (4, False, True, dict(loss_scale=0.1, topk_attention="mask")),  # the top-k as a mask over every block
    # the projections once over the sequence (attention_projections: whole), gathered and masked top-k, HCA-like
    (4, False, True, dict(loss_scale=0.1, projections="whole")),
    (4, False, True, dict(loss_scale=0.1, topk_attention="mask", projections="whole")),
    (8, False, False, dict(projections="whole")),
]


def check_layer_equals_masked(attention, ratio, dense, loss, kw, seed):
    """Whole layer, `attention` vs masked: output, indexer loss and every parameter's gradient."""
    other, masked = _layer_pair(ratio, seed=seed, attention=attention, **kw)
    t = 24  # the streamed loss needs T % W == 0; the chunk (5) does not divide T
    pos, seg = (jnp.asarray(a) for a in packed([[13, 9], [24]], t))
    x = jax.random.normal(jax.random.key(ratio), (2, t, 16))
    cot = jax.random.normal(jax.random.key(99), (2, t, 16))

    @nnx.jit
    def run(layer, x):
        def f(layer, x):
            y, aux = layer(x, pos, seg, dense=dense, indexer_loss=loss)
            return jnp.sum(y * cot) + aux.get("indexer_loss", 0.0), (y, aux)
        return nnx.value_and_grad(f, argnums=(0, 1), has_aux=True)(layer, x)

    (_, (y_c, aux_c)), (g_c, gx_c) = run(other, x)
    (_, (y_m, aux_m)), (g_m, gx_m) = run(masked, x)
    err = float(jnp.max(jnp.abs(y_c - y_m)))
    assert err < 1e-5, f"output max diff {err}"
    if loss:
        assert float(aux_m["indexer_loss"]) > 0
        np.testing.assert_allclose(aux_c["indexer_loss"], aux_m["indexer_loss"], rtol=1e-5)
    err = float(jnp.max(jnp.abs(gx_c - gx_m)))
    assert err < 1e-5, f"dx max diff {err}"
    flat_m = dict(nnx.to_flat_state(g_m))
    for path, v in nnx.to_flat_state(g_c):
        err = float(jnp.max(jnp.abs(v[...] - flat_m[path][...])))
        assert err < 1e-5, f"d{'.'.join(map(str, path))} max diff {err}"


@pytest.mark.parametrize("ratio,dense,loss,kw", LAYER_CASES)
def test_layer_chunked_equals_masked(ratio, dense, loss, kw):
    check_layer_equals_masked("chunked", ratio, dense, loss, kw, seed=7 + ratio)


def test_layer_chunked_collect_equals_masked():
    """`collect` (eval) and the unstreamed loss: the same dense aux and output from both paths."""
    chunked, masked = _layer_pair(4, seed=3, loss_scale=0.1)
    pos, seg = (jnp.asarray(a) for a in packed([[13, 9], [22]], 22))
    x = jax.random.normal(jax.random.key(5), (2, 22, 16))
    run = nnx.jit(lambda layer, x: layer(x, pos, seg, probe=collect, indexer_loss=True))
    (y_c, aux_c), (y_m, aux_m) = run(chunked, x), run(masked, x)
    np.testing.assert_allclose(y_c, y_m, atol=1e-5)
    assert set(aux_c) == set(aux_m)
    for key in aux_m:
        np.testing.assert_allclose(aux_c[key], aux_m[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_layer_memory_grows_linearly_in_t():
    """CSA layer with top-k: 4 x T makes about 4 x the compiled temp memory of its train step, with the
    projections per chunk or whole; the masked reference's doubles 2 x T's, so the check can fail. (The
    Flash test below compiles the streamed indexer loss too.)"""
    for projections in ("chunked", "whole"):  # 4 x T: 16 x the temp if it grew as T^2
        chunked = [layer_train_temp_bytes(spec(4, attention_chunk=32, projections=projections), t) for t in (512, 2048)]
        assert chunked[1] <= 4.4 * chunked[0], f"{projections}: temp {chunked[0]} -> {chunked[1]} bytes for T 512 -> 2048"
    masked = [layer_train_temp_bytes(spec(4, attention="masked"), t) for t in (512, 1024)]
    assert masked[1] > 3.5 * masked[0], f"masked temp {masked[0]} -> {masked[1]} bytes"


@pytest.mark.slow
def test_flash_csa_layer_memory_at_32k():
    """DeepSeek-V4-Flash shapes (H=64, D=512, k=512): one CSA layer's sparse-stage train step (top-k,
    streamed indexer loss) at T=32K, compiled ahead of time, needs <= 4 GiB of temp memory."""
    from core.config.schema import load_config

    cfg = load_config("deepseek4-284b", ["max_target_length=32768", "indexer_loss_scaling_factor=0.1",
                                         "csa_query_chunk_size=256", "csa_qk_head_chunk_size=8"])
    temp = layer_train_temp_bytes(resolve(cfg, "cpu").model.blocks[2].attn, 32768, indexer_loss=True)
    assert temp <= 4 * 2**30, f"temp {temp / 2**30:.2f} GiB"


def test_whole_projections_pin_queries_and_outputs_to_the_batch_split():
    """On a mesh, `attention_projections: whole` constrains the whole-sequence queries and attention output
    to the rules' sharding (core.ops.placement: batch over data x fsdp x expert, heads over tensor): left to the compiler, V4-Flash's
    sparse step on v5p-128 (fsdp 64) replicated the output over the batch and exceeded the chip. Without a
    mesh, nothing is added."""
    from jax.sharding import AbstractMesh, PartitionSpec

    from core.parallel.mesh import MESH_AXES

    layer, _ = make_layer(spec(4, attention="chunked", attention_chunk=8, projections="whole"), jnp.float32)
    pos, seg = (jnp.asarray(a) for a in packed([[16], [16]], 16))
    x = jnp.zeros((2, 16, 16))

    def constraints(mesh):
        with jax.sharding.use_abstract_mesh(mesh):
            jaxpr = jax.make_jaxpr(lambda x: nnx.merge(*nnx.split(layer))(x, pos, seg)[0])(x)
        return [e.params["sharding"].spec for e in jaxpr.jaxpr.eqns  # the activations [B, T, H, D], not the
                if e.primitive.name == "sharding_constraint" and e.invars[0].aval.ndim == 4]  # weights' gathers

    want = PartitionSpec(("data", "fsdp", "expert"), None, "tensor", None)
    assert constraints(AbstractMesh((1, 2, 2, 1), MESH_AXES)) == [want, want]  # the queries, the output
    # what does not divide stays whole: B = 2 over data 1 x fsdp 2 x expert 2 keeps data and fsdp
    assert constraints(AbstractMesh((1, 2, 1, 2), MESH_AXES))[0] == PartitionSpec(("data", "fsdp"), None, "tensor", None)
    assert constraints(AbstractMesh((1, 1, 1, 1), MESH_AXES)) == []


@pytest.mark.parametrize("topk_attention", ["gather", "mask"])
def test_layer_whole_projections_equal_the_masked_reference_float64(x64, topk_attention):
    """`attention_projections: whole` in float64: the CSA layer's output and every parameter's gradient equal
    the masked reference's (which builds its queries and projects its output whole) to float64 rounding."""
    base, _ = make_layer(spec(4, attention="masked", topk_attention=topk_attention), jnp.float64, seed=11)
    whole_spec = spec(4, attention="chunked", attention_chunk=5, topk_attention=topk_attention, projections="whole")
    whole = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Attention(whole_spec, rngs=nnx.Rngs(0), param_dtype=jnp.float64,
                                                                     dtype=jnp.float64))), nnx.state(base))
    pos, seg = (jnp.asarray(a) for a in packed([[13, 9], [24]], 24))
    x = jax.random.normal(jax.random.key(4), (2, 24, 16), jnp.float64)
    cot = jax.random.normal(jax.random.key(8), (2, 24, 16), jnp.float64)

    @nnx.jit
    def run(layer, x):
        return nnx.value_and_grad(lambda layer, x: jnp.sum(layer(x, pos, seg)[0] * cot), argnums=(0, 1))(layer, x)

    (v_w, (g_w, gx_w)), (v_m, (g_m, gx_m)) = run(whole, x), run(base, x)
    assert abs(float(v_m)) > 1e-3 and abs(float(v_w - v_m)) < 1e-10 and float(jnp.max(jnp.abs(gx_w - gx_m))) < 1e-10
    flat_m = dict(nnx.to_flat_state(g_m))
    for path, v in nnx.to_flat_state(g_w):
        err = float(jnp.max(jnp.abs(v[...] - flat_m[path][...])))
        assert err < 1e-10, f"d{'.'.join(map(str, path))} max diff {err}"
