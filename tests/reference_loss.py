"""Loop-based float64 NumPy references for the indexer loss and the masks/scores feeding it.

Written from DESIGN.md ("Block segment", "Visibility", "Lightning indexer", "The indexer loss"),
not from the JAX code: plain Python loops over batch, query, head and block, so each line can be
checked against the document by eye. Slow by design; use tiny shapes.
"""

from __future__ import annotations

import math

import numpy as np

from tests.reference import topk_mask, visible, window  # noqa: F401  (the shared mask and top-k references)

EPS = 1e-8


def indexer_scores(q_idx, k_idx, w_idx):
    """I[b, t, w] = sum_i weights[b, t, i] * ReLU(q[b, t, i] . k[b, w]) (unmasked)."""
    b_size, t_size, heads, _ = q_idx.shape
    w_size = k_idx.shape[1]
    out = np.zeros((b_size, t_size, w_size))
    for b in range(b_size):
        for t in range(t_size):
            for w in range(w_size):
                out[b, t, w] = sum(w_idx[b, t, i] * max(float(np.dot(q_idx[b, t, i], k_idx[b, w])), 0.0) for i in range(heads))
    return out


def _log_sum_exp(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def indexer_kl_loss(scores, query, kv, allowed, *, scale=1.0, teacher="compressed", raw_kv=None,
                    window_mask=None, sink=None):
    """DESIGN.md's loss, row by row. Returns (loss, per-row KL [B,T], valid [B,T], P [B,T,W])."""
    b_size, t_size, heads, _ = query.shape
    w_size = kv.shape[1]
    kl = np.zeros((b_size, t_size))
    valid = np.zeros((b_size, t_size), bool)
    target = np.zeros((b_size, t_size, w_size))
    for b in range(b_size):
        for t in range(t_size):
            blocks = [w for w in range(w_size) if allowed[b, t, w]]
            if not blocks:
                continue
            valid[b, t] = True
            p = np.zeros(w_size)
            for h in range(heads):
                logit = {w: float(np.dot(query[b, t, h], kv[b, w])) for w in blocks}
                normaliser = list(logit.values())
                if teacher == "joint":
                    normaliser += [float(np.dot(query[b, t, h], raw_kv[b, s])) for s in range(t_size) if window_mask[b, t, s]]
                    normaliser.append(float(sink[h]))
                lse = _log_sum_exp(normaliser)
                for w in blocks:
                    p[w] += math.exp(logit[w] - lse)
            p /= p.sum() + EPS
            lse_student = _log_sum_exp([float(scores[b, t, w]) for w in blocks])
            for w in blocks:
                if p[w] > 0:
                    kl[b, t] += p[w] * (math.log(p[w] + EPS) - (scores[b, t, w] - lse_student))
            target[b, t] = p
    loss = scale * kl[valid].sum() / max(int(valid.sum()), 1)
    return loss, kl, valid, target


def indexer_kl_grad(scores, target, allowed, valid, scale=1.0):
    """DESIGN.md's closed form: scale / #valid * (softmax(I) * sum_w P - P) on allowed entries.

    sum_w P is 1 up to the 1e-8 of the normalisation; keeping it makes this the exact derivative.
    """
    grad = np.zeros(scores.shape)
    n_valid = max(int(valid.sum()), 1)
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            blocks = [w for w in range(scores.shape[2]) if allowed[b, t, w]]
            if not blocks:
                continue
            lse = _log_sum_exp([float(scores[b, t, w]) for w in blocks])
            mass = sum(target[b, t, w] for w in blocks)
            for w in blocks:
                grad[b, t, w] = scale / n_valid * (math.exp(scores[b, t, w] - lse) * mass - target[b, t, w])
    return grad
