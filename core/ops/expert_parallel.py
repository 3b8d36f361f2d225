"""Expert parallelism that moves tokens, not weights (DESIGN.md, "Scale").

Inside `jax.shard_map` over the mesh, with P = the `expert` axis size and E_l = E / P experts per
device (experts are sharded over `expert` on their leading axis), every device splits its n tokens
into R rounds of n_r = ceil(n / R) tokens (the last round padded with tokens routed nowhere) and
runs one round at a time, in a `lax.map` whose body is under `jax.checkpoint`:

1. The round's tokens arrive routed (idx, weights: computed on their own device, outside). Slot
   (token, j) goes to device idx // E_l, local expert idx % E_l. A token travels to each device that
   holds one of its experts ONCE, with all of its slots there (at most k' = min(k, E_l): a token's
   experts are distinct): one row per (token, device) pair, its place in the destination's block
   its rank among the round's tokens for that device (stable: token order).
2. A send buffer [P, C, M] holds each destination's block of C rows (C the capacity below; rows
   left over are empty); `lax.all_to_all` over `expert` exchanges the blocks, together with each
   row's k' local expert ids (E_l: an empty slot) and combine weights.
3. The P*C received rows run through the tiled dispatch (core/ops/moe_dispatch.py) over the E_l
   LOCAL experts only: each row's output is the sum of its slots' experts times their weights, in
   float32; chunks of only empty slots are skipped at run time.
4. The inverse `all_to_all` returns each row's output to its source, which adds it to its token
   (float32). After the last round, a psum over `tensor` when F is sharded there.

The exchange is built from `lax.all_to_all` with static, worst-case blocks, not from
`lax.ragged_all_to_all`: XLA:CPU (jax 0.10.2) does not implement `ragged-all-to-all`
("UNIMPLEMENTED"), so only this exchange compiles and is tested in the CPU suite.

Capacity and buffers. A destination gets at most one row per token of the round: C = n_r is
drop-free (`Exchange.capacity_factor` 0, the default). What lives at once on a device is one round's: the
send and receive blocks, P*C rows of M each in the compute dtype, the destination's outputs and
their return exchange, P*C rows of M in float32 (and P*C rows of k' expert ids and weights);
across rounds only the tokens' outputs [n, M] (float32). The backward keeps each round's inputs
(its n_r rows of x and its routing), recomputes the round (layout, outbound exchanges, the
experts' forward) and holds one round's blocks and their gradients at a time. With R = P the drop-free
blocks hold P n_r < n + P rows, the device's own tokens: growing with tokens per device, not with
devices. The destination's tiled dispatch scans P*C*k' slots a round (empty chunks skipped).

A capacity factor f > 0 sets C = ceil(f * n_r * k / P) (f times a round's mean slots per
destination; at most n_r): capacity is per round, and a row (token, device) past its destination's
C rows in its round is dropped with all its slots there (they add 0; the round's later tokens
first) and counted, slot by slot, in the returned fraction. Rounds of fewer tokens drop a little
more at the same f than one block of n would (a round's load varies more). A drop-free exchange
never drops a slot.

Rounds. R = P, at most n (`token_rounds`; `Exchange.rounds` overrides): the fewest rounds whose
drop-free blocks hold no more rows than the device's own n tokens, the size of the MoE's input and
float32 output. Fewer rounds grow the blocks towards one exchange's worst case, P n rows (every
device's tokens on one device); more shrink them below what the MoE holds anyway and pay each
round's fixed cost more often: four all-to-alls forward (tokens, expert ids and weights out, outputs
back) and six backward (three of them the recomputation), a scan step, the tiled dispatch's tile
padding (up to E_l (rows per tile - 1) rows a round) and its chunks (about 3F / rows per tile a
round; in the backward each adds its gradient into the [E_l, M, F] weight gradients).

Weights. The in_specs take the expert weights as [experts over `expert`, embed whole, mlp over
`tensor`]: the `embed` dimension, sharded over `fsdp` in the parameters, is gathered by the
compiler once per call at the shard_map's boundary (and its gradient reduce-scattered back, once,
after the last round), one layer at a time; every round reads those local weights. No device
holds another device's experts or a per-tile copy of all weights. The backward accumulates the
weights' gradients across rounds, one [E_l, M, F] set beside the tiled dispatch's own per round.
Tokens (the flattened batch) split over (data, fsdp, expert), as the batch does
(core/parallel/sharding.py); mesh axes named here mirror its rules (ops may not import parallel).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from core.ops.moe_dispatch import Tiling, tiled_experts, vary_like

EXPERT_AXIS = "expert"                    # the experts' leading axis ("experts" -> "expert")
MLP_AXIS = "tensor"                       # the experts' hidden axis ("mlp" -> "tensor")
TOKEN_AXES = ("data", "fsdp", "expert")   # the batch's axes (BATCH_AXES)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Static layout of one expert-parallel MoE call (hashable)."""

    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh   # has an `expert` axis
    tiling: Tiling                        # rows per tile and tiles per step on the destination
    capacity_factor: float = 0.0          # 0: drop-free (module docstring)
    rounds: int = 0                       # R, token rounds per device (0: `token_rounds`' default)


def expert_axis_size(mesh) -> int:
    """Size of the mesh's `expert` axis (1 without a mesh or without the axis)."""
    if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[EXPERT_AXIS]


def token_shards(mesh) -> int:
    """Devices the tokens split over: the product of the mesh's TOKEN_AXES sizes."""
    return math.prod(mesh.shape[a] for a in TOKEN_AXES if a in mesh.axis_names)


def token_rounds(tokens: int, devices: int, rounds: int = 0) -> tuple[int, int]:
    """(R, n_r): n tokens per device in R rounds of n_r = ceil(n / R) tokens.

    `rounds` 0 takes P (module docstring); R is then lowered to ceil(n / n_r), so that only the last
    round holds padding, less than n_r tokens.
    """
    per_round = -(-tokens // max(1, min(rounds or devices, tokens)))
    return -(-tokens // per_round), per_round


def capacity(tokens: int, k: int, devices: int, factor: float) -> int:
    """C, rows (tokens) per destination block: drop-free n, or ceil(f * n * k / P) below it."""
    return tokens if factor <= 0 else max(1, min(tokens, math.ceil(factor * tokens * k / devices)))


def _send_layout(idx_nk, local_experts: int, devices: int, cap: int):
    """Where a round's tokens go: one row per (token, destination) pair.

    Returns (token_r [P*C]: each send row's token (0 when empty), slot_s [n*k]: each slot's place
    row * k' + rank in the rows' slot arrays (P*C*k' when dropped or when its expert is E, a padding
    token's), dropped: the real slots dropped for capacity). Rank: the slot's order among its token's
    slots on the same device, < k' = min(k, E_l) as a token's experts are distinct.
    """
    n, k = idx_nk.shape
    slots_per_row = min(k, local_experts)
    dest_nk = idx_nk // local_experts                                  # P for padding: no device
    to_nkd = dest_nk[..., None] == jnp.arange(devices)
    pos_nd = jnp.cumsum(jnp.any(to_nkd, axis=1), axis=0, dtype=jnp.int32) - 1   # rank among the device's tokens
    pos_nk = jnp.sum(jnp.where(to_nkd, pos_nd[:, None, :], 0), axis=-1)
    rank_nk = jnp.sum(jnp.tril(dest_nk[:, :, None] == dest_nk[:, None, :], -1), axis=-1)
    real_nk, kept_nk = dest_nk < devices, (dest_nk < devices) & (pos_nk < cap)
    row_nk = jnp.where(kept_nk, dest_nk * cap + pos_nk, devices * cap)
    token_r = jnp.zeros((devices * cap,), jnp.int32).at[row_nk].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, k)), mode="drop")
    slot_s = jnp.where(kept_nk, row_nk * slots_per_row + rank_nk, devices * cap * slots_per_row).reshape(-1)
    return token_r, slot_s, jnp.sum(real_nk & ~kept_nk)


def expert_parallel_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, exchange: Exchange, *, hidden):
    """sum_j weights[b,t,j] * expert_{idx[b,t,j]}(x[b,t]), the tokens sent to their experts' devices.

    Args:
      x_btm: [B, T, M] tokens (compute dtype); B*T must split over the mesh's TOKEN_AXES.
      idx_btk: int [B, T, k] chosen experts (distinct per token); weights_btk: float32 [B, T, k].
      w1_emf, w3_emf: [E, M, F]; w2_efm: [E, F, M] (E divisible by the `expert` axis size).
      exchange: the mesh, the destination's tiling, the capacity factor, the rounds.
      hidden: (gate, up) -> float32 hidden, the clamped SwiGLU.
    Returns:
      (y_btm in the accumulation dtype, dropped: float32 scalar, the fraction of the B*T*k slots
      dropped for capacity; 0 when drop-free).

    Shapes (per device: n = B*T / shards tokens in R rounds of n_r, P devices on `expert`, C = capacity
    per round, k' = min(k, E_l); steps 1-4 once per round, under `jax.checkpoint`):
      0. x_rnm, idx_rnk, weights_rnk = pad(x, idx, weights) to R*n_r tokens     [R, n_r, ...]
      1. token_r, slot_s = layout(idx)          send_x_pcm = x[token_r]           [P, C, M]
         send_e_pcj, send_w_pcj = local expert, weight of slot s at slot_s       [P, C, k']
      2. recv_* = all_to_all(send_*)
      3. y_rm = tiled_experts(recv_x, recv_e, recv_w; local experts)             [P*C, M]
      4. back_rm = all_to_all(y_rm); y_nm = zeros.at[token_r].add(back_rm)       [n_r, M]
      5. y_nm = y_rnm[:n]; psum over `tensor`                                     [n, M]
    """
    mesh = exchange.mesh
    b, t, m = x_btm.shape
    k, num_experts, mlp = idx_btk.shape[-1], w1_emf.shape[0], w1_emf.shape[-1]
    devices, shards = expert_axis_size(mesh), token_shards(mesh)
    if num_experts % devices or (b * t) % shards:
        raise ValueError(f"expert parallelism needs E={num_experts} divisible by expert={devices} and "
                         f"B*T={b * t} tokens divisible by the {shards} token shards")
    tokens = tuple(a for a in TOKEN_AXES if a in mesh.axis_names)
    mlp_axis = MLP_AXIS if MLP_AXIS in mesh.axis_names and mlp % mesh.shape[MLP_AXIS] == 0 else None
    local_experts, n = num_experts // devices, b * t // shards
    rounds, per_round = token_rounds(n, devices, exchange.rounds)
    cap, slots_per_row = capacity(per_round, k, devices, exchange.capacity_factor), min(k, local_experts)
    tiling = dataclasses.replace(exchange.tiling, empty_slots=True)
    acc = jnp.promote_types(x_btm.dtype, jnp.float32)

    def exchange_blocks(a):  # [P*C, ...] -> [P*C, ...]: block d to device d, device d's block back as block d
        blocks = a.reshape(devices, cap, *a.shape[1:])
        return jax.lax.all_to_all(blocks, EXPERT_AXIS, 0, 0).reshape(a.shape)

    def one_round(x_nm, idx_nk, weights_nk, w1, w2, w3):
        token_r, slot_s, dropped = _send_layout(idx_nk, local_experts, devices, cap)
        rows = (devices * cap * slots_per_row,)
        expert_s = jnp.full(rows, local_experts, jnp.int32).at[slot_s].set(idx_nk.reshape(-1) % local_experts,
                                                                           mode="drop")
        weight_s = jnp.zeros(rows, weights_nk.dtype).at[slot_s].set(weights_nk.reshape(-1), mode="drop")
        recv_x, recv_e, recv_w = (exchange_blocks(a) for a in (
            x_nm[token_r], expert_s.reshape(-1, slots_per_row), weight_s.reshape(-1, slots_per_row)))
        y_rm = tiled_experts(recv_x[None], recv_e[None], recv_w[None], w1, w2, w3, tiling, hidden=hidden)[0]
        # An empty or dropped row adds 0 to token 0: its slots are all empty, its output exactly 0.
        return jnp.zeros((per_round, m), acc).at[token_r].add(exchange_blocks(y_rm)), dropped

    def per_device(x_nm, idx_nk, weights_nk, w1, w2, w3):
        # Everything differentiated varies over every manual axis before the rounds, so that the casts'
        # transposes (the gradients' psums over data/fsdp for the weights, over tensor for the tokens) run
        # once, after the last round, not in every round's or every tile chunk's backward.
        w1, w2, w3 = (vary_like(w, x_nm) for w in (w1, w2, w3))
        x_nm, weights_nk = (vary_like(a, w1) for a in (x_nm, weights_nk))
        pad = ((0, rounds * per_round - n), (0, 0))
        xs = (jnp.pad(x_nm, pad).reshape(rounds, per_round, m),
              jnp.pad(idx_nk, pad, constant_values=num_experts).reshape(rounds, per_round, k),   # E: no device
              jnp.pad(weights_nk, pad).reshape(rounds, per_round, k))
        # Checkpointed: the backward keeps each round's inputs, not its [P*C, M] blocks.
        body = jax.checkpoint(lambda xs_r: one_round(*xs_r, w1, w2, w3), prevent_cse=False)
        y_rnm, dropped_r = jax.lax.map(body, xs)
        y_nm = y_rnm.reshape(rounds * per_round, m)[:n]
        if mlp_axis is not None:
            y_nm = jax.lax.psum(y_nm, mlp_axis)
        dropped = jax.lax.psum(jnp.sum(dropped_r), tokens)
        return y_nm, dropped.astype(jnp.float32) / (b * t * k)

    run = jax.shard_map(
        per_device, mesh=mesh, out_specs=(P(tokens, None), P()),
        in_specs=(P(tokens, None), P(tokens, None), P(tokens, None), P(EXPERT_AXIS, None, mlp_axis),
                  P(EXPERT_AXIS, mlp_axis, None), P(EXPERT_AXIS, None, mlp_axis)))
    y_nm, dropped = run(x_btm.reshape(b * t, m), idx_btk.reshape(b * t, k).astype(jnp.int32),
                        weights_btk.reshape(b * t, k), w1_emf, w2_efm, w3_emf)
    return y_nm.reshape(b, t, m), dropped


def token_parallel_experts(experts, x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, mesh):
    """`experts(x, idx, weights, w1, w2, w3)` on each device's own tokens, inside `jax.shard_map`: the
    form of a grouped-matmul MoE (moe_impl ragged, gmm) on a mesh without an `expert` axis. XLA cannot
    partition a Pallas / Mosaic kernel (XLA:TPU's ragged_dot is one) across devices, so each device
    runs it whole on its tokens.

    Tokens split over (data, fsdp), as the batch does; the expert weights enter whole along `embed`
    (gathered by the compiler at the boundary, one layer at a time, as FSDP gathers every weight) and
    split over `tensor` along the hidden width when it divides, the partial outputs summed there.

    Returns:
      y_btm [B, T, M] in the accumulation dtype.
    """
    b, t, m = x_btm.shape
    k, mlp = idx_btk.shape[-1], w1_emf.shape[-1]
    tokens = tuple(a for a in TOKEN_AXES if a in mesh.axis_names)
    if (b * t) % token_shards(mesh):
        raise ValueError(f"B*T={b * t} tokens must divide over the {token_shards(mesh)} token shards")
    mlp_axis = MLP_AXIS if MLP_AXIS in mesh.axis_names and mlp % mesh.shape[MLP_AXIS] == 0 else None

    def per_device(x_nm, idx_nk, weights_nk, w1, w2, w3):
        y_nm = experts(x_nm[None], idx_nk[None], weights_nk[None], w1, w2, w3)[0]
        return jax.lax.psum(y_nm, mlp_axis) if mlp_axis is not None else y_nm

    # check_vma off: a Pallas kernel's output type says nothing of how it varies over the mesh's axes
    run = jax.shard_map(
        per_device, mesh=mesh, out_specs=P(tokens, None), check_vma=False,
        in_specs=(P(tokens, None), P(tokens, None), P(tokens, None), P(None, None, mlp_axis),
                  P(None, mlp_axis, None), P(None, None, mlp_axis)))
    y_nm = run(x_btm.reshape(b * t, m), idx_btk.reshape(b * t, k).astype(jnp.int32), weights_btk.reshape(b * t, k),
               w1_emf, w2_efm, w3_emf)
    return y_nm.reshape(b, t, m)
