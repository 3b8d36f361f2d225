"""DeepSeek-V4 mixture of experts (DESIGN.md, "MoE"): router, hash routing, clamped SwiGLU experts.

Semantics follow the official DeepSeek-V4 inference code (`inference/model.py`, `Gate`, `Expert`,
`MoE`):

- Router scores s = sqrt(softplus(x W_r)) in float32. Learned-routing layers pick the top-k of
  s + bias; the bias steers selection only and is never differentiated: it is an `nnx.BatchStat`
  (Flax's kind for state moved by the batches, not by the optimizer), updated after each step by
  `update_router_bias` (bias_e += rate * sign(mean - load_e)) from the batch's expert load.
- Hash-routed layers (the first `first_num_hash_layers`) take the experts from a fixed
  token-id -> experts table (`HashTable`, int32 [V, k], not a parameter) but still weight them by
  the router's scores, so they keep a router weight and have no bias (as in the checkpoints).
- Combine weights: the chosen scores normalised to sum 1 (`norm_topk_prob`), times
  `routed_scaling_factor`.
- Experts and the shared expert (same width, `shared_experts` copies fused into one wider MLP)
  are SwiGLU w2(silu(min(x w1, L)) * clip(x w3, -L, L)); the official code clamps the gate from
  above only and the up projection on both sides; L = 0 disables the clamp.
- Load-balance loss (learned-routing layers): sequence-wise, as MaxText's `load_balance_loss`
  (per batch row f_e and P_e, then the mean over rows), padding excluded:
  lb = weight * E * sum_e f_e * P_e, = weight * k at perfect balance.

The modules take one flat frozen `MoESpec` (built by core.spec.resolve), as gemma passes its flat
hyper-parameters down.

Expert computation (`MoESpec.impl`, IMPLS; `auto` is resolved per platform before the build,
core/spec/platform.py: tiled on CPU and GPU, gmm on TPU, batched on a GPU under expert parallelism
with a capacity, docs/benchmarks.md#why-the-defaults):
- "tiled": the B*T*k (token, expert) slots sorted by expert into whole tiles of `tile_size` rows,
  batched einsums over tiles, summed back per token (`tiled_experts`, below): drop-free, about
  the slots' own FLOPs plus padding. tile_size 0 picks `auto_tile`. The fastest on CPU.
- "dense" runs every expert on every token and combines with a [B, T, E] weight matrix: E/k times
  the FLOPs, plain einsums that shard over an `experts` mesh axis without token permutations.
- "ragged" and "gmm" (`grouped_experts`) move each token's k copies into expert order by a
  permutation and run one grouped matmul per weight: `jax.lax.ragged_dot` (a Mosaic kernel on a
  TPU; XLA CPU lowers it densely) or the Pallas megablox kernels with their own tiles per pass
  (core/ops/grouped_matmul.py).
- "batched" pads each expert's slots to a capacity of rows and runs batched matmuls over experts
  (core/ops/batched_experts.py): a GPU's path under expert parallelism, with the exchange's capacity
  per local expert; without an exchange the same capacity of each device's tokens, dropped there
  (drop-free without a capacity factor: C = B*T rows per expert, E/k times the FLOPs, as "dense").
All five agree to float32 rounding in value and gradient (tests/model/test_moe.py, tests/model/test_moe_dispatch.py,
tests/ops/test_batched_experts.py).
On a mesh whose `expert` axis is larger than 1 (`jax.sharding.get_abstract_mesh()` during the trace:
traced under `jax.set_mesh` or `jax.sharding.use_abstract_mesh`), "tiled", "ragged", "gmm" and "batched" become
expert parallelism that moves tokens: a ragged all-to-all sends each slot to its expert's device, which
runs the same computation over its local experts (core/ops/expert_parallel.py; drop-free unless
`capacity_factor`, aux["dropped"]). "dense" stays GSPMD-partitioned. Without an `expert` axis, "ragged"
and "gmm" run inside `jax.shard_map` on each device's own tokens (XLA cannot partition a Mosaic kernel,
core/ops/expert_parallel.py's `token_parallel_experts`).

The tiled dispatch (`tiled_experts`): a megablox-style grouped matmul without a kernel, for backends
where `lax.ragged_dot` is slow (XLA CPU lowers it densely). With N = B*T tokens, k experts per token,
E experts and R rows per tile:
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
gradient. Slots may also be empty (expert id E, `empty_slots`): the expert-parallel exchange fills
its static buffers with them. They sort after every real expert, and a chunk of tiles that holds
only empty slots is skipped at run time (`lax.cond`).

Parameter layout is [in, out] (JAX convention; the official Linear stores [out, in]):
gate.weight [M, E], gate.bias [E], gate.tid2eid [V, k], experts.w1/w3 [E, M, F], experts.w2
[E, F, M], shared_experts.w1/w3 [M, S*F], shared_experts.w2 [S*F, M].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.model.layers import dense_init, param, upcast
from core.ops.grouped_matmul import GmmTiling, SlotOrder, gmm, ragged_dot
from core.ops.batched_experts import batched_experts, dropped_fraction
from core.ops.expert_parallel import Exchange, expert_capacity, expert_parallel_experts, token_parallel_experts
from core.ops.placement import after, cotangent_after_value, expert_axis_size, mesh_platform_of, token_shards


IMPLS = ("dense", "tiled", "ragged", "gmm", "batched")  # expert computation (module docstring); a config's auto is one of them


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """Static shape and behaviour of one MoE layer (core.spec.resolve builds it from a resolved config;
    hashable).

    The hash table's seed is per-layer data, not structure, so it is not part of the spec.
    """

    emb: int                        # M
    mlp: int                        # F, moe_mlp_dim (each routed expert's and shared copy's width)
    num_experts: int                # E
    k: int                          # num_experts_per_tok
    shared: int                     # shared_experts: copies fused into one MLP of width shared * F
    hash_routed: bool               # experts from the token id table (the first first_num_hash_layers)
    vocab_size: int                 # V, rows of the hash table
    scaling: float = 1.0            # routed_scaling_factor
    normalize: bool = True          # norm_topk_prob
    use_bias: bool = True           # routed_bias (learned routing only)
    swiglu_limit: float = 0.0       # mlp_activations_limit, L (0: no clamp)
    lb_weight: float = 1.0          # load_balance_loss_weight (1.0: the unweighted E * sum f P)
    impl: str = "tiled"             # moe_impl, one of IMPLS
    tile_size: int = 0              # moe_tile_size, rows per tile of "tiled" (0: auto_tile)
    tiles_per_step: int = 0         # moe_tiles_per_step, tiles per scan step of "tiled" (0: auto)
    capacity_factor: float = 0.0    # moe_capacity_factor, expert-parallel blocks (0: drop-free)
    gmm_tiles: tuple = ()           # moe_gmm_tiles: (tm, tk, tn) of gmm's forward, input and weight gradients (): auto

    def __post_init__(self):
        for name, kind in (("hash_routed", bool), ("scaling", float), ("normalize", bool), ("use_bias", bool),
                           ("swiglu_limit", float), ("lb_weight", float), ("tile_size", int),
                           ("tiles_per_step", int), ("capacity_factor", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))  # equal specs for equal values
        if self.impl not in IMPLS:
            raise ValueError(f"MoE impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        if self.gmm_tiles and (len(self.gmm_tiles) != 9 or min(self.gmm_tiles) < 1):
            raise ValueError(f"MoE gmm_tiles must be nine positive ints (tm, tk, tn of the forward, the input "
                             f"gradient and the weight gradient), got {self.gmm_tiles}")
        if self.tile_size < 0 or self.tiles_per_step < 0 or self.capacity_factor < 0:
            raise ValueError(f"MoE tile_size, tiles_per_step and capacity_factor must be >= 0 (0 = auto / drop-free), "
                             f"got {self.tile_size}, {self.tiles_per_step}, {self.capacity_factor}")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"experts_per_tok={self.k} must be in [1, {self.num_experts}]")

    def gmm_tiling(self) -> GmmTiling:
        """The megablox tiles of the three passes: `gmm_tiles` as given (nine ints: forward, input
        gradient, weight gradient), else `auto_gmm_tiling` of the layer's widths."""
        if self.gmm_tiles:
            t = self.gmm_tiles
            return GmmTiling(tuple(t[0:3]), tuple(t[3:6]), tuple(t[6:9]))
        return auto_gmm_tiling(self.emb, self.mlp)


class HashTable(nnx.Variable):
    """Fixed token id -> experts table, int32 [V, k]: part of the state, not a parameter."""


# ----------------------------------------------------------------------------- pure maths


def _acc(x):
    """Matmul accumulation dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(x.dtype, jnp.float32)


def router_scores(logits_bte):
    """s = sqrt(softplus(logits)) in float32 (DeepSeek-V4's `sqrtsoftplus`)."""
    return jnp.sqrt(jax.nn.softplus(upcast(logits_bte)))


def combine_weights(scores_bte, idx_btk, *, scaling: float, normalize: bool):
    """The chosen experts' scores, normalised to sum 1 if `normalize`, times `scaling`.

    Args:
      scores_bte: float32 router scores [B, T, E] (positive).
      idx_btk: int [B, T, k] chosen experts.
    Returns:
      float32 [B, T, k].
    """
    weights_btk = jnp.take_along_axis(upcast(scores_bte), idx_btk, axis=-1)
    if normalize:
        weights_btk = weights_btk / jnp.sum(weights_btk, axis=-1, keepdims=True)
    return weights_btk * scaling


def route(logits_bte, bias_e, k: int, *, scaling: float, normalize: bool):
    """Learned routing: top-k of s + bias; weights from s alone.

    Args:
      logits_bte: router logits x W_r [B, T, E] (any float dtype; used in float32).
      bias_e: selection bias [E], or None.
      k: experts per token (static).
      scaling: routed_scaling_factor.
      normalize: norm_topk_prob.
    Returns:
      (idx_btk int32 [B, T, k], weights_btk float32 [B, T, k], scores_bte float32 [B, T, E]).

    Shapes:
      1. scores_bte = sqrt(softplus(logits_bte))
      2. idx_btk    = top_k(scores_bte + bias_e)        (ties to the lower expert index)
      3. weights    = scores_bte[idx] / sum * scaling   (no gradient through the selection)
    """
    scores_bte = router_scores(logits_bte)
    ranked_bte = scores_bte if bias_e is None else scores_bte + upcast(bias_e)
    _, idx_btk = jax.lax.top_k(jax.lax.stop_gradient(ranked_bte), k)
    idx_btk = checkpoint_name(idx_btk.astype(jnp.int32), "moe_routing")
    return idx_btk, combine_weights(scores_bte, idx_btk, scaling=scaling, normalize=normalize), scores_bte


def _choice_counts(idx_btk, valid_bt, num_experts: int, dtype=jnp.float32):
    """[B, E] in `dtype`: how many valid tokens of each row chose each expert."""
    onehot_btke = jax.nn.one_hot(idx_btk, num_experts, dtype=dtype)
    return jnp.einsum("btke,bt->be", onehot_btke, valid_bt.astype(dtype))


def expert_load(idx_btk, valid_bt, num_experts: int):
    """Fraction of valid tokens (whole batch) that chose each expert: float32 [E], sums to k.

    A batch without valid tokens gives all zeros.
    """
    counts_e = jnp.sum(_choice_counts(idx_btk, valid_bt, num_experts), axis=0)
    return counts_e / jnp.maximum(jnp.sum(upcast(valid_bt)), 1.0)


def load_balance_loss(scores_bte, idx_btk, valid_bt, num_experts: int, weight: float):
    """Sequence-wise load-balance loss: weight * E * sum_e f_e * P_e, averaged over batch rows.

    Args:
      scores_bte: router scores s [B, T, E] (before the bias).
      idx_btk: chosen experts [B, T, k].
      valid_bt: bool [B, T], False for padding (excluded from f and P).
      num_experts: E.
      weight: load_balance_loss_weight.
    Returns:
      float32 scalar; rows without valid tokens do not count; 0 when no row has one.

    Shapes:
      1. f_be = (# valid tokens of row b choosing e) / (# valid tokens of row b)   (sum_e = k)
      2. P_be = mean over valid t of s[b,t,e] / sum_e' s[b,t,e']
      3. lb   = weight * E * mean over rows with valid tokens of sum_e f_be * P_be
    """
    scores_bte = upcast(scores_bte)
    valid_bt_f = valid_bt.astype(scores_bte.dtype)
    n_b = jnp.sum(valid_bt_f, axis=1)
    denom_b = jnp.maximum(n_b, 1.0)[:, None]
    f_be = _choice_counts(idx_btk, valid_bt, num_experts, scores_bte.dtype) / denom_b
    probs_bte = scores_bte / jnp.sum(scores_bte, axis=-1, keepdims=True)
    p_be = jnp.einsum("bte,bt->be", probs_bte, valid_bt_f) / denom_b
    row_loss_b = num_experts * jnp.sum(f_be * p_be, axis=-1)
    rows = (n_b > 0).astype(n_b.dtype)
    return weight * jnp.sum(row_loss_b * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def update_router_bias(bias_e, load_e, rate: float):
    """bias_e + rate * sign(mean(load) - load_e): overloaded experts become less likely.

    Works on one layer ([E]) or a stack of layers ([..., E]: the mean is per layer).
    """
    load_e = upcast(load_e)
    step_e = rate * jnp.sign(jnp.mean(load_e, axis=-1, keepdims=True) - load_e)
    return (upcast(bias_e) + step_e).astype(bias_e.dtype)


def swiglu_hidden(gate, up, limit: float):
    """silu(min(gate, L)) * clip(up, -L, L) in float32 (no clamp when L = 0)."""
    gate = upcast(gate)
    up = upcast(up)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def hash_table(seed: int, vocab_size: int, num_experts: int, k: int):
    """A fixed random table int32 [V, k]: k distinct experts per token, uniform over subsets.

    Deterministic in `seed` (threefry), traced with jax so `nnx.eval_shape` allocates nothing.
    """
    noise_ve = jax.random.uniform(jax.random.key(seed), (vocab_size, num_experts))
    _, idx_vk = jax.lax.top_k(noise_ve, k)
    return idx_vk.astype(jnp.int32)


def dense_experts(x_btm, combine_bte, w1_emf, w2_efm, w3_emf, limit: float):
    """sum_e combine[b,t,e] * expert_e(x[b,t]): every expert on every token (see module doc)."""
    gate_btef = jnp.einsum("btm,emf->btef", x_btm, w1_emf)
    up_btef = jnp.einsum("btm,emf->btef", x_btm, w3_emf)
    h_btef = swiglu_hidden(gate_btef, up_btef, limit) * combine_bte[..., None]
    return jnp.einsum("btef,efm->btm", h_btef.astype(x_btm.dtype), w2_efm,
                      preferred_element_type=_acc(x_btm))


def auto_tile(tokens: int, num_experts: int, k: int, most: int = 128) -> int:
    """Rows per tile for the tiled path: half the mean slots per expert, a power of two in [8, most]."""
    half_mean = max(tokens * k // (2 * num_experts), 1)
    return int(min(most, max(8, 1 << (half_mean - 1).bit_length())))


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


def tiled_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, *, tile: int, per_step: int = 0,
                  empty_slots: bool = False, hidden):
    """sum_j weights[b,t,j] * expert_{idx[b,t,j]}(x[b,t]) over whole row tiles (module docstring, "tiled").

    Args:
      x_btm: [B, T, M] tokens (compute dtype).
      idx_btk: int [B, T, k] chosen experts; weights_btk: float32 [B, T, k] combine weights.
      w1_emf, w3_emf: [E, M, F]; w2_efm: [E, F, M] expert weights (compute dtype).
      tile: R, rows per tile (>= 1).
      per_step: C, tiles per scan step (0: `tiles_per_step`).
      empty_slots: idx may hold E, a slot that adds nothing (a chunk of only those is skipped).
      hidden: (gate, up) -> float32 hidden, the clamped SwiGLU (`swiglu_hidden` with the layer's limit).
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
    dest_s, expert_g, tiles = tile_layout(idx_btk, num_experts + empty_slots, tile)
    per_step = min(per_step or tiles_per_step(tiles, tile, w1_emf.shape[-1]), tiles)
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


def grouped_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, limit: float, matmul):
    """The same sum over the k chosen experts only, one grouped matmul per weight over the slots.

    Args:
      matmul: (lhs [S, K], rhs [E, K, N], group_sizes [E]) -> [S, N] in the compute dtype (x's),
        accumulated in float32: core/ops/grouped_matmul.py's `ragged_dot` or `gmm`. The slots'
        products are rounded to the compute dtype, as MaxText's grouped matmuls return them; the
        SwiGLU, its product with the combine weight and the sum over k run in float32.

    Shapes:
      1. slots = SlotOrder(idx)                     S = B*T*k slots, sorted by expert (a permutation)
      2. x_sm = slots.sort(x)                       each token's k copies, in expert order
      3. h_sf = weights_s * swiglu(x_sm w1_e, x_sm w3_e);  y_sm = h_sf w2_e      (grouped by expert)
      4. y_btm = slots.gather_sum(y_sm)              (float32; its gradient is `sort`'s gather)
    The combine weight scales the hidden before w2 (linear, so the same sum): the sum over k is then
    `sort`'s transpose, and the weights' gradient a product over F inside the SwiGLU's backward.
    """
    b, t, m = x_btm.shape
    k = idx_btk.shape[-1]
    slots = SlotOrder(idx_btk.reshape(b * t, k), w1_emf.shape[0])
    x_sm = slots.sort(x_btm.reshape(b * t, m))
    gate_sf = checkpoint_name(matmul(x_sm, w1_emf, slots.group_sizes), "moe_gate")
    up_sf = checkpoint_name(matmul(x_sm, w3_emf, slots.group_sizes), "moe_up")
    # under expert parallelism the weights the exchange brought: kept by name, the SwiGLU's backward reads them
    weights_s = checkpoint_name(slots.weights(weights_btk.reshape(b * t, k).astype(_acc(x_btm))), "moe_weights")
    h_sf = (swiglu_hidden(gate_sf, up_sf, limit) * weights_s[:, None]).astype(x_btm.dtype)
    return slots.gather_sum(matmul(h_sf, w2_efm, slots.group_sizes)).reshape(b, t, m)


def auto_gmm_tiling(emb: int, mlp: int) -> GmmTiling:
    """Tiles of the megablox kernels for experts of width M -> F -> M: rows in tiles of 512 and the two
    widths in tiles of up to 1024 in every pass, MaxText's sizes and the fastest of those timed on a
    v5e chip (tools/moe_kernels.py; docs/tpu.md#the-routed-experts-alone)."""
    wide = lambda n: min(n, 1024)  # noqa: E731
    tile = (512, wide(emb), wide(mlp))
    return GmmTiling(tile, tile, tile)


def ragged(out_dtype):
    """core/ops/grouped_matmul.py's `ragged_dot` (lax.ragged_dot) returning `out_dtype`."""
    return lambda lhs, rhs, group_sizes: ragged_dot(lhs, rhs, group_sizes, out_dtype)


def megablox_gmm(out_dtype, tiling: GmmTiling, platform: str):
    """core/ops/grouped_matmul.py's `gmm` with `tiling`, returning `out_dtype`; the kernels interpret off a TPU."""
    return lambda lhs, rhs, group_sizes: gmm(lhs, rhs, group_sizes, tiling, out_dtype, platform != "tpu")


def routed_experts(spec: MoESpec, x_btm, idx_btk, weights_btk, experts, mesh):
    """(y_btm, dropped): the routed experts by `spec.impl`; on a mesh whose `expert` axis is larger than
    1, every impl but "dense" sends the slots to their experts' devices (core/ops/expert_parallel.py),
    where the impl's computation runs over the local experts.

    Args:
      spec: the layer's MoESpec.
      x_btm: [B, T, M] tokens (compute dtype); idx_btk, weights_btk: the routing [B, T, k].
      experts: (w1 [E, M, F], w2 [E, F, M], w3 [E, M, F]) in the compute dtype.
      mesh: the abstract mesh of the trace (`jax.sharding.get_abstract_mesh()`), possibly empty.
    Returns:
      (y_btm in the accumulation dtype, dropped: float32 scalar, 0 but under a capacity factor).
    """
    w1, w2, w3 = experts
    hidden = functools.partial(swiglu_hidden, limit=spec.swiglu_limit)
    devices = expert_axis_size(mesh)
    no_drops = jnp.zeros((), jnp.float32)
    if spec.impl == "dense":
        combine_bte = jnp.einsum("btk,btke->bte", weights_btk,
                                 jax.nn.one_hot(idx_btk, spec.num_experts, dtype=jnp.float32))
        return dense_experts(x_btm, combine_bte, w1, w2, w3, spec.swiglu_limit), no_drops
    tokens = x_btm.shape[0] * x_btm.shape[1]
    if spec.impl == "batched":  # the capacity per (local) expert of each device's tokens; no exchange: dropped here
        shards = 1 if mesh is None or mesh.empty else token_shards(mesh)
        rows = expert_capacity(tokens // shards, spec.k, spec.num_experts, devices, spec.capacity_factor)
        local = functools.partial(batched_experts, capacity=rows, hidden=hidden)
        drops = jax.lax.stop_gradient(dropped_fraction(idx_btk, spec.num_experts, rows, shards))
    elif spec.impl in ("ragged", "gmm"):
        dt = x_btm.dtype
        matmul = ragged(dt) if spec.impl == "ragged" else megablox_gmm(dt, spec.gmm_tiling(), mesh_platform_of(mesh))
        local = functools.partial(grouped_experts, limit=spec.swiglu_limit, matmul=matmul)
        drops = no_drops
    if spec.impl in ("ragged", "gmm", "batched"):
        if mesh is None or mesh.empty or mesh.size == 1:
            return local(x_btm, idx_btk, weights_btk, w1, w2, w3), drops
        if devices == 1:
            return token_parallel_experts(local, x_btm, idx_btk, weights_btk, w1, w2, w3, mesh), drops
    elif devices == 1:
        tile = spec.tile_size or auto_tile(tokens, spec.num_experts, spec.k)
        return tiled_experts(x_btm, idx_btk, weights_btk, w1, w2, w3, tile=tile, per_step=spec.tiles_per_step,
                             hidden=hidden), no_drops
    else:
        # a destination receives about the device's own n k slots (one per row) over its E_l local experts;
        # each tile reads its expert's weights, so tiles of up to 512 rows (docs/scaling.md#expert-parallelism)
        local_slots, local_experts = tokens // token_shards(mesh) * spec.k, spec.num_experts // devices
        tile = spec.tile_size or auto_tile(local_slots, local_experts, 1, most=512)
        local = functools.partial(tiled_experts, tile=tile, per_step=spec.tiles_per_step, empty_slots=True,
                                  hidden=hidden)
    exchange = Exchange(mesh, spec.capacity_factor, emulated=mesh_platform_of(mesh) == "cpu",
                        per_expert=spec.impl == "batched")
    return expert_parallel_experts(x_btm, idx_btk, weights_btk, w1, w2, w3, exchange, experts=local)


# ----------------------------------------------------------------------------- modules


def router(spec: MoESpec, *, seed_for_hash_table: int, rngs, param_dtype=jnp.float32) -> nnx.Dict:
    """The gate's variables: weight [M, E]; bias [E] (learned routing with use_bias); tid2eid [V, k] (hash)."""
    weight = param(rngs, dense_init(), (spec.emb, spec.num_experts), ("embed", None), param_dtype)
    if spec.hash_routed:
        table = hash_table(seed_for_hash_table, spec.vocab_size, spec.num_experts, spec.k)
        return nnx.Dict(weight=weight, tid2eid=HashTable(table, out_sharding=(None, None), eager_sharding=False),
                        bias=None)
    bias = (nnx.BatchStat(jnp.zeros((spec.num_experts,), jnp.float32), out_sharding=(None,), eager_sharding=False)
            if spec.use_bias else None)
    return nnx.Dict(weight=weight, tid2eid=None, bias=bias)


def swiglu_weights(emb: int, mlp: int, *, rngs, param_dtype=jnp.float32, experts: int = 0) -> nnx.Dict:
    """w1, w3 [M, F] and w2 [F, M] of one SwiGLU MLP (the shared expert), or with `experts` E of them
    stacked on a leading `experts` axis (the routed experts: w1, w3 [E, M, F], w2 [E, F, M])."""
    if not experts:
        return nnx.Dict(w1=param(rngs, dense_init(), (emb, mlp), ("embed", "mlp"), param_dtype),
                        w2=param(rngs, dense_init(), (mlp, emb), ("mlp", "embed"), param_dtype),
                        w3=param(rngs, dense_init(), (emb, mlp), ("embed", "mlp"), param_dtype))
    init_in = dense_init(in_axis=-2, out_axis=-1, batch_axis=(0,))
    return nnx.Dict(w1=param(rngs, init_in, (experts, emb, mlp), ("experts", "embed", "mlp"), param_dtype),
                    w2=param(rngs, init_in, (experts, mlp, emb), ("experts", "mlp", "embed"), param_dtype),
                    w3=param(rngs, init_in, (experts, emb, mlp), ("experts", "embed", "mlp"), param_dtype))


def cast_per_layer(w, dtype):
    """`w` in `dtype`, cast where the layer reads it. XLA:TPU moves a float32 -> bfloat16 convert of a
    scanned layer's slice of a stacked weight out of the scan, as one convert of the whole stack (an
    optimization barrier does not stop it): the forward makes it, the backward's recompute reads it, so
    every layer's bf16 copy of its experts lives from the forward to the backward (the step's largest
    temporaries after the gradients: docs/planning.md#v4-flash). That cast runs here as integer
    arithmetic (`_bf16_rounded`, round to nearest even as `astype`, bit for bit), which no pass moves;
    other casts are `astype`'s."""
    if w.dtype == dtype:
        return w
    if w.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
        return _bf16_rounded(w)
    return w.astype(dtype)


@jax.custom_vjp
def _bf16_rounded(w):
    """float32 -> bfloat16, round to nearest even (a NaN stays a NaN), from the float32's bits."""
    u = jax.lax.bitcast_convert_type(w, jnp.uint32)
    rounded = (u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))) >> 16
    b = jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)
    return jnp.where(jnp.isnan(w), jnp.bfloat16(jnp.nan), b)


# the transpose of a cast, as `astype`'s: the bfloat16 cotangent widened to float32
_bf16_rounded.defvjp(lambda w: (_bf16_rounded(w), None), lambda _, g: (g.astype(jnp.float32),))


def swiglu_mlp(x_btm, weights: nnx.Dict, limit: float, dtype):
    """One SwiGLU MLP (the shared expert) in `dtype`: w2(silu(min(x w1, L)) * clip(x w3, -L, L))."""
    x_btm = x_btm.astype(dtype)
    gate_btf = checkpoint_name(jnp.einsum("btm,mf->btf", x_btm, weights.w1[...].astype(dtype)), "moe_gate")
    up_btf = checkpoint_name(jnp.einsum("btm,mf->btf", x_btm, weights.w3[...].astype(dtype)), "moe_up")
    h_btf = swiglu_hidden(gate_btf, up_btf, limit).astype(dtype)
    return jnp.einsum("btf,fm->btm", h_btf, weights.w2[...].astype(dtype), preferred_element_type=_acc(x_btm))


class MoE(nnx.Module):
    """Routed experts + shared expert for one layer (DESIGN.md "MoE"; module docstring).

    The sublayer's input RMSNorm (ffn_norm) is not part of this module, as in the official code.
    `spec.lb_weight` scales aux["lb_loss"]; `spec.impl` picks the expert computation (module
    docstring); `seed_for_hash_table` seeds a hash-routed layer's table.
    """

    def __init__(self, spec: MoESpec, *, seed_for_hash_table: int = 0, rngs, param_dtype=jnp.float32,
                 dtype=jnp.float32):
        self.spec = spec
        self.dtype = dtype
        self.gate = router(spec, seed_for_hash_table=seed_for_hash_table, rngs=rngs, param_dtype=param_dtype)
        self.experts = swiglu_weights(spec.emb, spec.mlp, rngs=rngs, param_dtype=param_dtype, experts=spec.num_experts)
        self.shared_experts = (swiglu_weights(spec.emb, spec.shared * spec.mlp, rngs=rngs, param_dtype=param_dtype)
                               if spec.shared else None)

    def __call__(self, x_btm, tokens_bt, valid_bt):
        """Args: x_btm [B,T,M] (already ffn-normed), tokens_bt int [B,T], valid_bt bool [B,T].

        Returns:
          (y_btm in x's dtype, {"lb_loss": f32 scalar (0 in hash layers), "load": f32 [E],
          "dropped": f32 scalar, the fraction of slots dropped for expert-parallel capacity}).

        Shapes:
          1. logits_bte = x W_r (float32); scores_bte = sqrt(softplus(logits_bte))
          2. idx_btk from top-k(scores + bias) or tid2eid[tokens]; weights_btk from scores
          3. y = sum_k weights * expert_idx(x) + shared(x)      (accumulated in float32)
        """
        spec = self.spec
        x_c = x_btm.astype(self.dtype)
        idx_btk, weights_btk, lb_loss = self._route(x_btm, tokens_bt, valid_bt)
        w1, w2, w3 = (cast_per_layer(w[...], self.dtype) for w in (self.experts.w1, self.experts.w2, self.experts.w3))
        y_btm, dropped = routed_experts(spec, x_c, idx_btk, weights_btk, (w1, w2, w3),
                                        jax.sharding.get_abstract_mesh())
        # The shared expert's collectives follow the routed loop's, forward and backward, and the backward
        # waits for the loop's recompute (XLA:CPU's order, docs/scaling.md#collective-order-on-the-cpu).
        if self.shared_experts is not None:
            y_btm = y_btm + swiglu_mlp(after(x_c, y_btm), self.shared_experts, spec.swiglu_limit, self.dtype)
        y_btm = cotangent_after_value(y_btm)
        aux = {"lb_loss": lb_loss, "dropped": jax.lax.stop_gradient(dropped),
               "load": jax.lax.stop_gradient(expert_load(idx_btk, valid_bt, spec.num_experts))}
        return y_btm.astype(x_btm.dtype), aux

    def _route(self, x_btm, tokens_bt, valid_bt):
        """(idx_btk, weights_btk, lb_loss): learned top-k or the hash table; scores in float32."""
        spec = self.spec
        logits_bte = jnp.einsum("btm,me->bte", upcast(x_btm), upcast(self.gate.weight[...]))
        if spec.hash_routed:
            scores_bte = router_scores(logits_bte)
            idx_btk = self.gate.tid2eid[...][tokens_bt]
            weights_btk = combine_weights(scores_bte, idx_btk, scaling=spec.scaling, normalize=spec.normalize)
            return idx_btk, weights_btk, jnp.zeros((), jnp.float32)
        bias_e = None if self.gate.bias is None else self.gate.bias[...]
        idx_btk, weights_btk, scores_bte = route(logits_bte, bias_e, spec.k, scaling=spec.scaling,
                                                 normalize=spec.normalize)
        lb_loss = load_balance_loss(scores_bte, idx_btk, valid_bt, spec.num_experts, spec.lb_weight)
        return idx_btk, weights_btk, lb_loss
