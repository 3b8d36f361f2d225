"""Configuration: one frozen dataclass, loaded from flat MaxText-style YAML keys.

Precedence (DESIGN.md, "Layout"): base.yml < model file < stage preset < --config FILE <
KEY=VALUE overrides (later wins) < typed CLI options. `base.yml` declares every key with its
default; the dataclass declares its type. Every invalid input raises `ConfigError` naming the
key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import re
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from core.errors import ConfigError

ALIASES = {"mla_qk_head_chunk_size": "csa_qk_head_chunk_size"}
STAGES = ("warmup", "sparse", "pretrain")
LAYER_KINDS = {0: "swa", 4: "csa", 128: "hca"}


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
    weight_dtype: str
    scan_layers: bool
    remat_policy: str                 # none | minimal | full (what a layer saves for the backward)
    lm_loss_chunk_size: int           # tokens per LM-loss chunk, 0 = direct [B, T, V] logits
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
    csa_qk_head_chunk_size: int       # heads per scan step, 0 = off
    csa_query_chunk_size: int         # query positions per scan step, 0 = off
    attention: str                    # chunked (banded window, gathered top-k) | masked (dense reference)
    attention_query_chunk_size: int   # query positions per chunk of the chunked attention and top-k
    jax_cache_dir: str                # persistent compilation cache: "" off, "default" = ~/.cache/dsv4/jax, or a path
    compile_ahead: bool               # training runs compile the step from abstract state while the model builds
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
    moe_impl: str                     # tiled | dense | ragged (expert computation, core/moe.py)
    moe_tile_size: int                # rows per tile of the tiled path, 0 = auto
    # manifold-constrained hyper-connections
    mhc_expansion_rate: int
    hc_sinkhorn_iters: int
    hc_eps: float
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
    adam_weight_decay: float
    gradient_clipping_threshold: float
    trainable_parameters_mask: tuple[str, ...]
    frozen_parameters_mask: tuple[str, ...]
    init_weights_seed: int
    checkpoint_period: int            # steps
    max_checkpoints: int
    async_checkpointing: bool
    base_output_directory: str
    run_name: str
    learning_rate_schedule_steps: int  # steps; -1 = steps
    abort_on_nan_loss: bool
    abort_on_inf_loss: bool
    enable_tensorboard: bool
    # data
    dataset_type: str
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
    allow_data_change: bool           # resume although the data contents' identity changed
    # device mesh
    ici_data_parallelism: int
    ici_fsdp_parallelism: int
    ici_tensor_parallelism: int
    ici_expert_parallelism: int
    dcn_data_parallelism: int
    dcn_fsdp_parallelism: int
    dcn_tensor_parallelism: int
    dcn_expert_parallelism: int

    # ---- derived values (MaxText's short names)
    @property
    def emb(self) -> int:
        return self.base_emb_dim

    @property
    def num_heads(self) -> int:
        return self.base_num_query_heads

    @property
    def num_layers(self) -> int:
        return self.base_num_decoder_layers

    @property
    def moe_mlp_dim(self) -> int:
        return self.base_moe_mlp_dim

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'swa' | 'csa' | 'hca' per layer."""
        return tuple(LAYER_KINDS[r] for r in self.compress_ratios)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == 4)

    @property
    def dense_warmup(self) -> bool:
        """DESIGN.md's stage table: training with an indexer loss but not through the top-k."""
        return self.indexer_loss_scaling_factor > 0 and not self.indexer_sparse_training

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> "Config":
        """A validated copy with `changes` applied (same rules as load_config)."""
        values = self.to_dict()
        _merge(values, changes, "replace()")
        return _build(values)


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)

# Sizes that must be >= 1, and counts that may be 0.
_POSITIVE = {
    "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_num_decoder_layers",
    "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "vocab_size", "sliding_window_size",
    "indexer_n_heads", "indexer_head_dim", "indexer_topk", "num_experts", "num_experts_per_tok",
    "base_moe_mlp_dim", "attention_query_chunk_size", "mhc_expansion_rate", "hc_sinkhorn_iters", "steps",
    "per_device_batch_size", "max_target_length", "checkpoint_period", "max_checkpoints",
    "max_position_embeddings", "original_max_position_embeddings",
    "normalization_layer_epsilon", "hc_eps", "rope_max_timescale",
    "compressed_rope_max_timescale", "rope_factor", "adam_eps",
}
_NON_NEGATIVE = {
    "lm_loss_chunk_size", "moe_tile_size",
    "qk_rope_head_dim", "indexer_loss_scaling_factor", "csa_qk_head_chunk_size",
    "csa_query_chunk_size", "shared_experts", "mlp_activations_limit", "routed_scaling_factor",
    "routed_bias_update_rate", "first_num_hash_layers", "load_balance_loss_weight",
    "learning_rate", "warmup_steps_fraction", "cosine_learning_rate_final_fraction",
    "adam_weight_decay", "gradient_clipping_threshold", "init_weights_seed", "data_shuffle_seed",
    "eval_holdout_fraction",
}
_CHOICES = {
    "dtype": ("float32", "bfloat16"),
    "weight_dtype": ("float32", "bfloat16"),
    "remat_policy": ("none", "minimal", "full"),
    "moe_impl": ("tiled", "dense", "ragged"),
    "rope_type": ("default", "yarn"),
    "indexer_teacher": ("compressed", "joint"),
    "indexer_weights_init": ("fan_in", "zeros"),
    "attention": ("chunked", "masked"),
    "routed_score_func": ("sqrtsoftplus",),
    "dataset_type": ("hf", "synthetic"),
}
_MESH_KEYS = tuple(k for k in FIELDS if k.endswith("_parallelism"))


# ----------------------------------------------------------------------------- files


def configs_dir() -> Path:
    """The installed configs/ directory (package data `dsv4_configs`)."""
    return Path(str(importlib.resources.files("dsv4_configs")))


def model_names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yml") if p.stem != "base")


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read ({e.strerror}): check the path.") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}): give a YAML file.") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {_yaml_problem(e)}; fix the syntax there.") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r} must be a mapping of KEY: VALUE lines, got {type(data).__name__}.")
    return data


def _yaml_problem(e: Exception) -> str:
    """PyYAML's multi-line error as one phrase: 'line L, column C: problem (context at line L', column C')'."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return " ".join(str(e).split()) or type(e).__name__
    where = lambda m: f"line {m.line + 1}, column {m.column + 1}"  # noqa: E731  (marks are 0-based)
    text = f"{where(mark)}: {problem}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark is not None and (context_mark.line, context_mark.column) != (mark.line, mark.column):
        text += f" ({context} started at {where(context_mark)})"
    elif context:
        text += f" ({context})"
    return text


def _model_file(model: str) -> Path:
    if model in model_names():
        return configs_dir() / f"{model}.yml"
    path = Path(model).expanduser()
    if path.suffix in (".yml", ".yaml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"model file {model!r} does not exist: give a YAML path or one of {', '.join(model_names())}.")
        return path
    hint = difflib.get_close_matches(model, model_names(), n=1)
    fix = f"did you mean {hint[0]!r}?" if hint else f"choose one of {', '.join(model_names())} or a YAML path."
    raise ConfigError(f"unknown model {model!r}: {fix}")


def base_defaults() -> dict[str, Any]:
    data = _read_yaml(configs_dir() / "base.yml", "base config")
    data.pop("stages", None)
    return data


def stage_presets(stage: str) -> dict[str, Any]:
    """The overrides `dsv4 <stage>` applies (base.yml's `stages:` section)."""
    stages = _read_yaml(configs_dir() / "base.yml", "base config").get("stages", {})
    if stage not in stages:
        raise ConfigError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)}.")
    return dict(stages[stage])


# ----------------------------------------------------------------------------- parsing


def parse_override(text: str) -> tuple[str, Any]:
    """'key=value' -> (key, YAML-parsed value)."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not KEY=VALUE: write it like indexer_topk=16.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # plain strings such as regexes with YAML-special characters
    return key, value


def _canonical_key(key: str, source: str) -> str:
    key = ALIASES.get(key, key)
    if key not in FIELDS:
        hint = difflib.get_close_matches(key, list(FIELDS) + list(ALIASES), n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else "see configs/base.yml for every key."
        raise ConfigError(f"unknown config key {key!r} (from {source}): {fix}")
    return key


def _coerce(key: str, value: Any) -> Any:
    hint = _HINTS[key]
    bad = ConfigError(f"{key}={value!r} has the wrong type: it must be {_type_name(hint)}.")
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, str) and item is str:
            value = [value] if value else []
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(_coerce_scalar(item, v, bad) for v in value)
    return _coerce_scalar(hint, value, bad)


def _coerce_scalar(kind: type, value: Any, bad: ConfigError) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise bad
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 1e-3 (no dot) as a string
                except ValueError:
                    raise bad from None
            raise bad
        return float(value)
    if kind is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    raise bad


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {typing.get_args(hint)[0].__name__}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ----------------------------------------------------------------------------- validation


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config, stage: str | None = None) -> Config:
    """Cross-key rules; raises ConfigError naming key, value and fix."""
    for key in _POSITIVE:
        v = getattr(cfg, key)
        _check(v > 0, f"{key}={v} must be positive: give a value > 0.")
    for key in _NON_NEGATIVE:
        v = getattr(cfg, key)
        _check(v >= 0, f"{key}={v} must not be negative: give a value >= 0.")
    for key, choices in _CHOICES.items():
        v = getattr(cfg, key)
        _check(v in choices, f"{key}={v!r} is not supported: use one of {', '.join(choices)}.")
    _check(cfg.learning_rate_schedule_steps == -1 or cfg.learning_rate_schedule_steps >= 1,
           f"learning_rate_schedule_steps={cfg.learning_rate_schedule_steps} must be >= 1, or -1 to follow steps.")
    for key in _MESH_KEYS:
        v = getattr(cfg, key)
        _check(v == -1 or v >= 1, f"{key}={v} must be >= 1, or -1 to fill the remaining devices.")
    for prefix in ("ici_", "dcn_"):
        fills = [k for k in _MESH_KEYS if k.startswith(prefix) and getattr(cfg, k) == -1]
        _check(len(fills) <= 1, f"{', '.join(fills)} are all -1: at most one {prefix}* axis may fill the rest.")

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
    for key in ("trainable_parameters_mask", "frozen_parameters_mask"):
        for pattern in getattr(cfg, key):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{key} entry {pattern!r} is not a valid regex ({e}): fix or quote it.") from None
    if cfg.dense_pretraining:
        _check(cfg.indexer_loss_scaling_factor == 0 and not cfg.indexer_sparse_training,
               f"dense_pretraining=true with indexer_loss_scaling_factor={cfg.indexer_loss_scaling_factor} "
               f"indexer_sparse_training={cfg.indexer_sparse_training}: pre-training leaves the indexer idle; "
               "set the factor to 0 and indexer_sparse_training=false (or use dsv4 warmup / dsv4 sparse).")
    if stage == "pretrain":
        _check(cfg.dense_pretraining,
               "dense_pretraining=false in dsv4 pretrain: stage 1 attends every visible block; "
               "use dsv4 sparse to train through the top-k.")
    if stage == "warmup":
        _check(cfg.indexer_loss_scaling_factor > 0,
               "indexer_loss_scaling_factor=0 in a warm-up trains nothing (the LM loss is not run there): give it a value > 0, e.g. 0.01.")
        _check(not cfg.indexer_sparse_training,
               "indexer_sparse_training=true in dsv4 warmup: the warm-up is dense; use dsv4 sparse for sparse training.")
    return cfg


# ----------------------------------------------------------------------------- entry points


def _merge(into: dict[str, Any], data: Mapping[str, Any], source: str) -> None:
    for key, value in data.items():
        if key == "stages" and source.startswith("base"):
            continue
        into[_canonical_key(str(key), source)] = value


def _build(values: Mapping[str, Any], stage: str | None = None) -> Config:
    missing = sorted(set(FIELDS) - set(values))
    if missing:
        raise ConfigError(f"config is missing {', '.join(missing)}: declare them in configs/base.yml.")
    typed = {key: _coerce(key, values[key]) for key in FIELDS}
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
      stage: "pretrain" | "warmup" | "sparse" | None: applies base.yml's stage preset and its rules.
      options: typed CLI options (e.g. {"steps": 10}); they win over everything.

    Returns:
      A validated, frozen Config.
    """
    overrides = list(overrides)
    for text in overrides:  # MaxText selects the model file with model_name=...
        key, value = parse_override(text)
        if key == "model_name" and isinstance(value, str) and value:
            model = value
    values = base_defaults()
    path = _model_file(model)
    model_data = _read_yaml(path, "model file")
    values["model_name"] = path.stem
    _merge(values, model_data, f"model file {path.name}")
    if stage is not None:
        _merge(values, stage_presets(stage), f"stage {stage}")
    if config_file is not None:
        _merge(values, _read_yaml(Path(config_file), "config file"), f"--config {config_file}")
    for text in overrides:
        key, value = parse_override(text)
        _merge(values, {key: value}, f"override {text!r}")
    _merge(values, {k: v for k, v in (options or {}).items() if v is not None}, "command-line options")
    return _build(values, stage)


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
    return _build(values)
