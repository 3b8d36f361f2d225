"""Visibility masks derived from `positions` and `segment_ids` (DESIGN.md, "Visibility").

Every batch row is a packed sequence of documents: segment_ids >= 1 are real tokens, 0 is
padding; positions restart at 0 at each document start. All masks are boolean; callers mask
logits with `NEG` (a large finite negative) so a fully masked row is 0, never NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

NEG = -1e30  # masked logit: finite, so exp() underflows to 0 instead of producing NaN


class Packing(NamedTuple):
    """Where each token of a packed batch sits: the two arrays every mask derives from."""

    positions_bt: jnp.ndarray    # int [B, T], restarting at 0 at each document start
    segment_ids_bt: jnp.ndarray  # int [B, T], >= 1 real tokens, 0 padding


def block_segment_ids(segment_ids, ratio: int):
    """Segment id of each compressed block, -1 when its `ratio` tokens disagree.

    Args:
      segment_ids: int [B, T]; T a multiple of `ratio`.
      ratio: tokens per block m (static).

    Returns:
      int [B, T // ratio]. A block straddling a document boundary or padding gets -1 and is
      never visible; an all-padding block keeps 0, which is never visible either.
    """
    b, t = segment_ids.shape
    seg_bwr = segment_ids.reshape(b, t // ratio, ratio)
    uniform = jnp.all(seg_bwr == seg_bwr[..., :1], axis=-1)
    return jnp.where(uniform, seg_bwr[..., 0], -1)


def block_last_positions(positions, ratio: int):
    """Position of each block's last token, int [B, T // ratio]."""
    b, t = positions.shape
    return positions.reshape(b, t // ratio, ratio)[..., -1]


def block_first_positions(positions, ratio: int):
    """Position of each block's first token, int [B, T // ratio] (where its RoPE applies)."""
    b, t = positions.shape
    return positions.reshape(b, t // ratio, ratio)[..., 0]


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


def visible_rows(pos_bt, seg_bt, seg_bw, last_bw):
    """csa_visible's rule for any set of query rows (all of them, or one query chunk) against the
    blocks' segment ids and last positions: bool [B, t, W]."""
    same_doc_btw = (seg_bw[:, None, :] == seg_bt[:, :, None]) & (seg_bt[:, :, None] >= 1)
    return same_doc_btw & (last_bw[:, None, :] <= pos_bt[:, :, None])


def sliding_window_mask(positions, segment_ids, window: int):
    """Raw key s is in query t's window iff same document and 0 <= pos[t] - pos[s] < window.

    Returns:
      bool [B, T, S] with S = T (raw key positions).
    """
    return window_rows(positions, segment_ids, positions, segment_ids, window)


def window_rows(pos_bt, seg_bt, pos_bs, seg_bs, window: int):
    """sliding_window_mask's rule for any set of query rows against any set of raw keys (every key,
    or one chunk's band): bool [B, t, s]."""
    same_doc_bts = (seg_bt[:, :, None] == seg_bs[:, None, :]) & (seg_bt[:, :, None] >= 1)
    delta_bts = pos_bt[:, :, None] - pos_bs[:, None, :]
    return same_doc_bts & (delta_bts >= 0) & (delta_bts < window)
