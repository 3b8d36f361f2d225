"""Loop-based float64 NumPy references for the attention side of the decoder, from DESIGN.md.

Written from the maths in DESIGN.md ("The model") and the official DeepSeek-V4 semantics, not from
the JAX code: explicit loops over batch rows, positions, blocks and heads, so the indexing can be
checked by eye. Everything is float64. Used by tests/ops/test_rope.py, test_compressor.py,
test_attention.py and test_model.py.
"""

from __future__ import annotations

import math

import numpy as np


# ----------------------------------------------------------------------------- RoPE


def rope_freqs(rope_dim, theta, factor=1.0, original=0, beta_fast=32.0, beta_slow=1.0):
    """Angular frequency per rotating pair; YaRN interpolation when factor > 1 and original > 0."""
    half = rope_dim // 2
    freqs = np.array([theta ** (-2.0 * i / rope_dim) for i in range(half)])
    if factor <= 1.0 or original <= 0:
        return freqs

    def dim_for(rotations):  # dim index whose wavelength fits `rotations` times into `original`
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    out = np.empty(half)
    for i in range(half):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: divide by factor
        out[i] = freqs[i] * (1 - ramp) + freqs[i] / factor * ramp
    return out


def rope_vec(v, pos, freqs, inverse=False):
    """Rotate the last 2 * len(freqs) features of one vector v at position pos."""
    v = np.array(v, dtype=np.float64)
    r = 2 * len(freqs)
    start = v.shape[-1] - r
    out = v.copy()
    for i, f in enumerate(freqs):
        a = pos * f * (-1.0 if inverse else 1.0)
        x0, x1 = v[start + 2 * i], v[start + 2 * i + 1]
        out[start + 2 * i] = x0 * math.cos(a) - x1 * math.sin(a)
        out[start + 2 * i + 1] = x0 * math.sin(a) + x1 * math.cos(a)
    return out


def rope(x, positions, freqs, inverse=False):
    """x [B, T, ..., F], positions [B, T]: rope_vec on every vector."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for idx in np.ndindex(*x.shape[2:-1]):
                out[(b, t) + idx] = rope_vec(x[(b, t) + idx], positions[b, t], freqs, inverse)
    return out


def rms(v, eps, weight=None):
    v = np.asarray(v, np.float64)
    y = v / math.sqrt(np.mean(v * v) + eps)
    return y if weight is None else y * weight


# ----------------------------------------------------------------------------- compressor


def compress(x, wkv, wgate, ape, norm_w, positions, ratio, eps, freqs):
    """DESIGN.md's compressor: returns [B, T // ratio, d] float64."""
    x = np.asarray(x, np.float64)
    bsz, t, _ = x.shape
    nb = t // ratio
    a = x @ wkv
    g = x @ wgate
    f = a.shape[-1]
    d = f // 2 if ratio == 4 else f
    out = np.zeros((bsz, nb, d))
    for b in range(bsz):
        for w in range(nb):
            slots = []  # (value vector [d], gate vector [d]) per slot
            first = positions[b, w * ratio]
            if ratio == 4:
                prev_ok = w > 0 and first - positions[b, (w - 1) * ratio] == ratio
                if prev_ok:
                    for j in range(ratio):
                        s = (w - 1) * ratio + j
                        slots.append((a[b, s, :d], g[b, s, :d] + ape[j, :d]))
                for j in range(ratio):
                    s = w * ratio + j
                    slots.append((a[b, s, d:], g[b, s, d:] + ape[j, d:]))
            else:
                for j in range(ratio):
                    s = w * ratio + j
                    slots.append((a[b, s], g[b, s] + ape[j]))
            pooled = np.zeros(d)
            for feat in range(d):
                gates = np.array([gv[feat] for _, gv in slots])
                p = np.exp(gates - gates.max())
                p /= p.sum()
                pooled[feat] = sum(p[i] * slots[i][0][feat] for i in range(len(slots)))
            out[b, w] = rope_vec(rms(pooled, eps, norm_w), first, freqs)
    return out


# ----------------------------------------------------------------------------- masks


def visible(positions, segment_ids, ratio):
    """bool [B, T, T // ratio]: block complete, same document, uniform block."""
    bsz, t = positions.shape
    nb = t // ratio
    out = np.zeros((bsz, t, nb), bool)
    for b in range(bsz):
        for w in range(nb):
            seg = segment_ids[b, w * ratio: (w + 1) * ratio]
            if len(set(seg.tolist())) != 1:
                continue
            last = positions[b, (w + 1) * ratio - 1]
            for q in range(t):
                out[b, q, w] = seg[0] == segment_ids[b, q] >= 1 and last <= positions[b, q]
    return out


def window(positions, segment_ids, size):
    bsz, t = positions.shape
    out = np.zeros((bsz, t, t), bool)
    for b in range(bsz):
        for q in range(t):
            for s in range(t):
                same = segment_ids[b, q] == segment_ids[b, s] >= 1
                out[b, q, s] = same and 0 <= positions[b, q] - positions[b, s] < size
    return out


# ----------------------------------------------------------------------------- indexer


def indexer_scores(q_idx, k_idx, w_idx, vis):
    """I[t, w] = sum_h weights[t, h] * relu(q[t, h] . k[w]) on visible blocks (-inf elsewhere)."""
    bsz, t, heads, _ = q_idx.shape
    nb = k_idx.shape[1]
    out = np.full((bsz, t, nb), -np.inf)
    for b in range(bsz):
        for q in range(t):
            for w in range(nb):
                if vis[b, q, w]:
                    out[b, q, w] = sum(w_idx[b, q, h] * max(float(q_idx[b, q, h] @ k_idx[b, w]), 0.0)
                                       for h in range(heads))
    return out


def topk_mask(scores, vis, k):
    """bool [B, T, W]: the k best visible blocks per row (ties to the lower index)."""
    out = np.zeros(scores.shape, bool)
    for b in range(scores.shape[0]):
        for q in range(scores.shape[1]):
            cand = [w for w in range(scores.shape[2]) if vis[b, q, w]]
            cand.sort(key=lambda w: (-scores[b, q, w], w))
            for w in cand[:k]:
                out[b, q, w] = True
    return out


# ----------------------------------------------------------------------------- attention


def attention(q, kv, win, sink, ckv=None, allowed=None):
    """o[b, t, h] = sum over window keys and allowed blocks of p * v; sink in the denominator."""
    bsz, t, heads, d = q.shape
    o = np.zeros((bsz, t, heads, d))
    for b in range(bsz):
        for i in range(t):
            keys = [kv[b, s] for s in range(t) if win[b, i, s]]
            if ckv is not None:
                keys += [ckv[b, w] for w in range(ckv.shape[1]) if allowed[b, i, w]]
            for h in range(heads):
                logits = [float(q[b, i, h] @ k) for k in keys]
                m = max(logits + [sink[h]])
                e = [math.exp(x - m) for x in logits]
                den = sum(e) + math.exp(sink[h] - m)
                for ek, k in zip(e, keys):
                    o[b, i, h] += ek / den * k
    return o


def attention_layer(p, x, positions, segment_ids, *, heads, head_dim, o_groups, window_size, ratio,
                    eps, freqs, topk=0, idx_heads=0, idx_dim=0, dense=False):
    """One attention sublayer (queries, raw kv, compressor, indexer selection, output projection).

    `p` maps official names to float64 arrays in our [in, out] layout (see core.model.attention).
    Returns (y [B, T, M], scores [B, T, W] or None).
    """
    x = np.asarray(x, np.float64)
    bsz, t, _ = x.shape
    c_q = np.stack([[rms(x[b, i] @ p["wq_a"], eps, p["q_norm"]) for i in range(t)] for b in range(bsz)])
    q = np.einsum("btr,rhd->bthd", c_q, p["wq_b"])
    for b in range(bsz):
        for i in range(t):
            for h in range(heads):
                q[b, i, h] = rms(q[b, i, h], eps)
    q = rope(q, positions, freqs) * head_dim ** -0.5
    kv = np.stack([[rms(x[b, i] @ p["wkv"], eps, p["kv_norm"]) for i in range(t)] for b in range(bsz)])
    kv = rope(kv, positions, freqs)
    win = window(positions, segment_ids, window_size)
    ckv = allowed = scores = None
    if ratio:
        ckv = compress(x, p["compressor.wkv"], p["compressor.wgate"], p["compressor.ape"],
                       p["compressor.norm"], positions, ratio, eps, freqs)
        allowed = visible(positions, segment_ids, ratio)
        if idx_heads:
            q_i = rope(np.einsum("btr,rhd->bthd", c_q, p["indexer.wq_b"]), positions, freqs)
            k_i = compress(x, p["indexer.compressor.wkv"], p["indexer.compressor.wgate"],
                           p["indexer.compressor.ape"], p["indexer.compressor.norm"], positions, 4,
                           eps, freqs)
            w_i = x @ p["indexer.weights_proj"] * idx_heads ** -0.5 * idx_dim ** -0.5
            scores = indexer_scores(q_i, k_i, w_i, allowed)
            if not dense:
                allowed = allowed & topk_mask(scores, allowed, topk)
    o = rope(attention(q, kv, win, p["attn_sink"], ckv, allowed), positions, freqs, inverse=True)
    per_group = heads // o_groups * head_dim
    flat = o.reshape(bsz, t, heads * head_dim)
    lat = np.concatenate([flat[..., g * per_group:(g + 1) * per_group] @ p["wo_a"][g]
                          for g in range(o_groups)], axis=-1)
    return lat @ p["wo_b"], scores
