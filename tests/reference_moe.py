"""Loop-based float64 NumPy references for the MoE and mHC maths, written from DESIGN.md ("MoE",
"mHC") and the official DeepSeek-V4 inference code's semantics, independently of core/.

Conventions: one token at a time, plain Python loops over tokens, experts and copies; weights in
the official layouts where that differs from ours (mHC `fn` as [(2+n)n, n*M], flattened
copy-major), so the parity tests also check the layout mapping.
"""

from __future__ import annotations

import math

import numpy as np


def _softplus(v: float) -> float:
    return max(v, 0.0) + math.log1p(math.exp(-abs(v)))


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _silu(v: float) -> float:
    return v * _sigmoid(v)


# ----------------------------------------------------------------------------- routing


def scores_of(logits_e) -> np.ndarray:
    """sqrt(softplus(l)) per expert."""
    return np.array([math.sqrt(_softplus(float(v))) for v in logits_e])


def topk_lower_first(values_e, k):
    """Indices of the k largest values, larger first, ties to the lower index."""
    order = sorted(range(len(values_e)), key=lambda e: (-float(values_e[e]), e))
    return order[:k]


def weights_of(scores_e, idx_k, scaling, normalize):
    chosen = [float(scores_e[e]) for e in idx_k]
    total = sum(chosen) if normalize else 1.0
    return [c / total * scaling for c in chosen]


def route(logits_bte, bias_e, k, scaling, normalize):
    """Learned routing per token: (idx [B,T,k], weights [B,T,k], scores [B,T,E])."""
    b_, t_, e_ = logits_bte.shape
    idx = np.zeros((b_, t_, k), np.int64)
    weights = np.zeros((b_, t_, k))
    scores = np.zeros((b_, t_, e_))
    for b in range(b_):
        for t in range(t_):
            s = scores_of(logits_bte[b, t])
            ranked = s if bias_e is None else [s[e] + float(bias_e[e]) for e in range(e_)]
            chosen = topk_lower_first(ranked, k)
            idx[b, t] = chosen
            weights[b, t] = weights_of(s, chosen, scaling, normalize)
            scores[b, t] = s
    return idx, weights, scores


def hash_route(logits_bte, table_vk, tokens_bt, scaling, normalize):
    """Hash routing: experts from the table, weighted by the router scores."""
    b_, t_, _ = logits_bte.shape
    k = table_vk.shape[1]
    idx = np.zeros((b_, t_, k), np.int64)
    weights = np.zeros((b_, t_, k))
    for b in range(b_):
        for t in range(t_):
            s = scores_of(logits_bte[b, t])
            chosen = [int(e) for e in table_vk[int(tokens_bt[b, t])]]
            idx[b, t] = chosen
            weights[b, t] = weights_of(s, chosen, scaling, normalize)
    return idx, weights


def expert_load(idx_btk, valid_bt, num_experts):
    counts = [0.0] * num_experts
    n_valid = 0
    for b in range(idx_btk.shape[0]):
        for t in range(idx_btk.shape[1]):
            if valid_bt[b, t]:
                n_valid += 1
                for e in idx_btk[b, t]:
                    counts[int(e)] += 1.0
    return np.array([c / max(n_valid, 1) for c in counts])


def load_balance_loss(scores_bte, idx_btk, valid_bt, num_experts, weight):
    """weight * E * sum_e f_e P_e per batch row (sequence-wise), mean over rows with valid tokens."""
    row_losses = []
    for b in range(scores_bte.shape[0]):
        tokens = [t for t in range(scores_bte.shape[1]) if valid_bt[b, t]]
        if not tokens:
            continue
        f = [0.0] * num_experts
        p = [0.0] * num_experts
        for t in tokens:
            for e in idx_btk[b, t]:
                f[int(e)] += 1.0 / len(tokens)
            total = float(sum(scores_bte[b, t]))
            for e in range(num_experts):
                p[e] += float(scores_bte[b, t, e]) / total / len(tokens)
        row_losses.append(num_experts * sum(f[e] * p[e] for e in range(num_experts)))
    return weight * (sum(row_losses) / len(row_losses) if row_losses else 0.0)


def update_bias(bias_e, load_e, rate):
    mean = sum(float(v) for v in load_e) / len(load_e)
    out = []
    for b, l in zip(bias_e, load_e):
        d = mean - float(l)
        out.append(float(b) + rate * (1.0 if d > 0 else -1.0 if d < 0 else 0.0))
    return np.array(out)


# ----------------------------------------------------------------------------- experts


def swiglu(x_m, w1_mf, w2_fm, w3_mf, limit):
    """One token through one SwiGLU: gate clamped from above, up clamped on both sides."""
    f_ = w1_mf.shape[1]
    h = np.zeros(f_)
    for f in range(f_):
        g = float(x_m @ w1_mf[:, f])
        u = float(x_m @ w3_mf[:, f])
        if limit > 0:
            g = min(g, limit)
            u = min(max(u, -limit), limit)
        h[f] = _silu(g) * u
    return h @ w2_fm


def moe(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, shared, limit):
    """y = sum over chosen experts of weight * expert(x) + shared(x); shared = (w1, w2, w3) or None."""
    b_, t_, m_ = x_btm.shape
    y = np.zeros((b_, t_, m_))
    for b in range(b_):
        for t in range(t_):
            for e, w in zip(idx_btk[b, t], weights_btk[b, t]):
                e = int(e)
                y[b, t] += w * swiglu(x_btm[b, t], w1_emf[e], w2_efm[e], w3_emf[e], limit)
            if shared is not None:
                y[b, t] += swiglu(x_btm[b, t], *shared, limit)
    return y


# ----------------------------------------------------------------------------- mHC


def sinkhorn(logits_nn, iters, eps):
    """Row softmax + eps, column normalisation, then iters-1 (row, column) pairs, all with + eps."""
    n = logits_nn.shape[0]
    c = [[0.0] * n for _ in range(n)]
    for i in range(n):
        mx = max(float(v) for v in logits_nn[i])
        ex = [math.exp(float(v) - mx) for v in logits_nn[i]]
        tot = sum(ex)
        c[i] = [v / tot + eps for v in ex]

    def cols():
        for j in range(n):
            s = sum(c[i][j] for i in range(n)) + eps
            for i in range(n):
                c[i][j] /= s

    def rows():
        for i in range(n):
            s = sum(c[i]) + eps
            c[i] = [v / s for v in c[i]]

    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return np.array(c)


def _mixes(x_nm, fn_jc, norm_eps):
    """Official layout: fn [J, n*M] against flatten(X) copy-major, scaled by rsqrt(mean sq + eps)."""
    flat = x_nm.reshape(-1)
    rs = 1.0 / math.sqrt(sum(float(v) ** 2 for v in flat) / flat.size + norm_eps)
    return np.array([float(fn_jc[j] @ flat) * rs for j in range(fn_jc.shape[0])])


def hc_pre(x_nm, fn_jc, scale_3, base_j, iters, eps, norm_eps):
    """One token: (y [M], post [n], comb [n, n]) for the stream x [n, M]."""
    n = x_nm.shape[0]
    mix = _mixes(x_nm, fn_jc, norm_eps)
    pre = [_sigmoid(mix[i] * scale_3[0] + base_j[i]) + eps for i in range(n)]
    post = np.array([2.0 * _sigmoid(mix[n + i] * scale_3[1] + base_j[n + i]) for i in range(n)])
    comb_logits = np.array([[mix[2 * n + i * n + j] * scale_3[2] + base_j[2 * n + i * n + j]
                             for j in range(n)] for i in range(n)])
    comb = sinkhorn(comb_logits, iters, eps)
    y = sum(pre[i] * x_nm[i] for i in range(n))
    return y, post, comb


def hc_post(out_m, x_nm, post_n, comb_nn):
    """X'[i] = post_i * F + sum_j comb[j, i] X[j]."""
    n = x_nm.shape[0]
    return np.stack([post_n[i] * out_m + sum(comb_nn[j, i] * x_nm[j] for j in range(n))
                     for i in range(n)])


def head_collapse(x_nm, fn_nc, scale_1, base_n, eps, norm_eps):
    n = x_nm.shape[0]
    mix = _mixes(x_nm, fn_nc, norm_eps)
    pre = [_sigmoid(mix[i] * scale_1[0] + base_n[i]) + eps for i in range(n)]
    return sum(pre[i] * x_nm[i] for i in range(n))


def fn_official(fn_nmj):
    """Our fn [n, M, J] -> the official [J, n*M] (flatten copy-major)."""
    n, m, j = fn_nmj.shape
    return np.asarray(fn_nmj, np.float64).reshape(n * m, j).T


# ----------------------------------------------------------------------------- norms


def rms_norm(x_d, weight_d, eps):
    ms = sum(float(v) ** 2 for v in x_d) / len(x_d)
    r = 1.0 / math.sqrt(ms + eps)
    return np.array([float(v) * r * (1.0 if weight_d is None else float(w))
                     for v, w in zip(x_d, weight_d if weight_d is not None else [None] * len(x_d))])


# ----------------------------------------------------------------------------- test utility


def materialize(abstract_module, seed, tables=None):
    """Fill an `nnx.eval_shape`d module with seeded NumPy values, in place; returns it.

    Avoids compiling the random initialisers (slow on a loaded CPU) in tests that only need
    some fixed random weights: matrices ~ N(0, 1/fan_in), vectors ~ N(0, 0.5^2); integer
    variables are taken from `tables` (path tuple -> array) when given, else left abstract.
    """
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)
    for path, node in nnx.iter_graph(abstract_module):
        if not isinstance(node, nnx.Variable):
            continue
        sds = node.get_value()
        if not hasattr(sds, "shape") or isinstance(sds, np.ndarray) or hasattr(sds, "devices"):
            continue
        if np.issubdtype(sds.dtype, np.integer):
            if tables is not None and tuple(path) in tables:
                node.set_value(jnp.asarray(tables[tuple(path)], sds.dtype))
            continue
        scale = 1.0 / math.sqrt(sds.shape[-2]) if len(sds.shape) >= 2 else 0.5
        node.set_value(jnp.asarray(rng.normal(size=sds.shape) * scale, sds.dtype))
    return abstract_module
