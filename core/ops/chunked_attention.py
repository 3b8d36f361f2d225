"""Query-chunked attention: banded window, gathered top-k blocks, chunked visible blocks (DESIGN.md,
"Attention" and "Memory").

`chunked_attention` computes exactly `core.model.attention.attention` (window raw keys + compressed
entries + per-head sink in one softmax) without any [T, T] or [T, W]-over-all-queries tensor.
The queries are cut into chunks of C positions (T padded up to a multiple of C with padding
tokens, segment 0, which see nothing and are sliced off) and a `lax.scan` runs one chunk at a
time; the chunk body is `jax.checkpoint`ed, so the backward pass recomputes it and keeps nothing
of chunk size between steps. Per chunk, at once:

  window   its C queries meet only keys [t0 - (S - 1), t0 + C): logits [B, H, C, C + S - 1]
           (the keys are front-padded with invisible padding, so chunk 0 needs no special case)
  CSA      sparse: the k selected blocks' keys gathered per query, [B, C, k, D] and logits
           [B, H, C, k];  dense (warm-up, pre-training, no indexer): every block, [B, H, C, W]
  HCA      every block, [B, H, C, W] (W = T / 128)
  sink     [H]

and the parts merge in one softmax by log-sum-exp (one max over every part and the sink, one
sum of exponentials), so a fully masked part adds exactly 0. Visibility follows DESIGN.md to
the letter from positions and segment ids: the window test is `sliding_window_mask`'s and the
block test `csa_visible`'s; the band only assumes what DESIGN.md states, that positions count up
by one inside a document, so the keys of a query's window are among its S - 1 predecessors.

The query and output projections can run inside the chunk (`q_fn`, `o_fn`), so the [B, T, H, D]
queries and outputs never exist whole either (at Flash shapes they are 2 GiB each in bfloat16 at
T = 32K). Work is O(T (C + S + k) H D) in the sparse stage, O(T (C + S + W) H D) dense.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.ops.masks import NEG, block_last_positions, block_segment_ids, visible_rows, window_rows


def num_chunks(t: int, chunk: int) -> tuple[int, int]:
    """(chunk size c, number of chunks n) for T positions: c = min(chunk, T), n = ceil(T / c)."""
    c = max(1, min(chunk, t))
    return c, -(-t // c)


def to_chunks(x_bt_, c: int, n: int):
    """[B, T, ...] -> [n, B, c, ...], padding T up to n * c with zeros (padding tokens)."""
    b, t = x_bt_.shape[:2]
    pad = n * c - t
    if pad:
        x_bt_ = jnp.pad(x_bt_, [(0, 0), (0, pad)] + [(0, 0)] * (x_bt_.ndim - 2))
    return jnp.moveaxis(x_bt_.reshape(b, n, c, *x_bt_.shape[2:]), 1, 0)


def from_chunks(x_nbc_, t: int):
    """[n, B, c, ...] -> [B, T, ...] (the padding rows dropped)."""
    n, b, c = x_nbc_.shape[:3]
    return jnp.moveaxis(x_nbc_, 0, 1).reshape(b, n * c, *x_nbc_.shape[3:])[:, :t]


def block_keys(positions_bt, segment_ids_bt, ratio: int):
    """(segment id, last position) of each complete block: int [B, W] each, W = T // ratio."""
    w = positions_bt.shape[1] // ratio
    return (block_segment_ids(segment_ids_bt[:, : w * ratio], ratio),
            block_last_positions(positions_bt[:, : w * ratio], ratio))


def merged_softmax(q_bchd, sink_h, parts):
    """One softmax over several key sets and the sink, merged by log-sum-exp.

    Args:
      q_bchd: queries [B, C, H, D] in the accumulation dtype.
      sink_h: per-head sink logit [H].
      parts: (keys, mask) pairs: keys [B, U, D] shared by the chunk's queries with mask
        bool [B, C, U], or keys [B, C, U, D] per query (gathered blocks) with mask bool [B, C, U].

    Returns:
      o_bchd [B, C, H, D]: sum over parts of p * v (a row with nothing allowed gives 0).
    """
    def einsums(keys):
        return ("bchd,bud->bhcu", "bhcu,bud->bchd") if keys.ndim == 3 else \
               ("bchd,bcud->bhcu", "bhcu,bcud->bchd")

    parts = [(k, mask) for k, mask in parts if mask.shape[-1]]  # no block complete yet: no part
    logits = [jnp.where(mask[:, None], jnp.einsum(einsums(k)[0], q_bchd, k), NEG) for k, mask in parts]
    b, c, h, _ = q_bchd.shape
    sink_bhc = jnp.broadcast_to(sink_h[None, :, None], (b, h, c))
    mx_bhc = sink_bhc
    for l_bhcu in logits:
        mx_bhc = jnp.maximum(mx_bhc, jnp.max(l_bhcu, axis=-1))
    mx_bhc = jax.lax.stop_gradient(mx_bhc)  # any shift gives the same softmax; this one is stable
    exps = [jnp.where(mask[:, None], jnp.exp(l - mx_bhc[..., None]), 0.0)
            for l, (_, mask) in zip(logits, parts)]
    denom_bhc = jnp.exp(sink_bhc - mx_bhc) + sum(jnp.sum(e, axis=-1) for e in exps)
    o_bchd = sum((jnp.einsum(einsums(k)[1], e, k) for e, (k, _) in zip(exps, parts)),
                 jnp.zeros_like(q_bchd))
    return o_bchd / jnp.transpose(denom_bhc, (0, 2, 1))[..., None]


def _identity_q(q_bchd, pos_bc):
    del pos_bc
    return q_bchd


def _identity_o(o_bchd, pos_bc):
    del pos_bc
    return o_bchd


def chunked_attention(q_in_bt_, kv_bsd, positions_bt, segment_ids_bt, sink_h, *, window: int,
                      chunk: int, ckv_bwd=None, ratio: int = 0, topk_idx_btk=None,
                      topk_valid_btk=None, q_fn=None, o_fn=None):
    """`attention` (window + compressed + sink, one softmax) one query chunk at a time.

    Args:
      q_in_bt_: per-token query inputs [B, T, ...]: the queries [B, T, H, D] (RoPE'd, scaled by
        D^-1/2) when `q_fn` is None, else whatever `q_fn` turns into them (e.g. c_q [B, T, R]).
      kv_bsd: raw keys = values [B, T, D].
      positions_bt, segment_ids_bt: int [B, T] (DESIGN.md, "Visibility").
      sink_h: per-head sink logit [H].
      window: the sliding window S (tokens, static).
      chunk: query positions per scan step C (static; T need not be a multiple).
      ckv_bwd: compressed entries [B, W, D] (keys = values), or None (SWA).
      ratio: tokens per compressed block (static; with ckv_bwd).
      topk_idx_btk, topk_valid_btk: the selection (`select_topk`'s int [B, T, k] and bool
        [B, T, k]): attend only those blocks (CSA sparse). None: every visible block.
      q_fn: (inputs [B, C, ...], positions [B, C]) -> queries [B, C, H, D], run per chunk.
      o_fn: (o [B, C, H, D] in q's dtype, positions [B, C]) -> per-token output, run per chunk.

    Returns:
      [B, T, ...]: o_fn of the attention output (o_bthd [B, T, H, D] in q's dtype by default).

    Shapes (per chunk of c = min(C, T) queries starting at t0):
      1. q_bchd = q_fn(q_in[t0 : t0 + c]);  band keys kv[t0 - P : t0 + c], P = S - 1 (0 if one chunk)
      2. window logits [B, H, c, c + P];  blocks: gathered [B, c, k, D] -> [B, H, c, k], or all
         [B, H, c, W] masked by visibility
      3. merged softmax with the sink; o_fn(o) -> ys[j]
    """
    q_fn, o_fn = q_fn or _identity_q, o_fn or _identity_o
    b, t = positions_bt.shape
    c, n = num_chunks(t, chunk)
    band = (window - 1) if n > 1 else 0  # previous keys a chunk can see; one chunk has none before it
    pad_end = n * c - t
    pad_kv = lambda x: jnp.pad(x, [(0, 0), (band, pad_end)] + [(0, 0)] * (x.ndim - 2))
    kv_pad, pos_pad, seg_pad = pad_kv(kv_bsd), pad_kv(positions_bt), pad_kv(segment_ids_bt)
    sink_h = sink_h.astype(jnp.promote_types(sink_h.dtype, jnp.float32))
    if ckv_bwd is not None:
        seg_bw, last_bw = block_keys(positions_bt, segment_ids_bt, ratio)
    gathered = topk_idx_btk is not None
    xs = [to_chunks(q_in_bt_, c, n), to_chunks(positions_bt, c, n), to_chunks(segment_ids_bt, c, n),
          jnp.arange(n) * c]
    if gathered:
        xs += [to_chunks(topk_idx_btk, c, n), to_chunks(topk_valid_btk, c, n)]

    @jax.checkpoint
    def body(q_in, pos_bc, seg_bc, t0, *sel):
        q = q_fn(q_in, pos_bc)
        acc = jnp.promote_types(q.dtype, jnp.float32)
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, t0, c + band, axis=1)
        parts = [(sl(kv_pad).astype(acc), window_rows(pos_bc, seg_bc, sl(pos_pad), sl(seg_pad), window))]
        if ckv_bwd is not None:
            ckv = ckv_bwd.astype(acc)
            if gathered:
                idx_bck, valid_bck = sel
                parts.append((jax.vmap(lambda kv_wd, i_ck: kv_wd[i_ck])(ckv, idx_bck), valid_bck))
            else:
                parts.append((ckv, visible_rows(pos_bc, seg_bc, seg_bw, last_bw)))
        o = merged_softmax(q.astype(acc), sink_h.astype(acc), parts).astype(q.dtype)
        return o_fn(o, pos_bc)

    if n == 1:
        ys = body(*(x[0] for x in xs))[None]
    else:
        _, ys = jax.lax.scan(lambda carry, x: (carry, body(*x)), None, tuple(xs))
    return from_chunks(ys, t)
