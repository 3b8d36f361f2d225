"""Synthetic DeepSeek-V4 checkpoints for the import/export tests, written from the official code.

`official_inventory` lists every tensor of the official layout (name -> shape, storage kind) for a
config, from DeepSeek-V4-Flash `inference/model.py` (Linear dtypes, Compressor / Indexer / Gate /
Block parameters) and notes/checkpoint-format.md's table; it does not use core.hf.names.
`write_official` fills it with seeded random weights, quantised exactly as on disk (FP8 e4m3 with
e8m0 128x128 block scales, FP4 e2m1 packed two per int8 byte low nibble first with per-32 e8m0
scales), in two shards plus model.safetensors.index.json, and returns the float64 values each
tensor dequantises to, computed here block by block with ml_dtypes' own float8/float4 decoding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

FP8_MAX, FP4_MAX = 448.0, 6.0


def official_inventory(c: dict, *, mtp: bool = False, experts: str = "fp4") -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, kind)}, kind in fp8 | fp4 | bf16 | f32 | i64 (shapes: logical [out, in]).

    `c` uses config.json names (hidden_size, compress_ratios, num_hash_layers, ...). `experts`: the
    routed experts' kind, fp4 as released, or fp8 (128 x 128 blocks, as the official convert.py's
    `--expert-dtype fp8` writes them).
    """
    m, n, hd = c["hidden_size"], c["hc_mult"], c["head_dim"]
    h, e, f = c["num_attention_heads"], c["n_routed_experts"], c["moe_intermediate_size"]
    mix = (2 + n) * n
    inv = {"embed.weight": ((c["vocab_size"], m), "bf16"), "head.weight": ((c["vocab_size"], m), "bf16"),
           "norm.weight": ((m,), "bf16"), "hc_head_fn": ((n, n * m), "f32"), "hc_head_base": ((n,), "f32"),
           "hc_head_scale": ((1,), "f32")}

    def block(p: str, ratio: int, hashed: bool) -> None:
        for s in ("attn", "ffn"):
            inv.update({f"{p}hc_{s}_fn": ((mix, n * m), "f32"), f"{p}hc_{s}_base": ((mix,), "f32"),
                        f"{p}hc_{s}_scale": ((3,), "f32")})
        inv.update({f"{p}attn_norm.weight": ((m,), "bf16"), f"{p}ffn_norm.weight": ((m,), "bf16"),
                    f"{p}attn.attn_sink": ((h,), "f32"), f"{p}attn.wq_a.weight": ((c["q_lora_rank"], m), "fp8"),
                    f"{p}attn.q_norm.weight": ((c["q_lora_rank"],), "bf16"),
                    f"{p}attn.wq_b.weight": ((h * hd, c["q_lora_rank"]), "fp8"),
                    f"{p}attn.wkv.weight": ((hd, m), "fp8"), f"{p}attn.kv_norm.weight": ((hd,), "bf16"),
                    f"{p}attn.wo_a.weight": ((c["o_groups"] * c["o_lora_rank"], h * hd // c["o_groups"]), "fp8"),
                    f"{p}attn.wo_b.weight": ((m, c["o_groups"] * c["o_lora_rank"]), "fp8"),
                    f"{p}ffn.gate.weight": ((e, m), "bf16")})
        if ratio:
            coff = 2 if ratio == 4 else 1
            inv.update({f"{p}attn.compressor.ape": ((ratio, coff * hd), "f32"),
                        f"{p}attn.compressor.wkv.weight": ((coff * hd, m), "bf16"),
                        f"{p}attn.compressor.wgate.weight": ((coff * hd, m), "bf16"),
                        f"{p}attn.compressor.norm.weight": ((hd,), "bf16")})
        if ratio == 4:
            ih, idim = c["index_n_heads"], c["index_head_dim"]
            inv.update({f"{p}attn.indexer.wq_b.weight": ((ih * idim, c["q_lora_rank"]), "fp8"),
                        f"{p}attn.indexer.weights_proj.weight": ((ih, m), "bf16"),
                        f"{p}attn.indexer.compressor.ape": ((4, 2 * idim), "f32"),
                        f"{p}attn.indexer.compressor.wkv.weight": ((2 * idim, m), "bf16"),
                        f"{p}attn.indexer.compressor.wgate.weight": ((2 * idim, m), "bf16"),
                        f"{p}attn.indexer.compressor.norm.weight": ((idim,), "bf16")})
        if hashed:
            inv[f"{p}ffn.gate.tid2eid"] = ((c["vocab_size"], c["num_experts_per_tok"]), "i64")
        else:
            inv[f"{p}ffn.gate.bias"] = ((e,), "f32")
        for w, shape in (("w1", (f, m)), ("w2", (m, f)), ("w3", (f, m))):
            inv[f"{p}ffn.shared_experts.{w}.weight"] = (shape, "fp8")
            for x in range(e):
                inv[f"{p}ffn.experts.{x}.{w}.weight"] = (shape, experts)

    for i in range(c["num_hidden_layers"]):
        block(f"layers.{i}.", c["compress_ratios"][i], i < c["num_hash_layers"])
    if mtp:
        block("mtp.0.", 0, False)
        inv.update({"mtp.0.e_proj.weight": ((m, m), "fp8"), "mtp.0.h_proj.weight": ((m, m), "fp8"),
                    "mtp.0.enorm.weight": ((m,), "bf16"), "mtp.0.hnorm.weight": ((m,), "bf16"),
                    "mtp.0.norm.weight": ((m,), "bf16")})
    return inv


# ----------------------------------------------------------------------------- encoders


def _pow2_scale(absmax: np.ndarray, qmax: float) -> np.ndarray:
    """Power-of-two scales (ue8m0) with |x| / s <= qmax."""
    return np.exp2(np.ceil(np.log2(np.maximum(absmax, 1e-30) / qmax))).astype(np.float32)


def quantise_fp8(w: np.ndarray, block: int = 128):
    """(e4m3 [O, I], e8m0 [ceil(O/b), ceil(I/b)], float64 dequantised [O, I])."""
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    s = np.zeros((bo, bi), np.float32)
    q = np.zeros((o, i), ml_dtypes.float8_e4m3fn)
    deq = np.zeros((o, i), np.float64)
    for r in range(bo):
        for k in range(bi):
            sl = (slice(r * block, (r + 1) * block), slice(k * block, (k + 1) * block))
            s[r, k] = _pow2_scale(np.abs(w[sl]).max(), FP8_MAX)
            q[sl] = (w[sl] / s[r, k]).astype(ml_dtypes.float8_e4m3fn)
            deq[sl] = q[sl].astype(np.float64) * float(s[r, k])
    return q, s.astype(ml_dtypes.float8_e8m0fnu), deq


def quantise_fp4(w: np.ndarray, block: int = 32):
    """(int8 [O, I/2] packed low nibble = even column, e8m0 [O, I/block], float64 dequantised [O, I])."""
    o, i = w.shape
    s = _pow2_scale(np.abs(w.reshape(o, i // block, block)).max(-1), FP4_MAX)
    q = (w / np.repeat(s, block, 1)).astype(ml_dtypes.float4_e2m1fn)  # one code per byte
    codes = q.view(np.uint8) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    deq = q.astype(np.float64) * np.repeat(s.astype(np.float64), block, 1)
    return packed, s.astype(ml_dtypes.float8_e8m0fnu), deq


# ----------------------------------------------------------------------------- a whole checkpoint


def _groups(names: list[str], shards: int | None) -> list[list[str]]:
    """`shards` equal groups, or (None) the official split: embed, one shard per layer, the rest, MTP."""
    if shards is not None:
        per = -(-len(names) // shards)
        return [names[k * per:(k + 1) * per] for k in range(shards)]
    key = lambda n: (0 if n == "embed.weight" else int(n.split(".")[1]) + 1 if n.startswith("layers.")  # noqa: E731
                     else 10**6 if n.startswith("mtp.") else 10**6 - 1)
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(key(n), []).append(n)
    return [groups[k] for k in sorted(groups)]


def _encode(name: str, shape, kind: str, c: dict, rng) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """({stored name: on-disk array}, float64 dequantised value (int64 for tid2eid))."""
    if kind == "i64":
        table = np.stack([rng.choice(c["n_routed_experts"], c["num_experts_per_tok"], replace=False)
                          for _ in range(shape[0])]).astype(np.int64)
        return {name: table}, table
    scale = 1.0 if len(shape) == 1 or name.startswith("embed") else 1.0 / math.sqrt(shape[-1])
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    if name.endswith("_scale") or name.endswith("norm.weight"):
        w = (1.0 + 0.2 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    base = name[:-len(".weight")]
    if kind in ("fp8", "fp4"):
        q, s, deq = (quantise_fp8 if kind == "fp8" else quantise_fp4)(w)
        return {name: q, base + ".scale": s}, deq
    if kind == "bf16":
        b = w.astype(ml_dtypes.bfloat16)
        return {name: b}, b
    return {name: w}, w


def write_official(root: Path, c: dict, *, seed: int = 0, mtp: bool = True, shards: int | None = 2,
                   keep_values: bool = True, experts: str = "fp4") -> dict[str, np.ndarray]:
    """Write a random official-layout checkpoint, one shard at a time.

    Args:
      shards: how many equal shards, or None for the official split (embed / each layer / rest / MTP).
      keep_values: return {name: float64 dequantised value (int64 tid2eid)}; else {} (big checkpoints).
      experts: the routed experts' kind (`official_inventory`).
    """
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    inv = official_inventory(c, mtp=mtp, experts=experts)
    groups = _groups(list(inv), shards)
    values, weight_map, total = {}, {}, 0
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {}
        for name in group:
            stored, value = _encode(name, *inv[name], c, rng)
            part.update(stored)
            if keep_values:
                values[name] = value.astype(np.float64) if value.dtype != np.int64 else value
        save_file(part, str(root / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
        total += sum(t.nbytes for t in part.values())
        del part
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **c,
              "compress_ratios": list(c["compress_ratios"]) + ([0] if mtp else []),
              "num_nextn_predict_layers": int(mtp), "expert_dtype": experts, "torch_dtype": "bfloat16",
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return values


# A shrunken V4: SWA, hash-routed CSA, then (HCA, CSA) twice (a scanned segment), learned routing
# from layer 2; widths chosen so wq_b / wo_a span two 128-blocks and experts two 32-groups.
SMALL = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=16,
    compress_ratios=[0, 4, 128, 4, 128, 4], num_hash_layers=2, moe_intermediate_size=64,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5,
    norm_topk_prob=True, scoring_func="sqrtsoftplus", topk_method="noaux_tc", swiglu_limit=10.0,
    index_n_heads=4, index_head_dim=32, index_topk=64, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                  "beta_fast": 32, "beta_slow": 1},
    hidden_act="silu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)
# The export layout test's model: SWA (hash-routed), CSA, HCA, with widths chosen so that the
# tensors it checks are not square (M = 96, head_dim 48, o_lora 24, F = 64, E = 3, vocab 320): a
# transpose or a reshape in place of a transpose changes their shape or their bytes.
NARROW = dict(SMALL, hidden_size=96, num_hidden_layers=3, compress_ratios=[0, 4, 128], num_hash_layers=1,
              head_dim=48, o_lora_rank=24, moe_intermediate_size=64, n_routed_experts=3, num_experts_per_tok=2,
              index_n_heads=2, index_head_dim=32, hc_mult=2, vocab_size=320)
