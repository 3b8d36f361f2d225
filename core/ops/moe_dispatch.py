"""Drop-free sparse MoE dispatch in plain JAX: slots sorted by expert, padded to whole row tiles.

A megablox-style grouped matmul without a kernel, for backends where `lax.ragged_dot` is slow
(XLA CPU lowers it densely; docs/benchmarks.md#why-the-defaults). With N = B*T tokens, k experts
per token, E experts and R rows per tile:

1. The S = N*k (token, expert) slots are sorted by expert (stable). Expert e's c_e slots fill
   ceil(c_e / R) whole tiles of R rows; the rest of its last tile is padding (weight 0).
2. The number of rows is bounded statically: sum_e ceil(c_e / R) R <= S + E (R - 1), so
   G = ceil((S + E (R - 1)) / R) tiles always suffice (tiles past the used ones are padding too).
   Nothing is ever dropped, whatever the routing.
3. Each tile gathers its rows of x [G, R, M] and its expert's weights [G, M, F]; batched einsums
   over tiles run the SwiGLU; the rows, times their combine weight (0 on padding), are summed
   back to their tokens with `segment_sum`.

What lives at once: x rows [G*R, M], hidden [G*R, F] (twice), the tiles' weights [G, M, F] three
times. FLOPs: 6 G R M F, against 6 N E M F for the dense path (E/k times the slots' own work),
so tiles win whenever G R < N E. Gradients come from autodiff of the gathers and scatters: a
padding row has weight 0, so it adds exactly 0 to the output and to every gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def tile_layout(idx_sk, num_experts: int, tile: int):
    """Where every slot goes: each slot's row and each tile's expert.

    Args:
      idx_sk: int [N, k] chosen experts per token (any leading shape; flattened in order).
      num_experts: E.
      tile: R, rows per tile (>= 1).
    Returns:
      (dest_s, expert_g, G): the row (in [0, G*R)) that slot s = token * k + j occupies, distinct
      per slot; the expert whose weights tile g uses (tiles past the used ones: E-1); the static
      tile count G.
    """
    flat = idx_sk.reshape(-1).astype(jnp.int32)
    slots = flat.shape[0]
    tiles = -(-(slots + num_experts * (tile - 1)) // tile)
    counts_e = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    padded_e = -(-counts_e // tile) * tile
    start_e = jnp.cumsum(padded_e) - padded_e                 # first row of expert e
    first_e = jnp.cumsum(counts_e) - counts_e                 # first sorted slot of expert e
    order = jnp.argsort(flat, stable=True)                    # sorted position -> slot
    sorted_e = flat[order]
    rank = jnp.arange(slots, dtype=jnp.int32) - first_e[sorted_e]
    dest_s = jnp.zeros((slots,), jnp.int32).at[order].set(start_e[sorted_e] + rank, unique_indices=True)
    tile_rows = jnp.arange(tiles, dtype=jnp.int32) * tile
    expert_g = jnp.searchsorted(jnp.cumsum(padded_e), tile_rows, side="right").astype(jnp.int32)
    return dest_s, jnp.minimum(expert_g, num_experts - 1), tiles


def tiled_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, tile: int, *, hidden):
    """sum_j weights[b,t,j] * expert_{idx[b,t,j]}(x[b,t]) over whole row tiles (module docstring).

    Args:
      x_btm: [B, T, M] tokens (compute dtype).
      idx_btk: int [B, T, k] chosen experts; weights_btk: float32 [B, T, k] combine weights.
      w1_emf, w3_emf: [E, M, F]; w2_efm: [E, F, M] expert weights (compute dtype).
      tile: R rows per tile.
      hidden: (gate, up) -> float32 hidden, the clamped SwiGLU (core.model.moe.swiglu_hidden with
        the layer's limit).
    Returns:
      [B, T, M] in the accumulation dtype: float32, or float64 for float64 inputs.

    Shapes:
      1. dest_s, expert_g = tile_layout(idx)          S = B*T*k slots, G tiles of R rows
      2. x_grm = x[token of row]; w*_g.. = w*[expert_g]
      3. h_grf = hidden(x_grm w1_gmf, x_grm w3_gmf) * weight of row
      4. y_btm = segment_sum over rows of h_grf w2_gfm, by token
    """
    b, t, m = x_btm.shape
    k = idx_btk.shape[-1]
    n = b * t
    dest_s, expert_g, tiles = tile_layout(idx_btk, w1_emf.shape[0], tile)
    rows = tiles * tile
    token_s = jnp.arange(n * k, dtype=jnp.int32) // k
    token_r = jnp.zeros((rows,), jnp.int32).at[dest_s].set(token_s, unique_indices=True)
    dest_s, expert_g, token_r = (checkpoint_name(a, "moe_routing") for a in (dest_s, expert_g, token_r))
    weight_r = jnp.zeros((rows,), weights_btk.dtype).at[dest_s].set(weights_btk.reshape(-1), unique_indices=True)
    x_grm = x_btm.reshape(n, m)[token_r].reshape(tiles, tile, m)
    gate_grf = jnp.einsum("grm,gmf->grf", x_grm, w1_emf[expert_g])
    up_grf = jnp.einsum("grm,gmf->grf", x_grm, w3_emf[expert_g])
    h_grf = hidden(gate_grf, up_grf) * weight_r.reshape(tiles, tile, 1)
    acc = jnp.promote_types(x_btm.dtype, jnp.float32)
    y_grm = jnp.einsum("grf,gfm->grm", h_grf.astype(x_btm.dtype), w2_efm[expert_g], preferred_element_type=acc)
    y_nm = jax.ops.segment_sum(y_grm.reshape(rows, m), token_r, num_segments=n)
    return y_nm.reshape(b, t, m)
