"""One decoder layer (`Block`: mHC(attention) then mHC(MoE), each sublayer behind its RMSNorm; its `BlockSpec`)
and its manifold-constrained hyper-connections (DESIGN.md, "mHC"), as in the official DeepSeek-V4 code.

The residual stream holds n copies X[i] of width M. Around each sublayer F (attention, MoE):

  mixes = (flatten(X) @ fn) * rsqrt(mean(flatten(X)^2) + norm_eps)       [n + n + n*n]
  pre   = sigmoid(mixes[:n]    * scale[0] + base[:n])    + eps
  post  = 2 * sigmoid(mixes[n:2n] * scale[1] + base[n:2n])
  comb  = sinkhorn(mixes[2n:] * scale[2] + base[2n:] as [n, n], iters, eps)
  y     = sum_i pre_i X[i];   X'[i] = post_i F(y) + sum_j comb[j, i] X[j]

Sinkhorn follows the official `hc_split_sinkhorn` kernel exactly: row softmax, + eps, a column
normalisation, then iters - 1 (row, column) normalisation pairs, every division by (sum + eps).
So `iters` column normalisations in all; the result is column-stochastic up to eps and near
doubly stochastic. Before the final norm and head, `HeadCollapse` mixes the copies with
sigmoid(mixes * scale + base) + eps from its own fn [n*M, n] (one scale). All mixing maths is
float32 whatever the compute dtype; the sublayer's RMSNorm (attn_norm/ffn_norm) comes after
`pre`, outside these modules.

Implementation (XLA CPU runs this op-count bound: many tiny [B, T, 4, 4] ops in every layer;
docs/benchmarks.md#why-the-defaults):
Sinkhorn runs on the token-minor layout [n, n, B*T], its row / column sums as adds of n slices,
so one iteration is one elementwise fusion, with a custom VJP (the analytic backward of each
normalisation in one reverse loop); the mixes are scaled after the projection, their input
gradient autodiff's or a closed form (`hc_mixes_backward`, chosen per platform). The copies are
weighted, mixed and filled (`hc_mix_form`) by einsums, the default, or as `slices`, elementwise
sums of n products; XLA:TPU runs the einsums as batched matmuls of a few rows per token, yet the
slices measured slower there too (docs/tpu.md). Values and gradients equal the plain formulation to float32
rounding (tests/model/test_mhc.py).

Parameter layout (per HyperConnection): fn [n, M, (2+n)n] (the official [(2+n)n, n*M] with its
input axis unflattened copy-major: official[j, i*M + m] = ours[i, m, j]), base [(2+n)n],
scale [3]; HeadCollapse: fn [n, M, n], base [n], scale [1].

Initialisation (the official code ships trained values only; HF starts the bases at zero):
scale = 0.01 so the input-dependent part starts small; base gives pre = 1/n (y = the mean copy),
post = 1 and a uniform comb, so at init each sublayer adds about F(mean X) to every copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.model.attention import Attention, AttentionSpec
from core.model.layers import RMSNorm, dense_init, param, upcast
from core.model.moe import MoE, MoESpec

SCALE_INIT = 0.01


def _fold_copies(op, x, axis: int):
    """op folded over the slices of a small axis (n copies): elementwise, no reduce thunk."""
    return functools.reduce(op, [jax.lax.index_in_dim(x, k, axis, keepdims=False)
                                 for k in range(x.shape[axis])])


def sum_copies(x, axis: int):
    """Sum over a small axis (n copies) as adds of its slices (Sinkhorn's row / column sums).

    XLA CPU runs a reduce over a size-4 axis as its own tiny thunk; a sum of slices is
    elementwise, so a whole normalisation fuses into one loop (equal to float32 rounding). The
    hyper-connection mixes stay einsums: as slice sums they run slower on XLA CPU
    (docs/benchmarks.md#why-the-defaults).
    """
    return _fold_copies(operator.add, x, axis)


def _softmax_rows(z_ijt):
    """Softmax over j of [n, n, N] (token axis minor), max subtracted without a gradient."""
    e_ijt = jnp.exp(z_ijt - jax.lax.stop_gradient(_fold_copies(jnp.maximum, z_ijt, 1))[:, None])
    return e_ijt / sum_copies(e_ijt, 1)[:, None]


def _normalize(c_ijt, axis: int, eps: float):
    """c / (sum over `axis` + eps) of [n, n, N]: (result, the normaliser sum + eps)."""
    s = jnp.expand_dims(sum_copies(c_ijt, axis), axis) + eps
    return c_ijt / s, s


def _pair(c_ijt, eps: float):
    """One (row, column) normalisation pair: (result, its intermediate, both normalisers)."""
    mid_ijt, s_row = _normalize(c_ijt, 1, eps)
    out_ijt, s_col = _normalize(mid_ijt, 0, eps)
    return out_ijt, mid_ijt, s_row, s_col


def _first(soft_ijt, eps: float):
    """Sinkhorn's first column normalisation of the row softmax + eps: (comb, its normaliser)."""
    return _normalize(soft_ijt + eps, 0, eps)


def _normalize_vjp(g_ijt, out_ijt, s, axis: int):
    """Cotangent of c through out = c / (sum_axis c + eps), given out and the normaliser s."""
    return (g_ijt - jnp.expand_dims(sum_copies(g_ijt * out_ijt, axis), axis)) / s


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _sinkhorn_ijt(z_ijt, iters: int, eps: float):
    """sinkhorn on [n, n, N] logits (row i, column j, token axis minor); see `sinkhorn`."""
    comb_ijt, _ = _first(_softmax_rows(z_ijt), eps)
    return jax.lax.fori_loop(0, iters - 1, lambda _, c: _pair(c, eps)[0], comb_ijt)


def _sinkhorn_fwd(z_ijt, iters, eps):
    soft_ijt = _softmax_rows(z_ijt)
    comb_ijt, _ = _first(soft_ijt, eps)

    def step(c_ijt, _):
        return _pair(c_ijt, eps)[0], c_ijt

    out_ijt, ins_kijt = jax.lax.scan(step, comb_ijt, None, length=iters - 1)
    return out_ijt, (soft_ijt, ins_kijt)


def _sinkhorn_bwd(iters, eps, res, g_ijt):
    """The analytic VJP in reverse: each pair recomputed from its stored input (elementwise)."""
    soft_ijt, ins_kijt = res

    def step(g, c_ijt):
        out_ijt, mid_ijt, s_row, s_col = _pair(c_ijt, eps)
        g_mid = _normalize_vjp(g, out_ijt, s_col, 0)
        return _normalize_vjp(g_mid, mid_ijt, s_row, 1), None

    g_ijt, _ = jax.lax.scan(step, g_ijt, ins_kijt, reverse=True)
    comb_ijt, s_col = _first(soft_ijt, eps)
    g_soft = _normalize_vjp(g_ijt, comb_ijt, s_col, 0)
    return (soft_ijt * (g_soft - sum_copies(g_soft * soft_ijt, 1)[:, None]),)


_sinkhorn_ijt.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)


def sinkhorn(logits_bnn, iters: int, eps: float):
    """Row softmax + eps, then `iters` column normalisations interleaved with iters-1 row ones.

    Runs on the token-minor layout [n, n, N] (N = all leading axes), where every row / column
    sum is an add of n slices, so one iteration is one elementwise fusion; a custom VJP runs the
    analytic backward of each normalisation in one reverse loop over the stored pair inputs
    (equal to autodiff of the plain loop to float32 rounding; tests/model/test_mhc.py).

    Args:
      logits_bnn: [..., n, n] comb logits (row i = source copy, column j = destination copy).
      iters: hc_sinkhorn_iters (>= 1).
      eps: hc_eps, added after the softmax and to every normaliser.
    Returns:
      float32 [..., n, n]: columns sum to 1 (up to eps), rows close to 1.

    Shapes:
      1. z_ijt = logits as [n, n, N]
      2. comb_ijt = col_norm(softmax_j(z) + eps), then iters - 1 times col_norm(row_norm(comb))
      3. back to [..., n, n]
    """
    logits_bnn = upcast(logits_bnn)
    *lead, n, _ = logits_bnn.shape
    z_ijt = jnp.moveaxis(logits_bnn.reshape(-1, n, n), 0, -1)
    comb_ijt = _sinkhorn_ijt(z_ijt, int(iters), float(eps))
    return jnp.moveaxis(comb_ijt, -1, 0).reshape(*lead, n, n)


MIX_FORMS = ("einsum", "slices")


def _einsum(form: str) -> bool:
    """Whether `form` (hc_mix_form) is the einsum one; refuses an unknown one."""
    if form not in MIX_FORMS:
        raise ValueError(f"hc_mix_form={form!r}: one of {', '.join(MIX_FORMS)}")
    return form == "einsum"


def weighted_copies(w_btn, x_btnm, form: str):
    """sum_n w[b, t, n] x[b, t, n, :] -> [B, T, M] (float32): an einsum, or `slices` (n products of
    slices added: one elementwise fusion, where XLA:TPU runs the einsum as a batched matmul of
    [1, n] x [n, M] per token)."""
    w_btn, x_btnm = upcast(w_btn), upcast(x_btnm)
    if _einsum(form):
        return jnp.einsum("btn,btnm->btm", w_btn, x_btnm)
    return sum_copies(w_btn[..., None] * x_btnm, axis=2)


def mixed_copies(comb_btji, x_btjm, form: str):
    """[B, T, i, M] = sum_j comb[b, t, j, i] x[b, t, j, :] (float32), an einsum or `slices`."""
    comb_btji, x_btjm = upcast(comb_btji), upcast(x_btjm)
    if _einsum(form):
        return jnp.einsum("btji,btjm->btim", comb_btji, x_btjm)
    return sum_copies(comb_btji[..., None] * x_btjm[:, :, :, None, :], axis=2)


def filled_copies(post_btn, out_btm, form: str):
    """[B, T, n, M] = post[b, t, n] out[b, t, :] (float32): an einsum (its transpose is then a dot, not a
    reduce over n, a slow library thunk on XLA CPU), or `slices`, a broadcast product."""
    post_btn, out_btm = upcast(post_btn), upcast(out_btm)
    if _einsum(form):
        return jnp.einsum("btn,btm->btnm", post_btn, out_btm)
    return post_btn[..., None] * out_btm[:, :, None, :]


MIXES_BACKWARDS = ("autodiff", "closed")


def hc_mixes(x_btnm, fn_nmj, norm_eps: float, backward: str = "autodiff"):
    """float32 [B, T, J]: the flattened copies projected by fn, times their rsqrt(mean square + eps).

    The official order (project, then scale the J outputs): fewer elementwise passes than
    normalising the n*M inputs first, in the forward and the backward. `backward`
    (`hc_mixes_backward`): `autodiff` transposes the projection's einsum; `closed` (a custom VJP,
    `_mixes_bwd`) computes x's cotangent as J products of slices added, where XLA:TPU ran the
    transposed einsum as a matmul of depth J and a relayout (docs/tpu.md#where-the-sparse-steps-time-goes);
    on a CPU the transposed einsum is the faster (docs/benchmarks.md#why-the-defaults).
    """
    if backward not in MIXES_BACKWARDS:
        raise ValueError(f"hc_mixes_backward={backward!r}: one of {', '.join(MIXES_BACKWARDS)} "
                         "(core.spec.resolve turns auto into one)")
    if backward == "closed":
        return _mixes(x_btnm, fn_nmj, float(norm_eps))
    return _mixes_fwd(x_btnm, fn_nmj, norm_eps)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mixes(x_btnm, fn_nmj, norm_eps: float):
    return _mixes_fwd(x_btnm, fn_nmj, norm_eps)[0]


def _mixes_fwd(x_btnm, fn_nmj, norm_eps):
    """(mixes, residuals): the projection raw [B, T, J] and rs = rsqrt(mean square + eps) [B, T] of
    the flattened copies, in float32; mixes = raw * rs."""
    x32 = upcast(x_btnm)
    b, t, n, m = x32.shape
    ms_bt = jnp.mean(jnp.square(x32.reshape(b, t, n * m)), axis=-1)
    raw_btj = jnp.einsum("btnm,nmj->btj", x32, upcast(fn_nmj))
    rs_bt = jax.lax.rsqrt(ms_bt + norm_eps)
    return raw_btj * rs_bt[..., None], (x_btnm, fn_nmj, raw_btj, rs_bt)


def _mixes_bwd(norm_eps, res, g_btj):
    """The analytic VJP of mixes = (x . fn) * rs with rs = (mean(x^2) + eps)^-1/2.

    d raw = g * rs; d x = sum_j d raw_j fn[..., j] + x * 2 d ms / (n M) with d ms = -rs^3 / 2 *
    sum_j g_j raw_j. The sum over j runs as J products of slices added, one elementwise pass that
    also adds the norm's term and rounds to x's dtype: as the transposed einsum, XLA:TPU ran a
    matmul of depth J whose [B, T, n, M] float32 output it then relaid out.
    """
    x_btnm, fn_nmj, raw_btj, rs_bt = res
    n, m = x_btnm.shape[-2:]
    x32, fn32 = upcast(x_btnm), upcast(fn_nmj)
    draw_btj = g_btj * rs_bt[..., None]
    dms_bt = -0.5 * rs_bt ** 3 * jnp.sum(g_btj * raw_btj, axis=-1)
    dx_btnm = functools.reduce(operator.add, [draw_btj[..., j, None, None] * fn32[..., j]
                                              for j in range(fn32.shape[-1])])
    dx_btnm = dx_btnm + x32 * (dms_bt * (2.0 / (n * m)))[..., None, None]
    dfn_nmj = jnp.einsum("btnm,btj->nmj", x32, draw_btj)
    return dx_btnm.astype(x_btnm.dtype), dfn_nmj.astype(fn_nmj.dtype)


_mixes.defvjp(_mixes_fwd, _mixes_bwd)


def hc_split(mixes_btj, scale_3, base_j, n: int, iters: int, eps: float):
    """(pre_btn, post_btn, comb_btnn) from the (2+n)n mixing logits (module docstring)."""
    mixes_btj = upcast(mixes_btj)
    scale_3 = upcast(scale_3)
    base_j = upcast(base_j)
    pre = jax.nn.sigmoid(mixes_btj[..., :n] * scale_3[0] + base_j[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mixes_btj[..., n:2 * n] * scale_3[1] + base_j[n:2 * n])
    comb_logits = mixes_btj[..., 2 * n:] * scale_3[2] + base_j[2 * n:]
    comb = sinkhorn(comb_logits.reshape(*comb_logits.shape[:-1], n, n), iters, eps)
    return pre, post, comb


def expand(x_btm, n: int):
    """[B, T, M] -> [B, T, n, M]: the embedding fills all n copies."""
    return jnp.broadcast_to(x_btm[:, :, None, :], (*x_btm.shape[:2], n, x_btm.shape[-1]))


def _pre_base_logit(n: int) -> float:
    """sigmoid(b) = 1/n, so the pre weights start as a plain mean over the copies."""
    return -math.log(n - 1) if n > 1 else 0.0


class HyperConnection(nnx.Module):
    """The mHC around one sublayer: parameters fn, base, scale; `pre` and `post` as in DESIGN.md."""

    def __init__(self, emb, n, sinkhorn_iters, eps, norm_eps, *, rngs, param_dtype=jnp.float32, form="einsum",
                 mixes_backward="autodiff"):
        self.n = int(n)
        self.form = form  # MIX_FORMS: how `pre` weights the copies and `post` mixes and fills them
        self.mixes_backward = mixes_backward  # MIXES_BACKWARDS: the mixes' input gradient (hc_mixes)
        self.iters = int(sinkhorn_iters)
        self.eps = float(eps)
        self.norm_eps = float(norm_eps)
        mix = (2 + n) * n
        self.fn = param(rngs, dense_init(in_axis=(0, 1), out_axis=2), (n, emb, mix),
                        ("mhc", "embed", None), param_dtype)
        base = jnp.concatenate([jnp.full((n,), _pre_base_logit(n)), jnp.zeros((n + n * n,))])
        self.base = param(rngs, lambda *_: base.astype(param_dtype), (mix,), (None,), param_dtype)
        self.scale = param(rngs, lambda *_: jnp.full((3,), SCALE_INIT, param_dtype), (3,), (None,),
                           param_dtype)

    def pre(self, x_btnm):
        """Collapse the copies for the sublayer's input and compute its post/comb weights.

        Args:
          x_btnm: the residual stream [B, T, n, M].
        Returns:
          (y_btm in x's dtype, post_btn f32, comb_btnn f32).

        Shapes:
          1. mixes_btj = rmsnorm(flatten(x)) @ fn         j = (2+n)n
          2. pre_btn, post_btn, comb_btnn = hc_split(mixes_btj)
          3. y_btm = sum_n pre_btn * x_btnm
        """
        mixes_btj = hc_mixes(x_btnm, self.fn[...], self.norm_eps, self.mixes_backward)
        pre_btn, post_btn, comb_btnn = hc_split(mixes_btj, self.scale[...], self.base[...],
                                                self.n, self.iters, self.eps)
        y_btm = weighted_copies(pre_btn, x_btnm, self.form)
        return y_btm.astype(x_btnm.dtype), post_btn, comb_btnn

    @staticmethod
    def post(out_btm, x_btnm, post_btn, comb_btnn, form: str = "einsum"):
        """X'[i] = post_i F(y) + sum_j comb[j, i] X[j], in float32; returns x's dtype [B,T,n,M]."""
        mixed_btnm = mixed_copies(comb_btnn, x_btnm, form)
        return (filled_copies(post_btn, out_btm, form) + mixed_btnm).astype(x_btnm.dtype)


class HeadCollapse(nnx.Module):
    """Collapse the n copies before the final norm: y = sum_i (sigmoid(mix_i*scale + base_i) + eps) X[i]."""

    def __init__(self, emb, n, eps, norm_eps, *, rngs, param_dtype=jnp.float32, form="einsum",
                 mixes_backward="autodiff"):
        self.n = int(n)
        self.form = form
        self.mixes_backward = mixes_backward
        self.eps = float(eps)
        self.norm_eps = float(norm_eps)
        self.fn = param(rngs, dense_init(in_axis=(0, 1), out_axis=2), (n, emb, n),
                        ("mhc", "embed", None), param_dtype)
        self.base = param(rngs, lambda *_: jnp.full((n,), _pre_base_logit(n), param_dtype), (n,),
                          (None,), param_dtype)
        self.scale = param(rngs, lambda *_: jnp.full((1,), SCALE_INIT, param_dtype), (1,), (None,),
                           param_dtype)

    def __call__(self, x_btnm):
        """Args: x_btnm [B, T, n, M]. Returns: y_btm [B, T, M] in x's dtype."""
        mixes_btn = hc_mixes(x_btnm, self.fn[...], self.norm_eps, self.mixes_backward)
        scale = upcast(self.scale[...])[0]
        pre_btn = jax.nn.sigmoid(mixes_btn * scale + upcast(self.base[...])) + self.eps
        y_btm = weighted_copies(pre_btn, x_btnm, self.form)
        return y_btm.astype(x_btnm.dtype)


# ----------------------------------------------------------------------------- the block


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """Static description of one decoder layer; equal specs = stackable layers.

    The hash-table seed is per layer data, not structure, so it is not part of the spec.
    """

    attn: AttentionSpec
    emb: int
    eps: float
    hc_n: int
    hc_iters: int
    hc_eps: float
    moe: MoESpec
    hc_form: str
    hc_mixes_backward: str


class Block(nnx.Module):
    """One decoder layer: mHC(attention) then mHC(MoE), each sublayer behind its RMSNorm."""

    def __init__(self, spec: BlockSpec, *, seed_for_hash_table: int = 0, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.attn_norm = RMSNorm(spec.emb, spec.eps, **kw)
        self.attn = Attention(spec.attn, dtype=dtype, **kw)
        self.ffn_norm = RMSNorm(spec.emb, spec.eps, **kw)
        self.ffn = MoE(spec.moe, seed_for_hash_table=seed_for_hash_table, dtype=dtype, **kw)
        hc = dict(form=spec.hc_form, mixes_backward=spec.hc_mixes_backward, **kw)
        self.hc_attn = HyperConnection(spec.emb, spec.hc_n, spec.hc_iters, spec.hc_eps, spec.eps, **hc)
        self.hc_ffn = HyperConnection(spec.emb, spec.hc_n, spec.hc_iters, spec.hc_eps, spec.eps, **hc)

    def __call__(self, x_btnm, tokens_bt, positions_bt, segment_ids_bt, *, dense: bool,
                 indexer_loss: bool, probe=None):
        """[B, T, n, M] -> ([B, T, n, M], aux: lb_loss, load [E], dropped and the attention's aux)."""
        y_btm, post_btn, comb_btnn = self.hc_attn.pre(x_btnm)
        out_btm, aux = self.attn(self.attn_norm(y_btm), positions_bt, segment_ids_bt, dense=dense,
                                 indexer_loss=indexer_loss, probe=probe)
        out_btm = checkpoint_name(out_btm, "attn_sublayer_out")  # post's backward reads it
        x_btnm = HyperConnection.post(out_btm, x_btnm, post_btn, comb_btnn, self.hc_attn.form)
        y_btm, post_btn, comb_btnn = self.hc_ffn.pre(x_btnm)
        out_btm, moe_aux = self.ffn(self.ffn_norm(y_btm), tokens_bt, segment_ids_bt > 0)
        out_btm = checkpoint_name(out_btm, "moe_sublayer_out")
        x_btnm = HyperConnection.post(out_btm, x_btnm, post_btn, comb_btnn, self.hc_ffn.form)
        return x_btnm, {**aux, "lb_loss": moe_aux["lb_loss"], "load": moe_aux["load"], "dropped": moe_aux["dropped"]}
