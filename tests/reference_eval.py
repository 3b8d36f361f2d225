"""Loop-based float64 NumPy references of the indexer-evaluation metrics (core/eval/evaluate.py).

Written from DESIGN.md ("Visibility", "The indexer loss") and issue 6's definitions, one
(batch, query) row at a time, with no vectorised shortcut: the point is to be obviously right.
"""

from __future__ import annotations

import numpy as np

from tests.reference import visible  # noqa: F401  (the shared mask reference)

EPS = 1e-8


def teacher(q, kv, vis):
    """P[b,t,:] = sum_h softmax over visible w of q[b,t,h].kv[b,w], / (sum + 1e-8)."""
    b_, t_, h_, _ = q.shape
    w_ = kv.shape[1]
    p = np.zeros((b_, t_, w_))
    for b in range(b_):
        for t in range(t_):
            ws = [w for w in range(w_) if vis[b, t, w]]
            for h in range(h_):
                if not ws:
                    continue
                logits = np.array([float(np.dot(q[b, t, h], kv[b, w])) for w in ws])
                e = np.exp(logits - logits.max())
                for w, v in zip(ws, e / e.sum()):
                    p[b, t, w] += v
            p[b, t] /= p[b, t].sum() + EPS
    return p


def kl_row(p_row, s_row, vis_row):
    ws = [w for w in range(len(vis_row)) if vis_row[w]]
    if not ws:
        return 0.0
    s = np.array([s_row[w] for w in ws], np.float64)
    logq = s - (s.max() + np.log(np.exp(s - s.max()).sum()))
    return float(sum(p_row[w] * (np.log(p_row[w] + EPS) - lq) for w, lq in zip(ws, logq) if p_row[w] > 0))


def kl_uniform_row(p_row, vis_row):
    """KL(P || uniform over the visible blocks) of one row, 0 when nothing is visible."""
    ws = [w for w in range(len(vis_row)) if vis_row[w]]
    return float(sum(p_row[w] * (np.log(p_row[w] + EPS) + np.log(len(ws))) for w in ws if p_row[w] > 0))


def kl_captured(kl_mean, kl_uniform_mean):
    """1 - KL / KL_uniform over the same rows (None without rows or with KL_uniform 0)."""
    return None if kl_mean is None or not kl_uniform_mean else 1.0 - kl_mean / kl_uniform_mean


def gain(recall, oracle, random):
    """(recall - random) / (oracle - random); None when the oracle is no better than random."""
    return None if recall is None or oracle - random <= 0 else (recall - random) / (oracle - random)


def topk_row(s_row, vis_row, k):
    """Indices of the top-min(k, #visible) visible blocks, ties to the lower index."""
    ws = [w for w in range(len(vis_row)) if vis_row[w]]
    ws.sort(key=lambda w: (-s_row[w], w))
    return ws[:k]


def recent_row(vis_row, k):
    """The k most recent visible blocks: the highest visible block indices."""
    ws = [w for w in range(len(vis_row)) if vis_row[w]]
    return ws[-k:] if k else []


def row_metrics(p_row, s_row, vis_row, rand_row, k):
    """Dict of the metrics of one row, or None when nothing is visible."""
    n_vis = int(sum(vis_row))
    if n_vis == 0:
        return None
    mass = sum(p_row[w] for w in range(len(vis_row)) if vis_row[w])
    k_eff = min(k, n_vis)
    sel = topk_row(s_row, vis_row, k)
    sel_t = topk_row(p_row, vis_row, k)

    def recall(ws):
        return sum(p_row[w] for w in ws) / mass

    return {
        "kl": kl_row(p_row, s_row, vis_row),
        "kl_uniform": kl_uniform_row(p_row, vis_row),
        "recall": recall(sel),
        "overlap": len(set(sel) & set(sel_t)) / k_eff,
        "recall_oracle": recall(sel_t),
        "recall_recent": recall(recent_row(vis_row, k)),
        "recall_random": recall(topk_row(rand_row, vis_row, k)),
        "informative": n_vis > k,
    }


def layer_means(q, kv, scores, vis, rand, k):
    """({metric: mean over valid rows}, {metric: mean over informative rows}, #valid, #informative)."""
    p = teacher(q, kv, vis)
    rows = []
    for b in range(vis.shape[0]):
        for t in range(vis.shape[1]):
            r = row_metrics(p[b, t], scores[b, t], vis[b, t], rand[b, t], k)
            if r is not None:
                rows.append(r)
    informative = [r for r in rows if r["informative"]]
    names = ("kl", "recall", "overlap", "recall_oracle", "recall_recent", "recall_random", "kl_uniform")

    def mean(rs):
        return {m: (sum(r[m] for r in rs) / len(rs) if rs else None) for m in names}

    return mean(rows), mean(informative), len(rows), len(informative)


def nll_sums(logits, targets, weights):
    """(sum_t w[t] * -log softmax(logits[t])[targets[t]], sum_t w[t]) over every (b, t)."""
    total, count = 0.0, 0.0
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = logits[b, t].astype(np.float64)
            lse = row.max() + np.log(np.exp(row - row.max()).sum())
            total += weights[b, t] * (lse - row[targets[b, t]])
            count += weights[b, t]
    return total, count
