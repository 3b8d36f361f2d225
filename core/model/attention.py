"""DeepSeek-V4 attention for SWA, CSA and HCA layers (DESIGN.md, "Queries" to "Attention").

One layer, as in the official inference code's `Attention`:

  c_q = q_norm(x W_qa);  q = c_q W_qb -> [H, D];  q = RoPE(rms(q));  q *= D^-1/2
  kv  = RoPE(kv_norm(x W_kv))                     one K=V vector per token shared by all heads
  compressed kv: the layer's Compressor (CSA m = 4 overlapping, HCA m = 128 plain)
  keys: window raw keys + compressed entries (CSA: top-k selected, or all visible in dense mode /
        without an indexer; HCA: all visible; SWA: none), one softmax with a per-head sink
  o = inverse RoPE(sum p v);  out = W_ob [ per group g: W_oa[g] flatten(o heads of g) ]

Two implementations of the same maths (config `attention`), equal to float32 rounding in value
and gradient (tests/ops/test_sparse_attention.py). What lives at once, per layer call:

- `chunked` (default; core.ops.chunked_attention): a `lax.scan` over query chunks of C =
  attention_query_chunk_size positions, each chunk rematerialised in the backward pass. Whole-T
  tensors are per-token only: x, c_q [B, T, q_lora], raw kv [B, T, D], the output [B, T, M], the
  selection [B, T, k]. Per chunk: queries [B, C, H, D]; window logits [B, H, C, C + S - 1] (the
  chunk's own keys and the S - 1 before it); CSA sparse: the k selected blocks' keys gathered,
  [B, C, k, D], logits [B, H, C, k]; HCA and CSA dense (pre-training, warm-up, eval_dense, no
  indexer): logits over every block [B, H, C, W]. The indexer's top-k is chunked the same way
  (`select_topk_chunked`: [B, C, W, HI or head_chunk] scores per chunk, indexer queries built per
  chunk). Memory O(T (M + D + k) + C (S + k) H D); work O(T (C + S + k) H D) sparse, O(T W H D)
  over all visible blocks. The streamed indexer loss builds its teacher and indexer queries
  per block too (`query_fn`, `index_query_fn`), in blocks of csa_query_chunk_size or, when that
  is 0, of the largest divisor of T <= C. The dense [B, T, W] scores and [B, T, H, D] queries are
  built only where a consumer needs them whole: `collect` (eval tools) and an indexer loss that
  cannot stream (T not a multiple of the W blocks).
- `masked` (the reference): dense booleans over [T, T] (window) and [T, W] (blocks); the top-k
  selection enters as `allowed = visible & selected`; logits [B, H, T, T] and [B, H, T, W].

The lightning indexer (`core.model.indexer.Indexer`) lives under `indexer` on CSA layers; its inputs are
detached so neither the indexer loss reaches other parameters nor (the selection being discrete)
the LM loss the indexer. The layer computes its own indexer loss (core.loss.indexer_kl).

Deviations from the official code: no FP8/FP4 quantisation simulation; the weightless query norm
is computed in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from core.model.compressor import Compressor
from core.model.indexer import Indexer
from core.ops.topk import select_topk, select_topk_chunked, selection_mask
from core.loss.indexer_kl import csa_indexer_loss
from core.loss.indexer_kl_streamed import csa_indexer_loss_streamed
from core.model.layers import RMSNorm, dense_init, param, rms_normalize
from core.ops.masks import NEG, csa_visible, sliding_window_mask
from core.ops.rope import RopeSpec, apply_rope
from core.ops.chunked_attention import chunked_attention


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


def attention(q_bthd, kv_bsd, window_bts, sink_h, ckv_bwd=None, allowed_btw=None):
    """Window raw keys + allowed compressed entries + per-head sink in one softmax.

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


def project_queries(c_q_btr, wq_b_rhd, positions_bt, *, eps: float, rope: RopeSpec, dtype):
    """q = RoPE(rms(c_q W_qb)) * D^-1/2 in `dtype`: [B, T, R] x [R, H, D] -> [B, T, H, D]."""
    q = jnp.einsum("btr,rhd->bthd", c_q_btr.astype(dtype), wq_b_rhd.astype(dtype))
    q = apply_rope(rms_normalize(q, eps).astype(dtype), positions_bt, rope)
    return q * jnp.asarray(q.shape[-1] ** -0.5, dtype)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static shape and behaviour of one attention layer (derived from the config)."""

    emb: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    ratio: int                 # 0 SWA, 4 CSA, 128 HCA
    eps: float
    rope: RopeSpec
    indexer_heads: int = 0     # 0: no indexer (SWA, HCA, or use_indexer=false)
    indexer_head_dim: int = 0
    indexer_topk: int = 0
    loss_scale: float = 0.0    # indexer_loss_scaling_factor
    teacher: str = "compressed"
    indexer_weights_init: str = "fan_in"  # how the indexer's weights_proj starts (core.model.indexer.WEIGHTS_INITS)
    head_chunk: int = 0
    query_chunk: int = 0
    attention: str = "chunked"  # "chunked" (core.ops.chunked_attention) | "masked" (dense reference)
    attention_chunk: int = 128  # query positions per chunk of the chunked path

    @classmethod
    def from_config(cls, cfg, layer: int) -> "AttentionSpec":
        ratio = cfg.compress_ratios[layer]
        indexed = ratio == 4 and cfg.use_indexer
        return cls(
            emb=cfg.emb, heads=cfg.num_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
            o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, window=cfg.sliding_window_size,
            ratio=ratio, eps=cfg.normalization_layer_epsilon, rope=RopeSpec.for_layer(cfg, ratio),
            indexer_heads=cfg.indexer_n_heads if indexed else 0,
            indexer_head_dim=cfg.indexer_head_dim if indexed else 0,
            indexer_topk=cfg.indexer_topk if indexed else 0,
            loss_scale=cfg.indexer_loss_scaling_factor, teacher=cfg.indexer_teacher,
            indexer_weights_init=cfg.indexer_weights_init,
            head_chunk=cfg.csa_qk_head_chunk_size, query_chunk=cfg.csa_query_chunk_size,
            attention=cfg.attention, attention_chunk=cfg.attention_query_chunk_size)


class Attention(nnx.Module):
    """One attention sublayer. Parameters (official names, [in, out] layout):

    wq_a [M, q_lora], q_norm.weight [q_lora], wq_b [q_lora, H, D], wkv [M, D], kv_norm.weight [D],
    wo_a [G, H/G * D, o_lora], wo_b [G * o_lora, M], attn_sink [H] (init 0); compressed layers add
    `compressor`, CSA layers with the indexer add `indexer`.
    """

    def __init__(self, spec: AttentionSpec, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 dtype=jnp.float32):
        s = self.spec = spec
        self.dtype = dtype
        g_width = s.heads // s.o_groups * s.head_dim
        self.wq_a = param(rngs, dense_init(), (s.emb, s.q_lora_rank), ("embed", "q_lora"), param_dtype)
        self.q_norm = RMSNorm(s.q_lora_rank, s.eps, rngs=rngs, param_dtype=param_dtype)
        self.wq_b = param(rngs, dense_init(in_axis=0, out_axis=(1, 2)), (s.q_lora_rank, s.heads, s.head_dim),
                          ("q_lora", "heads", "kv"), param_dtype)
        self.wkv = param(rngs, dense_init(), (s.emb, s.head_dim), ("embed", "kv"), param_dtype)
        self.kv_norm = RMSNorm(s.head_dim, s.eps, rngs=rngs, param_dtype=param_dtype)
        self.wo_a = param(rngs, dense_init(in_axis=1, out_axis=2, batch_axis=(0,)),
                          (s.o_groups, g_width, s.o_lora_rank), ("heads", None, "o_lora"), param_dtype)
        self.wo_b = param(rngs, dense_init(), (s.o_groups * s.o_lora_rank, s.emb), ("o_lora", "embed"),
                          param_dtype)
        self.attn_sink = param(rngs, nnx.initializers.zeros, (s.heads,), ("heads",), param_dtype)
        if s.ratio:
            self.compressor = Compressor(s.emb, s.head_dim, s.ratio, s.rope, s.eps, rngs=rngs,
                                         param_dtype=param_dtype, dtype=dtype)
        if s.indexer_heads:
            self.indexer = Indexer(s.emb, s.q_lora_rank, s.indexer_heads, s.indexer_head_dim, s.rope,
                                   s.eps, rngs=rngs, param_dtype=param_dtype, dtype=dtype,
                                   weights_init=s.indexer_weights_init)

    def _queries(self, x_btm, positions_bt):
        """(c_q_btr, q_bthd): low-rank queries, per-head weightless RMS norm, RoPE, * D^-1/2."""
        c_q = self.q_norm(jnp.einsum("btm,mr->btr", x_btm, self.wq_a[...].astype(self.dtype)))
        return c_q, self._queries_from(c_q, positions_bt)

    def _queries_from(self, c_q_btr, positions_bt):
        """q_bthd from the low-rank queries (any run of positions: the chunked path's q_fn)."""
        return self._query_fn()(c_q_btr, self.wq_b[...], positions_bt)

    def _query_fn(self):
        s = self.spec
        return functools.partial(project_queries, eps=s.eps, rope=s.rope, dtype=self.dtype)

    def _output(self, o_bthd, positions_bt):
        """Inverse RoPE, then the grouped low-rank projection back to the model width."""
        s, dt = self.spec, self.dtype
        o = apply_rope(o_bthd, positions_bt, s.rope, inverse=True)
        b, t = o.shape[:2]
        o_btgf = o.reshape(b, t, s.o_groups, -1)
        lat_btgr = jnp.einsum("btgf,gfr->btgr", o_btgf, self.wo_a[...].astype(dt))
        return jnp.einsum("btr,rm->btm", lat_btgr.reshape(b, t, -1), self.wo_b[...].astype(dt))

    def __call__(self, x_btm, positions_bt, segment_ids_bt, *, dense: bool = False,
                 indexer_loss: bool = False, collect: bool = False):
        """Args:
          x_btm: [B, T, M] (already attn-normed).
          positions_bt, segment_ids_bt: int [B, T].
          dense: CSA attends every visible block (dense warm-up, eval_dense) instead of the top-k.
          indexer_loss: compute this CSA layer's indexer loss (dense if `dense`, else sparse).
          collect: also return the indexer's scores, selection and teacher inputs.

        Returns:
          (y_btm [B, T, M], aux). CSA layers with an indexer: aux["indexer_loss"] (f32 scalar,
          times loss_scale; 0.0 when not computed) and, when collecting, index_scores,
          topk_idx, topk_valid, teacher_query, compressed_kv, visible, raw_kv, window, sink.
        """
        s, dt = self.spec, self.dtype
        if s.attention == "chunked":
            return self._chunked(x_btm, positions_bt, segment_ids_bt, dense=dense,
                                 indexer_loss=indexer_loss, collect=collect)
        x_btm = x_btm.astype(dt)
        c_q, q = self._queries(x_btm, positions_bt)
        kv = self._raw_kv(x_btm, positions_bt)
        window_bts = sliding_window_mask(positions_bt, segment_ids_bt, s.window)
        sink_h = self.attn_sink[...].astype(jnp.promote_types(dt, jnp.float32))
        aux = {}
        ckv = allowed = None
        if s.ratio:
            ckv = self.compressor(x_btm, positions_bt)
            allowed = compressed_visibility(positions_bt, segment_ids_bt, s.ratio)
            if s.indexer_heads:
                allowed, _, aux = self._index(x_btm, c_q, q, kv, ckv, allowed, window_bts, sink_h,
                                              positions_bt, segment_ids_bt, dense=dense,
                                              loss=indexer_loss, collect=collect)
        o = attention(q, kv, window_bts, sink_h, ckv, allowed)
        return self._output(o, positions_bt), aux

    def _raw_kv(self, x_btm, positions_bt):
        dt = self.dtype
        kv = self.kv_norm(jnp.einsum("btm,md->btd", x_btm, self.wkv[...].astype(dt)))
        return apply_rope(kv, positions_bt, self.spec.rope)

    def _chunked(self, x_btm, positions_bt, segment_ids_bt, *, dense: bool, indexer_loss: bool,
                 collect: bool):
        """`__call__` with `chunked_attention`: queries, attention and output projection per chunk.

        The [B, T, H, D] queries exist whole only where `collect` (or an indexer loss that cannot
        stream) needs them as detached teacher inputs; the attention builds its own per chunk.
        """
        s, dt = self.spec, self.dtype
        x_btm = x_btm.astype(dt)
        c_q = self.q_norm(jnp.einsum("btm,mr->btr", x_btm, self.wq_a[...].astype(dt)))
        kv = self._raw_kv(x_btm, positions_bt)
        sink_h = self.attn_sink[...].astype(jnp.promote_types(dt, jnp.float32))
        aux, ckv, sel = {}, None, (None, None)
        if s.ratio:
            ckv = self.compressor(x_btm, positions_bt)
        if s.indexer_heads:
            sel, aux = self._index_chunked(x_btm, c_q, kv, ckv, sink_h, positions_bt, segment_ids_bt,
                                           dense=dense, loss=indexer_loss, collect=collect)
        y = chunked_attention(c_q, kv, positions_bt, segment_ids_bt, sink_h, window=s.window,
                              chunk=s.attention_chunk, ckv_bwd=ckv, ratio=s.ratio,
                              topk_idx_btk=sel[0], topk_valid_btk=sel[1],
                              q_fn=self._queries_from, o_fn=self._output)
        return y, aux

    def _index_chunked(self, x_btm, c_q, kv, ckv, sink_h, positions_bt, segment_ids_bt, *,
                       dense: bool, loss: bool, collect: bool):
        """((topk_idx, topk_valid) or (None, None) when dense, aux) for the chunked path.

        Dense [B, T, W] scores are built only where something consumes them whole (`collect`, or
        an indexer loss that cannot stream, see `_loss_chunk`); else the selection is chunked.
        """
        s = self.spec
        loss_chunk = self._loss_chunk(positions_bt.shape[1])
        streamed = loss and loss_chunk > 0
        if collect or (loss and not streamed):
            q = self._queries_from(c_q, positions_bt)
            visible_btw = compressed_visibility(positions_bt, segment_ids_bt, s.ratio)
            window_bts = sliding_window_mask(positions_bt, segment_ids_bt, s.window)
            _, sel, aux = self._index(x_btm, c_q, q, kv, ckv, visible_btw, window_bts, sink_h,
                                      positions_bt, segment_ids_bt, dense=dense, loss=loss,
                                      collect=collect)
            return (None, None) if dense else sel, aux
        aux = {"indexer_loss": jnp.zeros((), jnp.float32)}
        if dense and not loss:  # eval_dense / pre-training: the indexer plays no part
            return (None, None), aux
        k_idx, w_idx = self.indexer.keys_and_weights(x_btm, positions_bt)
        sel = (None, None)
        if not dense:
            sel = select_topk_chunked(c_q, k_idx, w_idx, positions_bt, segment_ids_bt,
                                      ratio=s.ratio, k=s.indexer_topk, chunk=s.attention_chunk,
                                      head_chunk=s.head_chunk, q_fn=self.indexer.queries)
        if loss:  # indexer and teacher queries are built per loss block from c_q
            aux["indexer_loss"] = self._streamed_loss(k_idx, w_idx, c_q, kv, ckv, sink_h,
                                                      positions_bt, segment_ids_bt, dense=dense,
                                                      query_chunk=loss_chunk)
        return sel, aux

    def _loss_chunk(self, t: int) -> int:
        """The streamed indexer loss's query block: csa_query_chunk_size, or when that is 0 the
        largest divisor of T <= attention_query_chunk_size; 0 (direct loss) if T cannot stream."""
        s = self.spec
        if s.query_chunk:
            return s.query_chunk
        w = t // s.ratio
        if w == 0 or t % w:  # the streamed loss needs T to be a multiple of the W blocks
            return 0
        return max(c for c in range(1, min(t, s.attention_chunk) + 1) if t % c == 0)

    def _streamed_loss(self, k_idx, w_idx, c_q, kv, ckv, sink_h, positions_bt, segment_ids_bt, *,
                       dense: bool, query_chunk: int):
        s, sg = self.spec, jax.lax.stop_gradient
        joint = s.teacher == "joint"
        return csa_indexer_loss_streamed(
            (sg(c_q), self.indexer.wq_b[...]), k_idx, w_idx, (sg(c_q), sg(self.wq_b[...])), sg(ckv),
            positions_bt, segment_ids_bt, index_query_fn=self.indexer.query_fn(),
            query_fn=self._query_fn(), topk=None if dense else s.indexer_topk,
            scale=s.loss_scale,
            window=s.window if joint else 0, teacher=s.teacher, head_chunk=s.head_chunk,
            query_chunk=query_chunk, sink=sg(sink_h) if joint else None,
            raw_kv=sg(kv) if joint else None)

    def _index(self, x_btm, c_q, q, kv, ckv, visible_btw, window_bts, sink_h, positions_bt,
               segment_ids_bt, *, dense: bool, loss: bool, collect: bool):
        """Indexer scores, top-k selection and the indexer loss.

        Returns (allowed_btw, (topk_idx, topk_valid) or (None, None) if not selected, aux).
        """
        s = self.spec
        streamed = loss and s.query_chunk > 0
        need_scores = collect or not dense or (loss and not streamed)
        aux = {"indexer_loss": jnp.zeros((), jnp.float32)}
        allowed, sel = visible_btw, (None, None)
        if not (need_scores or streamed):  # eval_dense: the indexer plays no part
            return allowed, sel, aux
        q_idx, k_idx, w_idx = self.indexer.project(x_btm, c_q, positions_bt)
        if need_scores:
            scores = self.indexer.score(q_idx, k_idx, w_idx, visible_btw, head_chunk=s.head_chunk)
            idx_btk, valid_btk = sel = select_topk(scores, visible_btw, s.indexer_topk)
            selected_btw = selection_mask(idx_btk, valid_btk, visible_btw.shape[-1])
            if not dense:
                allowed = visible_btw & selected_btw
        sg = jax.lax.stop_gradient
        teacher = dict(teacher=s.teacher, head_chunk=s.head_chunk, query_chunk=s.query_chunk,
                       sink=sg(sink_h) if s.teacher == "joint" else None,
                       raw_kv=sg(kv) if s.teacher == "joint" else None)
        if loss and streamed:
            aux["indexer_loss"] = csa_indexer_loss_streamed(
                q_idx, k_idx, w_idx, sg(q), sg(ckv), positions_bt, segment_ids_bt,
                topk=None if dense else s.indexer_topk, scale=s.loss_scale,
                window=s.window if s.teacher == "joint" else 0, **teacher)
        elif loss:
            aux["indexer_loss"] = csa_indexer_loss(
                scores, sg(q), sg(ckv), allowed, scale=s.loss_scale,
                window_mask=window_bts if s.teacher == "joint" else None, **teacher)
        if collect:
            aux.update(index_scores=sg(scores), topk_idx=idx_btk, topk_valid=valid_btk,
                       teacher_query=sg(q), compressed_kv=sg(ckv), visible=visible_btw)
            if s.teacher == "joint":
                aux.update(raw_kv=sg(kv), window=window_bts, sink=sg(sink_h))
        return allowed, sel, aux
