"""Drop-free sparse MoE dispatch in plain JAX: slots sorted by expert, padded to whole row tiles.

A megablox-style grouped matmul without a kernel, for backends where `lax.ragged_dot` is slow
(XLA CPU lowers it densely; docs/benchmarks.md#why-the-defaults). With N = B*T tokens, k experts
per token, E experts and R rows per tile:

1. The S = N*k (token, expert) slots are sorted by expert (stable). Expert e's c_e slots fill
   ceil(c_e / R) whole tiles of R rows; the rest of its last tile is padding (weight 0).
2. The number of rows is bounded statically: sum_e ceil(c_e / R) R <= S + E (R - 1), so
   G = ceil((S + E (R - 1)) / R) tiles always suffice (tiles past the used ones are padding too).
   Nothing is ever dropped, whatever the routing.
3. The tiles run in a `lax.scan` over chunks of C tiles (`tiles_per_step`), its body under
   `jax.checkpoint`: each step gathers its rows of x [C, R, M] and its tiles' weights [C, M, F]
   (three of them), runs the SwiGLU as batched einsums over tiles and adds the rows, times their
   combine weight (0 on padding), into their tokens' outputs (the scan's carry).

What lives at once: the token outputs [N, M] (float32), one chunk's x rows [C, R, M], hidden
[C, R, F] (twice) and gathered weights [C, M, F] (three times), in the backward also their
gradients; never [G, M, F]. FLOPs: 6 G R M F, against 6 N E M F for the dense path (E/k times
the slots' own work), so tiles win whenever G R < N E. Gradients come from autodiff of the gathers
and scatters: a padding row has weight 0, so it adds exactly 0 to the output and to every
gradient.

Slots may also be empty (expert id E, `empty_slots`): the expert-parallel exchange
(core/ops/expert_parallel.py) fills its static buffers with them. They sort after every real
expert, and a chunk of tiles that holds only empty slots is skipped at run time (`lax.cond`).
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static layout of `tiled_experts`: rows per tile, tiles per scan step, empty slots allowed."""

    rows: int                       # R, rows per tile (>= 1)
    per_step: int = 0               # C, tiles per scan step (0: `tiles_per_step`)
    empty_slots: bool = False       # idx may hold E: a slot that adds nothing (chunks of only those skipped)


def tiles_per_step(tiles: int, tile: int, mlp: int) -> int:
    """Auto chunk C: as many tiles as keep a chunk's three gathered weights [C, M, F] within the
    bytes of all the tiles' x rows [G*R, M] (memory that grows with tokens, not with tiles);
    at least 1, at most G."""
    return max(1, min(tiles, tiles * tile // (3 * mlp)))


def vary_like(a, *refs):
    """`a` cast to vary over every manual (shard_map) axis that one of `refs` varies over and it does
    not (outside shard_map: `a`). A scan carry that `lax.cond` may return unchanged must start with
    the type the scan body gives it; a value cast before a loop has its cast's transpose (a psum)
    run once after the loop's backward, not in every step's."""
    axes = frozenset().union(*(jax.typeof(r).manual_axis_type.varying for r in refs))
    axes -= jax.typeof(a).manual_axis_type.varying
    return jax.lax.pcast(a, tuple(sorted(axes)), to="varying") if axes else a


def tiled_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, tiling: Tiling, *, hidden):
    """sum_j weights[b,t,j] * expert_{idx[b,t,j]}(x[b,t]) over whole row tiles (module docstring).

    Args:
      x_btm: [B, T, M] tokens (compute dtype).
      idx_btk: int [B, T, k] chosen experts; weights_btk: float32 [B, T, k] combine weights.
      w1_emf, w3_emf: [E, M, F]; w2_efm: [E, F, M] expert weights (compute dtype).
      tiling: rows per tile R, tiles per scan step C, whether idx may hold E (an empty slot).
      hidden: (gate, up) -> float32 hidden, the clamped SwiGLU (core.model.moe.swiglu_hidden with
        the layer's limit).
    Returns:
      [B, T, M] in the accumulation dtype: float32, or float64 for float64 inputs.

    Shapes:
      1. dest_s, expert_g = tile_layout(idx)          S = B*T*k slots, G tiles of R rows
      2. per chunk c of C tiles (scan, G padded to a multiple of C):
         x_crm = x[token of row]; w*_c.. = w*[expert_c]
         h_crf = hidden(x_crm w1_cmf, x_crm w3_cmf) * weight of row
         y_nm += h_crf w2_cfm, scattered by token
    """
    b, t, m = x_btm.shape
    k = idx_btk.shape[-1]
    n = b * t
    num_experts = w1_emf.shape[0]
    tile, empty_slots = tiling.rows, tiling.empty_slots
    dest_s, expert_g, tiles = tile_layout(idx_btk, num_experts + empty_slots, tile)
    per_step = min(tiling.per_step or tiles_per_step(tiles, tile, w1_emf.shape[-1]), tiles)
    steps = -(-tiles // per_step)
    per_step = -(-tiles // steps)                             # the least padding for this many steps
    rows = steps * per_step * tile
    expert_g = jnp.pad(expert_g, (0, steps * per_step - tiles), constant_values=num_experts - 1 + empty_slots)
    token_s = jnp.arange(n * k, dtype=jnp.int32) // k
    token_r = jnp.zeros((rows,), jnp.int32).at[dest_s].set(token_s, unique_indices=True)
    dest_s, expert_g, token_r = (checkpoint_name(a, "moe_routing") for a in (dest_s, expert_g, token_r))
    if empty_slots:
        weights_btk = jnp.where(idx_btk < num_experts, weights_btk, 0)
    weight_r = jnp.zeros((rows,), weights_btk.dtype).at[dest_s].set(weights_btk.reshape(-1), unique_indices=True)
    acc = jnp.promote_types(x_btm.dtype, jnp.float32)
    x_nm = x_btm.reshape(n, m)

    def chunk(y_nm, xs):
        token_cr, weight_cr, w1_cmf, w2_cfm, w3_cmf = xs
        x_crm = x_nm[token_cr]
        gate_crf = jnp.einsum("crm,cmf->crf", x_crm, w1_cmf)
        up_crf = jnp.einsum("crm,cmf->crf", x_crm, w3_cmf)
        h_crf = hidden(gate_crf, up_crf) * weight_cr[..., None]
        y_crm = jnp.einsum("crf,cfm->crm", h_crf.astype(x_btm.dtype), w2_cfm, preferred_element_type=acc)
        return y_nm.at[token_cr.reshape(-1)].add(y_crm.reshape(-1, m)), None

    def step(y_nm, xs):
        expert_c, token_cr, weight_cr = xs
        expert_c = jnp.minimum(expert_c, num_experts - 1)     # an empty tile's weights: any, times 0
        # Gathered outside the cond: the cond's gradient is then chunk-sized, not the full [E, M, F].
        operands = (token_cr, weight_cr, w1_emf[expert_c], w2_efm[expert_c], w3_emf[expert_c])
        if not empty_slots:
            return chunk(y_nm, operands)
        # Tiles are sorted by expert, the empty slots' (E) last: a chunk is empty iff its first tile is.
        return jax.lax.cond(xs[0][0] < num_experts, chunk, lambda y, _: (y, None), y_nm, operands)

    xs = (expert_g.reshape(steps, per_step), token_r.reshape(steps, per_step, tile),
          weight_r.reshape(steps, per_step, tile))
    y_nm, _ = jax.lax.scan(jax.checkpoint(step), vary_like(jnp.zeros((n, m), acc), x_nm, weight_r, w1_emf, w2_efm, w3_emf),
                           xs)
    return y_nm.reshape(b, t, m)
