"""Configuration: one frozen dataclass, loaded from flat MaxText-style YAML keys.

Precedence (DESIGN.md, "Layout"): base.yml < model file < stage preset < --config FILE <
KEY=VALUE overrides (later wins) < typed CLI options. `base.yml` declares every key with its
default; the dataclass declares its type. Every invalid input raises `ConfigError` naming the
key, the value and the fix.

This module holds the Config dataclass and the merge of those layers. Reading the files
(core/config/files.py), parsing and coercing values (core/config/values.py) and the validation
rules (core/config/validate.py) live beside it in this package.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from core.config.files import base_config, base_defaults, model_file, read_yaml, split_stages, stage_presets
from core.config.validate import LAYER_KINDS, validate
from core.config.values import coerce, parse_override
from core.config.values import plain as _plain
from core.errors import ConfigError

ALIASES = {"mla_qk_head_chunk_size": "csa_qk_head_chunk_size"}


def run_only():
    """A key the compiled step does not depend on (the data's source, the run's directory, the
    checkpoints, the compile's cache): no spec of core.spec.resolve reads it."""
    return dataclasses.field(metadata={"run_only": True})


@dataclasses.dataclass(frozen=True)
class Config:
    """Every key of configs/base.yml, typed. Defaults live in base.yml, not here."""

    # identity
    model_name: str
    # decoder shape
    base_emb_dim: int
    base_num_query_heads: int
    base_num_kv_heads: int
    base_num_decoder_layers: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    vocab_size: int
    normalization_layer_epsilon: float
    compress_ratios: tuple[int, ...]
    sliding_window_size: int          # tokens
    dtype: str
    weight_dtype: str                 # trained parameters (the master copy AdamW updates)
    frozen_weight_dtype: str          # frozen parameters
    allow_bf16_updates: bool          # let a training command update bfloat16 parameters in place
    frozen_weights: str               # param_dtype | released (frozen linear weights as FP8/FP4 codes + scales)
    scan_layers: bool
    remat_policy: str                 # auto | none | minimal | projections | experts | full (what a layer saves for the backward)
    lm_loss_chunk_size: int           # tokens per LM-loss chunk, 0 = direct [B, T, V] logits, -1 = per platform
    # rotary position embedding
    rope_type: str
    rope_max_timescale: float
    compressed_rope_max_timescale: float
    rope_factor: float
    original_max_position_embeddings: int  # tokens
    beta_fast: int
    beta_slow: int
    max_position_embeddings: int      # tokens
    # lightning indexer and its loss
    use_indexer: bool
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_topk: int                 # blocks
    indexer_loss_scaling_factor: float
    indexer_sparse_training: bool
    dense_pretraining: bool           # stage 1: CSA over every visible block, indexer idle
    indexer_teacher: str
    indexer_weights_init: str         # fan_in | zeros: how the indexer's weights_proj starts
    indexer_init: str                 # random | teacher: how a warm-up --init-from starts its indexers
    indexer_init_batches: int         # calibration batches of indexer_init: teacher
    indexer_gradient: str             # local (per layer, in the forward) | backward (through the stack)
    csa_qk_head_chunk_size: int       # heads per scan step, 0 = off
    csa_query_chunk_size: int         # query rows per streamed block of the indexer loss, 0 = auto (base.yml)
    attention: str                    # chunked (banded window, gathered top-k) | fused (Pallas kernels) | masked (dense reference)
    attention_query_chunk_size: int   # query positions per chunk of the chunked attention and top-k; -1 = per platform
    csa_topk_attention: str           # auto | gather | mask (CSA's top-k keys gathered, or all keys masked)
    attention_projections: str        # auto | chunked | whole (core/model/attention.py)
    jax_cache_dir: str = run_only()   # persistent compilation cache: "" off, "default" = ~/.cache/dsv4/jax, or a path
    compile_ahead: bool = run_only()  # training runs compile the step from abstract state while the model builds
    xla_backend_optimization_level: int  # LLVM level of the train step's compile: 0-3, -1 = 1 on CPU, XLA's default elsewhere
    # mixture of experts
    num_experts: int
    num_experts_per_tok: int
    shared_experts: int
    base_moe_mlp_dim: int
    mlp_activations_limit: float
    routed_score_func: str
    routed_scaling_factor: float
    norm_topk_prob: bool
    routed_bias: bool
    routed_bias_update_rate: float
    first_num_hash_layers: int
    load_balance_loss_weight: float
    moe_impl: str                     # auto | tiled | dense | ragged | gmm | batched (expert computation, core/model/moe.py)
    moe_tile_size: int                # rows per tile of the tiled path, 0 = auto
    moe_tiles_per_step: int           # tiles per scan step of the tiled path, 0 = auto
    moe_capacity_factor: float        # expert parallelism: slots per destination / mean, 0 = drop-free
    moe_gmm_tiles: tuple[int, ...]    # moe_impl=gmm: (tm, tk, tn) of the forward, input and weight gradients; () = auto
    # manifold-constrained hyper-connections
    mhc_expansion_rate: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hc_mix_form: str                  # einsum | slices (core/model/block.py)
    hc_mixes_backward: str            # auto | autodiff | closed (core/model/block.py)
    # training
    steps: int
    per_device_batch_size: int        # sequences
    max_target_length: int            # tokens
    learning_rate: float
    warmup_steps_fraction: float
    cosine_learning_rate_final_fraction: float
    adam_b1: float
    adam_b2: float
    adam_eps: float
    mu_dtype: str                     # AdamW first moment
    nu_dtype: str                     # AdamW second moment
    adam_weight_decay: float
    gradient_clipping_threshold: float
    trainable_parameters_mask: tuple[str, ...]
    frozen_parameters_mask: tuple[str, ...]
    init_weights_seed: int
    checkpoint_period: int = run_only()  # steps
    max_checkpoints: int = run_only()
    async_checkpointing: bool = run_only()
    base_output_directory: str = run_only()
    run_name: str = run_only()
    learning_rate_schedule_steps: int  # steps; -1 = steps
    abort_on_nan_loss: bool
    abort_on_inf_loss: bool
    enable_tensorboard: bool = run_only()
    # data
    dataset_type: str = run_only()
    hf_path: str = run_only()
    hf_name: str = run_only()
    hf_data_files: str = run_only()
    hf_split: str = run_only()
    hf_eval_split: str = run_only()
    hf_text_column: str = run_only()
    hf_streaming: bool = run_only()
    tokenizer_path: str = run_only()
    eval_holdout_fraction: float = run_only()
    data_shuffle_seed: int = run_only()
    allow_data_change: bool = run_only()  # resume although the data contents' identity changed
    # device mesh
    ici_data_parallelism: int
    ici_fsdp_parallelism: int
    ici_tensor_parallelism: int
    ici_expert_parallelism: int
    ici_expert_outer_parallelism: int   # experts and batch split, every other weight replicated (core/parallel/mesh.py)
    dcn_data_parallelism: int
    dcn_fsdp_parallelism: int
    dcn_tensor_parallelism: int
    dcn_expert_parallelism: int
    dcn_expert_outer_parallelism: int

    # ---- derived values (MaxText's short names of base_* fields; not fields themselves)
    emb = property(operator.attrgetter("base_emb_dim"))
    num_heads = property(operator.attrgetter("base_num_query_heads"))
    num_layers = property(operator.attrgetter("base_num_decoder_layers"))
    moe_mlp_dim = property(operator.attrgetter("base_moe_mlp_dim"))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'swa' | 'csa' | 'hca' per layer."""
        return tuple(LAYER_KINDS[r] for r in self.compress_ratios)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == 4)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "Config":
        """A validated copy with `changes` applied (same rules as load_config)."""
        values = self.to_dict()
        _merge(values, changes, "replace()")
        return from_values(values)


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)


# ----------------------------------------------------------------------------- entry points


def canonical_key(key: str, source: str) -> str:
    """The Config field `key` names, through `ALIASES`.

    Args:
      key: a key as written in a file, an override or an option.
      source: where it was written, for the message (e.g. "override 'steps=3'").
    Returns:
      The field name. An unknown key raises ConfigError with a did-you-mean (difflib over the
      fields and the aliases) or, with no close match, a pointer to configs/base.yml.
    """
    key = ALIASES.get(key, key)
    if key not in FIELDS:
        hint = difflib.get_close_matches(key, list(FIELDS) + list(ALIASES), n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else "see configs/base.yml for every key."
        raise ConfigError(f"unknown config key {key!r} (from {source}): {fix}")
    return key


def _merge(into: dict[str, Any], data: Mapping[str, Any], source: str) -> None:
    for key, value in data.items():
        into[canonical_key(str(key), source)] = value


def from_values(values: Mapping[str, Any], stage: str | None = None) -> Config:
    missing = sorted(set(FIELDS) - set(values))
    if missing:
        raise ConfigError(f"config is missing {', '.join(missing)}: declare them in configs/base.yml.")
    typed = {key: coerce(key, values[key], _HINTS[key]) for key in FIELDS}
    return validate(Config(**typed), stage)


def load_config(
    model: str = "deepseek4-tiny",
    overrides: Iterable[str] = (),
    *,
    config_file: str | Path | None = None,
    stage: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Config:
    """Resolve a Config.

    Args:
      model: a name in configs/ (e.g. "deepseek4-tiny") or a path to a YAML file (a run's
        resolved config.yml works too).
      overrides: "KEY=VALUE" strings, values parsed as YAML; a later one wins.
      config_file: an extra YAML file applied after the stage preset.
      stage: "pretrain" | "warmup" | "sparse" | None: applies base.yml's stage preset, then the
        model file's own `stages:` entry for it, and the stage's rules.
      options: typed CLI options (e.g. {"steps": 10}); they win over everything.

    Returns:
      A validated, frozen Config.
    """
    overrides = list(overrides)
    for text in overrides:  # MaxText selects the model file with model_name=...
        key, value = parse_override(text)
        if key == "model_name" and isinstance(value, str) and value:
            model = value
    values, presets = base_config()
    path = model_file(model)
    model_data, model_stages = split_stages(read_yaml(path, "model file"), f"model file {path}")
    values["model_name"] = path.stem
    _merge(values, model_data, f"model file {path.name}")
    if stage is not None:
        _merge(values, stage_presets(stage, presets), f"stage {stage}")
        _merge(values, model_stages.get(stage, {}), f"model file {path.name}, stages: {stage}")
    if config_file is not None:
        _merge(values, read_yaml(Path(config_file), "config file"), f"--config {config_file}")
    for text in overrides:
        key, value = parse_override(text)
        _merge(values, {key: value}, f"override {text!r}")
    _merge(values, {k: v for k, v in (options or {}).items() if v is not None}, "command-line options")
    return from_values(values, stage)


def dump(cfg: Config) -> str:
    """The resolved config as YAML (loads back to an equal Config with `loads`)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None, width=120)


def loads(text: str) -> Config:
    """Inverse of `dump`: a full resolved YAML mapping -> Config."""
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError("a resolved config must be a mapping of KEY: VALUE lines.")
    values = base_defaults()
    _merge(values, data, "resolved config")
    return from_values(values)
