"""The lightning indexer module (DESIGN.md, "Lightning indexer").

`indexer_queries` is the indexer's query projection as a pure function; `Indexer` owns the
indexer's parameters and hands its projections out as `IndexerInputs` (queries per run of rows,
compressed keys, head weights) to the pure scoring and top-k of core.ops.topk and to the indexer
loss. Scores, selection and everything downstream are float32 whatever the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.model.compressor import Compressor
from core.model.layers import dense_init, param
from core.ops.rope import RopeSpec, apply_rope
from core.ops.chunked_attention import RowQueries
from core.ops.placement import gather_weight
from core.ops.topk import IndexerInputs


def indexer_queries(c_q_btr, wq_b_rid, positions_bt, *, rope: RopeSpec, dtype):
    """q_btid = RoPE(c_q W_Iq) in `dtype`: [B, T, R] x [R, HI, DI] -> [B, T, HI, DI]."""
    q_btid = jnp.einsum("btr,rid->btid", c_q_btr.astype(dtype), wq_b_rid.astype(dtype))
    return apply_rope(q_btid, positions_bt, rope)


def local_gradient_loss(module: nnx.Module, loss_of):
    """`loss_of(module)` whose gradient w.r.t. the module's parameters is taken here, in the forward.

    For a loss that reaches nothing but `module`'s own nnx.Params (the indexer loss: the indexer's
    inputs and teacher are detached). Returns the surrogate

        stop_gradient(value) + sum over parameters p of  sum((p - stop_gradient(p)) * g_p),
        g = d loss / d p,

    equal to the loss in value and with gradient g for p, and no gradient for anything else. The
    outer backward then needs only g (named "indexer_local_grads", which every remat policy saves),
    not the layer's activations: no layer of the warm-up runs again in the backward, and no layer's
    input is kept for it (core/model/transformer.py).
    """
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    value, grads = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p, rest)))(jax.lax.stop_gradient(params))
    return local_gradient_surrogate(params, value, grads)


def local_gradient_surrogate(params, value, grads):
    """`local_gradient_loss`'s surrogate of a loss `value` whose gradient `grads` w.r.t. `params`
    (an nnx.State of a module's Params, as `nnx.split` gives it) is already known:
    stop_gradient(value) + sum over p of sum((p - stop_gradient(p)) * g_p)."""
    sg = jax.lax.stop_gradient
    grads = jax.tree.map(lambda g: checkpoint_name(sg(g), "indexer_local_grads"), grads)

    def inner(p, g):  # in float32 (float64 for float64 parameters); its gradient is g, cast to p's dtype
        acc = jnp.promote_types(p.dtype, jnp.float32)
        return jnp.sum((p.astype(acc) - sg(p).astype(acc)) * g.astype(acc))

    inner = [inner(p, g) for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads))]
    return sg(value) + sum(inner)


# ----------------------------------------------------------------------------- module

WEIGHTS_INITS = ("fan_in", "zeros")  # IndexerSpec.weights_init: how weights_proj starts


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
    """Static shape of one lightning indexer, passed down whole (built from the layer's AttentionSpec)."""

    emb: int            # model width M
    q_lora_rank: int    # width of the main attention's c_q, the queries' input
    heads: int          # HI
    head_dim: int       # DI, also the width of the indexer's compressor
    rope: RopeSpec
    eps: float          # the compressor's RMSNorm epsilon
    weights_init: str = "fan_in"  # one of WEIGHTS_INITS


class Indexer(nnx.Module):
    """The lightning indexer of one CSA layer (official names, [in, out] layout).

    Parameters: wq_b [q_lora, HI, DI] (indexer queries from the main attention's c_q),
    weights_proj [M, HI] (per-head weights from x), compressor (its own overlapping m = 4
    compressor of width DI). Both inputs pass through `stop_gradient`, so no gradient leaves the
    indexer. The official code also applies a Hadamard rotation and FP4 quantisation to q_I and
    k_I; the rotation is orthogonal on both sides (dot products unchanged) and the quantisation is
    inference-only simulation, so both are omitted.

    spec.weights_init: "fan_in" (the default: weights_proj ~ variance 1/M) or "zeros" (weights_proj = 0:
    every score 0, a uniform student; the first step's gradient reaches weights_proj only, the next
    ones q and k too). The warm-up presets start from "zeros": a random start is a student worse
    than uniform (docs/benchmarks.md#why-the-defaults).
    """

    def __init__(self, spec: IndexerSpec, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
        s = spec
        if s.weights_init not in WEIGHTS_INITS:
            raise ValueError(f"weights_init={s.weights_init!r} is unknown: use one of {', '.join(WEIGHTS_INITS)}")
        self.heads, self.head_dim, self.rope, self.dtype = s.heads, s.head_dim, s.rope, dtype
        self.wq_b = param(rngs, dense_init(in_axis=0, out_axis=(1, 2)), (s.q_lora_rank, s.heads, s.head_dim),
                          ("q_lora", "indexer_heads", "kv"), param_dtype)
        # "zeros": every score 0, the student uniform (KL = KL_uniform) instead of a random one worse
        # than uniform; `param` draws its key either way, so every other parameter is unchanged.
        w_init = dense_init() if s.weights_init == "fan_in" else jax.nn.initializers.zeros
        self.weights_proj = param(rngs, w_init, (s.emb, s.heads), ("embed", "indexer_heads"), param_dtype)
        self.compressor = Compressor(s.emb, s.head_dim, 4, s.rope, s.eps, rngs=rngs,
                                     param_dtype=param_dtype, dtype=dtype)

    def inputs(self, x_btm, c_q_btr, positions_bt) -> IndexerInputs:
        """Detached inputs -> IndexerInputs(q_I per run of rows, k_bwd, weights_bti float32).

        Shapes:
          1. q_btid  = RoPE(stop_gradient(c_q) W_Iq)   at positions[t], built where consumed
          2. k_bwd   = compressor(x)           (m = 4, overlapping; RoPE at block starts)
          3. weights = x W_Iw * HI^-1/2 * DI^-1/2
        """
        queries = RowQueries(functools.partial(indexer_queries, rope=self.rope, dtype=self.dtype),
                             jax.lax.stop_gradient(c_q_btr), gather_weight(self.wq_b[...], heads_axis=1))
        return IndexerInputs(queries, *self.keys_and_weights(x_btm, positions_bt))

    def keys_and_weights(self, x_btm, positions_bt):
        """(k_bwd, weights_bti float32) of `inputs` from the detached x."""
        dt = self.dtype
        x_btm = jax.lax.stop_gradient(x_btm).astype(dt)
        k_bwd = self.compressor(x_btm, positions_bt)
        weights_bti = jnp.einsum("btm,mi->bti", x_btm, self.weights_proj[...].astype(dt))
        return k_bwd, weights_bti.astype(jnp.float32) * (self.heads ** -0.5 * self.head_dim ** -0.5)
