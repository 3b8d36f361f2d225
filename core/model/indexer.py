"""The lightning indexer (DESIGN.md, "Lightning indexer"): scores, top-k selection, the module.

Pure, jit-safe functions of arrays and static ints (`indexer_scores`, `select_topk`,
`selection_mask`), then the `Indexer` nnx.Module that owns the indexer's parameters. Scores,
selection and everything downstream are float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from core.model.compressor import Compressor
from core.model.layers import dense_init, param
from core.ops.rope import RopeSpec, apply_rope
from core.ops.topk import indexer_scores


def indexer_queries(c_q_btr, wq_b_rid, positions_bt, *, rope: RopeSpec, dtype):
    """q_btid = RoPE(c_q W_Iq) in `dtype`: [B, T, R] x [R, HI, DI] -> [B, T, HI, DI]."""
    q_btid = jnp.einsum("btr,rid->btid", c_q_btr.astype(dtype), wq_b_rid.astype(dtype))
    return apply_rope(q_btid, positions_bt, rope)


# ----------------------------------------------------------------------------- module

WEIGHTS_INITS = ("fan_in", "zeros")  # Indexer(weights_init=...): how weights_proj starts


class Indexer(nnx.Module):
    """The lightning indexer of one CSA layer (official names, [in, out] layout).

    Parameters: wq_b [q_lora, HI, DI] (indexer queries from the main attention's c_q),
    weights_proj [M, HI] (per-head weights from x), compressor (its own overlapping m = 4
    compressor of width DI). Both inputs pass through `stop_gradient`, so no gradient leaves the
    indexer. The official code also applies a Hadamard rotation and FP4 quantisation to q_I and
    k_I; the rotation is orthogonal on both sides (dot products unchanged) and the quantisation is
    inference-only simulation, so both are omitted.

    weights_init: "fan_in" (the default: weights_proj ~ variance 1/M) or "zeros" (weights_proj = 0:
    every score 0, a uniform student; the first step's gradient reaches weights_proj only, the next
    ones q and k too). Measured on deepseek4-tiny (docs/benchmarks.md, issue 11): a 100-step warm-up
    from a pre-trained model reaches gain@16 0.85 / kl_captured 0.72 from "zeros" against 0.68 /
    0.51 from "fan_in", whose random start is worse than uniform and whose shrinking leaves rows
    with every ReLU off (65% of layer 28's rows).
    """

    def __init__(self, emb: int, q_lora_rank: int, heads: int, head_dim: int, rope: RopeSpec,
                 eps: float, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
                 weights_init: str = "fan_in"):
        if weights_init not in WEIGHTS_INITS:
            raise ValueError(f"weights_init={weights_init!r} is unknown: use one of {', '.join(WEIGHTS_INITS)}")
        self.heads, self.head_dim, self.rope, self.dtype = heads, head_dim, rope, dtype
        self.wq_b = param(rngs, dense_init(in_axis=0, out_axis=(1, 2)), (q_lora_rank, heads, head_dim),
                          ("q_lora", "indexer_heads", "kv"), param_dtype)
        # "zeros": every score 0, the student uniform (KL = KL_uniform) instead of a random one worse
        # than uniform; `param` draws its key either way, so every other parameter is unchanged.
        w_init = dense_init() if weights_init == "fan_in" else jax.nn.initializers.zeros
        self.weights_proj = param(rngs, w_init, (emb, heads), ("embed", "indexer_heads"), param_dtype)
        self.compressor = Compressor(emb, head_dim, 4, rope, eps, rngs=rngs,
                                     param_dtype=param_dtype, dtype=dtype)

    def project(self, x_btm, c_q_btr, positions_bt):
        """Detached inputs -> (q_btid, k_bwd, weights_bti float32, scaled by HI^-1/2 DI^-1/2).

        Shapes:
          1. q_btid  = RoPE(c_q W_Iq)          at positions[t]
          2. k_bwd   = compressor(x)           (m = 4, overlapping; RoPE at block starts)
          3. weights = x W_Iw * HI^-1/2 * DI^-1/2
        """
        return (self.queries(c_q_btr, positions_bt), *self.keys_and_weights(x_btm, positions_bt))

    def queries(self, c_q_btr, positions_bt):
        """q_btid = RoPE(stop_gradient(c_q) W_Iq) for any run of positions (a chunk's q_fn)."""
        return self.query_fn()(jax.lax.stop_gradient(c_q_btr), self.wq_b[...], positions_bt)

    def query_fn(self):
        """`indexer_queries` with this indexer's static settings: (c_q, wq_b, positions) -> q."""
        return functools.partial(indexer_queries, rope=self.rope, dtype=self.dtype)

    def keys_and_weights(self, x_btm, positions_bt):
        """(k_bwd, weights_bti float32) of `project` from the detached x."""
        dt = self.dtype
        x_btm = jax.lax.stop_gradient(x_btm).astype(dt)
        k_bwd = self.compressor(x_btm, positions_bt)
        weights_bti = jnp.einsum("btm,mi->bti", x_btm, self.weights_proj[...].astype(dt))
        return k_bwd, weights_bti.astype(jnp.float32) * (self.heads ** -0.5 * self.head_dim ** -0.5)

    @staticmethod
    def score(q_btid, k_bwd, weights_bti, visible_btw, *, head_chunk: int = 0):
        """`indexer_scores` of the projected inputs: float32 [B, T, W], NEG where invisible."""
        return indexer_scores(q_btid, k_bwd, weights_bti, visible_btw, head_chunk=head_chunk)

    def __call__(self, x_btm, c_q_btr, positions_bt, visible_btw, *, head_chunk: int = 0):
        """Scores of every block for every query: float32 [B, T, W]."""
        q_btid, k_bwd, weights_bti = self.project(x_btm, c_q_btr, positions_bt)
        return self.score(q_btid, k_bwd, weights_bti, visible_btw, head_chunk=head_chunk)
