"""Config validation: the per-key and cross-key rules every resolved Config must satisfy.

DESIGN.md, "Layout" and the stage table: sizes are positive, counts non-negative, enumerated keys
take one of their choices, the mesh keys follow MaxText's -1-fills-the-rest rule, the layer
pattern and chunk sizes fit the model's shape, and each stage command enforces its own settings.
Every broken rule raises `ConfigError` naming the key, the value and the fix (never `assert`,
which `-O` strips). core/config/schema.py calls `validate` on every Config it builds; this module
imports nothing of it, so a Config reaches the rules as a plain argument (`cfg`).
"""

from __future__ import annotations

import dataclasses
import re

from core.config.stages import STAGE_COMMANDS, stage_of
from core.errors import ConfigError

LAYER_KINDS = {0: "swa", 4: "csa", 128: "hca"}  # compress ratio -> layer kind

# Sizes that must be >= 1, and counts that may be 0.
_POSITIVE = {
    "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_num_decoder_layers",
    "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "vocab_size", "sliding_window_size",
    "indexer_n_heads", "indexer_head_dim", "indexer_init_batches", "indexer_topk", "num_experts", "num_experts_per_tok",
    "base_moe_mlp_dim", "mhc_expansion_rate", "hc_sinkhorn_iters", "steps",
    "per_device_batch_size", "max_target_length", "checkpoint_period", "max_checkpoints",
    "max_position_embeddings", "original_max_position_embeddings",
    "normalization_layer_epsilon", "hc_eps", "rope_max_timescale",
    "compressed_rope_max_timescale", "rope_factor", "adam_eps",
}
_NON_NEGATIVE = {
    "moe_tile_size",
    "qk_rope_head_dim", "indexer_loss_scaling_factor", "csa_qk_head_chunk_size",
    "csa_query_chunk_size", "shared_experts", "mlp_activations_limit", "routed_scaling_factor",
    "routed_bias_update_rate", "first_num_hash_layers", "load_balance_loss_weight",
    "learning_rate", "warmup_steps_fraction", "cosine_learning_rate_final_fraction",
    "adam_weight_decay", "gradient_clipping_threshold", "init_weights_seed", "data_shuffle_seed",
    "eval_holdout_fraction",
}
_AUTO_INTS = {"attention_query_chunk_size": 1, "lm_loss_chunk_size": 0}  # key -> least explicit value
_CHOICES = {
    **dict.fromkeys(("dtype", "weight_dtype", "frozen_weight_dtype", "mu_dtype", "nu_dtype"), ("float32", "bfloat16")),
    "hc_mix_form": ("einsum", "slices"),
    "hc_mixes_backward": ("auto", "autodiff", "closed"),
    "remat_policy": ("auto", "none", "minimal", "projections", "experts", "full"),
    "moe_impl": ("auto", "tiled", "dense", "ragged", "gmm", "batched"),
    "rope_type": ("default", "yarn"),
    "indexer_teacher": ("compressed", "joint"),
    "indexer_gradient": ("local", "backward"),
    "frozen_weights": ("param_dtype", "released"),
    "indexer_weights_init": ("fan_in", "zeros"),
    "indexer_init": ("random", "teacher"),
    "attention": ("auto", "chunked", "fused", "masked"),
    "csa_topk_attention": ("auto", "gather", "mask"),
    "attention_projections": ("auto", "chunked", "whole"),
    "routed_score_func": ("sqrtsoftplus",),
    "dataset_type": ("hf", "synthetic"),
}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg, stage: str | None = None):
    """Every rule, in a fixed order; raises ConfigError naming key, value and fix.

    Args:
      cfg: a Config whose values already have their declared types.
      stage: "pretrain" | "warmup" | "sparse" | None: adds that stage command's rules.
    Returns:
      `cfg` itself, unchanged.
    """
    _check_ranges(cfg)
    _check_mesh(cfg)
    _check_shapes(cfg)
    _check_indexer(cfg)
    _check_masks(cfg)
    _check_precision(cfg, stage)
    _check_stage(cfg, stage)
    return cfg


def _check_ranges(cfg) -> None:
    """Positive sizes, non-negative counts, enumerated choices, the schedule length."""
    for key in _POSITIVE:
        v = getattr(cfg, key)
        _check(v > 0, f"{key}={v} must be positive: give a value > 0.")
    for key in _NON_NEGATIVE:
        v = getattr(cfg, key)
        _check(v >= 0, f"{key}={v} must not be negative: give a value >= 0.")
    for key, least in _AUTO_INTS.items():  # -1: the platform's choice (core/spec/platform.py)
        v = getattr(cfg, key)
        _check(v == -1 or v >= least, f"{key}={v} must be >= {least}, or -1 for the platform's choice.")
    for key, choices in _CHOICES.items():
        v = getattr(cfg, key)
        _check(v in choices, f"{key}={v!r} is not supported: use one of {', '.join(choices)}.")
    _check(cfg.xla_backend_optimization_level in (-1, 0, 1, 2, 3),
           f"xla_backend_optimization_level={cfg.xla_backend_optimization_level} is not supported: use 0-3, "
           "or -1 (1 on CPU, XLA's default elsewhere).")
    _check(cfg.learning_rate_schedule_steps == -1 or cfg.learning_rate_schedule_steps >= 1,
           f"learning_rate_schedule_steps={cfg.learning_rate_schedule_steps} must be >= 1, or -1 to follow steps.")


def _check_mesh(cfg) -> None:
    """Each *_parallelism key is >= 1 or -1, and at most one per ici_/dcn_ group is -1."""
    mesh_keys = tuple(f.name for f in dataclasses.fields(cfg) if f.name.endswith("_parallelism"))
    for key in mesh_keys:
        v = getattr(cfg, key)
        _check(v == -1 or v >= 1, f"{key}={v} must be >= 1, or -1 to fill the remaining devices.")
    for prefix in ("ici_", "dcn_"):
        fills = [k for k in mesh_keys if k.startswith(prefix) and getattr(cfg, k) == -1]
        _check(len(fills) <= 1, f"{', '.join(fills)} are all -1: at most one {prefix}* axis may fill the rest.")


def _check_shapes(cfg) -> None:
    """The layer pattern, head counts and expert counts fit together."""
    ratios = cfg.compress_ratios
    _check(len(ratios) == cfg.num_layers,
           f"compress_ratios has {len(ratios)} entries but base_num_decoder_layers={cfg.num_layers}: give one ratio per layer.")
    for r in ratios:
        _check(r in LAYER_KINDS, f"compress_ratios contains {r}: each ratio must be 0 (SWA), 4 (CSA) or 128 (HCA).")
    for r in sorted(set(ratios) - {0}):
        _check(cfg.max_target_length % r == 0,
               f"max_target_length={cfg.max_target_length} is not a multiple of compress ratio {r}: use a multiple of {r}.")
    _check(cfg.base_num_kv_heads == 1,
           f"base_num_kv_heads={cfg.base_num_kv_heads}: DeepSeek-V4 attention shares one K=V head; set it to 1.")
    _check(cfg.qk_rope_head_dim <= cfg.head_dim and cfg.qk_rope_head_dim % 2 == 0,
           f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and <= head_dim={cfg.head_dim}.")
    _check(cfg.qk_rope_head_dim <= cfg.indexer_head_dim,
           f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be <= indexer_head_dim={cfg.indexer_head_dim} (the indexer ropes its last dims too).")
    _check(cfg.num_heads % cfg.o_groups == 0,
           f"o_groups={cfg.o_groups} does not divide base_num_query_heads={cfg.num_heads}: choose a divisor.")
    _check(cfg.num_experts_per_tok <= cfg.num_experts,
           f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts={cfg.num_experts}: choose at most {cfg.num_experts}.")
    _check(cfg.first_num_hash_layers <= cfg.num_layers,
           f"first_num_hash_layers={cfg.first_num_hash_layers} exceeds the {cfg.num_layers} layers.")
    _check(not cfg.moe_gmm_tiles or (len(cfg.moe_gmm_tiles) == 9 and min(cfg.moe_gmm_tiles) >= 1),
           f"moe_gmm_tiles={list(cfg.moe_gmm_tiles)} must be nine positive ints (rows, contracted, output of the "
           "forward, the input gradient and the weight gradient), or [] for auto.")


def _check_indexer(cfg) -> None:
    """The indexer loss has an indexer and enough blocks; the CSA chunk sizes divide their axes."""
    blocks = cfg.max_target_length // 4
    if cfg.indexer_loss_scaling_factor > 0:
        _check(cfg.use_indexer,
               f"indexer_loss_scaling_factor={cfg.indexer_loss_scaling_factor} needs use_indexer=true: enable the indexer or set the factor to 0.")
        _check(cfg.indexer_topk <= blocks,
               f"indexer_topk={cfg.indexer_topk} exceeds max_target_length // 4 = {blocks} blocks: set indexer_topk <= {blocks} or raise max_target_length.")
    heads_chunk = cfg.csa_qk_head_chunk_size
    if heads_chunk:
        _check(cfg.num_heads % heads_chunk == 0 and cfg.indexer_n_heads % heads_chunk == 0,
               f"csa_qk_head_chunk_size={heads_chunk} must divide base_num_query_heads={cfg.num_heads} and indexer_n_heads={cfg.indexer_n_heads}.")
    query_chunk = cfg.csa_query_chunk_size
    if query_chunk:
        _check(cfg.max_target_length % query_chunk == 0,
               f"csa_query_chunk_size={query_chunk} must divide max_target_length={cfg.max_target_length}.")


def _check_masks(cfg) -> None:
    """Every trainable/frozen parameter pattern is a valid regex."""
    for key in ("trainable_parameters_mask", "frozen_parameters_mask"):
        for pattern in getattr(cfg, key):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{key} entry {pattern!r} is not a valid regex ({e}): fix or quote it.") from None


# the largest adam_b2 at which a bfloat16 second moment follows float32's (bfloat16 rounds each
# step's (1 - b2) share: docs/precision.md#moments)
BF16_NU_MAX_B2 = 0.95


def _check_precision(cfg, stage: str | None) -> None:
    """A training command keeps float32 master weights unless told otherwise (docs/precision.md), and a
    bfloat16 second moment has a b2 whose share of a step survives bfloat16's rounding."""
    _check(stage is None or cfg.weight_dtype != "bfloat16" or cfg.allow_bf16_updates,
           f"weight_dtype=bfloat16 makes dsv4 {stage} update bfloat16 parameters in place, where most AdamW steps "
           "round away: set weight_dtype=float32 (the master copy; dtype=bfloat16 still computes in bfloat16 and "
           "frozen_weight_dtype=bfloat16 holds what the stage freezes in bfloat16), or allow_bf16_updates=true "
           "to train that way anyway.")
    _check(cfg.nu_dtype != "bfloat16" or cfg.adam_b2 <= BF16_NU_MAX_B2,
           f"nu_dtype=bfloat16 with adam_b2={cfg.adam_b2}: bfloat16 rounds away too much of each step's (1 - b2) share "
           f"and the second moment falls behind the gradients; use nu_dtype=float32 or adam_b2 <= {BF16_NU_MAX_B2}.")


def _check_stage(cfg, stage: str | None) -> None:
    """DESIGN.md's stage table (core/config/stages.py): the config matches a row, and a stage
    command's config resolves to one of that command's rows (`STAGE_COMMANDS`)."""
    _check(not cfg.dense_pretraining or (cfg.indexer_loss_scaling_factor == 0 and not cfg.indexer_sparse_training),
           f"dense_pretraining=true with indexer_loss_scaling_factor={cfg.indexer_loss_scaling_factor} "
           f"indexer_sparse_training={cfg.indexer_sparse_training}: pre-training leaves the indexer idle; "
           "set the factor to 0 and indexer_sparse_training=false (or use dsv4 warmup / dsv4 sparse).")
    if stage is None:
        return
    _check(cfg.indexer_init == "random" or stage == "warmup",
           f"indexer_init={cfg.indexer_init} in dsv4 {stage}: the teacher initialisation starts a dense warm-up "
           "(dsv4 warmup --init-from RUN); set indexer_init=random here.")
    row = stage_of(cfg)
    if row not in STAGE_COMMANDS[stage]:
        raise ConfigError(_STAGE_FIXES[stage, row.name])


# (stage command, the other row its config resolved to) -> the key that moved it there, and the fix
_STAGE_FIXES = {
    **dict.fromkeys([("pretrain", "warmup"), ("pretrain", "sparse"), ("pretrain", "no_indexer_loss")],
                    "dense_pretraining=false in dsv4 pretrain: stage 1 attends every visible block; "
                    "use dsv4 sparse to train through the top-k."),
    **dict.fromkeys([("warmup", "pretrain"), ("warmup", "no_indexer_loss")],
                    "indexer_loss_scaling_factor=0 in a warm-up trains nothing (the LM loss is not run there): "
                    "give it a value > 0, e.g. 0.01."),
    ("warmup", "sparse"): "indexer_sparse_training=true in dsv4 warmup: the warm-up is dense; "
                          "use dsv4 sparse for sparse training.",
    ("sparse", "pretrain"): "dense_pretraining=true in dsv4 sparse: the sparse stage trains through the top-k; "
                            "set dense_pretraining=false (or use dsv4 pretrain for dense pre-training).",
    ("sparse", "warmup"): "indexer_sparse_training=false in dsv4 sparse: the sparse stage trains through the top-k; "
                          "set indexer_sparse_training=true (or use dsv4 warmup for the dense warm-up).",
}
