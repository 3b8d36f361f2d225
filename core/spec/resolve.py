"""`resolve(cfg, platform, mesh)`: a config's `auto` keys decided for a platform, and the frozen specs
the model and the step are built from (DESIGN.md, "The model"; the stage table).

  Resolved, the `Specs` (platform, model, step) and the config they came from:
    cfg       the Config with every `auto` key set (core/spec/platform.py): what config.yml records
    platform  "cpu" | "gpu" | "tpu"
    model     ModelSpec: widths, dtypes, masks, the stage row, and per layer a BlockSpec:
                attn  AttentionSpec: what the layer is (its RoPE frequencies; the indexer's IndexerSpec
                      derives from it), and how it runs: AttentionImpl
                moe   MoESpec
                the layer's mHC settings
    step      StepSpec: the stage row, the LM loss's chunk, the OptimizerSpec, the guard's flags, the
              batch's shape and the compile options

Called where a run (core/train/preflight.py), the planner, a benchmark or the evaluation starts,
once the mesh is known; everything below takes the specs. The batches' source is a `DataSpec` of its
own (`data_spec`), no part of the step's program: core/data reads it, never the Config. The specs refuse an `auto` (an unresolved
key fails where its spec is made, naming it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from core.config.stages import Stage, stage_of
from core.model.attention import AttentionImpl, AttentionSpec
from core.model.layers import rope_frequencies
from core.model.moe import MoESpec
from core.model.block import BlockSpec
from core.model.transformer import ModelSpec
from core.ops.placement import platform_name
from core.spec.platform import resolve_config


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The step's optimizer (core/train/optimizer.py): AdamW, its learning-rate schedule and the
    trainable mask, each the config key named beside it."""

    clip: float                # gradient_clipping_threshold: the global norm gradients are clipped to; <= 0 off
    b1: float                  # adam_b1
    b2: float                  # adam_b2
    eps: float                 # adam_eps
    weight_decay: float        # adam_weight_decay (decoupled)
    mu_dtype: str              # mu_dtype: the first moment's storage dtype
    nu_dtype: str              # nu_dtype: the second moment's storage dtype
    learning_rate: float       # the schedule's peak
    final_fraction: float      # cosine_learning_rate_final_fraction
    warmup_fraction: float     # warmup_steps_fraction
    schedule_steps: int        # `schedule_steps`: the schedule's length
    trainable: tuple[str, ...]  # trainable_parameters_mask
    frozen: tuple[str, ...]     # frozen_parameters_mask


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the training step reads besides the model: the stage row (whether the head and the LM
    loss run), the LM loss's tokens per chunk, the optimizer, the router biases' rate, the guard's
    flags, its batch and its compile options. Equal specs (with the model's) are one program."""

    stage: Stage
    lm_loss_chunk: int
    optimizer: OptimizerSpec
    bias_update_rate: float    # routed_bias_update_rate
    abort_on_nan: bool         # abort_on_nan_loss
    abort_on_inf: bool         # abort_on_inf_loss
    rows: int                  # per_device_batch_size
    length: int                # max_target_length
    opt_level: int             # xla_backend_optimization_level (core/train/program.py `step_compiler_options`)


@dataclasses.dataclass(frozen=True)
class Specs:
    """What the model and the training step are built from on one platform, and nothing else: the
    step program's input besides its graphdef, shardings and mesh (core/train/program.py)."""

    platform: str         # "cpu" | "gpu" | "tpu"
    model: ModelSpec
    step: StepSpec


@dataclasses.dataclass(frozen=True)
class Resolved(Specs):
    """A config resolved for one platform and mesh, with the specs built from it. What a run's
    config phases (its preflight and remat choice), the planner, a benchmark and the evaluation
    take; the run's later phases take its `specs` alone."""

    cfg: Any              # the resolved core.config.schema.Config
    axes: tuple | None = None  # the mesh's (axis, size) pairs it was resolved for; None: the config's ici_/dcn_ keys

    @property
    def specs(self) -> Specs:
        """The specs without the config."""
        return Specs(self.platform, self.model, self.step)

    def replace(self, **changes) -> "Resolved":
        """These specs with `changes` to the resolved config (a remat trial's policy, say), the specs
        rebuilt for the same platform and mesh."""
        return _resolve(self.cfg.replace(**changes), self.platform, self.axes)


def resolve(cfg, platform: str, mesh: Any = None) -> Resolved:
    """`cfg` resolved for `platform` (core/spec/platform.py) and its specs.

    Args:
      cfg: a Config (an already resolved one is kept as it is).
      platform: the platform of the mesh the step runs on (`core.parallel.mesh.mesh_platform`), or
        of the planner's target.
      mesh: that mesh (a `jax.sharding.Mesh` or `AbstractMesh`) or its axis sizes; None: a choice
        that depends on how the weights are split reads the config's ici_/dcn_ keys.
    """
    axes = None if mesh is None else tuple(dict(getattr(mesh, "shape", mesh)).items())
    return _resolve(cfg, platform, axes)


@functools.lru_cache(maxsize=32)
def _resolve(cfg, platform: str, axes: tuple | None) -> Resolved:
    cfg = resolve_config(cfg, platform, None if axes is None else dict(axes))
    return Resolved(platform_name(platform), model_spec(cfg), step_spec(cfg), cfg, axes)


def schedule_steps(cfg_or_dict: Any) -> int:
    """The learning-rate schedule's length: learning_rate_schedule_steps, or steps when it is -1
    (of a Config, or of a saved config's dict)."""
    get = cfg_or_dict.get if isinstance(cfg_or_dict, Mapping) else lambda k, d=None: getattr(cfg_or_dict, k, d)
    n = get("learning_rate_schedule_steps", -1)
    return int(n) if n is not None and n > 0 else int(get("steps"))


def optimizer_spec(cfg) -> OptimizerSpec:
    """The OptimizerSpec of `cfg`."""
    return OptimizerSpec(
        clip=cfg.gradient_clipping_threshold, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
        weight_decay=cfg.adam_weight_decay, mu_dtype=cfg.mu_dtype, nu_dtype=cfg.nu_dtype,
        learning_rate=cfg.learning_rate, final_fraction=cfg.cosine_learning_rate_final_fraction,
        warmup_fraction=cfg.warmup_steps_fraction, schedule_steps=schedule_steps(cfg),
        trainable=tuple(cfg.trainable_parameters_mask), frozen=tuple(cfg.frozen_parameters_mask))


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What core/data reads the batches from: the config's data keys, each under its key's name
    (docs/configuration.md), and the row's length and vocabulary."""

    dataset_type: str          # hf | synthetic
    hf_path: str
    hf_name: str
    hf_data_files: str
    hf_split: str
    hf_eval_split: str
    hf_text_column: str
    hf_streaming: bool
    tokenizer_path: str
    eval_holdout_fraction: float
    data_shuffle_seed: int
    allow_data_change: bool    # resume although the data contents' identity changed
    vocab_size: int
    max_target_length: int


def data_spec(cfg) -> DataSpec:
    """The DataSpec of `cfg`."""
    return DataSpec(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(DataSpec)})


def step_spec(cfg) -> StepSpec:
    """The StepSpec of a resolved `cfg`."""
    return StepSpec(
        stage=stage_of(cfg), lm_loss_chunk=cfg.lm_loss_chunk_size, optimizer=optimizer_spec(cfg),
        bias_update_rate=cfg.routed_bias_update_rate, abort_on_nan=cfg.abort_on_nan_loss,
        abort_on_inf=cfg.abort_on_inf_loss, rows=cfg.per_device_batch_size, length=cfg.max_target_length,
        opt_level=cfg.xla_backend_optimization_level)


def parameter_spec(cfg) -> ModelSpec:
    """The ModelSpec of `cfg` where only its parameters matter (their shapes, names and counts): its
    `auto` keys take the CPU's choices, which change how the layers run, never what they hold."""
    return resolve(cfg, "cpu").model


def model_spec(cfg) -> ModelSpec:
    """The ModelSpec of a resolved `cfg` (every layer's spec; `ModelSpec`'s fields)."""
    return ModelSpec(
        blocks=tuple(block_spec(cfg, i) for i in range(cfg.num_layers)), vocab_size=cfg.vocab_size, emb=cfg.emb,
        hc_n=cfg.mhc_expansion_rate, hc_eps=cfg.hc_eps, eps=cfg.normalization_layer_epsilon, hc_form=cfg.hc_mix_form,
        hc_mixes_backward=cfg.hc_mixes_backward, first_hash=cfg.first_num_hash_layers,
        csa_layers=tuple(cfg.csa_layers) if cfg.use_indexer else (), num_experts=cfg.num_experts,
        experts_per_token=cfg.num_experts_per_tok, stage=stage_of(cfg), joint=cfg.indexer_teacher == "joint",
        cross_layer_gradient=crosses_layers(cfg), remat_policy=cfg.remat_policy, scan_layers=cfg.scan_layers,
        weight_dtype=cfg.weight_dtype, dtype=cfg.dtype, trainable_mask=tuple(cfg.trainable_parameters_mask),
        frozen_mask=tuple(cfg.frozen_parameters_mask), frozen_weights=cfg.frozen_weights,
        frozen_weight_dtype=cfg.frozen_weight_dtype, init_seed=cfg.init_weights_seed)


def block_spec(cfg, layer: int) -> BlockSpec:
    """Layer `layer`'s BlockSpec: its attention, its MoE and its mHC settings."""
    return BlockSpec(attention_spec(cfg, layer), cfg.emb, cfg.normalization_layer_epsilon, cfg.mhc_expansion_rate,
                     cfg.hc_sinkhorn_iters, cfg.hc_eps, moe_spec(cfg, layer), cfg.hc_mix_form, cfg.hc_mixes_backward)


def layer_rope(cfg, compress_ratio: int) -> tuple[float, ...]:
    """The RoPE frequencies of a layer with `compress_ratio` (0 = SWA): the SWA theta plainly; the
    compressed theta, with YaRN when `rope_type: yarn`, in CSA and HCA layers."""
    if compress_ratio == 0:
        return rope_frequencies(cfg.qk_rope_head_dim, float(cfg.rope_max_timescale))
    yarn = cfg.rope_type == "yarn"
    return rope_frequencies(cfg.qk_rope_head_dim, float(cfg.compressed_rope_max_timescale),
                    yarn_factor=float(cfg.rope_factor) if yarn else 1.0,
                    original_max_positions=int(cfg.original_max_position_embeddings) if yarn else 0,
                    beta_fast=float(cfg.beta_fast), beta_slow=float(cfg.beta_slow))


def attention_spec(cfg, layer: int) -> AttentionSpec:
    """Layer `layer`'s AttentionSpec; the indexer's widths where the layer is CSA and use_indexer."""
    ratio = cfg.compress_ratios[layer]
    indexed = ratio == 4 and cfg.use_indexer
    return AttentionSpec(
        emb=cfg.emb, heads=cfg.num_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, window=cfg.sliding_window_size,
        ratio=ratio, eps=cfg.normalization_layer_epsilon, rope=layer_rope(cfg, ratio),
        indexer_heads=cfg.indexer_n_heads if indexed else 0,
        indexer_head_dim=cfg.indexer_head_dim if indexed else 0,
        indexer_topk=cfg.indexer_topk if indexed else 0,
        loss_scale=cfg.indexer_loss_scaling_factor, teacher=cfg.indexer_teacher,
        indexer_weights_init=cfg.indexer_weights_init, impl=attention_impl(cfg))


def attention_impl(cfg) -> AttentionImpl:
    """How every attention layer of a resolved `cfg` runs (the same in every layer)."""
    return AttentionImpl(
        attention=cfg.attention, attention_chunk=cfg.attention_query_chunk_size,
        topk_attention=cfg.csa_topk_attention, projections=cfg.attention_projections,
        head_chunk=cfg.csa_qk_head_chunk_size, query_chunk=cfg.csa_query_chunk_size,
        indexer_gradient=cfg.indexer_gradient)


def moe_spec(cfg, layer: int) -> MoESpec:
    """Layer `layer`'s MoESpec (hash-routed in the first first_num_hash_layers)."""
    return MoESpec(
        emb=cfg.emb, mlp=cfg.moe_mlp_dim, num_experts=cfg.num_experts, k=cfg.num_experts_per_tok,
        shared=cfg.shared_experts, hash_routed=layer < cfg.first_num_hash_layers,
        vocab_size=cfg.vocab_size, scaling=cfg.routed_scaling_factor, normalize=cfg.norm_topk_prob,
        use_bias=cfg.routed_bias, swiglu_limit=cfg.mlp_activations_limit,
        lb_weight=cfg.load_balance_loss_weight, impl=cfg.moe_impl, tile_size=cfg.moe_tile_size,
        tiles_per_step=cfg.moe_tiles_per_step, capacity_factor=cfg.moe_capacity_factor,
        gmm_tiles=tuple(cfg.moe_gmm_tiles))


def crosses_layers(cfg) -> bool:
    """Whether a gradient crosses the layers: unless only the indexer trains, from its local loss (the
    warm-up), where the backward keeps no layer's input and runs no layer again under any remat policy."""
    return stage_of(cfg).trains_rest or cfg.indexer_gradient != "local"

