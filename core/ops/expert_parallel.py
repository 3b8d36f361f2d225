"""Expert parallelism that moves tokens, not weights (DESIGN.md, "Expert parallelism").

Inside `jax.shard_map` over the mesh, with P = the devices the experts split over (`expert`, times
`expert_outer` where the mesh has it: core/ops/placement.py's EXPERT_AXES; "`expert`" below is
both), E_l = E / P experts per device (experts are sharded over them on their leading axis) and n
tokens per device, each device runs, once per call:

1. Its n tokens arrive routed (idx, weights: computed on their own device, outside). Their
   S = n k slots are sorted by global expert (`SlotOrder`): the slots for device d are then one
   contiguous block, in order of its local experts, their counts `counts_e` [E].
2. An all-gather over `expert` of every device's counts [P, E] tells each device where each block
   lands: destination d's buffer holds, source by source and within a source local expert by local
   expert, the slots sent to it, C rows in all (C the capacity below). A slot past row C of its
   destination is dropped: its output is 0 and it counts, slot by slot, in the returned fraction.
3. The exchange (`ragged_exchange`) sends each block's real rows, and beside them each slot's
   combine weight (float32, one per row): `lax.ragged_all_to_all` on a TPU or a GPU, whose
   transfers are the real counts.
4. Each destination runs `experts` on its C rows as one-slot tokens of its E_l local experts, each
   with its combine weight (the single-device MoE: a grouped matmul over the real rows for moe_impl
   ragged and gmm, which scales the hidden [C, F] by it before the down projection, the tiled
   dispatch for tiled; rows past the received ones are empty slots, expert E_l), and the inverse
   exchange returns each slot's weighted output, rounded to the compute dtype, to its source.
5. The source sums each token's k slots in float32 (`SlotOrder.gather_sum`), then over `tensor`
   when the hidden width F is sharded there: the same products, rounded at the same place, as the
   single-device MoE. Weighting at the source instead would multiply [n k, M] rows in float32 each
   way, and its backward would need the returned rows: under remat, the down projection and the
   return exchange run again. Three exchanges a call forward (two of them the rows) and three
   backward.

XLA:CPU (jax 0.10.2) does not implement `ragged-all-to-all` ("UNIMPLEMENTED"): there the exchange
is `emulated_ragged_all_to_all`, the same call's result from an `all_to_all` of static blocks, one
block per destination of min(S, C) rows, whose rows are then scattered to their offsets. Only the
exchange primitive differs; the CPU suite tests the expert-parallel MoE through it.

Capacity. Drop-free (capacity factor 0, the default): C = P n min(k, E_l), the most slots one
device can receive (every device's tokens on it, each with all of its slots there). A capacity
factor f > 0: C = ceil(f n k) rows, f times the slots a destination receives under a balanced load
(at most the drop-free C). The executed work (exchange, grouped matmul) is the real slots either
way; C sizes the receive buffers and what a static cost analysis counts for the grouped matmul.
`Exchange.per_expert` (moe_impl batched, core/ops/batched_experts.py) keeps C_e = ceil(f n k / E_l) slots
per local expert instead (drop-free: P n), each filled source by source, in a buffer of E_l C_e rows.

Weights. The in_specs take the expert weights as [experts over `expert`, embed whole, mlp over
`tensor`]: an `embed` dimension sharded over `fsdp` in the parameters is gathered by the compiler
at the shard_map's boundary (its gradient reduce-scattered back), one layer at a time; no device
holds another device's experts. Tokens (the flattened batch) split over (data, fsdp, expert), as
the batch does (core/ops/placement.py's BATCH_AXES, which the sharding rules take too).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from core.ops.batched_experts import kept_first
from core.ops.grouped_matmul import SlotOrder
from core.ops.placement import BATCH_AXES, MLP_AXIS, expert_axes, expert_axis_size, token_shards


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Static layout of one expert-parallel MoE call (hashable)."""

    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh   # has an `expert` axis
    capacity_factor: float = 0.0          # 0: drop-free (module docstring)
    emulated: bool = False                # the all_to_all form of the exchange (XLA:CPU has no ragged one)
    per_expert: bool = False              # C / E_l slots kept per local expert (`expert_capacity`), not C per device


def capacity(tokens: int, k: int, num_experts: int, devices: int, factor: float) -> int:
    """C, slot rows a destination receives: drop-free P n min(k, E_l), or ceil(f n k) below it."""
    worst = devices * tokens * min(k, num_experts // devices)
    return worst if factor <= 0 else max(1, min(worst, math.ceil(factor * tokens * k)))


def expert_capacity(tokens: int, k: int, num_experts: int, devices: int, factor: float) -> int:
    """Slot rows one local expert receives under `Exchange.per_expert` (core/ops/batched_experts.py's
    rows): drop-free P n (a token's k experts are distinct), or ceil(f n k / E_l) below it."""
    worst = devices * tokens
    return worst if factor <= 0 else max(1, min(worst, math.ceil(factor * tokens * k * devices / num_experts)))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, block: int):
    """`lax.ragged_all_to_all`'s result through `lax.all_to_all` of static blocks (XLA:CPU's form).

    Block d holds rows input_offsets[d] + [0, block) of `operand` (those past send_sizes[d]: 0); each
    received block's first recv_sizes[p] rows are written into `output` from the offset its sender
    gave (its output_offsets entry for this device, exchanged beside the blocks). `block` must be at
    least every send size.

    Shapes: operand [S, ...] -> blocks [P, block, ...] -> all_to_all -> output [C, ...].
    """
    devices = input_offsets.shape[0]
    j = jnp.arange(block, dtype=jnp.int32)
    rows_pb = input_offsets[:, None] + j
    live_pb = j < send_sizes[:, None]
    blocks = jnp.where(live_pb.reshape(devices, block, *(1,) * (operand.ndim - 1)),
                       operand[jnp.clip(rows_pb, 0, operand.shape[0] - 1)], jnp.zeros((), operand.dtype))
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0)
    at_p = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)     # where source p's rows go here
    dest_pb = jnp.where(j < recv_sizes[:, None], at_p[:, None] + j, output.shape[0])
    return output.at[dest_pb.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, emulated: bool,
                    block: int, axis_name="expert"):
    """`lax.ragged_all_to_all` over the experts' axes, or its emulation (`emulated_ragged_all_to_all`) on XLA:CPU."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    if emulated:
        return emulated_ragged_all_to_all(*args, axis_name=axis_name, block=block)
    return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _kept_counts(counts_pe, devices: int, local_experts: int, cap: int, per_expert: bool = False):
    """kept [P_dst, P_src, E_l]: of the counts [P_src, E] every source sends, the slots each destination
    keeps within its C rows, filled source by source, local expert by local expert (a prefix: once a
    destination is full, every later slot is dropped); `per_expert`: each local expert's C / E_l rows
    filled source by source."""
    to_dst = counts_pe.reshape(devices, devices, local_experts).transpose(1, 0, 2)   # [dst, src, e_l]
    if per_expert:
        return jnp.diff(jnp.minimum(jnp.cumsum(to_dst, axis=1), cap // local_experts), axis=1, prepend=0)
    filled = jnp.minimum(jnp.cumsum(to_dst.reshape(devices, -1), axis=-1), cap)
    return jnp.diff(filled, axis=-1, prepend=0).reshape(to_dst.shape)


def expert_parallel_experts(x_btm, idx_btk, weights_btk, w1_emf, w2_efm, w3_emf, exchange: Exchange, *,
                            experts: Callable):
    """sum_j weights[b,t,j] * expert_{idx[b,t,j]}(x[b,t]), the slots sent to their experts' devices.

    Args:
      x_btm: [B, T, M] tokens (compute dtype); B*T must split over the mesh's BATCH_AXES.
      idx_btk: int [B, T, k] chosen experts (distinct per token); weights_btk: float32 [B, T, k].
      w1_emf, w3_emf: [E, M, F]; w2_efm: [E, F, M] (E divisible by the `expert` axis size).
      exchange: the mesh, the capacity factor, the exchange's form.
      experts: the single-device MoE, `(x [1, C, M], idx [1, C, 1], weights [1, C, 1], w1, w2, w3) ->
        [1, C, M]` over the E_l local experts, an idx of E_l an empty slot that adds 0.
    Returns:
      (y_btm in the accumulation dtype, dropped: float32 scalar, the fraction of the B*T*k slots
      dropped for capacity; 0 when drop-free).

    Shapes (per device: n = B*T / shards tokens, S = n k slots, P devices on `expert`, C capacity):
      1. slots = SlotOrder(idx);  x_sm, weights_s = slots.sort(x), slots.weights(weights)   [S, M], [S]
      2. counts_pe = all_gather(bincount(idx)); kept_dse = _kept_counts(counts_pe)          [P, P, E_l]
      3. recv_cm = ragged_exchange(x_sm)                                                     [C, M]
         local_c = each row's local expert (E_l past the received rows)                      [C]
         recv_c = ragged_exchange(weights_s)                                                 [C]
      4. y_cm = experts(recv, local_c, recv_c); back_sm = ragged_exchange⁻¹(y_cm)             [S, M]
      5. y_nm = slots.gather_sum(back_sm) (float32); psum over `tensor`                       [n, M]
    """
    mesh = exchange.mesh
    b, t, m = x_btm.shape
    k, num_experts, mlp = idx_btk.shape[-1], w1_emf.shape[0], w1_emf.shape[-1]
    devices, shards = expert_axis_size(mesh), token_shards(mesh)
    if num_experts % devices or (b * t) % shards:
        raise ValueError(f"expert parallelism needs E={num_experts} divisible by expert={devices} and "
                         f"B*T={b * t} tokens divisible by the {shards} token shards")
    tokens = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    mlp_axis = MLP_AXIS if MLP_AXIS in mesh.axis_names and mlp % mesh.shape[MLP_AXIS] == 0 else None
    local_experts, n = num_experts // devices, b * t // shards
    slots_n = n * k
    cap = (local_experts * expert_capacity(n, k, num_experts, devices, exchange.capacity_factor) if exchange.per_expert
           else capacity(n, k, num_experts, devices, exchange.capacity_factor))

    # the experts' axes, outer-major as the experts are laid out (one name where one axis splits them)
    split = expert_axes(mesh)
    ep = split[0] if len(split) == 1 else split

    def per_device(x_nm, idx_nk, weights_nk, w1, w2, w3):
        me = jax.lax.axis_index(ep)
        slots = SlotOrder(idx_nk, num_experts)
        counts_pe = checkpoint_name(jax.lax.all_gather(slots.group_sizes, ep), "moe_routing")  # [P_src, E]
        kept_dse = _kept_counts(counts_pe, devices, local_experts, cap, exchange.per_expert)
        if exchange.per_expert:  # each destination's kept slots first: the prefix of its block that is sent
            slots = slots.permuted(kept_first(slots.group_sizes, kept_dse[:, me], local_experts, slots_n))
        x_sm, weights_s = slots.sort(x_nm), slots.weights(weights_nk)
        sent_ds = jnp.sum(kept_dse, axis=-1)                                              # [dst, src]
        at_ds = _exclusive_cumsum(sent_ds)                                                # row of src's block at dst
        block_sd = _exclusive_cumsum(jnp.sum(counts_pe.reshape(devices, devices, local_experts), axis=-1))
        # out: my blocks to each destination; back: each source's rows here returned to it
        out = (block_sd[me], sent_ds[:, me], at_ds[:, me], sent_ds[me])
        back = (at_ds[me], sent_ds[me], block_sd[:, me], sent_ds[:, me])
        block = min(slots_n, cap)

        def send(a, rows, offsets):
            return ragged_exchange(a, jnp.zeros((rows, *a.shape[1:]), a.dtype), *offsets,
                                   emulated=exchange.emulated, block=block, axis_name=ep)

        recv_cm, recv_c = send(x_sm, cap, out), send(weights_s, cap, out)
        ends = jnp.cumsum(kept_dse[me].reshape(-1))                                       # [src * E_l]
        # one fused compare of every row with the P E_l ends: the default binary search gathers the C rows
        # once per halving, which a TPU moves one row at a time
        row_e = jnp.searchsorted(ends, jnp.arange(cap, dtype=ends.dtype), side="right", method="compare_all")
        local_c = checkpoint_name(jnp.where(row_e < devices * local_experts, row_e % local_experts, local_experts),
                                  "moe_routing")
        y_cm = experts(recv_cm[None], local_c[None, :, None].astype(jnp.int32), recv_c[None, :, None], w1, w2, w3)[0]
        back_sm = send(y_cm.astype(x_nm.dtype), slots_n, back)
        y_nm = slots.gather_sum(back_sm)
        if mlp_axis is not None:
            y_nm = jax.lax.psum(y_nm, mlp_axis)
        dropped = jax.lax.psum(slots_n - jnp.sum(sent_ds[:, me]), tokens)
        return y_nm, dropped.astype(jnp.float32) / (b * t * k)

    # check_vma off: a Pallas kernel's output type says nothing of how it varies over the mesh's axes
    run = jax.shard_map(
        per_device, mesh=mesh, out_specs=(P(tokens, None), P()), check_vma=False,
        in_specs=(P(tokens, None), P(tokens, None), P(tokens, None), P(ep, None, mlp_axis),
                  P(ep, mlp_axis, None), P(ep, None, mlp_axis)))
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
    tokens = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
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
