"""Frozen weights held in the released FP8 / FP4 format (DESIGN.md, "Frozen weights may stay in their
released format"; config `frozen_weights: released`).

`hold_released(model, trainable)` replaces every frozen parameter that the official checkpoint
quantises (RELEASED) by a `HeldWeight`: the official [out, in] codes and e8m0 scales
(core/ops/quant.py) as two `Released` variables, which are not `nnx.Param`s, so the train step's
gradient filter and the optimizer (`wrt=nnx.Param`) never see them. `HeldWeight[...]` dequantises
to float32 in dsv4's parameter layout, so the layers' reads `w[...]` are unchanged and the
dequantisation runs inside the layer body, under its remat, just before use. Float32
dequantisation is exact: a model holding them equals, bitwise, its `dequantize_held` copy.

Held:   attn.{wq_a, wq_b, wkv, wo_a, wo_b}, attn.indexer.wq_b, ffn.shared_experts.{w1, w2, w3} as FP8
        e4m3 with 128 x 128 block scales; ffn.experts.{w1, w2, w3} as FP4 e2m1 (two per int8) with
        per-32 scales.
Kept as parameters (in frozen_weight_dtype): what the release stores unquantised: embed, head, norms, the router
weight, the compressors' wkv / wgate / ape, the indexer's weights_proj, mHC fn / base / scale,
attention sinks (BF16 or F32 there), plus the router biases and hash tables (not parameters).
Paths: `<param path>/codes` and `<param path>/scales`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from core import tree
from core.errors import ConfigError
from core.ops.quant import (FP4_BLOCK, dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8, to_official,
                            to_ours)

FROZEN_WEIGHTS = ("param_dtype", "released")  # config `frozen_weights`
# parameter path suffix -> (format, axes of one matrix in dsv4's layout [(G,) I, *out])
RELEASED = {
    "attn/wq_a": ("fp8", 2), "attn/wq_b": ("fp8", 3), "attn/wkv": ("fp8", 2), "attn/wo_a": ("fp8", 3),
    "attn/wo_b": ("fp8", 2), "attn/indexer/wq_b": ("fp8", 3),
    "ffn/shared_experts/w1": ("fp8", 2), "ffn/shared_experts/w2": ("fp8", 2), "ffn/shared_experts/w3": ("fp8", 2),
    "ffn/experts/w1": ("fp4", 2), "ffn/experts/w2": ("fp4", 2), "ffn/experts/w3": ("fp4", 2),
}
GROUPED = ("attn/wo_a",)  # [G, I, out]: G output groups, official rows g * out : (g + 1) * out


class Released(nnx.Variable):
    """Codes or scales of a frozen weight in the released format: state, never a parameter."""


def released_format(path: str) -> tuple[str, int, bool] | None:
    """(format, matrix ndim, grouped) of the RELEASED entry a '/'-joined parameter path ends with, or None."""
    for suffix, (fmt, ndim) in RELEASED.items():
        if path.endswith("/" + suffix):
            return fmt, ndim, suffix in GROUPED
    return None


class HeldWeight(nnx.Module):
    """One frozen weight as official codes [*stack, O, I (/2 for FP4)] + e8m0 scales; `[...]` dequantises.

    Static: fmt ("fp8" | "fp4"), groups (G of attn.wo_a, else 1), out (the output axes of dsv4's
    layout), param_axes (the parameter's logical axes, for `dequantize_held`).
    """

    def __init__(self, codes, scales, *, fmt: str, groups: int, out: tuple[int, ...], axes: tuple):
        self.fmt, self.groups, self.out, self.param_axes = fmt, int(groups), tuple(out), tuple(axes)
        stack = len(codes.shape) - 2
        official = (*axes[:stack], _official_out_axis(axes, stack, groups), _official_in_axis(axes, stack, groups))
        self.codes = Released(codes, out_sharding=official, eager_sharding=False)
        self.scales = Released(scales, out_sharding=official, eager_sharding=False)

    def dequantize(self, dtype=jnp.float32):
        """The weight in dsv4's layout [*stack, (G,) I, *out], in `dtype` (exact in float32)."""
        deq = dequantize_fp8 if self.fmt == "fp8" else dequantize_fp4
        w = to_ours(deq(self.codes[...], self.scales[...]), groups=self.groups, out=self.out).astype(dtype)
        # A whole buffer, as a float parameter is: fused into its consumer, the dequantisation changes the
        # consumer's kernel (XLA:CPU's dot emitter, its reduction order), and so the last bits of the result.
        return jax.lax.optimization_barrier(w)

    def __getitem__(self, index):
        return self.dequantize()[index]


def _official_out_axis(axes, stack: int, groups: int):
    return axes[stack] if groups > 1 else axes[stack + 1]


def _official_in_axis(axes, stack: int, groups: int):
    return axes[stack + (1 if groups > 1 else 0)]


@functools.partial(jax.jit, static_argnames=("fmt", "stack", "groups"))
def _encode(value, *, fmt: str, stack: int, groups: int):
    # one small program per distinct shape: op-by-op, quantising a model's weights dispatches thousands of ops
    official = to_official(value, stack=stack, groups=groups)
    return (quantize_fp8 if fmt == "fp8" else quantize_fp4)(official)


def hold(param: nnx.Param, fmt: str, ndim: int, grouped: bool) -> HeldWeight:
    """A parameter [*stack, (G,) I, *out] quantised into a HeldWeight (FP8 or FP4 as `fmt`)."""
    value = param[...]
    stack = value.ndim - ndim
    groups = value.shape[stack] if grouped else 1
    out = value.shape[stack + (2 if grouped else 1):]
    codes, scales = _encode(value, fmt=fmt, stack=stack, groups=groups)
    axes = tuple(param.get_metadata().get("out_sharding") or (None,) * value.ndim)
    return HeldWeight(codes, scales, fmt=fmt, groups=groups, out=out, axes=axes)


def holds_released(frozen_weights: str) -> bool:
    """Whether config `frozen_weights` holds frozen weights released; ConfigError for an unknown value."""
    if frozen_weights not in FROZEN_WEIGHTS:
        raise ConfigError(f"frozen_weights={frozen_weights!r} is unknown: use one of {', '.join(FROZEN_WEIGHTS)}.")
    return frozen_weights == "released"


def hold_released(model: nnx.Module, trainable: Callable[[str], bool]) -> list[str]:
    """Replace every frozen RELEASED parameter of `model` by its HeldWeight, in place.

    Args:
      model: the decoder (concrete, or inside `nnx.eval_shape` / a jit).
      trainable: '/'-joined parameter path -> trained? (core.model.params.mask_matcher of the
        config's masks); trained parameters stay nnx.Params in weight_dtype.
    Returns:
      the replaced parameter paths.
    Raises:
      ConfigError: a routed expert whose input width is not a multiple of 32 (FP4's block).
    """
    found = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or isinstance(node, HeldWeight):
            continue
        for name, value in vars(node).items():
            full = tree.join((*path, name))
            fmt = released_format(full) if isinstance(value, nnx.Param) else None
            if fmt is not None and not trainable(full):
                found.append((node, name, full, fmt))
    for node, name, full, (fmt, ndim, grouped) in found:
        param = getattr(node, name)
        width = param.shape[param.ndim - ndim]
        if fmt == "fp4" and width % FP4_BLOCK:
            raise ConfigError(f"frozen_weights=released holds {full} in FP4, whose input width {width} must be a "
                              f"multiple of {FP4_BLOCK}: use frozen_weights=param_dtype for this model.")
        setattr(node, name, hold(param, fmt, ndim, grouped))
    return [full for _, _, full, _ in found]


def dequantize_held(model: nnx.Module, dtype=jnp.float32) -> list[str]:
    """Replace every HeldWeight of `model` by an nnx.Param of its dequantised value in `dtype`, in place.

    Returns: the '/'-joined parameter paths replaced.
    """
    found = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            found += [(node, name, tree.join((*path, name))) for name, v in vars(node).items()
                      if isinstance(v, HeldWeight)]
    for node, name, _ in found:
        held = getattr(node, name)
        setattr(node, name, nnx.Param(held.dequantize(dtype), out_sharding=held.param_axes, eager_sharding=False))
    return [full for _, _, full in found]


# ----------------------------------------------------------------------------- checkpoints held otherwise


def _slot(tree_: dict, path: str):
    """(the dict holding `path`'s last entry, its key) in a nested dict whose keys may be ints."""
    node, parts = tree_, path.split("/")
    for part in parts[:-1]:
        node = node[next(k for k in node if str(k) == part)]
    return node, next(k for k in node if str(k) == parts[-1])


def restore_target(target: dict, saved: dict, trainable: Callable[[str], bool], stage: str):
    """Bridge a checkpoint whose RELEASED weights are held otherwise than the model holds them.

    A weight the checkpoint holds released (`P/codes`, `P/scales`) and the model as a parameter `P`
    is dequantised (exact); a parameter `P` of the checkpoint that the model holds released is
    quantised (a float run into the released format: lossy, for planning and tests).

    Args:
      target: the model's abstract state as a nested pure dict (`restore_model_state`'s target).
      saved: the checkpoint's {'/'-joined path: (shape, dtype)} (core.checkpoint.store.read_tree).
      trainable: '/'-joined parameter path -> trained by this run?
      stage: the command, for the error ("warmup", "sparse", ...).
    Returns:
      (read, convert): `read` is `target` with each bridged weight shaped as the checkpoint holds it;
      `convert(values)` turns the values restored into `read` into values shaped like `target`.
    Raises:
      ConfigError: the run trains a weight that the checkpoint holds released.
    """
    import copy

    import jax

    flat = tree.flatten(target)
    read, moves = copy.deepcopy(target), []
    for path in sorted({p.rsplit("/", 1)[0] for p in saved if p.endswith(("/codes", "/scales"))}):
        if path in flat and f"{path}/codes" in saved:
            if trainable(path):
                raise ConfigError(f"dsv4 {stage} trains {path}, which the checkpoint holds in the released FP8/FP4 "
                                  "format: re-import it without --keep-quantized, or freeze it "
                                  "(frozen_parameters_mask).")
            parent, key = _slot(read, path)
            parent[key] = {name: jax.ShapeDtypeStruct(*saved[f"{path}/{name}"]) for name in ("codes", "scales")}
            moves.append((path, "dequantize", flat[path]))
    for path, leaf in flat.items():
        base = path.rsplit("/", 1)[0]
        if path.endswith("/codes") and base in saved and path not in saved:
            parent, key = _slot(read, base)
            parent[key] = jax.ShapeDtypeStruct(*saved[base])
            moves.append((base, "quantize", (flat[path], flat[f"{base}/scales"])))

    def convert(values: dict) -> dict:
        for path, how, want in moves:
            parent, key = _slot(values, path)
            fmt, ndim, grouped = released_format(path)
            if how == "dequantize":
                stack = len(want.shape) - ndim
                groups = want.shape[stack] if grouped else 1
                deq = dequantize_fp8 if fmt == "fp8" else dequantize_fp4
                value = to_ours(deq(jnp.asarray(parent[key]["codes"]), jnp.asarray(parent[key]["scales"])),
                                groups=groups, out=want.shape[stack + (2 if grouped else 1):]).astype(want.dtype)
                parent[key] = _placed(value, want)
            else:
                value = jnp.asarray(parent[key])
                stack = value.ndim - ndim
                codes, scales = _encode(value, fmt=fmt, stack=stack, groups=value.shape[stack] if grouped else 1)
                parent[key] = {"codes": _placed(codes, want[0]), "scales": _placed(scales, want[1])}
        return values

    return read, convert


def _placed(value, want):
    """`value` on `want`'s sharding (an abstract leaf with or without one)."""
    import jax

    sharding = getattr(want, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else value
