"""Attention over window raw keys, compressed entries and a sink: the visibility rules and the
query-chunked path (DESIGN.md, "Visibility", "Attention" and "Memory").

Visibility derives from `positions` and `segment_ids`. Every batch row is a packed sequence of
documents: segment_ids >= 1 are real tokens, 0 is padding; positions restart at 0 at each document
start. `visible_rows` (compressed blocks) and `window_rows` (raw keys) are the rules for any set of
query rows; all masks are boolean, and logits are masked with `NEG` (a large finite negative) so a
fully masked row is 0, never NaN.

The dense formulation, every query's masks and logits at once, is the reference
(core/ops/masked_attention.py `masked_attention`). `chunked_attention` computes the same without
any [T, T] or [T, W]-over-all-queries tensor. Its queries are cut into chunks of C positions (T padded up to a multiple of C with
padding tokens, segment 0, which see nothing and are sliced off) and a `lax.scan` runs one chunk
at a time; the chunk body is `jax.checkpoint`ed, so the backward pass recomputes it and keeps
nothing of chunk size between steps. Per chunk, at once:

  window   its C queries meet only keys [t0 - (S - 1), t0 + C): logits [B, H, C, C + S - 1]
           (the keys are front-padded with invisible padding, so chunk 0 needs no special case);
           banded when C holds at least two runs of u >= S - 1 queries (u the smallest such
           divisor of C, `band_run`): each run meets its own 2u keys (`Band`), logits
           [B, C / u, H, u, 2u], so the window's work stays O(S) per query at any C
  CSA      top-k as indices (idx, valid): the k selected blocks' keys gathered per query,
           [B, C, k, D] and logits [B, H, C, k]; top-k as a mask bool [B, T, W]: every block,
           logits [B, H, C, W] masked to the selected ones (no gather: dense work O(W) per query,
           the better trade while W is a few times k); every visible block (pre-training, warm-up,
           no indexer): [B, H, C, W]
  HCA      every block, [B, H, C, W] (W = T / 128)
  sink     [H]

and the parts merge in one softmax by log-sum-exp (one max over every part and the sink, one
sum of exponentials), so a fully masked part adds exactly 0. Visibility follows DESIGN.md to
the letter from positions and segment ids: the window test is `window_rows` and the block test
`visible_rows`; the band only assumes what DESIGN.md states, that positions count up
by one inside a document, so the keys of a query's window are among its S - 1 predecessors.

Queries arrive as `RowQueries`: a pure function of per-token inputs (e.g. the low-rank c_q) run
for any run of rows, so the chunked path builds the [B, C, H, D] queries of one chunk at a time
and the [B, T, H, D] queries never exist whole. The output projection runs per chunk as well
(`out_fn`). A `ChunkTap` takes each chunk's indexer-loss teacher rows, read off its block logits
(`merged_softmax`'s `teacher`), and carries what it makes of them through the chunks (the dense
streamed loss: core/loss/indexer_kl.py `csa_indexer_loss_tap`). Work is O(T (S + k) H D)
with top-k, O(T (S + W) H D) over every block; without a banded window (fewer than two runs in a
chunk) the window's S becomes C + S.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from core.ops.placement import backward_after_cotangent

# ----------------------------------------------------------------------------- visibility

NEG = -1e30  # masked logit: finite, so exp() underflows to 0 instead of producing NaN


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


def visible_rows(pos_bt, seg_bt, seg_bw, last_bw):
    """Which compressed blocks each of a set of query rows (all of them, or one query chunk) may see,
    from the blocks' segment ids and last positions: bool [B, t, W].

    Block w is visible to query t iff seg_block[w] == seg[t] >= 1 and the block's last token position
    <= positions[t]: a block appears once complete, so t < ratio - 1 sees none."""
    same_doc_btw = (seg_bw[:, None, :] == seg_bt[:, :, None]) & (seg_bt[:, :, None] >= 1)
    return same_doc_btw & (last_bw[:, None, :] <= pos_bt[:, :, None])


def window_rows(pos_bt, seg_bt, pos_bs, seg_bs, window: int):
    """Which raw keys of a set (every key, or one chunk's band) are in each query row's window: key s
    is in query t's iff same document and 0 <= pos[t] - pos[s] < window. bool [B, t, s]."""
    same_doc_bts = (seg_bt[:, :, None] == seg_bs[:, None, :]) & (seg_bt[:, :, None] >= 1)
    delta_bts = pos_bt[:, :, None] - pos_bs[:, None, :]
    return same_doc_bts & (delta_bts >= 0) & (delta_bts < window)


# ----------------------------------------------------------------------------- queries, keys and chunks

def _given(q_bt_, params, positions_bt):
    del params, positions_bt
    return q_bt_


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inputs", "params"], meta_fields=["fn"])
@dataclasses.dataclass(frozen=True)
class RowQueries:
    """Queries for any run of rows: `fn(inputs[rows], params, positions[rows])` -> [B, rows, heads, dim].

    The one form in which queries reach the attention, the indexer's top-k and the streamed indexer
    loss: a chunked path builds each chunk's queries from the per-token inputs (e.g. the low-rank
    c_q [B, T, R] and W_qb), so [B, T, H, D] need not exist whole. `RowQueries.given(q)` wraps
    queries that already exist (fn returns its rows unchanged). A pytree: gradients reach
    `inputs` and `params`; `fn` is static.
    """

    fn: Callable
    inputs: Any         # per-token inputs [B, T, ...]
    params: Any = ()    # the arrays fn needs besides them (e.g. a projection matrix)

    @classmethod
    def given(cls, q_bt_) -> "RowQueries":
        return cls(_given, q_bt_)

    def of(self, inputs_bt_, positions_bt):
        """The queries of these rows' inputs [B, t, ...] at their positions [B, t]."""
        return self.fn(inputs_bt_, self.params, positions_bt)

    def rows(self, t0, size: int, positions_bt):
        """The queries of rows [t0, t0 + size) (t0 may be traced); positions_bt are those rows'."""
        return self.of(jax.lax.dynamic_slice_in_dim(self.inputs, t0, size, axis=1), positions_bt)

    def whole(self, positions_bt) -> "RowQueries":
        """Every row's queries built at once [B, T, heads, dim], wrapped as given."""
        return RowQueries.given(self.of(self.inputs, positions_bt))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["raw_bsd", "sink_h", "compressed_bwd"],
                   meta_fields=["window", "ratio"])
@dataclasses.dataclass(frozen=True)
class Keys:
    """What a layer's queries attend, and the static rule that makes each part visible."""

    raw_bsd: Any                # raw keys = values [B, S=T, D], seen within `window` tokens
    sink_h: Any                 # per-head sink logit [H]: exp(sink) joins the denominator only
    window: int                 # sliding window S (tokens)
    compressed_bwd: Any = None  # compressed entries [B, W, D] (keys = values), None in SWA layers
    ratio: int = 0              # tokens per compressed entry (4 CSA, 128 HCA)


class ChunkTap(NamedTuple):
    """What `chunked_attention` hands each chunk's teacher rows to: carry = step(carry, t0, psum_bcw)
    from init, psum_bcw the detached [B, C, W] rows of `merged_softmax`'s `teacher`."""

    teacher: str      # "compressed" | "joint"
    init: Any
    step: Callable


class Band(NamedTuple):
    """Window keys per run of u consecutive queries: keys [B, n, K, D] for a chunk's n = C / u runs.

    A key part of `merged_softmax` whose mask is [B, C, K], the run of query c being c // u.
    """

    keys_bnkd: Any


def band_run(c: int, window: int) -> int:
    """The run u of the banded window in a chunk of c queries: the smallest divisor of c with
    u >= window - 1, when c holds at least two runs; 0 where none does (the chunk's queries then
    share one band of c + window - 1 keys)."""
    return next((u for u in range(max(window - 1, 1), c // 2 + 1) if c % u == 0), 0)


def banded_window(kv_band, pos_band, seg_band, pos_bc, seg_bc, window: int, run: int):
    """A chunk's window part as `Band`: run j of the c queries meets band keys [j u, (j + 2) u).

    Args:
      kv_band, pos_band, seg_band: the chunk's band, keys [B, c + window - 1, D] and their
        positions and segment ids, starting window - 1 rows before the chunk.
      pos_bc, seg_bc: the chunk's queries' positions and segment ids [B, c].
      window, run: S and u (`band_run`; u >= S - 1 and u divides c).

    Returns:
      (Band(keys [B, c / u, 2u, D]), mask bool [B, c, 2u]): query j u + i needs band rows
      [j u + i, j u + i + S - 1], inside [j u, (j + 2) u) because S - 1 <= u; the rows past the band
      are padding (segment 0), never visible.
    """
    b, c = pos_bc.shape
    n = c // run
    pad = (n + 1) * run - kv_band.shape[1]

    def pairs(x):  # [B, c + S - 1, ...] -> [B, n, 2u, ...]: blocks j and j + 1 of u rows side by side
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(b, n + 1, run, *x.shape[2:])
        return jnp.concatenate([x[:, :-1], x[:, 1:]], axis=2)

    kpos, kseg = pairs(pos_band).reshape(b * n, 2 * run), pairs(seg_band).reshape(b * n, 2 * run)
    mask = window_rows(pos_bc.reshape(b * n, run), seg_bc.reshape(b * n, run), kpos, kseg, window)
    return Band(pairs(kv_band)), mask.reshape(b, c, 2 * run)


def _identity_out(o_bthd, positions_bt):
    del positions_bt
    return o_bthd


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


def merged_softmax(q_bchd, sink_h, parts, teacher: str | None = None):
    """One softmax over several key sets and the sink, merged by log-sum-exp.

    The products take the queries and keys in their own (compute) dtype and accumulate in float32
    (at least); logits, the softmax and the output are float32; the probabilities meet the values
    in the values' dtype, as flash attention feeds its second matmul.

    Args:
      q_bchd: queries [B, C, H, D] (compute dtype).
      sink_h: per-head sink logit [H] (float32).
      parts: (keys, mask) pairs: keys [B, U, D] shared by the chunk's queries with mask
        bool [B, C, U], keys [B, C, U, D] per query (gathered blocks) with mask bool [B, C, U], or
        `Band` keys [B, n, U, D] per run of C / n queries with mask bool [B, C, U].
      teacher: None, or the indexer loss's teacher ("compressed" | "joint", DESIGN.md "The indexer
        loss") over the last part, keys shared by the chunk's queries (the compressed entries):
        its rows are then read off these very logits.

    Returns:
      o_bchd [B, C, H, D] in the accumulation dtype: sum over parts of p * v (a row with nothing
      allowed gives 0); with `teacher`, (o_bchd, psum_bcu): sum over heads of each head's softmax
      on the last part's allowed keys, normalised over those keys alone ("compressed") or over
      everything the head attends, window and sink included ("joint"), detached.
    """
    acc = jnp.promote_types(q_bchd.dtype, jnp.float32)
    b, c, h, d = q_bchd.shape
    # Logits [B, H, C, U] for keys shared or gathered per query; [B, n, H, C / n, U] for a `Band`, its
    # runs a batch axis of both products and its mask [B, n, 1, C / n, U] a free reshape of [B, C, U]
    # (the two minor axes kept); the max and the sum meet in [B, H, C].

    def masked_logits(k, mask):  # (logits, the mask broadcast to them)
        if isinstance(k, Band):
            n = k.keys_bnkd.shape[1]
            l_bnhqu = jnp.einsum("bnqhd,bnud->bnhqu", q_bchd.reshape(b, n, c // n, h, d), k.keys_bnkd,
                                 preferred_element_type=acc)
            mask_bn1qu = mask.reshape(b, n, 1, c // n, -1)
            return jnp.where(mask_bn1qu, l_bnhqu, NEG), mask_bn1qu
        l_bhcu = jnp.einsum("bchd,bud->bhcu" if k.ndim == 3 else "bchd,bcud->bhcu", q_bchd, k, preferred_element_type=acc)
        return jnp.where(mask[:, None], l_bhcu, NEG), mask[:, None]

    def to_bhc(x, k):  # a part's array reduced over U -> [B, H, C]
        return jnp.transpose(x, (0, 2, 1, 3)).reshape(b, h, c) if isinstance(k, Band) else x

    def from_bhc(x_bhc, k):  # [B, H, C] -> the part's layout, U as 1
        if isinstance(k, Band):
            n = k.keys_bnkd.shape[1]
            return jnp.transpose(x_bhc.reshape(b, h, n, c // n), (0, 2, 1, 3))[..., None]
        return x_bhc[..., None]

    def values(e, k):  # [B, C, H, D]
        if isinstance(k, Band):
            o_bnqhd = jnp.einsum("bnhqu,bnud->bnqhd", e.astype(k.keys_bnkd.dtype), k.keys_bnkd, preferred_element_type=acc)
            return o_bnqhd.reshape(b, c, h, d)
        return jnp.einsum("bhcu,bud->bchd" if k.ndim == 3 else "bhcu,bcud->bchd", e.astype(k.dtype), k,
                          preferred_element_type=acc)

    parts = [(k, mask) for k, mask in parts if mask.shape[-1]]  # no block complete yet: no part
    logits = [masked_logits(k, mask) for k, mask in parts]
    sink_bhc = jnp.broadcast_to(sink_h.astype(acc)[None, :, None], (b, h, c))
    mx_bhc = sink_bhc
    for (l, _), (k, _) in zip(logits, parts):
        mx_bhc = jnp.maximum(mx_bhc, to_bhc(jnp.max(l, axis=-1), k))
    mx_bhc = jax.lax.stop_gradient(mx_bhc)  # any shift gives the same softmax; this one is stable
    exps = [jnp.where(m, jnp.exp(l - from_bhc(mx_bhc, k)), 0.0) for (l, m), (k, _) in zip(logits, parts)]
    denom_bhc = jnp.exp(sink_bhc - mx_bhc) + sum(to_bhc(jnp.sum(e, axis=-1), k) for e, (k, _) in zip(exps, parts))
    o_bchd = sum((values(e, k) for e, (k, _) in zip(exps, parts)), jnp.zeros(q_bchd.shape, acc))
    o_bchd = o_bchd / jnp.transpose(denom_bhc, (0, 2, 1))[..., None]
    if teacher is None:
        return o_bchd
    l_bhcu, mask_b1cu = jax.tree.map(jax.lax.stop_gradient, logits[-1])
    if teacher == "joint":  # the head's own log-sum-exp over everything it attends
        lse_bhc = mx_bhc + jnp.log(jax.lax.stop_gradient(denom_bhc))
    else:  # over the last part alone, with its own max: nothing underflows against the window's
        own_bhc = jnp.max(l_bhcu, axis=-1)
        sum_bhc = jnp.sum(jnp.where(mask_b1cu, jnp.exp(l_bhcu - own_bhc[..., None]), 0.0), axis=-1)
        lse_bhc = own_bhc + jnp.log(jnp.where(sum_bhc > 0, sum_bhc, 1.0))
    psum_bcu = jnp.sum(jnp.where(mask_b1cu, jnp.exp(l_bhcu - lse_bhc[..., None]), 0.0), axis=1)
    return o_bchd, psum_bcu


def chunked_attention(queries: RowQueries, keys: Keys, positions_bt, segment_ids_bt, selection=None, out_fn=None, *,
                      chunk: int, tap=None):
    """The attention (core.ops.masked_attention's `masked_attention`) one query chunk at a time, without a
    [T, T] or [T, W] tensor.

    Args:
      queries: the layer's queries, built per chunk.
      keys: raw keys, sink, compressed entries and their visibility rules.
      positions_bt, segment_ids_bt: int [B, T], where each token of the packed batch sits.
      selection: CSA's top-k blocks per query (core.ops.topk), as (idx int32 [B, T, k], valid bool
        [B, T, k]) or as a mask bool [B, T, W]; None for every visible block.
      out_fn: (o [B, C, H, D] in q's dtype, positions [B, C]) -> per-token output, run per chunk;
        None keeps o.
      chunk: query positions per scan step C (static; T need not be a multiple).
      tap: None, or `ChunkTap`: the indexer loss's teacher read off each chunk's block logits
        (`merged_softmax`'s `teacher`) and handed, with the chunk's first row, to tap.step, which
        carries tap.init through the chunks (the streamed indexer loss, one block per chunk: T a
        multiple of C, every visible block attended, keys shared by the chunk).

    Returns:
      [B, T, ...]: out_fn of the attention output (o_bthd [B, T, H, D] in q's dtype by default);
      with `tap`, (that, the carry after the last chunk).

    Shapes (per chunk of c = min(C, T) queries starting at t0):
      1. q_bchd = queries of rows [t0, t0 + c);  band keys kv[t0 - P : t0 + c], P = S - 1 (0 if one chunk)
      2. window logits [B, H, c, c + P];  blocks: gathered [B, c, k, D] -> [B, H, c, k], or all
         [B, H, c, W] masked by visibility
      3. merged softmax with the sink; out_fn(o) -> ys[j]
    """
    out_fn = out_fn or _identity_out
    window, ckv_bwd = keys.window, keys.compressed_bwd
    b, t = positions_bt.shape
    c, n = num_chunks(t, chunk)
    band = (window - 1) if n > 1 else 0  # previous keys a chunk can see; one chunk has none before it
    run = band_run(c, window) if n > 1 else 0  # the banded window (see the module's docstring)
    pad_end = n * c - t
    pad_kv = lambda x: jnp.pad(x, [(0, 0), (band, pad_end)] + [(0, 0)] * (x.ndim - 2))
    kv_pad, pos_pad, seg_pad = pad_kv(keys.raw_bsd), pad_kv(positions_bt), pad_kv(segment_ids_bt)
    sink_h = keys.sink_h.astype(jnp.promote_types(keys.sink_h.dtype, jnp.float32))
    if ckv_bwd is not None:
        seg_bw, last_bw = block_keys(positions_bt, segment_ids_bt, keys.ratio)
    gathered = isinstance(selection, tuple)  # (indices, validity): the selected blocks' keys gathered
    if tap is not None and (pad_end or gathered or ckv_bwd is None):
        raise ValueError(f"a teacher tap needs T={t} a multiple of the chunk {c} and every block's keys shared")
    xs = [to_chunks(queries.inputs, c, n), to_chunks(positions_bt, c, n), to_chunks(segment_ids_bt, c, n),
          jnp.arange(n) * c]
    if gathered:
        xs += [to_chunks(selection[0], c, n), to_chunks(selection[1], c, n)]
    elif selection is not None:  # a mask: every block, masked to the selected ones
        xs += [to_chunks(selection, c, n)]

    @backward_after_cotangent  # its recompute follows its cotangent (docs/scaling.md#collective-order-on-the-cpu)
    @jax.checkpoint
    def body(q_in, pos_bc, seg_bc, t0, *sel):
        q = queries.of(q_in, pos_bc)
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, t0, c + band, axis=1)
        kv_b, pos_b, seg_b = sl(kv_pad).astype(q.dtype), sl(pos_pad), sl(seg_pad)
        parts = [banded_window(kv_b, pos_b, seg_b, pos_bc, seg_bc, window, run) if run else
                 (kv_b, window_rows(pos_bc, seg_bc, pos_b, seg_b, window))]
        if ckv_bwd is not None:
            ckv = ckv_bwd.astype(q.dtype)
            if gathered:
                idx_bck, valid_bck = sel
                parts.append((jax.vmap(lambda kv_wd, i_ck: kv_wd[i_ck])(ckv, idx_bck), valid_bck))
            else:
                visible_bcw = visible_rows(pos_bc, seg_bc, seg_bw, last_bw)
                parts.append((ckv, visible_bcw & sel[0] if sel else visible_bcw))
        if tap is None:
            return out_fn(merged_softmax(q, sink_h, parts).astype(q.dtype), pos_bc)
        o, psum_bcw = merged_softmax(q, sink_h, parts, tap.teacher)
        return out_fn(o.astype(q.dtype), pos_bc), psum_bcw

    def step(carry, x):
        if tap is None:
            return carry, body(*x)
        y, psum_bcw = body(*x)
        return tap.step(carry, x[3], psum_bcw), y

    carry, ys = (step(None if tap is None else tap.init, tuple(x[0] for x in xs)) if n == 1 else
                 jax.lax.scan(step, None if tap is None else tap.init, tuple(xs)))
    ys = from_chunks(ys[None] if n == 1 else ys, t)
    return ys if tap is None else (ys, carry)
