"""The indexer-quality metrics' definitions against loop-based float64 references: the dense
formulation (tests/dense_eval.py, which the streamed evaluation must equal: tests/eval/test_streamed.py)
and core/eval/report.py's pooling and derived figures."""

from __future__ import annotations

import json
import pytest
from tests import dense_eval as eval_metrics, reference_eval as ref

import jax
import jax.numpy as jnp
import numpy as np

from core.eval import evaluate as ev, report
from core.ops.chunked_attention import NEG
from core.ops.masked_attention import csa_visible

KS = (1, 4)
# Jitted once per module: a handful of compiles instead of hundreds of eager per-op ones.
row_metrics = jax.jit(eval_metrics.row_metrics, static_argnums=4)
layer_sums = jax.jit(eval_metrics.layer_sums, static_argnums=5)
batch_sums = jax.jit(eval_metrics.batch_sums, static_argnums=2)
dense_teacher = jax.jit(eval_metrics.dense_teacher)
row_kl = jax.jit(eval_metrics.row_kl)


def _packed_case(seed, dtype=np.float64):
    """Two packed rows (two documents; one document then padding), random teacher and indexer."""
    rng = np.random.default_rng(seed)
    b, t, h, d = 2, 32, 3, 8
    seg = np.array([[1] * 10 + [2] * 22, [1] * 27 + [0] * 5])
    pos = np.array([list(range(10)) + list(range(22)), list(range(27)) + [0] * 5])
    vis = ref.visible(pos, seg, 4)
    q = rng.normal(size=(b, t, h, d)) * d ** -0.5
    kv = rng.normal(size=(b, t // 4, d))
    scores = np.where(vis, rng.normal(size=vis.shape), NEG)
    rand = rng.uniform(size=vis.shape)
    return [x.astype(dtype) if x.dtype.kind == "f" else x for x in (q, kv, scores, vis, rand)], (pos, seg)


def _means(sums, j, subset_key, count):
    return {m: float(sums["sums"][subset_key][m][j]) / count for m in eval_metrics.METRICS}


def test_visibility_matches_the_reference():
    (_, _, _, vis, _), (pos, seg) = _packed_case(0)
    np.testing.assert_array_equal(np.asarray(csa_visible(jnp.asarray(pos), jnp.asarray(seg), 4)), vis)


def test_dense_teacher_float64(x64):
    (q, kv, _, vis, _), _ = _packed_case(1)
    got = np.asarray(dense_teacher(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(vis)))
    want = ref.teacher(q, kv, vis)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"max diff {np.abs(got - want).max()}")


def test_layer_sums_float32_jit():
    (q, kv, scores, vis, rand), _ = _packed_case(4, np.float32)
    sums = layer_sums(*map(jnp.asarray, (q, kv, scores, vis, rand)), KS)
    for j, k in enumerate(KS):
        want_all, want_inf, n_valid, n_inf = ref.layer_means(*(x.astype(np.float64) if x.dtype.kind == "f" else x
                                                               for x in (q, kv, scores, vis, rand)), k)
        got_all = _means(sums, j, "all", n_valid)
        got_inf = _means(sums, j, "informative", n_inf)
        for m in eval_metrics.METRICS:
            assert abs(got_all[m] - want_all[m]) < 1e-5, (k, m, got_all[m], want_all[m])
            assert abs(got_inf[m] - want_inf[m]) < 1e-5, (k, m, got_inf[m], want_inf[m])


def test_perfect_indexer(x64):
    """Indexer scores = log P: KL 0, overlap 1, recall = the oracle's; a teacher whose mass sits
    on <= k blocks is then fully recalled."""
    (q, kv, _, vis, rand), _ = _packed_case(5)
    p = ref.teacher(q, kv, vis)
    scores = np.where(vis, np.log(p + 1e-300), NEG)
    r = row_metrics(*map(jnp.asarray, (p, scores, vis, rand)), 2)
    valid = np.asarray(r["valid"])
    np.testing.assert_allclose(np.asarray(r["kl"])[valid], 0.0, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(r["overlap"])[valid], 1.0)
    np.testing.assert_array_equal(np.asarray(r["recall"]), np.asarray(r["recall_oracle"]))
    # a teacher concentrated on the two most recent blocks: a perfect top-2 recalls everything
    conc = np.zeros_like(p)
    for b, t in zip(*np.nonzero(vis.any(-1))):
        ws = np.flatnonzero(vis[b, t])[-2:]
        conc[b, t, ws] = 1.0 / len(ws)
    r = row_metrics(*map(jnp.asarray, (conc, conc, vis, rand)), 2)
    valid = np.asarray(r["valid"])
    np.testing.assert_allclose(np.asarray(r["recall"])[valid], 1.0, atol=1e-15)
    np.testing.assert_allclose(np.asarray(r["recall_recent"])[valid], 1.0, atol=1e-15)


def test_teachers_own_topk_overlaps_fully():
    (q, kv, _, vis, rand), _ = _packed_case(6, np.float32)
    p = dense_teacher(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(vis))
    r = row_metrics(p, p, jnp.asarray(vis), jnp.asarray(rand), 2)
    valid = np.asarray(r["valid"])
    np.testing.assert_array_equal(np.asarray(r["overlap"])[valid], 1.0)
    np.testing.assert_array_equal(np.asarray(r["recall"]), np.asarray(r["recall_oracle"]))


def test_recency_and_edge_rows_by_hand():
    """One document of 16 tokens (4 blocks). Row t=15 sees blocks 0..3, t=8 sees 0..1, t=2 none."""
    vis = np.zeros((1, 16, 4), bool)
    vis[0, 15] = True
    vis[0, 8, :2] = True
    p = np.zeros((1, 16, 4), np.float32)
    p[0, 15] = [0.4, 0.1, 0.3, 0.2]
    p[0, 8, :2] = [0.75, 0.25]
    scores = np.where(vis, np.array([0.0, 3.0, 2.0, 1.0]), NEG).astype(np.float32)  # picks 1, 2
    rand = np.broadcast_to(np.array([9.0, 0.0, 0.0, 8.0], np.float32), vis.shape)   # picks 0, 3
    r = {n: np.asarray(v) for n, v in row_metrics(*map(jnp.asarray, (p, scores, vis, rand)), 2).items()}
    assert r["valid"][0].tolist() == [i in (8, 15) for i in range(16)]
    assert r["informative"][0, 15] and not r["informative"][0, 8]
    assert r["recall_recent"][0, 15] == pytest.approx(0.3 + 0.2, abs=1e-6)   # blocks 2, 3
    assert r["recall"][0, 15] == pytest.approx(0.1 + 0.3, abs=1e-6)          # blocks 1, 2
    assert r["recall_random"][0, 15] == pytest.approx(0.4 + 0.2, abs=1e-6)   # blocks 0, 3
    assert r["recall_oracle"][0, 15] == pytest.approx(0.4 + 0.3, abs=1e-6)   # blocks 0, 2
    assert r["overlap"][0, 15] == pytest.approx(0.5)                         # {1,2} & {0,2}
    for m in ("recall", "recall_recent", "recall_random", "recall_oracle", "overlap"):
        assert r[m][0, 8] == pytest.approx(1.0, abs=1e-6), m  # <= k visible: trivially perfect
        assert r[m][0, 2] == 0.0 and np.isfinite(r[m]).all(), m
    assert np.isfinite(r["kl"]).all() and r["kl"][0, 2] == 0.0


def test_kl_is_nonnegative_and_zero_without_visible_blocks():
    (q, kv, scores, vis, rand), _ = _packed_case(7, np.float32)
    p = dense_teacher(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(vis))
    kl = np.asarray(row_kl(p, jnp.asarray(scores), jnp.asarray(vis)))
    assert (kl >= -1e-6).all() and np.isfinite(kl).all()
    assert (kl[~vis.any(-1)] == 0).all()


@pytest.mark.parametrize("seed", [14, 15])
def test_mean_kl_is_the_dense_indexer_loss(x64, seed):
    """Mean row KL over valid rows = core.loss.indexer_kl_direct.csa_indexer_loss(allowed=visible, scale=1)."""
    from core.loss.indexer_kl_direct import WholeTeacher, csa_indexer_loss

    (q, kv, scores, vis, _), _ = _packed_case(seed)
    q, kv, scores, vis = map(jnp.asarray, (q, kv, scores, vis))
    kl = row_kl(dense_teacher(q, kv, vis), scores, vis)
    got = float(jnp.sum(kl) / jnp.sum(jnp.any(vis, axis=-1)))
    want = float(jax.jit(csa_indexer_loss)(scores, WholeTeacher(q, kv), vis))
    assert abs(got - want) < 1e-10, (got, want)


def test_token_nll_float64(x64):
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(2, 5, 11))
    targets = rng.integers(0, 11, size=(2, 5))
    weights = (rng.uniform(size=(2, 5)) > 0.3).astype(np.float64)
    got = eval_metrics.token_nll(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    want = ref.nll_sums(logits, targets, weights)
    assert abs(float(got[0]) - want[0]) < 1e-10 and abs(float(got[1]) - want[1]) < 1e-12


def test_metric_sums_pool_rows_across_batches_and_layers(x64):
    """Two batches x two layers through batch_sums + MetricSums = the reference on all rows."""
    cases = [_packed_case(s)[0] for s in (10, 11, 12, 13)]
    acc = report.MetricSums(layers=(2, 4), ks=KS)
    for batch in (cases[:2], cases[2:]):  # a batch holds layers (2, 4)
        aux = {name: jnp.asarray(np.stack([c[i] for c in batch]))
               for i, name in enumerate(("teacher_query", "compressed_kv", "index_scores", "visible"))}
        acc.add(jax.tree.map(np.asarray, batch_sums(aux, jnp.asarray(np.stack([c[4] for c in batch])), KS)))
    layers, overall = acc.layer_reports(), acc.overall()
    for j, k in enumerate(KS):
        per_layer = [[ref.layer_means(*c, k) for c in (cases[i], cases[i + 2])] for i in (0, 1)]
        for li, layer in enumerate(layers):
            (a0, i0, v0, n0), (a1, i1, v1, n1) = per_layer[li]
            assert layer["valid_rows"] == v0 + v1 and layer["by_k"][j]["informative_rows"] == n0 + n1
            for m in eval_metrics.METRICS:
                want = (a0[m] * v0 + a1[m] * v1) / (v0 + v1)
                assert abs(layer["by_k"][j]["all"][m] - want) < 1e-10, (k, m)
                want = (i0[m] * n0 + i1[m] * n1) / (n0 + n1)
                assert abs(layer["by_k"][j]["informative"][m] - want) < 1e-10, (k, m)
        rows = [x for pl in per_layer for x in pl]
        n_all, n_inf = sum(x[2] for x in rows), sum(x[3] for x in rows)
        assert overall["by_k"][j]["informative_share"] == pytest.approx(n_inf / n_all, abs=1e-15)
        for m in eval_metrics.METRICS:
            want = sum(x[1][m] * x[3] for x in rows) / n_inf
            assert abs(overall["by_k"][j]["informative"][m] - want) < 1e-10, (k, m)
        for subset, (mi, ni) in (("all", (0, 2)), ("informative", (1, 3))):  # derived from the pooled means
            pooled = {m: sum(x[mi][m] * x[ni] for x in rows) / sum(x[ni] for x in rows) for m in eval_metrics.METRICS}
            got = overall["by_k"][j][subset]
            assert abs(got["kl_captured"] - ref.kl_captured(pooled["kl"], pooled["kl_uniform"])) < 1e-10, (k, subset)
            want = ref.gain(pooled["recall"], pooled["recall_oracle"], pooled["recall_random"])
            assert abs(got["gain"] - want) < 1e-10, (k, subset)


EVAL_KEYS = {"checkpoint", "ks", "indexer_topk", "batches", "rows", "tokens", "seed", "lm_loss", "layers", "overall",
             "topk_binds_share", "warnings"}
ROW_KEYS = {"valid_rows", "by_k"}
K_KEYS = {"k", "informative_rows", "informative_share", "all", "informative"}


def test_report_schema_is_stable_and_json_safe():
    acc = report.MetricSums(layers=(2,), ks=(4, 8))
    result = report.IndexerEval(ks=(4, 8), indexer_topk=4, batches=0, rows=0, tokens=0, lm_loss_dense=None,
                            lm_loss_topk=None, layers=acc.layer_reports(), overall=acc.overall(), seed=0)
    d = json.loads(json.dumps(result.to_dict()))
    assert set(d) == EVAL_KEYS and set(d["lm_loss"]) == {"dense", "topk", "gap"}
    assert set(d["overall"]) == ROW_KEYS and set(d["layers"][0]) == ROW_KEYS | {"layer"}
    for entry in d["overall"]["by_k"]:
        assert set(entry) == K_KEYS
        assert set(entry["all"]) == set(entry["informative"]) == set(eval_metrics.METRICS) | set(report.DERIVED)
        assert entry["all"]["recall"] is None and entry["all"]["gain"] is None  # no rows: null, never NaN


def _hand_case():
    """One document of 16 tokens (4 blocks): row t=15 sees blocks 0..3, t=8 sees 0..1, t=2 none."""
    vis = np.zeros((1, 16, 4), bool)
    vis[0, 15] = True
    vis[0, 8, :2] = True
    p = np.zeros((1, 16, 4))
    p[0, 15] = [0.4, 0.1, 0.3, 0.2]
    p[0, 8, :2] = [0.75, 0.25]
    rand = np.broadcast_to(np.array([9.0, 0.0, 0.0, 8.0]), vis.shape)  # random top-2 = blocks 0, 3
    return p, vis, rand


def _derived_means(p, scores, vis, rand, k):
    """report.derived of the row means (all valid rows, informative rows) of one layer."""
    r = {n: np.asarray(v, np.float64) for n, v in row_metrics(*map(jnp.asarray, (p, scores, vis, rand)), k).items()}
    out = []
    for key in ("valid", "informative"):
        rows = r[key].astype(bool)
        out.append(report.derived({m: float(r[m][rows].mean()) for m in eval_metrics.METRICS}))
    return out


def test_kl_captured_and_gain_float64_by_hand(x64):
    """Perfect indexer: gain 1, kl_captured 1; uniform student: kl_captured 0; a poor one by hand."""
    p, vis, rand = _hand_case()
    uniform_kl = [sum(x * np.log(x * n) for x in row if x > 0) for row, n in (([0.4, 0.1, 0.3, 0.2], 4), ([0.75, 0.25], 2))]
    perfect = np.where(vis, np.log(p + 1e-300), NEG)
    every, informative = _derived_means(p, perfect, vis, rand, 2)
    assert informative["gain"] == pytest.approx(1.0, abs=1e-12)  # recall 0.7 = oracle on row 15
    # kl of scores log P is sum P (log(P + 1e-8) - log P) ~ 1e-8 per block, not exactly 0
    assert every["kl_captured"] == pytest.approx(1.0, abs=1e-6) and informative["kl_captured"] == pytest.approx(1.0, abs=1e-6)
    assert every["kl_uniform"] == pytest.approx(np.mean(uniform_kl), abs=1e-7)
    every, informative = _derived_means(p, np.where(vis, 0.0, NEG), vis, rand, 2)
    assert abs(every["kl_captured"]) < 1e-12 and abs(informative["kl_captured"]) < 1e-12
    poor = np.where(vis, np.array([0.0, 3.0, 2.0, 1.0]), NEG)  # picks blocks 1, 2: recall 0.4
    _, informative = _derived_means(p, poor, vis, rand, 2)
    want = ref.gain(0.4, 0.7, 0.6)
    assert want == pytest.approx(-2.0) and informative["gain"] == pytest.approx(want, abs=1e-12)
    kl15 = ref.kl_row(p[0, 15], poor[0, 15], vis[0, 15])
    want = ref.kl_captured(kl15, ref.kl_uniform_row(p[0, 15], vis[0, 15]))
    assert abs(ref.kl_uniform_row(p[0, 15], vis[0, 15]) - uniform_kl[0]) < 1e-7  # the reference = the formula
    assert informative["kl_captured"] == pytest.approx(want, abs=1e-12)


def test_derived_metrics_without_rows_or_headroom():
    none = report.derived({m: None for m in eval_metrics.METRICS})
    assert none["kl_captured"] is None and none["gain"] is None
    flat = report.derived({**{m: 0.5 for m in eval_metrics.METRICS}, "kl_uniform": 0.0})  # oracle == random
    assert flat["gain"] is None and flat["kl_captured"] is None


@pytest.mark.parametrize("topk,length,binds", [(16, 128, True), (31, 128, True), (32, 128, False), (64, 128, False),
                                               (16, 256, True), (64, 256, False)])
def test_topk_warnings_fire_exactly_when_topk_cannot_bind(topk, length, binds):
    from core.eval.report import topk_warnings
    from core.train.handoff import topk_never_binds

    assert topk_never_binds(topk, length) == (not binds)
    assert bool(topk_warnings((topk,), [1], topk, length)) == (not binds)
    rows = topk_warnings((4, topk), [5, 0], 4, length)  # k=topk binds on no evaluated row
    assert len(rows) == 1 and f"k={topk}" in rows[0]


def test_overrides_accept_aliases_and_hint_typos():
    """eval-indexer's KEY=VALUE overrides go through the config's own key check: an alias names its
    field, a typo gets the did-you-mean, an alias typo the alias."""
    from core.config.schema import load_config
    from core.errors import ConfigError

    cfg = load_config("deepseek4-tiny")
    assert ev.with_overrides(cfg, ["mla_qk_head_chunk_size=2"]).csa_qk_head_chunk_size == 2
    assert ev.with_overrides(cfg, ["indexer_topk=8", "steps=3"]) == cfg.replace(indexer_topk=8, steps=3)
    assert ev.with_overrides(cfg, []) is cfg
    with pytest.raises(ConfigError, match=r"unknown config key 'indexr_topk' \(from override 'indexr_topk=3'\): "
                                          r"did you mean 'indexer_topk'\?"):
        ev.with_overrides(cfg, ["indexr_topk=3"])
    with pytest.raises(ConfigError, match="did you mean 'mla_qk_head_chunk_size'"):
        ev.with_overrides(cfg, ["mla_qk_head_chunk_sizes=2"])
