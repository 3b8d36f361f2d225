"""Attention (window + blocks + sink), the indexer module and whole attention layers vs float64 loops.

The layer tests run the default chunked mode against tests/reference.py: once with a single query
chunk (T = 16 < C) and once with several chunks and a ragged last one (T = 20, C = 8), so the
window band across chunk edges, the gathered top-k and the chunked visible blocks meet the loop
reference in float64.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.model.attention import Attention, AttentionImpl, AttentionSpec, collect
from core.model.layers import Indexer, IndexerSpec
from core.ops.masked_attention import compressed_visibility, softmax_attention
from core.ops.topk import indexer_scores, select_topk
from core.model.layers import rope_frequencies
from tests import reference as ref


def packed(rows, t):
    """positions, segment_ids [B, T] for rows of document lengths (the rest is padding)."""
    pos, seg = np.zeros((len(rows), t), np.int64), np.zeros((len(rows), t), np.int64)
    for b, lengths in enumerate(rows):
        start = 0
        for i, n in enumerate(lengths):
            pos[b, start:start + n] = np.arange(n)
            seg[b, start:start + n] = i + 1
            start += n
    return pos, seg


ROWS = [[16], [7, 6]]  # one full row; two documents (not block-aligned) then 3 padding tokens
T = 16


def test_attention_matches_reference(x64):
    rng = np.random.default_rng(0)
    pos, seg = packed(ROWS, T)
    q = rng.standard_normal((2, T, 3, 8))
    kv = rng.standard_normal((2, T, 8))
    ckv = rng.standard_normal((2, T // 4, 8))
    sink = rng.standard_normal(3)
    win = ref.window(pos, seg, 5)
    allowed = ref.visible(pos, seg, 4) & (rng.random((2, T, T // 4)) < 0.7)
    got = softmax_attention(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(win), jnp.asarray(sink),
                    jnp.asarray(ckv), jnp.asarray(allowed))
    want = ref.attention(q, kv, win, sink, ckv, allowed)
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert err < 1e-10, f"max diff {err}"
    swa = softmax_attention(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(win), jnp.asarray(sink))
    err = float(np.max(np.abs(np.asarray(swa) - ref.attention(q, kv, win, sink))))
    assert err < 1e-10, f"SWA max diff {err}"


def test_masks_match_reference():
    pos, seg = packed(ROWS, T)
    np.testing.assert_array_equal(compressed_visibility(jnp.asarray(pos), jnp.asarray(seg), 4),
                                  ref.visible(pos, seg, 4))
    # T not a multiple of the ratio: the trailing partial block is dropped.
    got = compressed_visibility(jnp.asarray(pos[:, :14]), jnp.asarray(seg[:, :14]), 4)
    np.testing.assert_array_equal(got, ref.visible(pos, seg, 4)[:, :14, :3])


def test_empty_rows_are_zero_without_nan():
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    kv = jax.random.normal(jax.random.key(1), (1, 4, 8))
    none = jnp.zeros((1, 4, 4), bool)
    f = lambda q_, s_: jnp.sum(softmax_attention(q_, kv, none, s_) ** 2)
    out = jax.jit(softmax_attention)(q, kv, none, jnp.zeros(2))
    np.testing.assert_array_equal(out, 0.0)
    grads = jax.jit(jax.grad(f, argnums=(0, 1)))(q, jnp.zeros(2))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def spec(ratio, indexer=True, **kw):
    """A small layer's spec; keywords of `AttentionImpl` (how it runs) go to its `impl`."""
    impl = {k: kw.pop(k) for k in [f.name for f in dataclasses.fields(AttentionImpl)] if k in kw}
    return AttentionSpec(emb=16, heads=4, head_dim=8, q_lora_rank=8, o_groups=2, o_lora_rank=6,
                         window=5, ratio=ratio, eps=1e-6, rope=rope_frequencies(4, 50.0),
                         indexer_heads=2 if indexer and ratio == 4 else 0,
                         indexer_head_dim=8 if indexer and ratio == 4 else 0,
                         indexer_topk=2 if indexer and ratio == 4 else 0, impl=AttentionImpl(**impl), **kw)


def make_layer(s, dtype, seed=0):
    return random_module(lambda: Attention(s, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype), dtype, seed)


def random_module(factory, dtype, seed):
    """factory()'s module with every parameter random, drawn on the host (no init compiles).

    Weights ~ N(0, 1/fan_in); norms 1 + noise; sinks and ape (zero-initialised) get noise too.
    Returns (module, {dotted name without ".weight": float64 value}).
    """
    abstract = nnx.eval_shape(factory)
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    params = {}
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path).removesuffix(".weight")
        if len(var.shape) == 1:
            value = (name.endswith("norm")) + 0.3 * rng.standard_normal(var.shape)
        elif name.endswith("ape"):
            value = 0.3 * rng.standard_normal(var.shape)
        else:
            fan_in = var.shape[1] if name.endswith("wo_a") else var.shape[0]
            value = rng.standard_normal(var.shape) / np.sqrt(fan_in)
        var.set_value(jnp.asarray(value, dtype))
        params[name] = value
    return nnx.merge(graphdef, state), params


@functools.lru_cache(maxsize=None)
def _jitted(flags):
    return nnx.jit(lambda layer, *a: layer(*a, **dict(flags)))


def call(layer, x, pos, seg, **flags):
    """The layer under nnx.jit (one compile per shape and flags, not op-by-op dispatch)."""
    return _jitted(tuple(sorted(flags.items())))(layer, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg))


def ref_layer(s, params, x, pos, seg, dense=False):
    return ref.attention_layer(params, x, pos, seg, heads=s.heads, head_dim=s.head_dim,
                               o_groups=s.o_groups, window_size=s.window, ratio=s.ratio, eps=s.eps,
                               freqs=ref.rope_freqs(4, 50.0), topk=s.indexer_topk,
                               idx_heads=s.indexer_heads, idx_dim=s.indexer_head_dim, dense=dense)


@pytest.mark.parametrize("ratio,dense", [(0, False), (4, False), (4, True), (8, False)])
def test_attention_layer_matches_reference(x64, ratio, dense):
    """SWA, CSA (top-k and dense), plain compression (HCA's path at m=8) in float64."""
    s = spec(ratio)
    layer, params = make_layer(s, jnp.float64, seed=ratio)
    pos, seg = packed(ROWS, T)
    x = np.random.default_rng(10 + ratio).standard_normal((2, T, 16))
    y, aux = call(layer, x, pos, seg, dense=dense, probe=collect)
    want, scores = ref_layer(s, params, x, pos, seg, dense=dense)
    err = float(np.max(np.abs(np.asarray(y) - want)))
    assert err < 1e-10, f"max diff {err}"
    if ratio == 4:  # indexer scores are float32 by design: compare at float32 tolerance
        vis = np.isfinite(scores)
        got = np.asarray(aux["index_scores"], np.float64)
        np.testing.assert_allclose(got[vis], scores[vis], rtol=1e-5, atol=1e-5)
        assert np.all(got[~vis] <= -1e29)
        chosen = np.zeros(vis.shape, bool)
        idx, valid = np.asarray(aux["topk_idx"]), np.asarray(aux["topk_valid"])
        for b, t_, k in zip(*np.nonzero(valid)):
            chosen[b, t_, idx[b, t_, k]] = True
        np.testing.assert_array_equal(chosen, ref.topk_mask(scores, vis, s.indexer_topk))


MULTI_ROWS, MULTI_T = [[20], [9, 7]], 20  # document 2 starts inside chunk 1; 4 padding tokens


@pytest.mark.parametrize("ratio,dense", [(0, False), (4, False), (4, True), (8, False)])
def test_multi_chunk_layer_matches_reference(x64, ratio, dense):
    """SWA, CSA (top-k and dense), plain compression (HCA's path at m=8) in float64 with three
    query chunks of C = 8, the last one ragged (4 rows): the window band reaches S - 1 keys back
    into the previous chunk, the top-k is selected per chunk (`select_topk_chunked`), and the
    visible blocks are masked per chunk."""
    s = spec(ratio, attention_chunk=8)
    layer, params = make_layer(s, jnp.float64, seed=20 + ratio)
    pos, seg = packed(MULTI_ROWS, MULTI_T)
    x = np.random.default_rng(30 + ratio).standard_normal((2, MULTI_T, 16))
    y, _ = call(layer, x, pos, seg, dense=dense)
    want, _ = ref_layer(s, params, x, pos, seg, dense=dense)
    err = float(np.max(np.abs(np.asarray(y) - want)))
    assert err < 1e-10, f"max diff {err}"


def test_indexer_module_scores_and_topk():
    rng = np.random.default_rng(5)
    idx, _ = random_module(lambda: Indexer(IndexerSpec(16, 8, 2, 8, rope_frequencies(4, 50.0), 1e-6),
                                           rngs=nnx.Rngs(3)), jnp.float32, 5)
    pos, seg = packed(ROWS, T)
    x = rng.standard_normal((2, T, 16)).astype(np.float32)
    c_q = rng.standard_normal((2, T, 8)).astype(np.float32)
    vis = ref.visible(pos, seg, 4)

    def scores_of(m, x, c_q, pos, vis):  # as the attention scores whole rows (core/model/attention.py)
        index = m.inputs(x, c_q, pos)
        return indexer_scores(index.queries.whole(pos).inputs, *index[1:], vis)

    scores = nnx.jit(scores_of)(idx, jnp.asarray(x), jnp.asarray(c_q), jnp.asarray(pos), jnp.asarray(vis))
    freqs = ref.rope_freqs(4, 50.0)
    p = lambda v: np.asarray(v[...], np.float64)
    q_i = ref.rope(np.einsum("btr,rhd->bthd", c_q, p(idx.wq_b)), pos, freqs)
    c = idx.compressor
    k_i = ref.compress(x, p(c.wkv), p(c.wgate), p(c.ape), p(c.norm.weight), pos, 4, 1e-6, freqs)
    w_i = x @ p(idx.weights_proj) * 2 ** -0.5 * 8 ** -0.5
    want = ref.indexer_scores(q_i, k_i, w_i, vis)
    np.testing.assert_allclose(np.asarray(scores)[vis], want[vis], rtol=1e-5, atol=1e-5)
    sel, valid = select_topk(scores, jnp.asarray(vis), 3)
    mask = np.zeros(vis.shape, bool)
    for b, t_, k in zip(*np.nonzero(np.asarray(valid))):
        mask[b, t_, int(sel[b, t_, k])] = True
    np.testing.assert_array_equal(mask, ref.topk_mask(want, vis, 3))


@pytest.mark.parametrize("ratio", [4, 8])
def test_layer_causality(ratio):
    """Perturbing tokens after t0 leaves outputs at <= t0 unchanged (compressed blocks included)."""
    layer, _ = make_layer(spec(ratio), jnp.float32, seed=1)
    t, t0 = 24, 13
    pos = jnp.tile(jnp.arange(t), (2, 1))
    seg = jnp.ones((2, t), jnp.int32)
    x = jax.random.normal(jax.random.key(0), (2, t, 16))
    x2 = x.at[:, t0 + 1:].add(jax.random.normal(jax.random.key(1), (2, t - t0 - 1, 16)))
    y, _ = call(layer, x, pos, seg)
    y2, _ = call(layer, x2, pos, seg)
    np.testing.assert_allclose(y[:, :t0 + 1], y2[:, :t0 + 1], atol=1e-6)
    assert float(jnp.max(jnp.abs(y[:, t0 + 1:] - y2[:, t0 + 1:]))) > 1e-3


def test_layer_packing_equals_each_document_alone():
    """Two documents in one row give each document's outputs alone (alone = the document + padding).

    The block grid is the row's: a document starting inside a block would see its blocks shifted
    (and the straddling block is never visible), so packed documents must start at multiples of
    the ratio for equality. The second document here is block-aligned, its length is not.
    """
    layer, _ = make_layer(spec(4), jnp.float32, seed=2)
    x = jnp.tile(jax.random.normal(jax.random.key(2), (1, 24, 16)), (2, 1, 1))
    pos, seg = packed([[12, 11], [12]], 24)
    y, _ = call(layer, x, pos, seg)  # row 1: the first document alone
    np.testing.assert_allclose(y[0, :12], y[1, :12], atol=2e-5)
    x_b = jnp.zeros_like(x).at[:, :11].set(x[0, 12:23])
    pos_b, seg_b = packed([[11], [11]], 24)
    y_b, _ = call(layer, x_b, pos_b, seg_b)  # the second document alone
    np.testing.assert_allclose(y[0, 12:23], y_b[0, :11], atol=2e-5)


def test_parameter_names_and_shapes():
    layer = nnx.eval_shape(lambda: Attention(spec(4), rngs=nnx.Rngs(0)))
    names = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert names == {
        "wq_a": (16, 8), "q_norm.weight": (8,), "wq_b": (8, 4, 8), "wkv": (16, 8),
        "kv_norm.weight": (8,), "wo_a": (2, 16, 6), "wo_b": (12, 16), "attn_sink": (4,),
        "compressor.wkv": (16, 16), "compressor.wgate": (16, 16), "compressor.ape": (4, 16),
        "compressor.norm.weight": (8,), "indexer.wq_b": (8, 2, 8), "indexer.weights_proj": (16, 2),
        "indexer.compressor.wkv": (16, 16), "indexer.compressor.wgate": (16, 16),
        "indexer.compressor.ape": (4, 16), "indexer.compressor.norm.weight": (8,),
    }
    plain = nnx.eval_shape(lambda: Attention(spec(4, indexer=False), rngs=nnx.Rngs(0)))
    assert not any("indexer" in map(str, p) for p, _ in nnx.to_flat_state(nnx.state(plain, nnx.Param)))


def test_layer_indexer_loss_wiring():
    """The layer's indexer loss = csa_indexer_loss on its own collected inputs; streamed = direct.

    Covers both teachers and both stages; the joint teacher also needs the raw window keys and
    the sinks, passed through by the layer.
    """
    from core.loss.indexer_kl_direct import WholeTeacher, csa_indexer_loss

    variants = {("compressed", 0, False), ("compressed", 8, False), ("joint", 0, True), ("joint", 8, True)}
    base, _ = make_layer(spec(4), jnp.float32, seed=3)
    state = nnx.state(base)

    def layer_for(teacher, chunk):
        s = spec(4, loss_scale=0.1, teacher=teacher, query_chunk=chunk)
        return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Attention(s, rngs=nnx.Rngs(0)))), state)

    layers = {v: layer_for(*v[:2]) for v in sorted(variants)}
    pos, seg = packed(ROWS, T)
    x = jax.random.normal(jax.random.key(4), (2, T, 16))

    @nnx.jit
    def run(layers, x, pos, seg):
        return {v: layer(x, pos, seg, dense=v[2], indexer_loss=True, probe=collect)[1]
                for v, layer in layers.items()}

    out = run(layers, x, jnp.asarray(pos), jnp.asarray(seg))
    for (teacher, chunk, dense), aux in out.items():
        allowed = aux["visible"]
        if not dense:
            sel = jax.nn.one_hot(aux["topk_idx"], T // 4, dtype=bool) & aux["topk_valid"][..., None]
            allowed = allowed & jnp.any(sel, axis=-2)
        extra = dict(raw_bsd=aux["raw_kv"], window_bts=aux["window"], sink_h=aux["sink"]) if teacher == "joint" else {}
        whole = WholeTeacher(aux["teacher_query"], aux["compressed_kv"], kind=teacher, **extra)
        want = csa_indexer_loss(aux["index_scores"], whole, allowed, scale=0.1)
        assert float(want) > 0
        np.testing.assert_allclose(aux["indexer_loss"], want, rtol=1e-5, err_msg=f"{teacher} {chunk} {dense}")
