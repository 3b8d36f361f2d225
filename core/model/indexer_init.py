"""The teacher initialisation of a lightning indexer: its own layer's main attention, projected onto
the principal query-key subspace (`indexer_init: teacher`; docs/indexer-init.md).

The teacher's logit of head h for query t and block w is q_h[t] . K[w] (DESIGN.md, "Queries",
"Compressor"), D features of which the last R rotate (RoPE). The indexer has DI >= R features, of
which the last R rotate with the same RoPE frequencies, and HI heads. The initialisation keeps:

  rope part (R features)   copied: the teacher compressor's rotating features and the queries'
                           rotating columns, so the positional part of every logit is the teacher's;
  nope part (DI - R)       the best rank-(DI - R) approximation of the bilinear form q_n . K_n over the
                           calibration data: with Ck the covariance of the keys' D - R non-rotating
                           features over blocks and Cq the second moment of the queries' (summed over
                           heads), the top eigenvectors V of Ck^1/2 Cq Ck^1/2 give the key map
                           C = Ck^-1/2 V and the query map B = Ck^1/2 V, so q.K ~ (B^T q).(C^T K),
                           exact when DI - R = D - R. `kept` is the share of the nope logits' variance
                           over blocks that the subspace keeps (the eigenvalues' share);
  heads                    indexer head i takes the mean query of the teacher heads h with
                           h * HI // H == i (HI <= H), or teacher head i * H // HI (HI > H);
  head weights             weights_proj fits x . w = 1 by least squares (a constant positive weight
                           per head: the score is the heads' mean logit through the ReLU), times a
                           temperature the caller picks per layer by the calibration KL.

Approximations (docs/indexer-init.md#what-is-approximate): the teacher's queries are RMS-normalised
per token and the indexer's are not (a per-head scale 1/sqrt(E[rms^2]) stands in); the compressor
gates each feature by its own softmax over slots, so a projected feature takes the gate
logits averaged with the projection's squared weights (exact for copied features); the indexer's
RMSNorm runs over its DI features, the teacher's over D (a scale fitted in the mean square stands
in); the ReLU cuts negative logits.

Everything here is float64 NumPy on host statistics: deterministic, and the float64 reference of
tests/model/test_indexer_init.py checks it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

RIDGE = 1e-6  # relative floor of the eigenvalues inverted (a share of the largest)


@dataclasses.dataclass(frozen=True)
class TeacherWeights:
    """One CSA layer's main attention, as the initialisation reads it (float64).

    wq_b [Rq, H, D]; the compressor's wkv, wgate [M, 2D], ape [4, 2D], norm [D].
    """

    wq_b: np.ndarray
    wkv: np.ndarray
    wgate: np.ndarray
    ape: np.ndarray
    norm: np.ndarray


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Sums over one layer's calibration data (float64).

    blocks, tokens: counts of the blocks visible to some query and of the rows that see a block.
    k_sum [D], k_m2 [D, D]: sum of K and of K K^T over those blocks, K the teacher's compressed keys
      with RoPE undone (the RMS-normalised, norm-scaled pooled features).
    q_m2 [D, D]: sum over rows and teacher heads of q q^T (queries as the teacher scores with them).
    cq_m2 [Rq, Rq]: sum over rows of c_q c_q^T (the queries' input).
    x_sum [M], x_m2 [M, M]: sum over rows of the attention input x and of x x^T.
    """

    blocks: float
    tokens: float
    k_sum: np.ndarray
    k_m2: np.ndarray
    q_m2: np.ndarray
    cq_m2: np.ndarray
    x_sum: np.ndarray
    x_m2: np.ndarray

    def __add__(self, other: "LayerStats") -> "LayerStats":
        return LayerStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class IndexerWeights:
    """The initialised indexer of one layer (float64): wq_b [Rq, HI, DI], weights_proj [M, HI] (before
    the temperature), compressor wkv, wgate [M, 2DI], ape [4, 2DI], norm [DI]; kept and weight_fit:
    the nope subspace's share of the logit variance and the head weights' R^2."""

    wq_b: np.ndarray
    weights_proj: np.ndarray
    wkv: np.ndarray
    wgate: np.ndarray
    ape: np.ndarray
    norm: np.ndarray
    kept: float
    weight_fit: float


def _sym_powers(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(C^1/2, C^-1/2) of a symmetric PSD matrix, eigenvalues floored at RIDGE x the largest."""
    lam, u = np.linalg.eigh((c + c.T) / 2)
    lam = np.maximum(lam, RIDGE * max(float(lam.max(initial=0.0)), 1e-30))
    return (u * np.sqrt(lam)) @ u.T, (u / np.sqrt(lam)) @ u.T


def principal_maps(ck: np.ndarray, cq: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The key map C, the query map B ([n, rank] each) and the kept variance share (module docstring).

    Eigenvectors in descending eigenvalue order, each signed so its largest-magnitude entry is
    positive (a deterministic choice; B C^T does not depend on it).
    """
    n = ck.shape[0]
    if n == 0 or rank == 0:
        return np.zeros((n, rank)), np.zeros((n, rank)), 0.0 if n else 1.0
    half, inv_half = _sym_powers(ck)
    m = half @ cq @ half
    lam, v = np.linalg.eigh((m + m.T) / 2)
    order = np.argsort(-lam, kind="stable")[:rank]
    lam_all, v = np.maximum(lam, 0.0), v[:, order]
    v = v * np.sign(v[np.argmax(np.abs(v), axis=0), np.arange(rank)])
    kept = float(lam_all[order].sum() / lam_all.sum()) if lam_all.sum() > 0 else 1.0
    return inv_half @ v, half @ v, kept


def head_groups(teacher_heads: int, index_heads: int) -> list[list[int]]:
    """The teacher heads each indexer head averages (module docstring)."""
    if index_heads <= teacher_heads:
        return [[h for h in range(teacher_heads) if h * index_heads // teacher_heads == i] for i in range(index_heads)]
    return [[i * teacher_heads // index_heads] for i in range(index_heads)]


def _halves(w: np.ndarray, d: int, di: int, nope_map: np.ndarray, rope_scale: np.ndarray) -> np.ndarray:
    """Map a compressor array [..., 2D] (halves A | B) to the indexer's [..., 2DI]: per half, the
    D - R nope features through `nope_map` [D - R, r] into the first r, the last R features times
    `rope_scale` into the last R; features in between stay 0."""
    rope = rope_scale.shape[0]
    n, r = nope_map.shape
    out = np.zeros(w.shape[:-1] + (2 * di,))
    for half in range(2):
        src = w[..., half * d: (half + 1) * d]
        out[..., half * di: half * di + r] = src[..., :n] @ nope_map
        out[..., (half + 1) * di - rope: (half + 1) * di] = src[..., n:] * rope_scale
    return out


def teacher_indexer(teacher: TeacherWeights, stats: LayerStats, *, index_heads: int, index_dim: int,
                    rope_dim: int) -> IndexerWeights:
    """The indexer of one CSA layer initialised from its teacher (module docstring).

    Args:
      teacher: the layer's main attention weights.
      stats: its calibration sums.
      index_heads, index_dim: HI, DI.
      rope_dim: R (<= DI and <= D).

    Returns:
      IndexerWeights in float64; weights_proj before the caller's temperature.

    Shapes:
      1. Ck = Cov(K_n) [n, n], n = D - R;  Cq = E[sum_h q_h,n q_h,n^T]
      2. C, B = principal_maps(Ck, Cq, r), r = min(DI - R, n)
      3. compressor: value columns through P = diag(norm_n) C; gate and ape columns through P^2 / sum P^2;
         rope columns copied (values pre-scaled by norm_r); norm = sqrt(E|z|^2 / DI), z = (P^T u_n, u_r)
      4. queries: per head a_h W_h / sqrt(D), a_h = sqrt(D / E|c_q W_h|^2); group means; nope through B
      5. weights_proj[:, i] = sqrt(HI DI) (E[x x^T] + ridge)^-1 E[x]
    """
    wq_b, norm = teacher.wq_b, teacher.norm
    rq, heads, d = wq_b.shape
    n, r = d - rope_dim, min(index_dim - rope_dim, d - rope_dim)
    k_mean = stats.k_sum / stats.blocks
    k_m2 = stats.k_m2 / stats.blocks
    ck = k_m2[:n, :n] - np.outer(k_mean[:n], k_mean[:n])
    key_map, query_map, kept = principal_maps(ck, stats.q_m2[:n, :n] / stats.tokens, r)

    # keys: K = u * norm with u the unit-RMS pooled features; the value columns carry norm_n into P
    p = norm[:n, None] * key_map
    energy = np.sum(p * p, axis=0)
    g = p * p / np.where(energy > 0, energy, 1.0)
    norm_r = norm[n:]
    wkv = _halves(teacher.wkv, d, index_dim, p, np.ones(rope_dim))
    wgate = _halves(teacher.wgate, d, index_dim, g, np.ones(rope_dim))
    ape = _halves(teacher.ape, d, index_dim, g, np.ones(rope_dim))
    safe = np.where(norm != 0, norm, 1.0)
    u_m2 = np.where(np.outer(norm != 0, norm != 0), k_m2 / np.outer(safe, safe), 0.0)
    z_sq = np.trace(p.T @ u_m2[:n, :n] @ p) + np.trace(u_m2[n:, n:])
    gamma = np.sqrt(z_sq / index_dim)
    index_norm = np.full(index_dim, gamma)
    index_norm[index_dim - rope_dim:] *= norm_r

    # queries: the teacher's per-token RMS norm replaced by its mean-square scale
    cq = stats.cq_m2 / stats.tokens
    eff = np.empty_like(wq_b)
    for h in range(heads):
        ms = np.trace(wq_b[:, h].T @ cq @ wq_b[:, h]) / d
        eff[:, h] = wq_b[:, h] / np.sqrt(max(ms, 1e-30)) / np.sqrt(d)
    index_q = np.zeros((rq, index_heads, index_dim))
    for i, group in enumerate(head_groups(heads, index_heads)):
        w = eff[:, group].mean(axis=1)
        index_q[:, i, :r] = w[:, :n] @ query_map
        index_q[:, i, index_dim - rope_dim:] = w[:, n:]

    # head weights: x . w ~ 1 in the least-squares sense
    x_mean, x_m2 = stats.x_sum / stats.tokens, stats.x_m2 / stats.tokens
    m = x_mean.shape[0]
    w = np.linalg.solve(x_m2 + RIDGE * np.trace(x_m2) / m * np.eye(m), x_mean)
    weights_proj = np.repeat((w * np.sqrt(index_heads * index_dim))[:, None], index_heads, axis=1)
    return IndexerWeights(wq_b=index_q, weights_proj=weights_proj, wkv=wkv, wgate=wgate, ape=ape,
                          norm=index_norm, kept=kept, weight_fit=float(x_mean @ w))
