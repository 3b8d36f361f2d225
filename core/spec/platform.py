"""Per-platform choices: the keys whose value `auto` is decided by the platform a step runs on.

A config is read before JAX knows its devices, so a key that is fastest one way on a CPU and
another on a TPU says `auto` (-1 for an integer key), and `resolve_config(cfg, platform, mesh_axes)`
turns every `auto` into the platform's choice once the mesh is known. `core.spec.resolve.resolve`
calls it where a run, the planner, a benchmark or the evaluation starts, and builds the specs the
model takes from its result: no `auto` reaches the model (its specs refuse one). An explicit value
always wins. Why each choice: docs/benchmarks.md#why-the-defaults.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from core.config.stages import stage_of
from core.ops.placement import platform_name

AUTO = "auto"      # the value of an `auto` string key
AUTO_INT = -1      # the value of an `auto` integer key (as xla_backend_optimization_level's -1)
PLATFORMS = ("cpu", "gpu", "tpu")


# The TPU's choices come from a v5e chip's profile and runs; a GPU keeps the CPU's until one is measured,
# or where `dsv4 plan`'s estimate for an H200 target chose (uncalibrated GPU constants).


def _topk_attention(cfg, platform: str, axes) -> str:
    """CSA's top-k as a mask over every compressed key on a TPU or a GPU while the W = T/4 blocks are at
    most twice the k selected ones (its dense matmuls beat gathering each query's k keys and scattering
    their gradient back, which are memory-bound on both); gathered keys beyond, and on a CPU."""
    if platform == "cpu" or cfg.max_target_length // 4 > 2 * cfg.indexer_topk:
        return "gather"
    return "mask"


def _moe_impl(cfg, platform: str, axes) -> str:
    """A grouped matmul on a TPU: the megablox kernels with tiles per pass (`gmm`; `lax.ragged_dot`
    tiles the forward only), on each device's own tokens where the experts are whole on every device,
    and on each device's local experts under expert parallelism (the tokens sent to them); tiles of
    plain einsums elsewhere (XLA:CPU lowers ragged_dot densely), and on a TPU whose experts are split
    over fsdp or tensor but not over expert: a Mosaic kernel (which XLA cannot partition) would need
    each layer's experts gathered whole on every device (V4-Flash's sparse stage on v5p-128 then
    exceeds the chip). On a GPU under expert parallelism with a capacity factor, batched matmuls over each
    local expert's capacity of rows (`batched`, core/ops/batched_experts.py: cuBLAS's batched GEMM, no
    per-tile weight gather or float32 accumulator carried through a loop); the tiled einsums elsewhere on
    a GPU (drop-free, `batched` would pad every expert to the worst case): XLA:GPU expands `lax.ragged_dot`
    into one dense matmul over every group (each row times all G local experts' weights: G times the
    FLOPs, the rows copied G times; docs/scaling.md#expert-parallelism)."""
    if platform == "gpu" and cfg.moe_capacity_factor > 0 and _split(cfg, axes, ("expert_outer", "expert")) > 1:
        return "batched"
    if platform != "tpu":
        return "tiled"
    whole = _split(cfg, axes, ("expert", "fsdp", "tensor")) == 1
    return "gmm" if whole or _split(cfg, axes, ("expert_outer", "expert")) > 1 else "tiled"


def _split(cfg, axes, names) -> int:
    """How many ways the mesh splits over `names`: from its shape when known, else from the config's
    ici_/dcn_ keys, where a -1 (fill with the remaining devices) counts as a split."""
    if axes is not None:
        return math.prod(axes.get(name, 1) for name in names)
    sizes = [getattr(cfg, f"{level}_{name}_parallelism") for level in ("ici", "dcn") for name in names]
    return 2 if any(n != 1 for n in sizes) else 1


# W_qb's float32 weight gradient above this many bytes does not stay on a TPU core across the chunks
# (XLA:TPU's default scoped VMEM): each chunk then adds it to its accumulator through HBM
_ACCUMULATOR_ON_CHIP_BYTES = 16 * 2**20


def _attention_projections(cfg, platform: str, axes) -> str:
    """The attention's query and output projections once over the whole sequence on a TPU where they
    train and W_qb's float32 gradient exceeds the on-chip scratch: one matmul per weight gradient,
    where per chunk each would read and write its float32 accumulator in HBM. On a GPU wherever they
    are that large, the warm-up too: with the weights sharded, XLA:GPU gathers them again for every
    query chunk (docs/scaling.md#expert-parallelism). Per chunk elsewhere, in a TPU's warm-up (where
    they only run forward) and for small projections (deepseek4-tiny's)."""
    large = 4 * cfg.q_lora_rank * cfg.num_heads * cfg.head_dim > _ACCUMULATOR_ON_CHIP_BYTES
    trains = platform == "tpu" and stage_of(cfg).trains_rest
    return "whole" if large and (trains or platform == "gpu") else "chunked"


# query rows per chunk of a GPU's training step (docs/benchmarks.md#why-the-defaults)
_GPU_TRAIN_CHUNK = 512


def _attention_chunk(cfg, platform: str, axes) -> int:
    """128 query rows per chunk, and 512 on a TPU where the attention's projections train per chunk:
    each chunk adds their weight gradients into float32 accumulators, whose traffic fewer chunks
    divide. With the projections whole, 128 measured fastest on the chip, as in the warm-up. On a GPU
    where the step trains the attention, _GPU_TRAIN_CHUNK: each chunk's many small kernels (the
    indexer's top-k, the masks, the softmax pieces) are fewer launches and passes over fewer chunks."""
    if platform == "gpu" and stage_of(cfg).trains_rest:
        return _GPU_TRAIN_CHUNK
    projections = cfg.attention_projections
    if projections == AUTO:
        projections = _attention_projections(cfg, platform, axes)
    per_chunk = platform == "tpu" and stage_of(cfg).trains_rest and projections == "chunked"
    return 512 if per_chunk else 128


def _attention(cfg, platform: str, axes) -> str:
    """The fused Pallas kernels (core/ops/fused_attention.py) on a TPU where the step trains the
    attention, their shapes fit them (head_dim a multiple of 128 and 16 heads per device) and CSA's
    top-k runs as a mask (the kernels attend to every compressed entry): their backward is where
    they gain: in the warm-up, which runs the attention forward only, the chunked path measured
    faster. Chunked elsewhere."""
    if platform != "tpu" or not stage_of(cfg).trains_rest or _topk_attention(cfg, platform, axes) != "mask":
        return "chunked"
    heads = cfg.num_heads
    if axes is not None:
        split = axes.get("tensor", 1)
        heads //= split if heads % split == 0 else 1
    elif _split(cfg, axes, ("tensor",)) != 1:
        return "chunked"  # the heads per device are not known before the mesh
    return "fused" if cfg.head_dim % 128 == 0 and heads % 16 == 0 else "chunked"


# key -> (its auto value, platform -> choice, or a function (cfg, platform, mesh axes or None) -> choice)
PLATFORM_CHOICES: dict[str, tuple[Any, Any]] = {
    "moe_impl": (AUTO, _moe_impl),
    "attention": (AUTO, _attention),
    "csa_topk_attention": (AUTO, _topk_attention),
    "attention_query_chunk_size": (AUTO_INT, _attention_chunk),
    "attention_projections": (AUTO, _attention_projections),
    # the mHC mixes' input gradient in closed form on a TPU and a GPU (no depth-J matmul and relayout
    # there); the transposed einsum on a CPU, the faster there
    "hc_mixes_backward": (AUTO, {"cpu": "autodiff", "gpu": "closed", "tpu": "closed"}),
    # 2048 on a TPU and a GPU: the head's float32 weight gradient is accumulated, and under a mesh summed
    # over the devices, once per chunk (docs/benchmarks.md#why-the-defaults)
    "lm_loss_chunk_size": (AUTO_INT, {"cpu": 256, "gpu": 2048, "tpu": 2048}),
    # `full` here; an entry point that compiles the step (the run's preflight, the planner, the
    # benchmarks) takes `none`, `projections` or `experts` instead on a TPU (`none` or `experts` on a
    # GPU) where that step compiles within the device (core/train/remat.py `remat_that_fits`)
    "remat_policy": (AUTO, {"cpu": "full", "gpu": "full", "tpu": "full"}),
}


def resolve_config(cfg, platform: str, mesh_axes: Mapping[str, int] | None = None):
    """`cfg` with every `auto` key set to `platform`'s choice (the same Config when none is `auto`).

    Args:
      cfg: a Config (core.config.schema).
      platform: the platform of the mesh the step runs on (`core.parallel.mesh.mesh_platform`),
        or of the planner's target.
      mesh_axes: that mesh's axis sizes (`mesh.shape`); without them, a choice that depends on how the
        weights are split reads the config's ici_/dcn_ keys, a fill (-1) counting as a split.
    """
    platform = platform_name(platform)
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}: one of {', '.join(PLATFORMS)}")
    changes = {key: choice(cfg, platform, mesh_axes) if callable(choice) else choice[platform]
               for key, (auto, choice) in PLATFORM_CHOICES.items() if getattr(cfg, key) == auto}
    # every choice is a valid value of its key (tests/spec/test_platform.py validates them all)
    return dataclasses.replace(cfg, **changes) if changes else cfg
