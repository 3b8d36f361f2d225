"""The routed experts as one batched matmul per weight over rows padded to a capacity per expert.

A GPU's expert computation under expert parallelism (core/spec/platform.py): XLA:GPU expands
`lax.ragged_dot` into a dense matmul over every group, and the tiled dispatch (core/model/moe.py
`tiled_experts`) gathers its expert's weights for every tile and carries the float32 outputs of all
its rows through a loop, adding each tile's into them. Here every expert e owns a static block of
C rows (the capacity): its slots, in slot order (token by token), fill rows [0, count_e) of block
e; rows past count_e are zero, and slots past row C are dropped (their output is 0). Then

    gate, up = x_ecm w1_emf, x_ecm w3_emf;  h_ecf = SwiGLU(gate, up) * weight_ec;  y_ecm = h_ecf w2_efm

as batched matmuls ("ecm,emf->ecf"): the weights are read as they are, once per matmul, and the
slots move to their rows and back by gathers whose transposes are gathers (`to_rows`, `from_rows`),
never a scatter. Work: 6 E C M F FLOPs, the slots' own when C is the rows an expert receives.

Drops: with C below an expert's slots, its later slots are dropped. Under expert parallelism the
exchange keeps at most C slots per local expert (core/ops/expert_parallel.py, `Exchange.per_expert`),
so nothing is dropped here that the exchange did not drop and count; without an exchange the caller
counts them (`dropped_fraction`); C = N, the most slots one expert can get (a token's k experts are
distinct), is drop-free.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def kept_first(group_sizes_e, kept_de, local_experts: int, slots: int):
    """position_p: where each of a source's S slots, sorted by expert (`SlotOrder`), moves so that in each
    destination's block the slots it keeps come first, local expert by local expert, then the dropped ones.

    The exchange sends a prefix of each destination's block; with a capacity per local expert
    (`Exchange.per_expert`) the slots a destination keeps are each local expert's first ones, not the
    block's first rows.

    Args:
      group_sizes_e: int [E] the source's slots per expert (E = P E_l, destination-major; they sum to S).
      kept_de: int [P, E_l] of them, the slots each destination keeps (a prefix of each expert's).
      slots: S.
    Returns:
      int32 [S], a permutation of the sorted positions, each within its destination's block.
    """
    p = jnp.arange(slots, dtype=jnp.int32)
    ends_e = jnp.cumsum(group_sizes_e).astype(jnp.int32)
    start_e = ends_e - group_sizes_e
    g = jnp.minimum(jnp.searchsorted(ends_e, p, side="right"), group_sizes_e.shape[0] - 1)
    rank, d, e = p - start_e[g], g // local_experts, g % local_experts
    kept = kept_de[d, e]
    kept_at_de = jnp.cumsum(kept_de, axis=1) - kept_de                                 # offsets in the block
    dropped_de = group_sizes_e.reshape(-1, local_experts) - kept_de
    dropped_at_de = jnp.sum(kept_de, axis=1, keepdims=True) + jnp.cumsum(dropped_de, axis=1) - dropped_de
    at = jnp.where(rank < kept, kept_at_de[d, e] + rank, dropped_at_de[d, e] + rank - kept)
    return (start_e[d * local_experts] + at).astype(jnp.int32)


def dropped_fraction(idx_btk, num_experts: int, capacity: int, shards: int = 1):
    """float32: the fraction of the B*T*k slots past their expert's `capacity` on their device, the tokens
    split in `shards` equal consecutive parts (the devices' batch shards); ids >= E (empty) are not slots."""
    idx_s = idx_btk.reshape(shards, -1).astype(jnp.int32)
    counts_de = jax.vmap(lambda i: jnp.bincount(i, length=num_experts))(idx_s)
    return (jnp.sum(counts_de - jnp.minimum(counts_de, capacity)) / idx_btk.size).astype(jnp.float32)


class ExpertRows:
    """Where each of the S = N k slots sits in the [E, C] expert rows, and which slot fills each row.

    Built from idx [N, k] (ids >= num_experts: empty slots, in no row): a stable sort by expert gives
    each slot its rank among its expert's slots; slot s goes to row idx_s C + rank_s if its rank is
    below C.
    """

    def __init__(self, idx_nk, num_experts: int, capacity: int):
        flat = idx_nk.reshape(-1).astype(jnp.int32)
        self.k, self.num_experts, self.capacity = idx_nk.shape[-1], num_experts, capacity
        order = jnp.argsort(flat, stable=True)                                # sorted position -> slot
        counts_e = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        start_e = jnp.cumsum(counts_e) - counts_e
        expert_s = jnp.minimum(flat, num_experts - 1)
        rank_s = jnp.argsort(order).astype(jnp.int32) - start_e[expert_s]
        self.valid_s = (flat < num_experts) & (rank_s < capacity)
        self.row_s = jnp.where(self.valid_s, expert_s * capacity + rank_s, 0)
        j_r = jnp.tile(jnp.arange(capacity, dtype=jnp.int32), num_experts)
        e_r = jnp.repeat(jnp.arange(num_experts, dtype=jnp.int32), capacity)
        self.valid_r = j_r < counts_e[e_r]
        self.slot_r = jnp.where(self.valid_r, order[jnp.minimum(start_e[e_r] + j_r, flat.shape[0] - 1)], 0)
        # named as the routing is (core.model.transformer's SAVED_NAMES): no remat policy sorts again
        self.row_s, self.valid_s, self.slot_r, self.valid_r = (
            checkpoint_name(a, "moe_routing") for a in (self.row_s, self.valid_s, self.slot_r, self.valid_r))

    def rows(self, x_n_, k: int):
        """[N, ...] per token (k = the layout's k) or [S, ...] per slot (k = 1) -> [E, C, ...]."""
        out = to_rows(x_n_, self.slot_r, self.valid_r, self.row_s, self.valid_s, k)
        return out.reshape(self.num_experts, self.capacity, *x_n_.shape[1:])

    def tokens(self, y_ec_):
        """[E, C, ...] -> [N, ...]: each token's k slots summed, in at least float32."""
        y_r_ = y_ec_.reshape(-1, *y_ec_.shape[2:])
        return from_rows(y_r_, self.row_s, self.valid_s, self.slot_r, self.valid_r, self.k)


def _zero_where_not(valid, x):
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _sum_slots(y_r_, row_s, valid_s, k: int):
    """sum_j y[row[n k + j]] over the valid slots of each row n, in at least float32, slot by slot."""
    acc = jnp.promote_types(y_r_.dtype, jnp.float32)
    y_kn_ = _zero_where_not(valid_s, y_r_[row_s]).reshape(-1, k, *y_r_.shape[1:]).swapaxes(0, 1)
    return functools.reduce(lambda total, j: total + y_kn_[j].astype(acc), range(1, k), y_kn_[0].astype(acc))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def to_rows(x_n_, slot_r, valid_r, row_s, valid_s, k: int):
    """out[r] = x[slot_r // k] where row r holds a slot, else 0; the gradient sums each token's k slots
    back from their rows (`from_rows`' value): a gather both ways."""
    return _zero_where_not(valid_r, x_n_[slot_r // k])


def _to_fwd(x_n_, slot_r, valid_r, row_s, valid_s, k):
    return to_rows(x_n_, slot_r, valid_r, row_s, valid_s, k), (row_s, valid_s, jnp.zeros((0,), x_n_.dtype))


def _to_bwd(k, residual, d_r_):
    row_s, valid_s, like = residual
    return _sum_slots(d_r_, row_s, valid_s, k).astype(like.dtype), None, None, None, None


to_rows.defvjp(_to_fwd, _to_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def from_rows(y_r_, row_s, valid_s, slot_r, valid_r, k: int):
    """[N, ...]: each token's k slots' rows of y summed (a dropped slot adds 0), in at least float32;
    `to_rows`' transpose, its gradient `to_rows`' gather."""
    return _sum_slots(y_r_, row_s, valid_s, k)


def _from_fwd(y_r_, row_s, valid_s, slot_r, valid_r, k):
    return from_rows(y_r_, row_s, valid_s, slot_r, valid_r, k), (slot_r, valid_r, jnp.zeros((0,), y_r_.dtype))


def _from_bwd(k, residual, d_n_):
    slot_r, valid_r, like = residual
    return _zero_where_not(valid_r, d_n_.astype(like.dtype)[slot_r // k]), None, None, None, None


from_rows.defvjp(_from_fwd, _from_bwd)


def batched_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, *, capacity: int | None, hidden):
    """sum_j weights[b,t,j] * expert_{idx[b,t,j]}(x[b,t]) by batched matmuls over C rows per expert.

    Args:
      x_btm: [B, T, M] tokens (compute dtype); idx_btk: int [B, T, k] (ids >= E: empty slots, adding 0);
      weights_btk: float [B, T, k] combine weights.
      w1_emf, w3_emf: [E, M, F]; w2_efm: [E, F, M].
      capacity: C, rows per expert (a slot past its expert's C is dropped); None: B*T, drop-free.
      hidden: (gate, up) -> float32 hidden, the clamped SwiGLU.
    Returns:
      [B, T, M] in the accumulation dtype (float32, or float64 for float64 inputs).

    Shapes:
      1. rows = ExpertRows(idx, E, C);  x_ecm = rows.rows(x)             [E, C, M]  (zero rows past count_e)
      2. gate_ecf, up_ecf = x_ecm w1_emf, x_ecm w3_emf                    batched over e
      3. h_ecf = hidden(gate, up) * weight_ec;  y_ecm = h_ecf w2_efm       (compute dtype)
      4. y_btm = rows.tokens(y_ecm)                                        (float32 sum of k slots)
    """
    b, t, m = x_btm.shape
    k, num_experts = idx_btk.shape[-1], w1_emf.shape[0]
    acc = jnp.promote_types(x_btm.dtype, jnp.float32)
    rows = ExpertRows(idx_btk.reshape(b * t, k), num_experts, b * t if capacity is None else capacity)
    # kept by a GPU's `experts` remat (core.model.transformer's GPU_EXPERT_NAMES): not exchanged again
    x_ecm = checkpoint_name(rows.rows(x_btm.reshape(b * t, m), k), "moe_rows")
    gate_ecf = checkpoint_name(jnp.einsum("ecm,emf->ecf", x_ecm, w1_emf), "moe_gate")
    up_ecf = checkpoint_name(jnp.einsum("ecm,emf->ecf", x_ecm, w3_emf), "moe_up")
    # under expert parallelism the weights the exchange brought: kept by name, the SwiGLU's backward reads them
    weight_ec = checkpoint_name(rows.rows(weights_btk.reshape(-1).astype(acc), 1), "moe_weights")
    h_ecf = (hidden(gate_ecf, up_ecf) * weight_ec[..., None]).astype(x_btm.dtype)
    y_ecm = jnp.einsum("ecf,efm->ecm", h_ecf, w2_efm)
    return rows.tokens(y_ecm).reshape(b, t, m)
