"""Expert parallelism that moves tokens, not weights (DESIGN.md, "Scale").

Inside `jax.shard_map` over the mesh, with P = the `expert` axis size and E_l = E / P experts per
device (experts are sharded over `expert` on their leading axis), on every device:

1. Its n tokens arrive routed (idx, weights: computed on their own device, outside). Each of the
   n*k (token, expert) slots goes to device idx // E_l, local expert idx % E_l; a slot's place in
   its destination's block is its rank among the slots for that device (stable: token order).
2. A send buffer [P, C, M] holds each destination's block of C rows (C the capacity below; rows
   left over are empty slots); `lax.all_to_all` over `expert` exchanges the blocks, together with
   the rows' local expert ids (E_l on an empty row).
3. The P*C received rows run through the tiled dispatch (core/ops/moe_dispatch.py) over the E_l
   LOCAL experts only, one row per token, with empty slots: chunks of only empty rows are skipped.
4. The inverse `all_to_all` returns each row's output to its slot; each token sums its k slots
   times their combine weights (in float32), then a psum over `tensor` when F is sharded there.

The exchange is built from `lax.all_to_all` with static, worst-case blocks, not from
`lax.ragged_all_to_all`: XLA:CPU (jax 0.10.2) does not implement `ragged-all-to-all`
("UNIMPLEMENTED"), so only this exchange compiles and is tested in the CPU suite.

Capacity. A token's k experts are distinct, so at most min(k, E_l) of its slots go to one device:
C = n * min(k, E_l) is drop-free (`Exchange.capacity_factor` 0, the default). Its cost: the send
and receive buffers hold P * n * min(k, E_l) rows of M each, P * min(k, E_l) / k times the slots'
own n*k rows (at most P times), and the destination's tiled dispatch scans that many rows (empty
chunks skipped at run time). A capacity factor f > 0 sets C = ceil(f * n * k / P) (at most the
drop-free C): buffers of f * n * k rows, growing with tokens per device, not with devices; a slot
past its destination's C rows is dropped (adds 0; later tokens first) and counted in the returned
fraction. A drop-free exchange never drops a slot.

Weights. The in_specs take the expert weights as [experts over `expert`, embed whole, mlp over
`tensor`]: the `embed` dimension, sharded over `fsdp` in the parameters, is gathered by the
compiler once per call at the shard_map's boundary (and its gradient reduce-scattered back), one
layer at a time; no device holds another device's experts or a per-tile copy of all weights.
Tokens (the flattened batch) split over (data, fsdp, expert), as the batch does
(core/parallel/sharding.py); mesh axes named here mirror its rules (ops may not import parallel).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from core.ops.moe_dispatch import Tiling, tiled_experts

EXPERT_AXIS = "expert"                    # the experts' leading axis ("experts" -> "expert")
MLP_AXIS = "tensor"                       # the experts' hidden axis ("mlp" -> "tensor")
TOKEN_AXES = ("data", "fsdp", "expert")   # the batch's axes (BATCH_AXES)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Static layout of one expert-parallel MoE call (hashable)."""

    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh   # has an `expert` axis
    tiling: Tiling                        # rows per tile and tiles per step on the destination
    capacity_factor: float = 0.0          # 0: drop-free (module docstring)


def expert_axis_size(mesh) -> int:
    """Size of the mesh's `expert` axis (1 without a mesh or without the axis)."""
    if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[EXPERT_AXIS]


def token_shards(mesh) -> int:
    """Devices the tokens split over: the product of the mesh's TOKEN_AXES sizes."""
    return math.prod(mesh.shape[a] for a in TOKEN_AXES if a in mesh.axis_names)


def capacity(tokens: int, k: int, local_experts: int, devices: int, factor: float) -> int:
    """C, rows per destination block: drop-free n * min(k, E_l), or ceil(f * n * k / P) below it."""
    free = tokens * min(k, local_experts)
    return free if factor <= 0 else max(1, min(free, math.ceil(factor * tokens * k / devices)))


def _send_layout(idx_nk, local_experts: int, devices: int, cap: int):
    """(row_s, token_r, expert_r): each slot's row in the send buffer [P*C] (P*C when dropped), each
    row's token (0 when empty) and local expert (E_l when empty)."""
    flat = idx_nk.reshape(-1).astype(jnp.int32)
    slots, k = flat.shape[0], idx_nk.shape[-1]
    dest_s = flat // local_experts
    counts_d = jnp.bincount(dest_s, length=devices).astype(jnp.int32)
    first_d = jnp.cumsum(counts_d) - counts_d
    order = jnp.argsort(dest_s, stable=True)
    rank = jnp.arange(slots, dtype=jnp.int32) - first_d[dest_s[order]]
    pos_s = jnp.zeros((slots,), jnp.int32).at[order].set(rank, unique_indices=True)
    row_s = jnp.where(pos_s < cap, dest_s * cap + pos_s, devices * cap)
    token_r = jnp.zeros((devices * cap,), jnp.int32).at[row_s].set(jnp.arange(slots, dtype=jnp.int32) // k,
                                                                   mode="drop")
    expert_r = jnp.full((devices * cap,), local_experts, jnp.int32).at[row_s].set(flat % local_experts,
                                                                                 mode="drop")
    return row_s, token_r, expert_r


def expert_parallel_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, exchange: Exchange, *, hidden):
    """sum_j weights[b,t,j] * expert_{idx[b,t,j]}(x[b,t]), the tokens sent to their experts' devices.

    Args:
      x_btm: [B, T, M] tokens (compute dtype); B*T must split over the mesh's TOKEN_AXES.
      idx_btk: int [B, T, k] chosen experts (distinct per token); weights_btk: float32 [B, T, k].
      w1_emf, w3_emf: [E, M, F]; w2_efm: [E, F, M] (E divisible by the `expert` axis size).
      exchange: the mesh, the destination's tiling, the capacity factor.
      hidden: (gate, up) -> float32 hidden, the clamped SwiGLU.
    Returns:
      (y_btm in the accumulation dtype, dropped: float32 scalar, the fraction of the B*T*k slots
      dropped for capacity; 0 when drop-free).

    Shapes (per device: n = B*T / shards tokens, P devices on `expert`, C = capacity):
      1. row_s = dest(idx) * C + rank          send_x_pcm = x[token of row]      [P, C, M]
      2. recv_x_pcm = all_to_all(send_x_pcm)   recv_e_pc = all_to_all(expert_r)
      3. y_rm = tiled_experts(recv_x, recv_e, local experts)                      [P*C, M]
      4. back_rm = all_to_all(y_rm); y_nm = sum_k weights * back[row_s]; psum over `tensor`
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
    cap = capacity(n, k, local_experts, devices, exchange.capacity_factor)
    acc = jnp.promote_types(x_btm.dtype, jnp.float32)

    def exchange_blocks(a):  # [P*C, ...] -> [P*C, ...]: block d to device d, device d's block back as block d
        blocks = a.reshape(devices, cap, *a.shape[1:])
        return jax.lax.all_to_all(blocks, EXPERT_AXIS, 0, 0).reshape(a.shape)

    def per_device(x_nm, idx_nk, weights_nk, w1, w2, w3):
        row_s, token_r, expert_r = _send_layout(idx_nk, local_experts, devices, cap)
        recv_x, recv_e = exchange_blocks(x_nm[token_r]), exchange_blocks(expert_r)
        y_rm = tiled_experts(recv_x[None], recv_e[None, :, None], jnp.ones((1, devices * cap, 1), acc), w1, w2, w3,
                             dataclasses.replace(exchange.tiling, empty_slots=True), hidden=hidden)[0]
        back_sm = exchange_blocks(y_rm).at[row_s].get(mode="fill", fill_value=0)    # dropped slots: 0
        y_nm = jnp.einsum("nk,nkm->nm", weights_nk.astype(acc), back_sm.reshape(n, k, m))
        if mlp_axis is not None:
            y_nm = jax.lax.psum(y_nm, mlp_axis)
        dropped = jax.lax.psum(jnp.sum(row_s == devices * cap), tokens)
        return y_nm, dropped.astype(jnp.float32) / (b * t * k)

    run = jax.shard_map(
        per_device, mesh=mesh, out_specs=(P(tokens, None), P()),
        in_specs=(P(tokens, None), P(tokens, None), P(tokens, None), P(EXPERT_AXIS, None, mlp_axis),
                  P(EXPERT_AXIS, mlp_axis, None), P(EXPERT_AXIS, None, mlp_axis)))
    y_nm, dropped = run(x_btm.reshape(b * t, m), idx_btk.reshape(b * t, k), weights_btk.reshape(b * t, k),
                        w1_emf, w2_efm, w3_emf)
    return y_nm.reshape(b, t, m), dropped
