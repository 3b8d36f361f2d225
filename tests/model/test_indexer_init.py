"""The teacher initialisation's projection (core/model/indexer_init.py) against a float64 reference.

The reference builds the same indexer by other means: the query-key maps from an SVD of
Cq^1/2 Ck^1/2 (the best rank-r approximation of the bilinear form) instead of the eigenvectors of
Ck^1/2 Cq Ck^1/2, and every output column by an explicit loop over features and heads.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.model.indexer_init import LayerStats, TeacherWeights, head_groups, principal_maps, teacher_indexer


def _psd_sum(rng, n: int, samples: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(samples, n)) * scale + rng.normal(size=n)
    return x.sum(0), x.T @ x


def _layer(seed: int, *, d=8, heads=4, rq=5, m=6):
    rng = np.random.default_rng(seed)
    teacher = TeacherWeights(wq_b=rng.normal(size=(rq, heads, d)), wkv=rng.normal(size=(m, 2 * d)),
                             wgate=rng.normal(size=(m, 2 * d)), ape=rng.normal(size=(4, 2 * d)),
                             norm=rng.uniform(0.5, 1.5, size=d))
    k_sum, k_m2 = _psd_sum(rng, d, 40)
    _, q_m2 = _psd_sum(rng, d, 60, 0.3)
    _, cq_m2 = _psd_sum(rng, rq, 30)
    x_sum, x_m2 = _psd_sum(rng, m, 30, 0.2)
    return teacher, LayerStats(40.0, 30.0, k_sum, k_m2, q_m2, cq_m2, x_sum, x_m2)


def _sqrtm(c):
    lam, u = np.linalg.eigh(c)
    return (u * np.sqrt(lam)) @ u.T


def _reference(t: TeacherWeights, s: LayerStats, hi: int, di: int, rope: int) -> dict[str, np.ndarray]:
    rq, h, d = t.wq_b.shape
    n, r = d - rope, min(di - rope, d - rope)
    mean = s.k_sum / s.blocks
    ck = s.k_m2[:n, :n] / s.blocks - np.outer(mean[:n], mean[:n])
    cq = s.q_m2[:n, :n] / s.tokens
    ck_h, cq_h = _sqrtm(ck), _sqrtm(cq)
    _, _, wt = np.linalg.svd(cq_h @ ck_h)
    kmap = np.linalg.inv(ck_h) @ wt[:r].T      # C: the key side (up to each column's sign)
    qmap = ck_h @ wt[:r].T                     # B: the query side
    sign = np.array([np.sign(wt[j][np.argmax(np.abs(wt[j]))]) for j in range(r)])  # the largest entry positive
    kmap, qmap = kmap * sign, qmap * sign
    out = {k: np.zeros(shape) for k, shape in (("wkv", (t.wkv.shape[0], 2 * di)), ("wgate", (t.wkv.shape[0], 2 * di)),
                                               ("ape", (4, 2 * di)), ("wq_b", (rq, hi, di)))}
    p = t.norm[:n, None] * kmap
    for half in range(2):
        for j in range(r):
            energy = sum(p[f, j] ** 2 for f in range(n))
            for f in range(n):
                out["wkv"][:, half * di + j] += t.wkv[:, half * d + f] * p[f, j]
                out["wgate"][:, half * di + j] += t.wgate[:, half * d + f] * p[f, j] ** 2 / energy
                out["ape"][:, half * di + j] += t.ape[:, half * d + f] * p[f, j] ** 2 / energy
        for k in range(rope):
            for name in ("wkv", "wgate", "ape"):
                out[name][:, half * di + di - rope + k] = getattr(t, name)[:, half * d + n + k]
    u_m2 = s.k_m2 / s.blocks / np.outer(t.norm, t.norm)
    gamma = np.sqrt((np.trace(p.T @ u_m2[:n, :n] @ p) + np.trace(u_m2[n:, n:])) / di)
    out["norm"] = np.array([gamma] * (di - rope) + [gamma * t.norm[n + k] for k in range(rope)])
    cqq = s.cq_m2 / s.tokens
    for i in range(hi):
        group = [g for g in range(h) if g * hi // h == i] if hi <= h else [i * h // hi]
        w = sum(t.wq_b[:, g] / np.sqrt(np.mean((t.wq_b[:, g].T @ cqq @ t.wq_b[:, g]).diagonal()) * d)
                for g in group) / len(group)
        out["wq_b"][:, i, :r] = w[:, :n] @ qmap
        out["wq_b"][:, i, di - rope:] = w[:, n:]
    m = s.x_sum.shape[0]
    x_m2 = s.x_m2 / s.tokens
    fit = np.linalg.lstsq(x_m2 + 1e-6 * np.trace(x_m2) / m * np.eye(m), s.x_sum / s.tokens, rcond=None)[0]
    out["weights_proj"] = np.stack([fit * np.sqrt(hi * di)] * hi, axis=1)
    return out


@pytest.mark.parametrize("hi,di,rope", [(4, 8, 2), (2, 4, 2), (8, 6, 2), (3, 2, 2)])
def test_projection_matches_float64_reference(hi, di, rope):
    teacher, stats = _layer(hi * 10 + di)
    got = teacher_indexer(teacher, stats, index_heads=hi, index_dim=di, rope_dim=rope)
    want = _reference(teacher, stats, hi, di, rope)
    for name, ref in want.items():
        err = np.max(np.abs(getattr(got, name) - ref))
        assert err < 1e-10 * max(1.0, np.max(np.abs(ref))), f"{name}: max |diff| {err:.3e}"
    assert 0 <= got.kept <= 1 + 1e-12
    assert got.kept == pytest.approx(1.0) if di == 8 else got.kept < 1


def test_full_rank_keeps_the_bilinear_form_and_is_deterministic():
    """With DI = D the maps invert each other (q.K unchanged); two calls agree bitwise."""
    teacher, stats = _layer(3)
    n = 6
    ck = stats.k_m2[:n, :n] / stats.blocks - np.outer(stats.k_sum[:n], stats.k_sum[:n]) / stats.blocks ** 2
    key_map, query_map, kept = principal_maps(ck, stats.q_m2[:n, :n] / stats.tokens, n)
    assert np.max(np.abs(query_map @ key_map.T - np.eye(n))) < 1e-9 and kept == pytest.approx(1.0)
    a = teacher_indexer(teacher, stats, index_heads=4, index_dim=8, rope_dim=2)
    b = teacher_indexer(teacher, stats, index_heads=4, index_dim=8, rope_dim=2)
    for name in ("wq_b", "weights_proj", "wkv", "wgate", "ape", "norm"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_head_groups():
    assert head_groups(4, 2) == [[0, 1], [2, 3]]
    assert head_groups(4, 4) == [[0], [1], [2], [3]]
    assert head_groups(2, 4) == [[0], [0], [1], [1]]
    assert head_groups(5, 2) == [[0, 1, 2], [3, 4]]
