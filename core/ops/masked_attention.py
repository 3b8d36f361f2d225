"""The dense formulation of the attention's visibility and of the attention itself: the reference the
chunked and fused paths are held against (DESIGN.md, "Visibility", "Attention"), and the `masked` mode.

The masks are the rules of core.ops.chunked_attention (`visible_rows`, `window_rows`) over every
query row at once: `csa_visible` and `compressed_visibility` bool [B, T, W] (which compressed blocks
each query may see), `sliding_window_mask` bool [B, T, S] (raw keys in each query's window),
`selection_mask` a top-k selection's indices as bool [B, T, W] (`selected`: either form of a
selection as a mask). `softmax_attention` is the formula with those dense masks, logits
[B, H, T, T] and [B, H, T, W] at once; `masked_attention` builds the masks from the packing and
calls it, with the chunked path's arguments. Memory O(T^2 H): tests and short sequences only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core.ops.chunked_attention import (NEG, Keys, RowQueries, block_last_positions, block_segment_ids, visible_rows,
                                        window_rows)


def csa_visible(positions, segment_ids, ratio: int = 4):
    """Which compressed blocks each query may see.

    Block w is visible to query t iff seg_block[w] == seg[t] >= 1 and the block's last token
    position <= positions[t]: a block appears once complete, so t < ratio - 1 sees none.

    Args:
      positions: int [B, T], restarting at 0 per document.
      segment_ids: int [B, T], >= 1 real, 0 padding.
      ratio: tokens per block (4 for CSA, 128 for HCA).

    Returns:
      bool [B, T, T // ratio].
    """
    return visible_rows(positions, segment_ids, block_segment_ids(segment_ids, ratio),
                        block_last_positions(positions, ratio))


def compressed_visibility(positions_bt, segment_ids_bt, ratio: int):
    """bool [B, T, T // ratio]: csa_visible, also when T is not a multiple of `ratio`.

    Trailing tokens that do not fill a block form no entry (the compressor drops them).
    """
    t = positions_bt.shape[1]
    pad = (-t) % ratio
    if pad:  # padding tokens (segment 0) make the extra block invisible; it is then dropped
        positions_bt = jnp.pad(positions_bt, ((0, 0), (0, pad)))
        segment_ids_bt = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)))
    return csa_visible(positions_bt, segment_ids_bt, ratio)[:, :t, : t // ratio]


def sliding_window_mask(positions, segment_ids, window: int):
    """Raw key s is in query t's window iff same document and 0 <= pos[t] - pos[s] < window.

    Returns:
      bool [B, T, S] with S = T (raw key positions).
    """
    return window_rows(positions, segment_ids, positions, segment_ids, window)


def selection_mask(idx_btk, valid_btk, num_blocks: int):
    """bool [B, T, W]: True at the valid selected blocks.

    A scatter of the top-k indices (distinct per row, so invalid slots never clear a valid one):
    a one-hot formulation would materialise [B, T, k, W], k times the mask itself (k = 512 at V4-Flash).
    """
    b, t, _ = idx_btk.shape
    rows_btw = jnp.zeros((b, t, num_blocks), jnp.bool_)
    return rows_btw.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx_btk].set(valid_btk)


def selected(selection, num_blocks: int):
    """bool [B, T, W]: a selection's blocks, whichever its form: (indices, validity) through
    `selection_mask`, or the mask itself."""
    return selection_mask(*selection, num_blocks) if isinstance(selection, tuple) else selection


def softmax_attention(q_bthd, kv_bsd, window_bts, sink_h, ckv_bwd=None, allowed_btw=None):
    """Window raw keys + allowed compressed entries + per-head sink in one softmax, dense masks.

    Args:
      q_bthd: queries [B, T, H, D], RoPE applied and already scaled by D^-1/2.
      kv_bsd: raw keys = values [B, S=T, D].
      window_bts: bool [B, T, S], raw key s in query t's window.
      sink_h: per-head sink logit [H]; adds exp(sink) to the denominator only.
      ckv_bwd: compressed entries [B, W, D] (keys = values), or None (SWA).
      allowed_btw: bool [B, T, W], which entries query t attends.

    Returns:
      o_bthd [B, T, H, D] in q's dtype. A row with no allowed key returns 0 (the sink takes all).

    Shapes:
      1. logits_bhts = q . kv,  logits_bhtw = q . ckv            (float32, masked with NEG)
      2. p = exp(logit - mx) / (sum exp(logit - mx) + exp(sink - mx)),  mx = max(logits, sink)
      3. o_bthd = p_bhts . kv + p_bhtw . ckv
    """
    acc = jnp.promote_types(q_bthd.dtype, jnp.float32)
    q = q_bthd.astype(acc)
    keys = [(kv_bsd.astype(acc), window_bts)]
    if ckv_bwd is not None:
        keys.append((ckv_bwd.astype(acc), allowed_btw))
    logits = [jnp.where(mask[:, None], jnp.einsum("bthd,bsd->bhts", q, k), NEG) for k, mask in keys]
    sink_bht = jnp.broadcast_to(sink_h.astype(acc)[None, :, None], logits[0].shape[:3])
    mx_bht = jax.lax.stop_gradient(
        jnp.maximum(sink_bht, jnp.max(jnp.concatenate(logits, axis=-1), axis=-1)))
    exps = [jnp.where(mask[:, None], jnp.exp(l - mx_bht[..., None]), 0.0)
            for l, (_, mask) in zip(logits, keys)]
    denom_bht = jnp.exp(sink_bht - mx_bht) + sum(jnp.sum(e, axis=-1) for e in exps)
    o_bthd = sum(jnp.einsum("bhts,bsd->bthd", e, k) for e, (k, _) in zip(exps, keys))
    return (o_bthd / jnp.transpose(denom_bht, (0, 2, 1))[..., None]).astype(q_bthd.dtype)


def masked_attention(queries: RowQueries, keys: Keys, positions_bt, segment_ids_bt, selection=None, out_fn=None):
    """The reference: every query at once, with dense [B, T, S] and [B, T, W] masks.

    Args:
      queries: the layer's queries (built whole here).
      keys: raw keys, sink, compressed entries and their visibility rules.
      positions_bt, segment_ids_bt: int [B, T], where each token of the packed batch sits
        (positions restart at 0 per document; segment ids >= 1 real tokens, 0 padding).
      selection: CSA's top-k blocks per query (core.ops.topk), as (idx int32 [B, T, k], valid bool
        [B, T, k]) or as a mask bool [B, T, W]; None for every visible block.
      out_fn: (o [B, T, H, D], positions [B, T]) -> per-token output; None keeps o.

    Returns:
      out_fn(o_bthd, positions): `softmax_attention` with allowed = visible (& selected).
    """
    window_bts = sliding_window_mask(positions_bt, segment_ids_bt, keys.window)
    allowed_btw = None
    if keys.compressed_bwd is not None:
        allowed_btw = compressed_visibility(positions_bt, segment_ids_bt, keys.ratio)
        if selection is not None:
            allowed_btw = allowed_btw & selected(selection, allowed_btw.shape[-1])
    o_bthd = softmax_attention(queries.of(queries.inputs, positions_bt), keys.raw_bsd, window_bts,
                               keys.sink_h, keys.compressed_bwd, allowed_btw)
    return o_bthd if out_fn is None else out_fn(o_bthd, positions_bt)
