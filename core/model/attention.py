"""DeepSeek-V4 attention for SWA, CSA and HCA layers (DESIGN.md, "Queries" to "Attention").

One layer, as in the official inference code's `Attention`:

  c_q = q_norm(x W_qa);  q = c_q W_qb -> [H, D];  q = RoPE(rms(q));  q *= D^-1/2
  kv  = RoPE(kv_norm(x W_kv))                     one K=V vector per token shared by all heads
  compressed kv: the layer's Compressor (CSA m = 4 overlapping, HCA m = 128 plain)
  keys: window raw keys + compressed entries (CSA: top-k selected, or all visible in dense mode /
        without an indexer; HCA: all visible; SWA: none), one softmax with a per-head sink
  o = inverse RoPE(sum p v);  out = W_ob [ per group g: W_oa[g] flatten(o heads of g) ]

`Attention.__call__` is one forward for every implementation of config `attention`; they differ
only in the pure functions `attend_of` and `select_of` pick, and are equal to float32 rounding in value and
gradient (tests/ops/test_sparse_attention.py, test_fused_attention.py). What lives at once, per
layer call:

- `chunked` (`auto`'s choice but where a TPU trains the attention, which takes `fused`:
  core/spec/platform.py): `chunked_attention` (core.ops.chunked_attention), a `lax.scan` over query
  chunks of C = attention_query_chunk_size positions, each rematerialised in the backward pass.
  With `attention_projections: chunked`, whole-T tensors are per-token only: x, c_q [B, T, q_lora],
  raw kv [B, T, D], the output [B, T, M], the selection [B, T, k]; the queries are built and the
  output projected per chunk, so each chunk adds the projections' weight gradients into float32
  accumulators. With `whole`, the queries [B, T, H, D] are built and the attention's output
  [B, T, H, D] projected once over the sequence (two more whole-T tensors of H D per token, one
  matmul per weight gradient), and the chunks run the attention alone. Per chunk: queries
  [B, C, H, D]; window logits [B, H, C, C + S - 1]; CSA top-k: the k selected blocks' keys
  [B, C, k, D], logits [B, H, C, k] (`csa_topk_attention: gather`), or every block's logits
  [B, H, C, W] masked to the selection, a bool [B, T, W] (`mask`: no gather, dense work over W);
  HCA and CSA over every visible block: logits [B, H, C, W]. The indexer's top-k is chunked the
  same way (`select_topk_chunked`), and the streamed indexer loss builds its indexer and teacher
  queries per block of csa_query_chunk_size rows or, when that is 0, of the largest divisor of
  T <= C. Where that block is the chunk (C divides T) in the dense warm-up with the local gradient,
  the loss runs inside the attention's scan and reads its teacher off the chunk's block logits
  (`_teacher_tap`): the teacher's queries and logits are not built a second time. Memory O(T (M + D + k) + C (S + k) H D), plus O(T H D) with `whole`; work
  O(T (S + k) H D) with top-k, O(T W H D) over every visible block (the window banded per run of
  about S queries where a chunk holds two, else C + S keys per query: core.ops.chunked_attention).
- `fused`: `fused_layer_attention` (core.ops.fused_attention), a forward and a backward Pallas
  kernel over blocks of query tokens, all heads at once: the queries [B, T, H, D] built whole and
  read in place, no [T, T] or [T, W] logits in HBM; CSA's entries through the bool [B, T, W] mask
  of visibility & selection (the top-k as a mask); work as `chunked`'s with the top-k as a mask.
  The indexer's top-k and loss stream as in `chunked`.
- `masked` (the reference): `masked_attention`, dense booleans over [T, T] (window) and [T, W]
  (blocks), the top-k selection entering as `allowed = visible & selected`; logits [B, H, T, T]
  and [B, H, T, W]; the indexer scores [B, T, W] are built whole.

Either mode builds the whole [B, T, W] scores and [B, T, H, D] teacher queries where the indexer
loss cannot stream (T not a multiple of the W blocks), which then takes the direct path
(core.loss.indexer_kl_direct). The training forward is the selection and the loss; what else reads the
indexer (the evaluation's metrics, core/eval/metrics.py; the indexer's scores and teacher inputs,
`collect`) is a probe: the layer hands it an `IndexerView` of its call and puts its result in aux.

Queries travel as one `RowQueries` (a pure function of c_q and W_qb for any run of rows). The
lightning indexer (`Indexer`, core/model/layers.py, DESIGN.md "Lightning indexer") lives under
`indexer` on CSA layers; its inputs are detached so neither the indexer loss reaches other parameters
nor (the selection being discrete) the LM loss the indexer. It hands its projections out as
`IndexerInputs` (queries per run of rows, compressed keys, head weights) to the pure scoring and top-k
of core.ops.topk and to the indexer loss, whose gradient this module takes in the forward where the
mode asks (`local_gradient_loss`). Scores, selection and everything downstream are float32 whatever
the compute dtype.

Deviations from the official code: no FP8/FP4 quantisation simulation; the weightless query norm
is computed in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.loss.indexer_kl import csa_indexer_loss_streamed, csa_indexer_loss_tap
from core.loss.indexer_kl_direct import csa_indexer_loss, whole_teacher
from core.model.layers import (Compressor, Indexer, IndexerSpec, RMSNorm, apply_rope, dense_init, local_gradient_loss,
                                local_gradient_surrogate, param, rms_normalize)
from core.ops.chunked_attention import Keys, RowQueries, chunked_attention
from core.ops.masked_attention import compressed_visibility, masked_attention, selected, sliding_window_mask
from core.ops.placement import einsum_after_cotangent, gather_weight, pin_rows
from core.ops.topk import IndexerInputs, indexer_scores, select_topk, select_topk_chunked


def project_queries(c_q_btr, wq_b_rhd, positions_bt, *, eps: float, rope: tuple[float, ...], dtype):
    """q = RoPE(rms(c_q W_qb) * D^-1/2) in `dtype`: [B, T, R] x [R, H, D] -> [B, T, H, D].

    The softmax scale D^-1/2 joins the norm's float32 factor (a rotation commutes with it), so
    the [B, T, H, D] queries take no pass of their own for it, forward or backward.
    """
    q = checkpoint_name(jnp.einsum("btr,rhd->bthd", c_q_btr.astype(dtype), wq_b_rhd.astype(dtype)), "attn_q_proj")
    return checkpoint_name(apply_rope((rms_normalize(q, eps) * q.shape[-1] ** -0.5).astype(dtype), positions_bt, rope),
                           "attn_q")


ATTENTIONS = ("chunked", "fused", "masked")  # AttentionSpec.attention (module docstring)
TOPK_ATTENTIONS = ("gather", "mask")
PROJECTIONS = ("chunked", "whole")


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """How one attention layer runs: the platform's choices (core/spec/platform.py), which change no
    value (every choice equals the others to float32 rounding) and no parameter."""

    attention: str = "chunked"  # "chunked" (core.ops.chunked_attention) | "fused" (core.ops.fused_attention) | "masked"
    attention_chunk: int = 128  # query positions per chunk of the chunked path
    topk_attention: str = "gather"  # chunked CSA top-k: "gather" (the selected keys) | "mask" (all keys, masked)
    projections: str = "chunked"  # W_qb and the output projection: "chunked" (per query chunk) | "whole" (once)
    head_chunk: int = 0        # csa_qk_head_chunk_size: heads per group of the indexer's scores and loss
    query_chunk: int = 0       # csa_query_chunk_size: the streamed indexer loss's rows per block
    indexer_gradient: str = "local"  # "local": the streamed loss's gradient taken in the forward | "backward"

    def __post_init__(self):
        for name, value, allowed in (("attention", self.attention, ATTENTIONS),
                                     ("csa_topk_attention", self.topk_attention, TOPK_ATTENTIONS),
                                     ("attention_projections", self.projections, PROJECTIONS)):
            if value not in allowed:  # `auto` included: core.spec.resolve turns it into a platform's choice
                raise ValueError(f"{name}={value!r}: the layer takes one of {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer is: its widths, ranks, ratio, window, top-k and its indexer loss's
    settings; how it runs is `impl`'s (core.spec.resolve builds both from a resolved config)."""

    emb: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    ratio: int                 # 0 SWA, 4 CSA, 128 HCA
    eps: float
    rope: tuple[float, ...]    # RoPE's pair frequencies (core.model.layers.rope_frequencies)
    indexer_heads: int = 0     # 0: no indexer (SWA, HCA, or use_indexer=false)
    indexer_head_dim: int = 0
    indexer_topk: int = 0
    loss_scale: float = 0.0    # indexer_loss_scaling_factor
    teacher: str = "compressed"
    indexer_weights_init: str = "fan_in"  # how the indexer's weights_proj starts (core.model.attention.WEIGHTS_INITS)
    impl: AttentionImpl = AttentionImpl()

    def indexer_spec(self) -> IndexerSpec:
        """The static shape of this layer's lightning indexer (meaningful when indexer_heads > 0)."""
        return IndexerSpec(emb=self.emb, q_lora_rank=self.q_lora_rank, heads=self.indexer_heads,
                           head_dim=self.indexer_head_dim, rope=self.rope, eps=self.eps,
                           weights_init=self.indexer_weights_init)


def indexer_inputs(s: AttentionSpec, indexer: Indexer, x_btm, queries: RowQueries, keys: Keys, positions_bt,
                   whole: bool) -> tuple[IndexerInputs, tuple[RowQueries, Keys]]:
    """(the indexer's inputs, the teacher: the main attention's queries and keys, detached; the raw
    keys and sink only for the joint teacher) of a CSA layer, per run of rows, or with their queries
    built whole."""
    sg, joint, pos = jax.lax.stop_gradient, s.teacher == "joint", positions_bt
    teacher_keys = Keys(sg(keys.raw_bsd) if joint else None, sg(keys.sink_h) if joint else None, keys.window,
                        sg(keys.compressed_bwd), keys.ratio)
    teacher_queries, index = sg(queries), indexer.inputs(x_btm, queries.inputs, pos)
    if whole:
        index = index._replace(queries=index.queries.whole(pos))
        teacher_queries = teacher_queries.whole(pos)
    return index, (teacher_queries, teacher_keys)


@dataclasses.dataclass(frozen=True)
class IndexerView:
    """What a CSA layer's call shows a probe (`Attention.__call__`'s `probe`): its spec and indexer,
    its input x, its queries and keys, the positions and segment ids, and how its mode runs the indexer (the streamed
    loss's rows per block, 0: none; `whole`: the mode scores [B, T, W] whole)."""

    spec: AttentionSpec
    indexer: Indexer
    x_btm: jax.Array
    queries: RowQueries
    keys: Keys
    positions_bt: jax.Array
    segment_ids_bt: jax.Array
    rows: int
    whole: bool

    def inputs(self) -> tuple[IndexerInputs, tuple[RowQueries, Keys]]:
        """(the indexer's inputs, the teacher) as the layer's loss takes them: per run of rows, or
        built whole where the mode scores whole."""
        return indexer_inputs(self.spec, self.indexer, self.x_btm, self.queries, self.keys, self.positions_bt,
                              self.whole)


def collect(view: IndexerView) -> dict:
    """The probe of the indexer's tools (core/train/indexer_init.py, tools/, the tests): the layer's
    whole scores [B, T, W], its top-k selection and the teacher's inputs, detached: index_scores,
    topk_idx, topk_valid, teacher_query, compressed_kv, visible, indexer_x, indexer_c_q (+ raw_kv,
    window, sink for the joint teacher)."""
    s, sg, pos, seg = view.spec, jax.lax.stop_gradient, view.positions_bt, view.segment_ids_bt
    index, (t_queries, t_keys) = dataclasses.replace(view, whole=True).inputs()
    visible = compressed_visibility(pos, seg, s.ratio)
    scores = indexer_scores(index.queries.inputs, *index[1:], visible, head_chunk=s.impl.head_chunk)
    selection = select_topk(scores, visible, s.indexer_topk)
    out = dict(index_scores=sg(scores), topk_idx=selection[0], topk_valid=selection[1],
               teacher_query=t_queries.inputs, compressed_kv=t_keys.compressed_bwd, visible=visible,
               indexer_x=sg(view.x_btm), indexer_c_q=sg(view.queries.inputs))
    if s.teacher == "joint":
        out.update(raw_kv=t_keys.raw_bsd, window=sliding_window_mask(pos, seg, s.window), sink=t_keys.sink_h)
    return out


def streamable_rows(s: AttentionSpec, t: int) -> int:
    """The chunked mode's streamed-loss block: csa_query_chunk_size, or when that is 0 the largest
    divisor of T <= attention_query_chunk_size; 0 (direct loss) where T cannot stream."""
    if s.impl.query_chunk:
        return s.impl.query_chunk
    w = t // s.ratio
    if w == 0 or t % w:  # the streamed loss needs T to be a multiple of the W blocks
        return 0
    return max(c for c in range(1, min(t, s.impl.attention_chunk) + 1) if t % c == 0)


def loss_rows(s: AttentionSpec, t: int) -> int:
    """Query rows per block of the streamed indexer loss for T positions; 0: the direct loss on whole scores."""
    if s.impl.attention == "masked":
        return s.impl.query_chunk
    return streamable_rows(s, t) if s.indexer_heads else 0


def attend_of(s: AttentionSpec) -> Callable:
    """(queries, keys, positions, segment ids, selection, out_fn) -> the layer output [B, T, M], as
    `s.impl.attention` runs it."""
    if s.impl.attention == "masked":
        return masked_attention
    if s.impl.attention == "fused":
        from core.ops.fused_attention import fused_layer_attention  # Pallas's import only where it runs

        return fused_layer_attention
    return functools.partial(chunked_attention, chunk=s.impl.attention_chunk)


def select_of(s: AttentionSpec) -> Callable | None:
    """(IndexerInputs, positions, segment ids) -> the top-k selection, one query chunk at a time; None
    (masked): the top-k comes from whole [B, T, W] scores (`indexer_scores`, `select_topk`)."""
    if s.impl.attention == "masked":
        return None
    return functools.partial(select_topk_chunked, ratio=s.ratio, k=s.indexer_topk, chunk=s.impl.attention_chunk,
                             head_chunk=s.impl.head_chunk, as_mask=s.impl.topk_attention == "mask")


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
            self.indexer = Indexer(s.indexer_spec(), rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    def __call__(self, x_btm, positions_bt, segment_ids_bt, *, dense: bool = False,
                 indexer_loss: bool = False, probe: Callable[[IndexerView], dict] | None = None):
        """Args:
          x_btm: [B, T, M] (already attn-normed).
          positions_bt, segment_ids_bt: int [B, T].
          dense: CSA attends every visible block (dense warm-up, eval_dense) instead of the top-k.
          indexer_loss: compute this CSA layer's indexer loss (dense if `dense`, else sparse).
          probe: CSA layers with an indexer call it with their `IndexerView`, before the attention;
            the dict it returns joins aux (`collect`; the evaluation's `core.eval.metrics.layer_sums`).

        Returns:
          (y_btm [B, T, M], aux). CSA layers with an indexer: aux["indexer_loss"] (f32 scalar,
          times loss_scale; 0.0 when not computed) and the probe's keys.
        """
        s, dt = self.spec, self.dtype
        rows, select = loss_rows(s, x_btm.shape[1]), select_of(s)
        x_btm = x_btm.astype(dt)
        c_q = self.q_norm(jnp.einsum("btm,mr->btr", x_btm, self.wq_a[...].astype(dt)))
        queries = RowQueries(functools.partial(project_queries, eps=s.eps, rope=s.rope, dtype=dt), c_q,
                             gather_weight(self.wq_b[...], heads_axis=1))  # read per block: gathered once
        kv = apply_rope(self.kv_norm(jnp.einsum("btm,md->btd", x_btm, self.wkv[...].astype(dt))),
                        positions_bt, s.rope)
        keys = Keys(kv, self.attn_sink[...].astype(jnp.promote_types(dt, jnp.float32)), s.window,
                    self.compressor(x_btm, positions_bt) if s.ratio else None, s.ratio)
        selection, aux, tap = None, {}, None
        if s.indexer_heads:
            selection, aux, tap = self._index(select, rows, x_btm, queries, keys, positions_bt, segment_ids_bt, dense,
                                              indexer_loss)
            if probe is not None:
                aux.update(probe(IndexerView(s, self.indexer, x_btm, queries, keys, positions_bt, segment_ids_bt, rows,
                                             select is None)))
        attend = attend_of(s) if tap is None else functools.partial(attend_of(s), tap=tap[0])
        if s.impl.projections == "whole":  # one matmul per projection and weight gradient, [B, T, H, D] whole
            q = RowQueries.given(pin_rows(queries.of(queries.inputs, positions_bt), heads_axis=2))  # split as x is
            got = attend(q, keys, positions_bt, segment_ids_bt, selection, None)
            o_bthd, carry = got if tap is not None else (got, None)
            out = self._output(pin_rows(o_bthd, heads_axis=2), positions_bt)
        else:  # the output projection per chunk: its weights read by every chunk, gathered once
            output = functools.partial(self._output, wo_a=gather_weight(self.wo_a[...], heads_axis=0),
                                       wo_b=gather_weight(self.wo_b[...]))
            got = attend(queries, keys, positions_bt, segment_ids_bt, selection, output)
            out, carry = got if tap is not None else (got, None)
        if tap is not None:
            aux["indexer_loss"] = tap[1](carry)
        return out, aux

    def _output(self, o_bthd, positions_bt, wo_a=None, wo_b=None):
        """Inverse RoPE, then the grouped low-rank projection back to the model width (by `wo_a` and
        `wo_b` where given: the layer's weights gathered once before a loop of chunks)."""
        s, dt = self.spec, self.dtype
        wo_a = self.wo_a[...] if wo_a is None else wo_a
        wo_b = self.wo_b[...] if wo_b is None else wo_b
        o = checkpoint_name(apply_rope(o_bthd, positions_bt, s.rope, inverse=True), "attn_out")
        b, t = o.shape[:2]
        o_btgf = o.reshape(b, t, s.o_groups, -1)
        # its weight gradient gathers o after the cotangent (docs/scaling.md#collective-order-on-the-cpu)
        lat_btgr = checkpoint_name(einsum_after_cotangent("btgf,gfr->btgr", o_btgf, wo_a.astype(dt)),
                                   "attn_o_lora")
        return jnp.einsum("btr,rm->btm", lat_btgr.reshape(b, t, -1), wo_b.astype(dt))

    def _index(self, select: Callable | None, rows: int, x_btm, queries: RowQueries, keys: Keys, positions_bt,
               segment_ids_bt, dense: bool, indexer_loss: bool):
        """The indexer of a CSA layer: (the selection attention uses, None for every visible block; aux;
        None, or the loss's (tap, finish) when the chunked attention feeds it, `_teacher_tap`).

        The scores [B, T, W] are built whole in the masked mode and for a loss that cannot stream;
        otherwise the top-k runs per chunk and the loss streams.
        """
        s, pos, seg = self.spec, positions_bt, segment_ids_bt
        aux = {"indexer_loss": jnp.zeros((), jnp.float32)}
        if dense and not indexer_loss:  # no part
            return None, aux, None
        if dense and s.impl.attention == "chunked" and s.impl.indexer_gradient == "local" and \
                rows == min(s.impl.attention_chunk, x_btm.shape[1]):  # one loss block per chunk
            return None, aux, self._teacher_tap(x_btm, queries, pos, seg, rows)
        whole = select is None or (indexer_loss and not rows)
        index, teacher = indexer_inputs(s, self.indexer, x_btm, queries, keys, pos, whole)
        scores = visible = selection = None
        if whole and (not dense or (indexer_loss and not rows)):
            visible = compressed_visibility(pos, seg, s.ratio)
            scores = indexer_scores(index.queries.inputs, *index[1:], visible, head_chunk=s.impl.head_chunk)
            selection = select_topk(scores, visible, s.indexer_topk)
        elif not dense:
            selection = select(index, pos, seg)
        if indexer_loss:
            allowed = None if scores is None else visible if dense else visible & selected(selection, visible.shape[-1])
            topk = None if dense else s.indexer_topk
            if rows and not whole and s.impl.indexer_gradient == "local":  # the streamed loss, differentiated here
                aux["indexer_loss"] = local_gradient_loss(self.indexer, lambda indexer: self._indexer_loss(
                    indexer.inputs(x_btm, queries.inputs, pos), teacher, pos, seg, None, topk, rows))
            else:
                aux["indexer_loss"] = self._indexer_loss(index, teacher, pos, seg, (scores, allowed), topk, rows)
        return (None if dense else selection), aux, None

    def _teacher_tap(self, x_btm, queries: RowQueries, positions_bt, segment_ids_bt, rows: int):
        """The dense streamed loss with its gradient taken here (`indexer_gradient: local`), its teacher
        read off the chunked attention's own block logits, one loss block per chunk of `rows` queries
        (core.loss.indexer_kl.csa_indexer_loss_tap): (the attention's ChunkTap, finish), where
        finish(the tap's last carry) is the layer's loss as `local_gradient_loss` gives it. The same
        loss and indexer gradient as the streamed loss's own teacher, which builds the queries and
        the logits a second time."""
        s, pos = self.spec, positions_bt
        graphdef, params, rest = nnx.split(self.indexer, nnx.Param, ...)
        index, pull = jax.vjp(lambda p: nnx.merge(graphdef, p, rest).inputs(x_btm, queries.inputs, pos),
                              jax.lax.stop_gradient(params))
        tap, finish = csa_indexer_loss_tap(index, pos, segment_ids_bt, teacher=s.teacher, scale=s.loss_scale,
                                           head_chunk=s.impl.head_chunk, query_chunk=rows)

        def loss(carry):
            value, d_index = finish(carry)
            return local_gradient_surrogate(params, value, pull(d_index)[0])

        return tap, loss

    def _indexer_loss(self, index: IndexerInputs, teacher: tuple[RowQueries, Keys], positions_bt, segment_ids_bt,
                      whole, topk, rows: int):
        """The layer's scaled indexer loss: streamed in blocks of `rows` query rows, or with rows 0
        the direct loss on the whole (scores, allowed) (core.loss.indexer_kl_direct)."""
        s = self.spec
        if rows:
            return csa_indexer_loss_streamed(index, *teacher, positions_bt, segment_ids_bt, teacher=s.teacher,
                                             topk=topk, scale=s.loss_scale, head_chunk=s.impl.head_chunk,
                                             query_chunk=rows)
        scores_btw, allowed_btw = whole
        return csa_indexer_loss(scores_btw, whole_teacher(*teacher, s.teacher, positions_bt, segment_ids_bt),
                                allowed_btw, scale=s.loss_scale, head_chunk=s.impl.head_chunk)
