"""core.loss.indexer_kl against the float64 reference (tests/reference_loss.py) and its contract.

DESIGN.md "The indexer loss" / "Memory". Shapes are tiny and reused, and static settings go
positionally, so jit's cache hits across tests.
"""

from __future__ import annotations

import dataclasses
import functools
import pytest
from hypothesis import given, settings, strategies as st
from tests import reference_loss as ref
from tests.conftest import packed

import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

from core.loss.indexer_kl import csa_indexer_loss_streamed
from core.loss.indexer_kl_direct import WholeTeacher, csa_indexer_loss
from core.ops.chunked_attention import Keys, RowQueries
from core.ops.masked_attention import csa_visible, selection_mask, sliding_window_mask
from core.ops.topk import IndexerInputs, indexer_scores, select_topk

RATIO, WINDOW, TOPK = 4, 5, 2
# Chunk settings shared by the tests so jit's cache is hit: (head_chunk, query_chunk).
CHUNKS = {"compressed": [(1, 0), (0, 4), (2, 8)], "joint": [(2, 8)]}
# (teacher, topk, head_chunk, query_chunk): one indexer head group (kept residuals) or several
# (recomputed per group), dense and sparse, both teachers.
STREAM_CASES = [("compressed", None, 0, 4), ("compressed", TOPK, 2, 8), ("joint", TOPK, 2, 8)]


def problem(seed, b=2, t=16, h=4, d=8, hi=4, di=8, docs=None):
    """Random teacher and indexer inputs (numpy float64) plus positions / segment ids."""
    rng = np.random.default_rng(seed)
    w = t // RATIO
    rows = [packed(docs[i % len(docs)] if docs else [t], t) for i in range(b)]
    return dict(
        q=rng.normal(size=(b, t, h, d)) * d**-0.5 * 3, kv=rng.normal(size=(b, w, d)),
        raw=rng.normal(size=(b, t, d)), sink=rng.normal(size=h),
        qi=rng.normal(size=(b, t, hi, di)), ki=rng.normal(size=(b, w, di)), wi=rng.normal(size=(b, t, hi)) * 0.5,
        pos=np.stack([r[0] for r in rows]), seg=np.stack([r[1] for r in rows]),
    )


def masks(p, sparse):
    vis = ref.visible(p["pos"], p["seg"], RATIO)
    scores = ref.indexer_scores(p["qi"], p["ki"], p["wi"])
    allowed = vis & ref.topk_mask(scores, vis, TOPK) if sparse else vis
    return scores, allowed, ref.window(p["pos"], p["seg"], WINDOW)


@functools.partial(jax.jit, static_argnums=(7, 8, 9))
def _loss_and_grads(scores, q, kv, allowed, raw, win, sink, head_chunk, query_chunk, teacher):
    def f(scores, q, kv, raw, sink):
        return csa_indexer_loss(scores, WholeTeacher(q, kv, raw, sink, teacher, win), allowed, scale=0.5,
                                head_chunk=head_chunk, query_chunk=query_chunk)
    return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))(scores, q, kv, raw, sink)


def loss_and_grads(*arrays, head_chunk=0, query_chunk=0, teacher="compressed"):
    """value and gradient w.r.t. (scores, q, kv, raw, sink) of csa_indexer_loss, scale 0.5.

    Static settings go positionally so that equal settings always hit jit's cache.
    """
    return _loss_and_grads(*arrays, head_chunk, query_chunk, teacher)


@functools.partial(jax.jit, static_argnums=(9, 10, 11, 12))
def _streamed_and_grads(qi, ki, wi, q, kv, pos, seg, raw, sink, head_chunk, query_chunk, teacher, topk):
    def f(qi, ki, wi, q, kv, raw, sink):
        index = IndexerInputs(RowQueries.given(qi), ki, wi)
        return csa_indexer_loss_streamed(index, RowQueries.given(q), Keys(raw, sink, WINDOW, kv, RATIO), pos, seg,
                                         teacher=teacher, topk=topk, scale=0.5, head_chunk=head_chunk,
                                         query_chunk=query_chunk)
    return jax.value_and_grad(f, argnums=tuple(range(7)))(qi, ki, wi, q, kv, raw, sink)


def streamed_and_grads(*arrays, head_chunk=0, query_chunk=0, teacher="compressed", topk=None):
    """value and gradient w.r.t. (qi, ki, wi, q, kv, raw, sink) of the streamed loss, scale 0.5."""
    return _streamed_and_grads(*arrays, head_chunk, query_chunk, teacher, topk)


def direct_from_indexer(qi, ki, wi, q, kv, pos, seg, raw, sink, teacher, topk):
    """The direct path the streamed one must equal: indexer_scores, top-k, csa_indexer_loss.

    The chain rule by hand (scores' VJP after the loss's) reuses loss_and_grads' compiled
    direct programs.
    """
    vis = csa_visible(pos, seg, RATIO)
    scores, pull = jax.vjp(lambda a, b, c: indexer_scores(a, b, c, vis), qi, ki, wi)
    allowed = vis if topk is None else vis & selection_mask(*select_topk(scores, vis, topk), vis.shape[-1])
    loss, grads = loss_and_grads(scores, q, kv, allowed, raw, sliding_window_mask(pos, seg, WINDOW), sink,
                                 teacher=teacher)
    return loss, pull(grads[0])


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def jx(p, *names, dtype=jnp.float32):
    return [jnp.asarray(p[n], dtype) for n in names]


# ----------------------------------------------------------------------------- reference parity


@pytest.mark.parametrize("teacher", ["compressed", "joint"])
@pytest.mark.parametrize("docs", [None, [[7, 6], [16]]], ids=["single", "packed+padding"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_matches_float64_reference(x64, teacher, docs, sparse):
    p = problem(1, docs=docs)
    scores, allowed, win = masks(p, sparse)
    want, _, valid, target = ref.indexer_kl_loss(scores, p["q"], p["kv"], allowed, scale=0.5, teacher=teacher,
                                                 raw_kv=p["raw"], window_mask=win, sink=p["sink"])
    want_grad = ref.indexer_kl_grad(scores, target, allowed, valid, scale=0.5)
    for head_chunk, query_chunk in [(0, 0)] + ([(2, 8)] if teacher == "compressed" else []):
        loss, grads = loss_and_grads(jnp.asarray(scores), *jx(p, "q", "kv", dtype=jnp.float64), jnp.asarray(allowed),
                                     jnp.asarray(p["raw"]), jnp.asarray(win), jnp.asarray(p["sink"]),
                                     head_chunk=head_chunk, query_chunk=query_chunk, teacher=teacher)
        assert loss.dtype == jnp.float64
        assert abs(float(loss) - want) <= 1e-10 * abs(want), (head_chunk, query_chunk, float(loss), want)
        assert rel_err(grads[0], want_grad) <= 1e-10, rel_err(grads[0], want_grad)


@pytest.mark.parametrize("teacher", ["compressed", "joint"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_float32_within_1e5_of_reference(teacher, sparse):
    p = problem(2, docs=[[9, 7], [12]])
    scores, allowed, win = masks(p, sparse)
    want, _, valid, target = ref.indexer_kl_loss(scores, p["q"], p["kv"], allowed, scale=0.5, teacher=teacher,
                                                 raw_kv=p["raw"], window_mask=win, sink=p["sink"])
    loss, grads = loss_and_grads(jnp.asarray(scores, jnp.float32), *jx(p, "q", "kv"), jnp.asarray(allowed),
                                 *jx(p, "raw"), jnp.asarray(win), *jx(p, "sink"), teacher=teacher)
    assert loss.dtype == jnp.float32 and want > 0
    assert abs(float(loss) - want) <= 1e-5 * want, (float(loss), want)
    assert rel_err(grads[0], ref.indexer_kl_grad(scores, target, allowed, valid, 0.5)) <= 1e-5


def test_gradient_matches_finite_differences_of_reference(x64):
    """Central differences of the float64 NumPy loss vs the custom VJP, every score of row 0."""
    p = problem(3, docs=[[12, 4]])
    scores, allowed, win = masks(p, sparse=False)
    _, grads = loss_and_grads(jnp.asarray(scores), *jx(p, "q", "kv", dtype=jnp.float64), jnp.asarray(allowed),
                              jnp.asarray(p["raw"]), jnp.asarray(win), jnp.asarray(p["sink"]), teacher="joint")
    step, fd = 1e-6, np.zeros(scores.shape)
    for idx in np.ndindex(scores.shape):
        if idx[0] == 1:  # the second row repeats the first one's layout: spare the slow reference
            continue
        bumped = [scores.copy(), scores.copy()]
        bumped[0][idx] += step
        bumped[1][idx] -= step
        up, down = (ref.indexer_kl_loss(s, p["q"], p["kv"], allowed, scale=0.5, teacher="joint", raw_kv=p["raw"],
                                        window_mask=win, sink=p["sink"])[0] for s in bumped)
        fd[idx] = (up - down) / (2 * step)
    assert np.any(fd != 0)
    err = np.max(np.abs(np.asarray(grads[0])[0] - fd[0]))
    assert err <= 1e-8, err
    loss = jax.jit(lambda s: csa_indexer_loss(s, WholeTeacher(jnp.asarray(p["q"]), jnp.asarray(p["kv"])),
                                              jnp.asarray(allowed)))
    check_grads(loss, (jnp.asarray(scores),), order=1, modes=["rev"])


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_loss_positive_on_random_inputs(sparse):
    p = problem(4)
    scores, allowed, win = masks(p, sparse)
    loss, _ = loss_and_grads(jnp.asarray(scores, jnp.float32), *jx(p, "q", "kv"), jnp.asarray(allowed),
                             *jx(p, "raw"), jnp.asarray(win), *jx(p, "sink"))
    assert float(loss) > 1e-3


def test_zero_when_teacher_and_student_uniform():
    p = problem(5)
    _, allowed, win = masks(p, sparse=False)
    zeros_q, zeros_kv = jnp.zeros(p["q"].shape), jnp.zeros(p["kv"].shape)
    loss, grads = loss_and_grads(jnp.full(allowed.shape, 0.7), zeros_q, zeros_kv, jnp.asarray(allowed),
                                 *jx(p, "raw"), jnp.asarray(win), *jx(p, "sink"))
    assert abs(float(loss)) < 1e-6 and float(jnp.max(jnp.abs(grads[0]))) < 1e-6


def test_two_document_packed_batch():
    """Perfect student ~0; a wrong visible block costs; future / other-document blocks cost nothing."""
    p = problem(6, docs=[[8, 8]])
    _, allowed, win = masks(p, sparse=False)
    _, _, valid, target = ref.indexer_kl_loss(np.zeros(allowed.shape), p["q"], p["kv"], allowed)
    perfect = np.where(allowed, np.log(np.maximum(target, 1e-30)), 0.0)
    run = lambda s: loss_and_grads(jnp.asarray(s, jnp.float32), *jx(p, "q", "kv"), jnp.asarray(allowed),
                                   *jx(p, "raw"), jnp.asarray(win), *jx(p, "sink"))
    base, base_grads = run(perfect)
    assert abs(float(base)) < 1e-6, float(base)
    # query 15 (document 2, position 7) sees block 2 (doc 2, tokens 8-11) and block 3 (tokens 12-15)
    assert allowed[0, 15].tolist() == [False, False, True, True]
    assert allowed[0, 11].tolist() == [False, False, True, False]
    wrong, future, other_doc = perfect.copy(), perfect.copy(), perfect.copy()
    wrong[0, 15, 2 if target[0, 15, 2] < target[0, 15, 3] else 3] += 30.0
    future[0, 11, 3] += 30.0    # query 11 (doc 2, position 3) sees block 2; block 3 is not complete
    other_doc[0, 15, 0] += 30.0  # block 0 belongs to document 1
    assert float(run(wrong)[0]) > 0.05
    for masked in (future, other_doc):
        loss, grads = run(masked)
        assert float(loss) == float(base)
        np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(base_grads[0]))


@pytest.mark.parametrize("teacher", ["compressed", "joint"])
def test_gradient_reaches_scores_only(teacher):
    p = problem(7, docs=[[6, 10]])
    scores, allowed, win = masks(p, sparse=True)
    _, grads = loss_and_grads(jnp.asarray(scores, jnp.float32), *jx(p, "q", "kv"), jnp.asarray(allowed),
                              *jx(p, "raw"), jnp.asarray(win), *jx(p, "sink"), head_chunk=2, query_chunk=8,
                              teacher=teacher)  # in CHUNKS
    assert float(jnp.max(jnp.abs(grads[0]))) > 0
    assert np.all(np.asarray(grads[0])[~allowed] == 0)
    for g in grads[1:]:
        assert np.all(np.asarray(g) == 0)
    _, topk, head_chunk, query_chunk = next(case for case in STREAM_CASES if case[0] == teacher)
    out = streamed_and_grads(*jx(p, "qi", "ki", "wi", "q", "kv"), *jx(p, "pos", "seg", dtype=jnp.int32),
                             *jx(p, "raw", "sink"), head_chunk=head_chunk, query_chunk=query_chunk, teacher=teacher,
                             topk=topk)[1]
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in out[:3])
    assert all(np.all(np.asarray(g) == 0) for g in out[3:])


@pytest.mark.parametrize("teacher", ["compressed", "joint"])
def test_rows_with_nothing_allowed_are_nan_free(teacher):
    p = problem(8, docs=[[2, 3], [5]])  # short documents and padding: many rows see no block
    scores, allowed, win = masks(p, sparse=False)
    assert (~allowed.any(-1)).sum() > 8 and allowed.any()
    args = (*jx(p, "q", "kv"), jnp.asarray(allowed), *jx(p, "raw"), jnp.asarray(win), *jx(p, "sink"))
    loss, grads = loss_and_grads(jnp.asarray(scores, jnp.float32), *args, teacher=teacher, head_chunk=2, query_chunk=8)
    assert np.isfinite(float(loss)) and all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    none = jnp.zeros(allowed.shape, bool)
    loss, grads = loss_and_grads(jnp.asarray(scores, jnp.float32), *args[:2], none, *args[3:], teacher=teacher)
    assert float(loss) == 0.0 and all(np.all(np.asarray(g) == 0) for g in grads)
    padding = jnp.zeros(p["seg"].shape, jnp.int32)
    _, topk, head_chunk, query_chunk = next(case for case in STREAM_CASES if case[0] == teacher)
    loss, grads = streamed_and_grads(*jx(p, "qi", "ki", "wi", "q", "kv"), jnp.asarray(p["pos"], jnp.int32), padding,
                                     *jx(p, "raw", "sink"), teacher=teacher, head_chunk=head_chunk,
                                     query_chunk=query_chunk, topk=topk)
    assert float(loss) == 0.0 and all(np.all(np.asarray(g) == 0) for g in grads)


def test_low_precision_inputs_compute_in_float32():
    p = problem(9)
    scores, allowed, win = masks(p, sparse=False)
    args = (jnp.asarray(allowed), *jx(p, "raw"), jnp.asarray(win), *jx(p, "sink"))
    rounded = [x.astype(jnp.float32) for x in jx(p, "q", "kv", dtype=jnp.bfloat16)]
    want, _ = loss_and_grads(jnp.asarray(scores, jnp.bfloat16).astype(jnp.float32), *rounded, *args)
    loss, grads = loss_and_grads(jnp.asarray(scores, jnp.bfloat16), *jx(p, "q", "kv", dtype=jnp.bfloat16), *args)
    assert loss.dtype == jnp.float32 and grads[0].dtype == jnp.bfloat16
    assert abs(float(loss) - float(want)) <= 1e-5 * float(want)


def test_invalid_arguments_raise():
    p = problem(10)
    scores, allowed, teacher = jnp.zeros((2, 16, 4)), jnp.ones((2, 16, 4), bool), WholeTeacher(*jx(p, "q", "kv"))
    with pytest.raises(ValueError, match="head_chunk=3"):
        csa_indexer_loss(scores, teacher, allowed, head_chunk=3)
    with pytest.raises(ValueError, match="query_chunk=5"):
        csa_indexer_loss(scores, teacher, allowed, query_chunk=5)
    with pytest.raises(ValueError, match="joint"):
        csa_indexer_loss(scores, dataclasses.replace(teacher, kind="joint"), allowed)
    with pytest.raises(ValueError, match="unknown"):
        csa_indexer_loss(scores, dataclasses.replace(teacher, kind="dense"), allowed)
    ki, wi, q, kv, pos, seg = jx(p, "ki", "wi", "q", "kv", "pos", "seg")
    with pytest.raises(ValueError, match="indexer heads"):
        csa_indexer_loss_streamed(IndexerInputs(RowQueries.given(jnp.zeros((2, 16, 2, 8))), ki, wi),
                                  RowQueries.given(q), Keys(None, None, 0, kv), pos, seg, head_chunk=4)


# ----------------------------------------------------------------------------- chunking


@pytest.mark.parametrize("teacher", ["compressed", "joint"])
def test_chunk_combinations_match_direct(teacher):
    """Head chunks only, query chunks only, both (the property test adds (1, 4) on random masks)."""
    p = problem(11, docs=[[9, 7], [16]])
    scores, allowed, win = masks(p, sparse=True)
    args = (jnp.asarray(scores, jnp.float32), *jx(p, "q", "kv"), jnp.asarray(allowed), *jx(p, "raw"),
            jnp.asarray(win), *jx(p, "sink"))
    want, want_grads = loss_and_grads(*args, teacher=teacher)
    for head_chunk, query_chunk in CHUNKS[teacher]:
        loss, grads = loss_and_grads(*args, head_chunk=head_chunk, query_chunk=query_chunk, teacher=teacher)
        assert abs(float(loss) - float(want)) <= 1e-5 * float(want), (head_chunk, query_chunk)
        assert rel_err(grads[0], want_grads[0]) <= 1e-5, (head_chunk, query_chunk)


@pytest.mark.parametrize(("teacher", "topk", "head_chunk", "query_chunk"), STREAM_CASES)
def test_streamed_matches_direct(teacher, topk, head_chunk, query_chunk):
    """Value and every gradient equal the direct path's (indexer_scores, top-k, csa_indexer_loss)."""
    p = problem(12, docs=[[9, 7], [16]])
    inputs = (*jx(p, "qi", "ki", "wi", "q", "kv"), *jx(p, "pos", "seg", dtype=jnp.int32), *jx(p, "raw", "sink"))
    want, want_grads = direct_from_indexer(*inputs, teacher, topk)
    loss, grads = streamed_and_grads(*inputs, head_chunk=head_chunk, query_chunk=query_chunk, teacher=teacher, topk=topk)
    assert float(want) > 0 and abs(float(loss) - float(want)) <= 1e-5 * float(want)
    for got, ref_grad in zip(grads[:3], want_grads):
        assert rel_err(got, ref_grad) <= 1e-5, rel_err(got, ref_grad)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    t=st.sampled_from([8, 16]),
    density=st.floats(0.0, 1.0),
)
def test_property_kl_nonnegative_and_chunk_parity(seed, t, density):
    """Random masks (any pattern, empty rows included): KL >= 0, chunked == direct == reference."""
    rng = np.random.default_rng(seed)
    p = problem(seed, b=2, t=t)
    allowed = rng.random((2, t, t // RATIO)) < density
    scores = rng.normal(size=allowed.shape) * 3
    want, kl_rows, _, _ = ref.indexer_kl_loss(scores, p["q"], p["kv"], allowed, scale=0.5)
    assert np.all(kl_rows >= -1e-12)
    args = (jnp.asarray(scores, jnp.float32), *jx(p, "q", "kv"), jnp.asarray(allowed), *jx(p, "raw"),
            jnp.asarray(ref.window(p["pos"], p["seg"], WINDOW)), *jx(p, "sink"))
    direct, direct_grads = loss_and_grads(*args)
    head_chunk, query_chunk = (2, 8) if t == 16 else (1, 4)  # (2, 8) is CHUNKS': jit's cache
    loss, grads = loss_and_grads(*args, head_chunk=head_chunk, query_chunk=query_chunk)
    # float32 cannot resolve the ~1e-9 that the 1e-8 epsilons add to single-block rows: atol 1e-7
    assert float(direct) >= 0 and abs(float(direct) - want) <= 1e-5 * want + 1e-7
    assert abs(float(loss) - float(direct)) <= 1e-5 * float(direct) + 1e-7
    scale = max(float(jnp.max(jnp.abs(direct_grads[0]))), 1e-6)
    assert np.max(np.abs(np.asarray(grads[0]) - np.asarray(direct_grads[0]))) <= 1e-5 * scale


# ----------------------------------------------------------------------------- zero-initialised indexer weights


def _value(v):
    return np.asarray(v.get_value() if hasattr(v, "get_value") else v)


def _indexer_pair(seed=3):
    from flax import nnx

    from core.model.layers import Indexer, IndexerSpec
    from core.model.layers import rope_frequencies

    rope = rope_frequencies(4, 50.0)
    make = lambda init: Indexer(IndexerSpec(16, 8, 4, 8, rope, 1e-6, weights_init=init),  # noqa: E731
                                rngs=nnx.Rngs(seed))
    return make("fan_in"), make("zeros")


def test_zero_weights_init_is_a_uniform_student_and_changes_nothing_else(x64):
    """weights_init="zeros": weights_proj = 0, every other parameter as with "fan_in" (same keys); the
    scores are 0, so the loss is KL(P || uniform) of the float64 reference; at that point the
    gradient reaches weights_proj only (q and k are multiplied by the zero weights)."""
    from flax import nnx

    fan_in, zeros = _indexer_pair()
    a, b = (dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in (fan_in, zeros))
    assert a.keys() == b.keys()
    for k in a:
        same = np.array_equal(_value(a[k]), _value(b[k]))
        assert same == (k != ("weights_proj",)), k
    assert not np.any(np.asarray(zeros.weights_proj[...])) and np.any(np.asarray(fan_in.weights_proj[...]))

    rng = np.random.default_rng(0)
    bsz, t, h, d = 2, 16, 4, 8
    pos, seg = (np.stack(z) for z in zip(*[packed([t], t)] * bsz))
    x, c_q = rng.normal(size=(bsz, t, 16)), rng.normal(size=(bsz, t, 8))
    q, kv = rng.normal(size=(bsz, t, h, d)) * d**-0.5 * 3, rng.normal(size=(bsz, t // RATIO, d))
    vis = ref.visible(pos, seg, RATIO)

    def loss(model):  # the indexer's scores as the attention computes whole rows (core/model/attention.py)
        index = model.inputs(jnp.asarray(x), jnp.asarray(c_q), jnp.asarray(pos))
        scores = indexer_scores(index.queries.whole(jnp.asarray(pos)).inputs, *index[1:], jnp.asarray(vis))
        return csa_indexer_loss(scores, WholeTeacher(jnp.asarray(q), jnp.asarray(kv)), jnp.asarray(vis)), scores

    # one compiled program, not one small compile per eager op of the forward and backward
    (value, scores), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(zeros)
    assert not np.any(np.asarray(scores)[vis])
    uniform = ref.indexer_kl_loss(np.zeros((bsz, t, t // RATIO)), q, kv, vis)[0]
    np.testing.assert_allclose(float(value), uniform, rtol=1e-12)
    flat = dict(nnx.to_flat_state(grads))
    for k, g in flat.items():
        assert np.any(_value(g)) == (k == ("weights_proj",)), k


def test_unknown_weights_init_raises():
    from flax import nnx

    from core.model.layers import Indexer, IndexerSpec
    from core.model.layers import rope_frequencies

    with pytest.raises(ValueError, match="weights_init='normal' is unknown"):
        Indexer(IndexerSpec(16, 8, 4, 8, rope_frequencies(4, 50.0), 1e-6, weights_init="normal"), rngs=nnx.Rngs(0))
