"""The streamed evaluation (core/eval/metrics.py, core/eval/evaluate.py) equals the dense reference
(tests/dense_eval.py) to float32 rounding, every figure, and its compiled step grows linearly in T.

* `layer_sums` on given inputs (packed rows, a padded row, several k, query blocks and head groups)
  = the dense `layer_sums` fed the same random draws, in float64 (float32 where the indexer scores enter).
* The eval step on a two-CSA-layer tiny model (packed rows, a padded row, several k, csa_query_chunk_size and
  csa_qk_head_chunk_size set) = `dense_eval.dense_step`: every metric sum, both LM losses.
* Memory: the compiled eval step's temporaries at 4T are at most 4x those at T (XLA's memory
  analysis; the dense step's grow about 16x).
"""

from __future__ import annotations

import functools
import pytest
from tests import dense_eval, reference_eval as ref
from tests.conftest import init_model, tiny_config

import jax
import jax.numpy as jnp
import numpy as np

from core.eval import evaluate as ev, metrics
from core.eval.rows import EVAL_KEYS, row_keys
from core.ops.chunked_attention import RowQueries
from core.ops.topk import IndexerInputs, indexer_scores
from core.spec.resolve import resolve

KS = (1, 2, 4, 7)


def _packing(t: int):
    """Two rows: three documents packed; one document then padding."""
    seg = np.array([[1] * 10 + [2] * 14 + [3] * (t - 24), [1] * (t - 9) + [0] * 9], np.int32)
    pos = np.zeros_like(seg)
    for b in range(2):
        for s in np.unique(seg[b][seg[b] > 0]):
            idx = np.flatnonzero(seg[b] == s)
            pos[b, idx] = np.arange(len(idx))
    return pos, seg


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(a, np.float64) for p, a in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_close(got, want, atol, rtol=0.0):
    got, want = _leaves(got), _leaves(want)
    assert got.keys() == want.keys()
    for name in want:
        diff = np.abs(got[name] - want[name]).max()
        assert diff <= atol + rtol * np.abs(want[name]).max(), f"{name}: max |diff| = {diff:.3e}"


def test_layer_sums_equal_the_dense_sums_float64(x64):
    """Query blocks of 16 rows, head groups of 1. The indexer scores are float32 by definition
    (DESIGN.md), so figures that go through them agree to float32 rounding, the rest to 1e-10."""
    rows, head_chunk = 16, 1
    rng = np.random.default_rng(0)
    b, t, h, d, hi, di = 2, 48, 2, 8, 2, 4
    pos, seg = _packing(t)
    q = rng.normal(size=(b, t, h, d)) * d ** -0.5
    kv = rng.normal(size=(b, t // 4, d))
    q_i, k_i, w_i = rng.normal(size=(b, t, hi, di)), rng.normal(size=(b, t // 4, di)), rng.normal(size=(b, t, hi))
    keys = row_keys(7, jnp.arange(3, 3 + b))
    index = IndexerInputs(RowQueries.given(jnp.asarray(q_i)), jnp.asarray(k_i), jnp.asarray(w_i))
    got = jax.jit(functools.partial(metrics.layer_sums, ks=KS, head_chunk=head_chunk), static_argnums=5)(
        index, RowQueries.given(jnp.asarray(q)), jnp.asarray(kv), jnp.asarray(pos), jnp.asarray(seg), rows, keys_b=keys)
    vis = ref.visible(pos, seg, 4)
    scores = indexer_scores(jnp.asarray(q_i), jnp.asarray(k_i), jnp.asarray(w_i), jnp.asarray(vis))
    want = dense_eval.layer_sums(jnp.asarray(q), jnp.asarray(kv), scores, jnp.asarray(vis),
                                 metrics.random_rows(keys, 0, t, t // 4), KS)
    _assert_close(got, want, atol=1e-10, rtol=1e-6)
    teacher_only = ("recall_oracle", "recall_recent", "recall_random", "kl_uniform")
    _assert_close({m: got["sums"]["all"][m] for m in teacher_only}, {m: want["sums"]["all"][m] for m in teacher_only},
                  atol=1e-10)
    assert int(got["valid"]) == int(vis.any(-1).sum()) and 0 < int(got["informative"][-1]) < int(got["valid"])


def test_random_draws_depend_on_the_row_and_position_only():
    draws = jax.jit(lambda rows, t0, n: metrics.random_rows(row_keys(0, rows), t0, n, 5), static_argnums=2)
    whole = draws(jnp.arange(3), 0, 8)
    np.testing.assert_array_equal(np.asarray(draws(jnp.arange(3), 4, 4)), np.asarray(whole[:, 4:]))
    np.testing.assert_array_equal(np.asarray(draws(jnp.arange(1, 3), 0, 8)), np.asarray(whole[1:]))
    assert not np.array_equal(np.asarray(whole[0]), np.asarray(whole[1]))


@pytest.fixture(scope="module")
def tiny():
    """The tiny test model with a random (not uniform) indexer, and a packed batch with a padded row."""
    cfg = tiny_config("warmup", "compress_ratios=[4,4]", "base_num_decoder_layers=2", "indexer_weights_init=fan_in",
                      "indexer_topk=4", "csa_query_chunk_size=32", "csa_qk_head_chunk_size=2")
    t = cfg.max_target_length
    pos, seg = _packing(t)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, seg.shape).astype(np.int32)
    batch = {"tokens": tokens, "positions": pos, "segment_ids": seg, "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": (seg > 0).astype(np.int32), "rows": np.array([4, 9], np.int32)}
    return cfg, init_model(cfg, 0), {k: jnp.asarray(x) for k, x in batch.items()}


def test_eval_step_equals_the_dense_step(tiny):
    from flax import nnx

    cfg, model, batch = tiny
    ks = (2, 4, 8)
    got = ev.make_eval_step(ev.StepSpec.of(resolve(cfg, "cpu").cfg, ks, seed=5))(model, batch)
    want = nnx.jit(lambda m, b: dense_eval.dense_step(m, b, ks, 5))(model, batch)
    _assert_close(got, want, atol=1e-5, rtol=1e-5)
    sums = _leaves(got[0])
    assert sums["['sums']['all']['kl']"].min() > 0 and sums["['informative']"].min() > 0
    assert float(got[3]) == float(np.asarray(batch["loss_mask"]).sum())


def _temp_bytes(cfg, length: int, spec) -> int:
    """Temporaries of the eval step's dense program (the one that streams the metrics; the top-k
    one is the model's inference forward) compiled for one row of `length` tokens (abstract
    inputs: nothing runs)."""
    from flax import nnx

    from core.model.transformer import abstract

    cfg = cfg.replace(max_target_length=length)
    model = abstract(resolve(cfg, "cpu").model)
    batch = {k: jax.ShapeDtypeStruct((1, length), jnp.int32) for k in EVAL_KEYS}
    batch["rows"] = jax.ShapeDtypeStruct((1,), jnp.int32)
    return nnx.jit(ev.eval_step(spec, "dense")).lower(model, batch).compile().memory_analysis().temp_size_in_bytes


def test_eval_step_memory_is_linear_in_t():
    """One CSA layer: temp at 1024 tokens <= 4x temp at 256 tokens."""
    cfg = tiny_config("warmup", "compress_ratios=[4]", "base_num_decoder_layers=1", "first_num_hash_layers=0",
                      "indexer_topk=4")
    spec = ev.StepSpec.of(resolve(cfg, "cpu").cfg, (4, 16))
    short, long = _temp_bytes(cfg, 256, spec), _temp_bytes(cfg, 1024, spec)
    assert long <= 4 * short, f"temp {short} B at T=256, {long} B at T=1024: {long / short:.2f}x for 4x the tokens"
