"""The KV compressor (DESIGN.md, "Compressor"): gated per-feature softmax pooling of token blocks.

Every m consecutive tokens become one compressed entry of width d:

  a = x W_kv, g = x W_gate + ape[slot]       (float32, width c*d; c = 2 when overlapping)
  plain (m = 128, HCA):   entry[w] = sum over the m slots of block w of softmax_slot(g) * a
  overlap (m = 4, CSA and the indexer): the features split into halves A | B and entry[w]
      pools 2m slots: the A-half of block w-1's tokens and the B-half of block w's tokens.
      Block w-1's slots are excluded for w = 0 and whenever block w does not continue block
      w-1's document (their first tokens' positions do not differ by exactly m).
  then RMSNorm (learned scale) and RoPE on the last R features at the block's first position.

The softmax runs over slots independently for every feature. Only complete blocks are
compressed: W = T // m, trailing tokens that do not fill a block are dropped (a query never sees
an incomplete block anyway). Deviation from the official inference code: no FP8/FP4
quantisation simulation and no Hadamard rotation of the indexer's keys (an orthogonal map applied
to both indexer queries and keys, which leaves their dot products unchanged).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.model.layers import RMSNorm, dense_init, param, rms_normalize
from core.ops.masks import NEG, block_first_positions
from core.ops.rope import RopeSpec, apply_rope


class CompressorWeights(NamedTuple):
    """The arrays of one compressor, as `compress` takes them (c = 2 if ratio == 4 else 1)."""

    wkv_mf: Any     # [M, c*d] value projection
    wgate_mf: Any   # [M, c*d] gate projection
    ape_rf: Any     # [ratio, c*d] learned position bias added to the gate per slot
    norm_d: Any     # [d] RMSNorm scale


def compress(x_btm, weights: CompressorWeights, positions_bt, *, ratio: int, eps: float, rope: RopeSpec):
    """Compress `x` into T // ratio entries (overlapping pooling when ratio == 4).

    Args:
      x_btm: [B, T, M] token features (the attention input).
      weights: the compressor's wkv, wgate [M, c*d], ape [ratio, c*d] and norm scale [d].
      positions_bt: int [B, T], restarting at 0 per document.
      ratio: tokens per block m (static; 4 overlaps).
      eps: RMSNorm epsilon.
      rope: the layer's RoPE settings (applied at each block's first position).

    Returns:
      [B, T // ratio, d] in x's dtype (pooled in float32, or float64 for float64 inputs).

    Shapes:
      1. kv_bwrf, gate_bwrf = x W_kv, x W_gate + ape      (blocks of r = ratio slots)
      2. overlap: slots_bw(2r)d = [A-half of block w-1 | B-half of block w]
      3. pooled_bwd = sum_slot softmax_slot(gate) * kv
      4. kv_bwd = RoPE(RMSNorm(pooled), first position of block w)
    """
    wkv_mf, wgate_mf, ape_rf, norm_d = weights
    b, t, _ = x_btm.shape
    w = t // ratio
    overlap = ratio == 4
    in_dtype = x_btm.dtype
    acc = jnp.promote_types(in_dtype, jnp.float32)
    x_btm = x_btm[:, : w * ratio].astype(acc)
    kv_btf = checkpoint_name(jnp.einsum("btm,mf->btf", x_btm, wkv_mf.astype(acc)), "compressor_proj")
    gate_btf = checkpoint_name(jnp.einsum("btm,mf->btf", x_btm, wgate_mf.astype(acc)), "compressor_proj")
    f = kv_btf.shape[-1]
    kv_bwrf = kv_btf.reshape(b, w, ratio, f)
    gate_bwrf = gate_btf.reshape(b, w, ratio, f) + ape_rf.astype(acc)
    first_bw = block_first_positions(positions_bt[:, : w * ratio], ratio)

    if overlap:
        d = f // 2
        # Block w-1's A-half, shifted one block later; a zero block stands in front of block 0.
        prev_kv = jnp.pad(kv_bwrf[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_gate = jnp.pad(gate_bwrf[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_first_bw = jnp.pad(first_bw[:, :-1], ((0, 0), (1, 0)))
        continues_bw = (first_bw - prev_first_bw == ratio) & (jnp.arange(w) > 0)
        prev_gate = jnp.where(continues_bw[:, :, None, None], prev_gate, NEG)
        kv_bwrf = jnp.concatenate([prev_kv, kv_bwrf[..., d:]], axis=2)
        gate_bwrf = jnp.concatenate([prev_gate, gate_bwrf[..., d:]], axis=2)

    probs_bwrf = jax.nn.softmax(gate_bwrf, axis=2)
    pooled_bwd = jnp.sum(probs_bwrf * kv_bwrf, axis=2)
    normed_bwd = rms_normalize(pooled_bwd, eps).astype(acc) * norm_d.astype(acc)
    return apply_rope(normed_bwd, first_bw, rope).astype(in_dtype)


class Compressor(nnx.Module):
    """Parameters of one compressor: wkv, wgate [M, c*d], ape [m, c*d] (init 0), norm [d]."""

    def __init__(self, emb: int, head_dim: int, ratio: int, rope: RopeSpec, eps: float, *,
                 rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
        self.ratio, self.rope, self.eps, self.dtype = ratio, rope, float(eps), dtype
        width = (2 if ratio == 4 else 1) * head_dim
        self.wkv = param(rngs, dense_init(), (emb, width), ("embed", "kv"), param_dtype)
        self.wgate = param(rngs, dense_init(), (emb, width), ("embed", "kv"), param_dtype)
        self.ape = param(rngs, nnx.initializers.zeros, (ratio, width), (None, "kv"), param_dtype)
        self.norm = RMSNorm(head_dim, eps, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x_btm, positions_bt):
        """[B, T, M] -> compressed entries [B, T // ratio, d] in the compute dtype."""
        weights = CompressorWeights(self.wkv[...], self.wgate[...], self.ape[...], self.norm.weight[...])
        kv_bwd = compress(x_btm, weights, positions_bt, ratio=self.ratio, eps=self.eps, rope=self.rope)
        return kv_bwd.astype(self.dtype)
