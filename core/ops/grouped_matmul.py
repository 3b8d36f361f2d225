"""Grouped matmuls for the MoE experts: slots sorted by expert, one matmul per expert's rows.

Two ways to run `out[rows of group g] = lhs[rows of group g] @ rhs[g]`:

- `ragged_dot`: `lax.ragged_dot` (XLA's own grouped matmul and its transposes), its backward in the
  inputs' dtype;
- `gmm`: the Pallas megablox kernels that JAX ships (`jax.experimental.pallas.ops.tpu.megablox`:
  `gmm` for the forward and the input gradient, `tgmm` for the weight gradient) under a custom VJP
  that gives each of the three passes its own tiles (`GmmTiling`), as MaxText tunes them. On a
  machine without a TPU the kernels run in Pallas' interpret mode (`interpret=True`): the tests'
  way to check them against `ragged_dot` on the CPU.

The slots reach the matmul through `SlotOrder.sort` and leave it through `SlotOrder.gather_sum`
(`copy_rows`, `sum_rows`, each the other's transpose; `permute_rows` for per-slot values): gathers
whose gradients are gathers too, never the scatter-add that autodiff of a gather gives. Each sums a
token's k slots from a gather into [k, N, M] (`_sum_slots`), slot-major, so the sum adds whole
slices; gathered token-major, [N, k, M] puts k (not a multiple of a TPU tile's 8 rows) on the
tiled axis and costs a relayout of every slot before the sum
(docs/tpu.md#where-the-sparse-steps-time-goes). A token's k slots are its k copies, so no slot is
ever dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


@dataclasses.dataclass(frozen=True)
class GmmTiling:
    """(rows, contracted, output columns) tiles of each pass of `gmm`.

    fwd:  out [S, N] = lhs [S, K] @ rhs[g] [K, N]
    dlhs: dlhs [S, K] = dout [S, N] @ rhs[g]^T      (tiles of S, N, K)
    drhs: drhs[g] [K, N] = lhs_g^T @ dout_g          (tiles of S, K, N: `tgmm`)
    """

    fwd: tuple[int, int, int] = (512, 1024, 1024)
    dlhs: tuple[int, int, int] = (512, 1024, 1024)
    drhs: tuple[int, int, int] = (512, 1024, 1024)


def _fit(tile: tuple[int, int, int], m: int, k: int, n: int) -> tuple[int, int, int]:
    """A tile no larger than its dimension (the kernel reads whole tiles; rows are padded to tm)."""
    return (min(tile[0], _ceil_to(m, 8)), min(tile[1], k), min(tile[2], n))


def _ceil_to(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _megablox():
    import importlib

    # the module, not the package's custom-VJP `gmm` of the same name
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _padded(x, rows: int):
    return x if x.shape[0] == rows else jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _gmm_call(lhs, rhs, group_sizes, tile, out_dtype, interpret, transpose_rhs=False):
    """megablox gmm with S padded to a multiple of the row tile; rows outside every group are 0."""
    m = lhs.shape[0]
    k, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    tm, tk, tn = _fit(tile, m, k, n)
    rows = _ceil_to(m, tm)
    out = _megablox().gmm(_padded(lhs, rows), rhs, group_sizes, out_dtype, (tm, tk, tn),
                          transpose_rhs=transpose_rhs, interpret=interpret)[:m]
    # rows past sum(group_sizes) are never written by the kernel
    live = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def gmm(lhs_sk, rhs_gkn, group_sizes_g, tiling: GmmTiling, out_dtype, interpret: bool):
    """out [S, N]: rows of group g (consecutive, in order of g) times rhs[g], by the megablox kernels.

    Args:
      lhs_sk: [S, K] rows sorted by group; rows past sum(group_sizes) give 0.
      rhs_gkn: [G, K, N].
      group_sizes_g: int32 [G].
      tiling: the tiles of the three passes (`GmmTiling`).
      out_dtype: the output's dtype (the kernel accumulates in float32).
      interpret: run the kernels in Pallas' interpret mode (any backend).
    """
    return _gmm_call(lhs_sk, rhs_gkn, group_sizes_g, tiling.fwd, out_dtype, interpret)


def _gmm_fwd(lhs_sk, rhs_gkn, group_sizes_g, tiling, out_dtype, interpret):
    return gmm(lhs_sk, rhs_gkn, group_sizes_g, tiling, out_dtype, interpret), (lhs_sk, rhs_gkn, group_sizes_g)


def _gmm_bwd(tiling, out_dtype, interpret, residual, dout_sn):
    lhs_sk, rhs_gkn, group_sizes_g = residual
    dout_sn = dout_sn.astype(lhs_sk.dtype)
    dlhs = _gmm_call(dout_sn, rhs_gkn, group_sizes_g, tiling.dlhs, lhs_sk.dtype, interpret, transpose_rhs=True)
    m, k = lhs_sk.shape
    n = dout_sn.shape[1]
    tm, tk, tn = _fit(tiling.drhs, m, k, n)
    rows = _ceil_to(m, tm)
    drhs = _megablox().tgmm(_padded(lhs_sk, rows).swapaxes(0, 1), _padded(dout_sn, rows), group_sizes_g,
                            rhs_gkn.dtype, (tm, tk, tn), interpret=interpret)
    return dlhs, drhs, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_dot(lhs_sk, rhs_gkn, group_sizes_g, out_dtype):
    """`lax.ragged_dot` into `out_dtype` whose backward runs in the inputs' dtype.

    Autodiff of a bf16 ragged_dot with a float32 output would multiply the float32 cotangent by the
    bf16 weights in float32 (both gradients' matmuls at float32 speed); here the cotangent is cast to
    the inputs' dtype first, as `gmm`'s backward does, and XLA's own transposes run.
    """
    return jax.lax.ragged_dot(lhs_sk, rhs_gkn, group_sizes_g, preferred_element_type=out_dtype)


def _ragged_fwd(lhs_sk, rhs_gkn, group_sizes_g, out_dtype):
    return ragged_dot(lhs_sk, rhs_gkn, group_sizes_g, out_dtype), (lhs_sk, rhs_gkn, group_sizes_g)


def _ragged_bwd(out_dtype, residual, dout_sn):
    lhs_sk, rhs_gkn, group_sizes_g = residual
    dout_sn = dout_sn.astype(lhs_sk.dtype)
    dot = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes_g, preferred_element_type=lhs_sk.dtype)
    # each operand's transpose alone (no forward product is traced again)
    (dlhs,) = jax.linear_transpose(lambda a: dot(a, rhs_gkn), lhs_sk)(dout_sn)
    (drhs,) = jax.linear_transpose(lambda b: dot(lhs_sk, b), rhs_gkn)(dout_sn)
    return dlhs, drhs, None


ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)


# ----------------------------------------------------------------------------- slots


@jax.custom_vjp
def permute_rows(x_s_, order_s, inverse_s):
    """x[order]: a permutation of rows whose gradient is the inverse permutation (a gather, not a scatter)."""
    return x_s_[order_s]


def _permute_fwd(x_s_, order_s, inverse_s):
    return x_s_[order_s], (order_s, inverse_s)


def _permute_bwd(residual, d_s_):
    order_s, inverse_s = residual
    return d_s_[inverse_s], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def copy_rows(x_n_, token_s, inverse_s, k: int):
    """x[token]: each of N rows copied to its k slots (token = the slot's row, every row k times, in the
    permuted order whose inverse is `inverse`); the gradient gathers the slots back and sums each
    row's k, so neither pass materialises the k copies in slot order or scatters."""
    return x_n_[token_s]


def _copy_fwd(x_n_, token_s, inverse_s, k):
    return x_n_[token_s], inverse_s


def _copy_bwd(k, inverse_s, d_s_):
    return _sum_slots(d_s_, inverse_s, k).astype(d_s_.dtype), None, None


copy_rows.defvjp(_copy_fwd, _copy_bwd)


class SlotOrder:
    """The S = N*k (token, expert) slots in order of expert: the permutation and the group sizes.

    Built from idx [N, k] (stable: slots of one expert stay in token order); ids >= num_groups
    (empty slots) sort last and belong to no group.
    """

    def __init__(self, idx_nk, num_groups: int):
        flat = idx_nk.reshape(-1).astype(jnp.int32)
        self.k = idx_nk.shape[-1]
        order = jnp.argsort(flat, stable=True)                        # sorted position -> slot
        # named as the routing is (core.model.transformer's SAVED_NAMES): no remat policy sorts again
        self.order, self.inverse, self.group_sizes = (checkpoint_name(a, "moe_routing") for a in (
            order, jnp.argsort(order), jnp.bincount(flat, length=num_groups).astype(jnp.int32)))

    def permuted(self, position_p):
        """The same slots in another order: the slot at sorted position p moves to `position_p[p]` (a
        permutation of [0, S)); the group sizes stay."""
        moved = copy.copy(self)
        moved.order, moved.inverse = (checkpoint_name(a, "moe_routing") for a in (
            self.order[jnp.argsort(position_p)], position_p[self.inverse]))
        return moved

    def sort(self, x_nm):
        """[N, M] tokens -> [S, M] their slots' copies in expert order."""
        return copy_rows(x_nm, self.order // self.k, self.inverse, self.k)

    def weights(self, w_nk):
        """[N, k] per-slot values -> [S] in expert order."""
        return permute_rows(w_nk.reshape(-1), self.order, self.inverse)

    def gather_sum(self, y_sm):
        """[S, M] in expert order -> [N, M]: each token's k slots summed (in at least float32); the
        transpose of `sort`, so its gradient is `sort`'s gather and neither pass scatters."""
        return sum_rows(y_sm, self.order // self.k, self.inverse, self.k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sum_rows(y_s_, token_s, inverse_s, k: int):
    """sum over each row's k slots of y (slot s belongs to row token[s]; `inverse` takes slot order to
    the permuted one): `copy_rows`' transpose, its gradient `copy_rows`' gather."""
    return _sum_slots(y_s_, inverse_s, k)


def _sum_slots(y_s_, inverse_s, k: int):
    """sum_j y[inverse[n * k + j]] in at least float32: gathered as [k, N, ...] (slot j of every row
    together), then added slot by slot, one elementwise pass over the gathered rows; gathering
    [N, k, ...] lays k (not a multiple of the TPU's 8-row tile) across tiles and costs a relayout, and
    a float32 `sum` over the k axis made XLA:TPU write the gathered rows once more in float32."""
    y_kn_ = y_s_[inverse_s.reshape(-1, k).T]
    acc = jnp.promote_types(y_s_.dtype, jnp.float32)
    return functools.reduce(lambda total, j: total + y_kn_[j].astype(acc), range(1, k), y_kn_[0].astype(acc))


def _sum_fwd(y_s_, token_s, inverse_s, k):
    return sum_rows(y_s_, token_s, inverse_s, k), (token_s, jnp.zeros((0,), y_s_.dtype))  # the dtype alone


def _sum_bwd(k, residual, d_n_):
    token_s, like = residual
    return d_n_.astype(like.dtype)[token_s], None, None


sum_rows.defvjp(_sum_fwd, _sum_bwd)
