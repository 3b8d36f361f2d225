"""core.ops.chunked_attention and the pure functions of core.model.attention against tests/reference_loss.py.

DESIGN.md "Block segment", "Visibility", "Lightning indexer"; issue 4 (the T=16 warm-up mask).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from tests import reference_loss as ref
from tests.conftest import packed

import jax
import jax.numpy as jnp
import numpy as np

from core.ops.chunked_attention import NEG, block_segment_ids
from core.ops.masked_attention import csa_visible, selection_mask, sliding_window_mask
from core.ops.topk import indexer_scores, select_topk

visible = jax.jit(csa_visible, static_argnums=2)
window = jax.jit(sliding_window_mask, static_argnums=2)
scores_fn = jax.jit(indexer_scores, static_argnames="head_chunk")
topk_fn = jax.jit(select_topk, static_argnums=2)


def batch(*rows, t):
    pairs = [packed(lengths, t) for lengths in rows]
    return np.stack([p for p, _ in pairs]), np.stack([s for _, s in pairs])


# ----------------------------------------------------------------------------- visibility


def test_dense_warmup_mask_t16():
    """Row 0 sees nothing, row 3 block 0, row 7 blocks 0-1, row 15 all four (issue 4)."""
    pos, seg = batch([16], t=16)
    vis = np.asarray(visible(pos, seg, 4))[0]
    assert not vis[0].any() and not vis[1].any() and not vis[2].any()
    assert vis[3].tolist() == [True, False, False, False]
    assert vis[7].tolist() == [True, True, False, False]
    assert vis[15].tolist() == [True, True, True, True]
    # a block appears exactly at its last token: t sees blocks 0 .. (t + 1) // 4 - 1
    expected = np.array([[w < (t + 1) // 4 for w in range(4)] for t in range(16)])
    np.testing.assert_array_equal(vis, expected)


def test_block_segment_ids_straddle_and_padding():
    _, seg = batch([6, 6], t=16)  # doc 1: tokens 0-5, doc 2: 6-11, padding 12-15
    np.testing.assert_array_equal(np.asarray(block_segment_ids(jnp.asarray(seg), 4))[0], [1, -1, 2, 0])


def test_packed_documents_and_padding():
    pos, seg = batch([6, 6], t=16)
    vis = np.asarray(visible(pos, seg, 4))[0]
    assert not vis[:, 1].any(), "a block straddling two documents is never visible"
    assert not vis[:, 3].any(), "an all-padding block is never visible"
    assert not vis[12:].any(), "padding queries see nothing"
    assert vis[5].tolist() == [True, False, False, False]
    assert not vis[6:11].any(), "document 2 does not see document 1's block, nor its own before complete"
    assert vis[11].tolist() == [False, False, True, False]


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), ratio=st.sampled_from([2, 4]))
def test_visibility_and_window_match_reference(lengths, ratio):
    t = 24
    lengths = [n for n in lengths if n > 0]
    while sum(lengths) > t:
        lengths.pop()
    pos, seg = batch(lengths, [t], t=t)
    np.testing.assert_array_equal(np.asarray(visible(pos, seg, ratio)), ref.visible(pos, seg, ratio))
    np.testing.assert_array_equal(np.asarray(window(pos, seg, 3)), ref.window(pos, seg, 3))


def test_sliding_window_edges():
    pos, seg = batch([5, 3], t=10)
    win = np.asarray(window(pos, seg, 1))[0]
    np.testing.assert_array_equal(win, np.diag(seg[0] >= 1))
    win = np.asarray(window(pos, seg, 3))[0]
    assert win[4].tolist() == [False, False, True, True, True] + [False] * 5
    assert win[6].tolist() == [False] * 5 + [True, True] + [False] * 3, "never across the document start"
    assert not win[8:].any() and not win[:, 8:].any(), "padding is in nobody's window"


# ----------------------------------------------------------------------------- indexer


def _indexer_inputs(seed, b=2, t=16, hi=4, di=8):
    rng = np.random.default_rng(seed)
    pos, seg = batch([9, 7], [16], t=t) if b == 2 else batch([t], t=t)
    return (rng.normal(size=(b, t, hi, di)).astype(np.float32), rng.normal(size=(b, t // 4, di)).astype(np.float32),
            rng.normal(size=(b, t, hi)).astype(np.float32), ref.visible(pos, seg, 4))


def test_indexer_scores_match_reference_and_mask():
    q, k, w, vis = _indexer_inputs(0)
    got = np.asarray(scores_fn(q, k, w, vis))
    want = ref.indexer_scores(q.astype(np.float64), k.astype(np.float64), w.astype(np.float64))
    assert got.dtype == np.float32
    err = np.max(np.abs(got[vis] - want[vis])) / np.max(np.abs(want[vis]))
    assert err <= 1e-5, err
    assert np.all(got[~vis] == NEG)


@pytest.mark.parametrize("head_chunk", [1, 2])
def test_indexer_head_chunks_match_and_select_identically(head_chunk):
    q, k, w, vis = _indexer_inputs(1)
    full = scores_fn(q, k, w, vis, head_chunk=0)
    chunked = scores_fn(q, k, w, vis, head_chunk=head_chunk)
    err = float(jnp.max(jnp.abs(full - chunked)) / jnp.max(jnp.abs(jnp.where(vis, full, 0))))
    assert err <= 1e-6, err
    for idx_a, idx_b in zip(topk_fn(full, vis, 3), topk_fn(chunked, vis, 3)):
        np.testing.assert_array_equal(np.asarray(idx_a), np.asarray(idx_b))
    with pytest.raises(ValueError, match="head_chunk=3"):
        indexer_scores(q, k, w, vis, head_chunk=3)


# ----------------------------------------------------------------------------- top-k


def test_select_topk_ties_go_to_the_lower_index():
    scores = jnp.zeros((1, 1, 6))
    vis = jnp.array([[[False, True, True, True, False, True]]])
    idx, ok = topk_fn(scores, vis, 2)
    assert np.asarray(idx)[0, 0].tolist() == [1, 2] and np.asarray(ok).all()


def test_select_topk_k_eff_and_never_invisible():
    q, k, w, vis = _indexer_inputs(2)
    scores = scores_fn(q, k, w, vis)
    idx, ok = (np.asarray(x) for x in topk_fn(scores, vis, 3))
    n_visible = vis.sum(-1)
    np.testing.assert_array_equal(ok.sum(-1), np.minimum(3, n_visible))
    assert np.all(np.take_along_axis(vis, idx, -1)[ok]), "a valid selection is always visible"
    want = ref.topk_mask(np.asarray(scores, np.float64), vis, 3)
    np.testing.assert_array_equal(np.asarray(selection_mask(idx, ok, vis.shape[-1])), want)
    idx_all, ok_all = topk_fn(scores, vis, 99)  # k clipped to W
    assert idx_all.shape[-1] == vis.shape[-1]
    np.testing.assert_array_equal(np.asarray(ok_all).sum(-1), n_visible)
