"""DeepSeek-V4 `config.json` <-> dsv4 Config (DESIGN.md, "Real checkpoints").

Reads both spellings: the official file (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`) and what `transformers`' DeepseekV4Config writes (`layer_types`, `mlp_layer_types`,
`partial_rotary_factor`, `rope_parameters`, flat or nested {main, compress}). Every field is in
MAPPED (a dsv4 key), SPECIAL (decoded below), REQUIRED (a value dsv4 implements; anything else
changes the maths and is an error naming the field) or IGNORED (with the reason). A field in none
of them is an error too: a later model variant may add maths dsv4 does not know. A missing field
takes DeepseekV4Config's default (DeepSeek-V4-Flash's value).

`compress_ratios` may carry one entry more than the layers (the MTP block's); it is dropped.
Training keys (steps, learning rate, data, mesh...) keep configs/base.yml's defaults.
"""

from __future__ import annotations

import math
from typing import Any, Collection

from core.errors import ConfigError

MAPPED = {
    "vocab_size": "vocab_size", "hidden_size": "base_emb_dim", "num_hidden_layers": "base_num_decoder_layers",
    "num_attention_heads": "base_num_query_heads", "num_key_value_heads": "base_num_kv_heads",
    "head_dim": "head_dim", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "sliding_window_size", "rms_norm_eps": "normalization_layer_epsilon",
    "moe_intermediate_size": "base_moe_mlp_dim", "n_routed_experts": "num_experts",
    "n_shared_experts": "shared_experts", "num_experts_per_tok": "num_experts_per_tok",
    "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
    "swiglu_limit": "mlp_activations_limit", "scoring_func": "routed_score_func",
    "index_n_heads": "indexer_n_heads", "index_head_dim": "indexer_head_dim", "index_topk": "indexer_topk",
    "hc_mult": "mhc_expansion_rate", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "rope_theta": "rope_max_timescale", "compress_rope_theta": "compressed_rope_max_timescale",
    "max_position_embeddings": "max_position_embeddings",
}
SPECIAL = ("compress_ratios", "layer_types", "compress_rates", "num_hash_layers", "mlp_layer_types",
           "qk_rope_head_dim", "partial_rotary_factor", "rope_scaling", "rope_parameters")
REQUIRED = {
    "model_type": "deepseek_v4", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "topk_method": "noaux_tc", "scoring_func": "sqrtsoftplus",
    "attention_dropout": 0.0, "router_jitter_noise": 0.0,
}
IGNORED = {
    "architectures": "the class name", "transformers_version": "provenance", "torch_dtype": "storage dtype (see --dtype)",
    "dtype": "storage dtype (see --dtype)", "use_cache": "decoding only", "bos_token_id": "tokenizer",
    "eos_token_id": "tokenizer", "pad_token_id": "tokenizer", "initializer_range": "initialisation of fresh weights",
    "num_nextn_predict_layers": "the MTP block is not imported", "quantization_config": "decoded from the tensors",
    "expert_dtype": "decoded from the tensors", "output_router_logits": "HF output option",
    "router_aux_loss_coef": "HF's training loss (dsv4: load_balance_loss_weight)", "_name_or_path": "provenance",
    "output_attentions": "HF output option", "output_hidden_states": "HF output option", "return_dict": "HF output option",
}
DEFAULTS = {  # DeepseekV4Config's defaults (= DeepSeek-V4-Flash)
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "sliding_window": 128, "rms_norm_eps": 1e-6, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "routed_scaling_factor": 1.5, "norm_topk_prob": True,
    "swiglu_limit": 10.0, "scoring_func": "sqrtsoftplus", "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576, "num_hash_layers": 3,
}
LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_YARN_KEYS = {"factor": "rope_factor", "original_max_position_embeddings": "original_max_position_embeddings",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
_ROPE_OK = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "attention_factor", "truncate", *_YARN_KEYS}


def _fail(field: str, value: Any, why: str) -> None:
    raise ConfigError(f"config.json field {field}={value!r} {why}")


def _layers(hf: dict, n: int) -> list[int]:
    if "layer_types" in hf:
        rates = hf.get("compress_rates") or {}
        if rates and rates != {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}:
            _fail("compress_rates", rates, "is not supported: dsv4 compresses CSA by 4 and HCA by 128.")
        bad = [t for t in hf["layer_types"] if t not in LAYER_TYPES]
        if bad:
            _fail("layer_types", bad[0], f"is not a DeepSeek-V4 layer type ({', '.join(LAYER_TYPES)}).")
        ratios = [LAYER_TYPES[t] for t in hf["layer_types"]]
    elif "compress_ratios" in hf:
        ratios = list(hf["compress_ratios"])
    else:
        raise ConfigError("config.json has neither compress_ratios nor layer_types: dsv4 cannot tell the layer kinds.")
    if len(ratios) < n:
        _fail("compress_ratios", ratios, f"has {len(ratios)} entries for num_hidden_layers={n}: give one per layer.")
    return ratios[:n]  # a trailing entry belongs to the MTP block


def _hash_layers(hf: dict) -> int:
    if "mlp_layer_types" not in hf:
        return int(hf.get("num_hash_layers", DEFAULTS["num_hash_layers"]))
    kinds = list(hf["mlp_layer_types"])
    k = next((i for i, t in enumerate(kinds) if t != "hash_moe"), len(kinds))
    if any(t != "moe" for t in kinds[k:]):
        _fail("mlp_layer_types", kinds, "is not supported: dsv4 routes by hash in leading layers only (hash_moe then moe).")
    return k


def _rope(hf: dict, rope_dims: int, head_dim: int) -> dict[str, Any]:
    """rope_type, thetas and YaRN keys from rope_scaling / rope_parameters."""
    out = {"rope_max_timescale": float(hf.get("rope_theta", DEFAULTS["rope_theta"])),
           "compressed_rope_max_timescale": float(hf.get("compress_rope_theta", DEFAULTS["compress_rope_theta"]))}
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict):  # transformers' nested form
        main = params["main"]
        if main.get("rope_type", "default") != "default":
            _fail("rope_parameters.main.rope_type", main.get("rope_type"),
                  "is not supported: sliding-window layers use plain RoPE (official code).")
        out["rope_max_timescale"] = float(main.get("rope_theta", out["rope_max_timescale"]))
        compress, where = params.get("compress") or {}, "rope_parameters.compress"
        out["compressed_rope_max_timescale"] = float(compress.get("rope_theta", out["compressed_rope_max_timescale"]))
    elif params:
        compress, where = params, "rope_parameters"
        if "rope_theta" in params and "rope_theta" not in hf:
            out["rope_max_timescale"] = float(params["rope_theta"])
    else:
        compress, where = hf.get("rope_scaling") or {}, "rope_scaling"
    for key, value in compress.items():
        if key not in _ROPE_OK:
            _fail(f"{where}.{key}", value, "is not supported by dsv4's RoPE: remove it or convert the model.")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in ("default", "yarn"):
        _fail(f"{where}.rope_type", kind, "is not supported: dsv4 implements default and yarn RoPE.")
    if compress.get("attention_factor", 1.0) != 1.0:
        _fail(f"{where}.attention_factor", compress["attention_factor"], "is not supported: DeepSeek-V4 applies no YaRN mscale.")
    if compress.get("truncate", True) is not True:
        _fail(f"{where}.truncate", compress["truncate"], "is not supported: the official YaRN rounds its ramp bounds.")
    prf = compress.get("partial_rotary_factor")
    if prf is not None and not math.isclose(prf * head_dim, rope_dims):
        _fail(f"{where}.partial_rotary_factor", prf, f"disagrees with qk_rope_head_dim={rope_dims}.")
    out["rope_type"] = kind
    if kind == "yarn":
        out.update({ours: compress[key] for key, ours in _YARN_KEYS.items() if key in compress})
    return out


def from_hf_config(hf: dict, *, model_name: str, weight_dtype: str = "float32", use_indexer: bool = True,
                   routed_bias: bool = True):
    """A validated dsv4 Config from a config.json mapping.

    Args:
      use_indexer / routed_bias: whether the checkpoint holds indexer tensors / router biases.
    Raises:
      ConfigError: naming the first field dsv4 does not support or does not know.
    """
    from core.config.schema import from_values
    from core.config.files import base_defaults

    for field, value in hf.items():
        if field in REQUIRED and value != REQUIRED[field] and not (field == "topk_method" and value is None):
            _fail(field, value, f"is not supported: dsv4 implements {field}={REQUIRED[field]!r} only.")
        if field not in MAPPED and field not in SPECIAL and field not in REQUIRED and field not in IGNORED:
            _fail(field, value, "is unknown to dsv4 (it may change the model): remove it if it does not, "
                  "or convert the model to a supported DeepSeek-V4 layout.")
    for field in MAPPED:
        if field in hf and hf[field] is None:
            _fail(field, None, "is not supported: dsv4 needs a value (null turns the component off).")
    get = lambda k: hf.get(k, DEFAULTS[k])  # noqa: E731
    values = base_defaults()
    values.update({ours: get(theirs) for theirs, ours in MAPPED.items()})
    n, head_dim = int(get("num_hidden_layers")), int(get("head_dim"))
    rope_dims = (int(hf["qk_rope_head_dim"]) if "qk_rope_head_dim" in hf
                 else int(round((hf.get("partial_rotary_factor") or 64 / 512) * head_dim)))
    values.update(_rope(hf, rope_dims, head_dim))
    values.update(model_name=model_name, compress_ratios=_layers(hf, n), first_num_hash_layers=_hash_layers(hf),
                  qk_rope_head_dim=rope_dims, weight_dtype=weight_dtype, use_indexer=use_indexer,
                  routed_bias=routed_bias)
    return from_values(values)


QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128]}  # the released checkpoints' (notes/checkpoint-format.md)


def to_hf_config(cfg, torch_dtype: str, *, released: Collection[str] = ()) -> dict[str, Any]:
    """The official-style config.json of a dsv4 Config (no MTP).

    Args:
      released: the formats ("fp8", "fp4") of the weights written as the release stores them; any:
        the official quantization_config, and "fp4": expert_dtype "fp4" (routed experts in FP4).
    """
    theirs = {ours: h for h, ours in MAPPED.items()}
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    for ours, h in theirs.items():
        out[h] = getattr(cfg, ours)
    out.update(qk_rope_head_dim=cfg.qk_rope_head_dim, num_hash_layers=cfg.first_num_hash_layers,
               compress_ratios=list(cfg.compress_ratios), topk_method="noaux_tc", hidden_act="silu",
               attention_bias=False, tie_word_embeddings=False, num_nextn_predict_layers=0,
               bos_token_id=0, eos_token_id=1, torch_dtype=torch_dtype)
    if released:
        out["quantization_config"] = dict(QUANTIZATION_CONFIG)
    if "fp4" in released:
        out["expert_dtype"] = "fp4"
    if cfg.rope_type == "yarn":
        out["rope_scaling"] = {"type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                               "beta_slow": cfg.beta_slow,
                               "original_max_position_embeddings": cfg.original_max_position_embeddings}
    return out
