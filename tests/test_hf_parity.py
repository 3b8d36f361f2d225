"""Parity with an independent implementation: Hugging Face `transformers`' DeepSeek-V4.

`tests/fixtures/hf_deepseek_v4.npz` (written by `tools/make_hf_fixture.py`, described with every
HF-vs-official-vs-DESIGN difference in `tests/fixtures/hf_deepseek_v4.md`) holds a tiny random
DeepSeek-V4 (SWA, CSA, HCA, CSA layers; hash routing in layers 0-1, learned routing with a
selection bias in layers 2-3; mHC; sinks; YaRN on the compressed layers), its weights in HF names
and layouts, 256 token ids, HF's logits and per-layer intermediates. This test needs no torch:
it maps the weights onto `core.model.Transformer` (`hf_to_dsv4`, the one name/layout map), then

  * the whole forward: logits, the CSA layers' indexer scores and compressed kv;
  * every layer in isolation, fed HF's own input streams, so a mismatch names its component:
    mHC weights, attention sublayer, compressors, indexer keys, routing, MoE sublayer, layer
    output, the head.

Deviations (hf_deepseek_v4.md, D1-D11): none touches what is compared here. HF and the official
code agree on every prefill semantic this fixture exercises; their differences are numerics (fp8/
fp4 simulation, Hadamard rotation: D1), SwiGLU limit 0 (D2, not exercised), top-k ties (D3,
avoided: indexer_topk = W selects every visible block and router margins are >= 2e-4), packing
(D4, one document), training-only losses/bias updates (D5, D6: not compared) and decoding (D8).
Comparisons that depend on a convention rather than the maths are marked CONVENTION below.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config import load_config
from core.mhc import HyperConnection, expand
from core.model import Transformer
from core.moe import combine_weights, route, router_scores

FIXTURE = Path(__file__).parent / "fixtures" / "hf_deepseek_v4.npz"
LOGIT_TOL = 1e-4   # float32, composite (the whole 4-layer forward)
STEP_TOL = 1e-4    # float32, one layer or sublayer fed HF's inputs (composite)
SIMPLE_TOL = 1e-5  # float32, a single small computation (mHC weights, router weights)


# ----------------------------------------------------------------------------- the name map


def _t(a, dims=None):
    return a.T


def _linear_heads(heads_key, dim_key):
    """[heads * dim, in] (torch Linear) -> [in, heads, dim]."""
    return lambda a, c: a.T.reshape(a.shape[1], c[heads_key], c[dim_key])


def _hc_fn(a, c):
    """[J, n * M] (HF / official) -> [n, M, J]: ours[i, m, j] = hf[j, i * M + m]."""
    return a.reshape(a.shape[0], c["n"], c["emb"]).transpose(1, 2, 0)


def _grouped_out(a, c):
    """o_a_proj [G * R, H/G * D] -> wo_a [G, H/G * D, R] (HF views it as [G, R, H/G * D])."""
    g = c["o_groups"]
    return a.reshape(g, a.shape[0] // g, a.shape[1]).transpose(0, 2, 1)


def _experts_half(half):
    """gate_up_proj [E, 2F, M] (rows [:F] gate = w1, [F:] up = w3) -> [E, M, F]."""
    def convert(a, c):
        f = a.shape[1] // 2
        return a[:, half * f:(half + 1) * f, :].transpose(0, 2, 1)
    return convert


# (HF name regex relative to `model.layers.{i}.` or the model root, dsv4 path, convert). The dsv4
# path is relative to the layer's Block; `convert(array, dims)` turns HF's layout into ours
# (torch Linear [out, in] -> ours [in, out]). One HF tensor may feed several dsv4 ones.
LAYER_RULES = [
    (r"input_layernorm\.weight", "attn_norm.weight", None),
    (r"post_attention_layernorm\.weight", "ffn_norm.weight", None),
    (r"attn_hc\.fn", "hc_attn.fn", _hc_fn),
    (r"attn_hc\.(base|scale)", r"hc_attn.\1", None),
    (r"ffn_hc\.fn", "hc_ffn.fn", _hc_fn),
    (r"ffn_hc\.(base|scale)", r"hc_ffn.\1", None),
    (r"self_attn\.q_a_proj\.weight", "attn.wq_a", _t),
    (r"self_attn\.q_a_norm\.weight", "attn.q_norm.weight", None),
    (r"self_attn\.q_b_proj\.weight", "attn.wq_b", _linear_heads("heads", "head_dim")),
    (r"self_attn\.kv_proj\.weight", "attn.wkv", _t),
    (r"self_attn\.kv_norm\.weight", "attn.kv_norm.weight", None),
    (r"self_attn\.o_a_proj\.weight", "attn.wo_a", _grouped_out),
    (r"self_attn\.o_b_proj\.weight", "attn.wo_b", _t),
    (r"self_attn\.sinks", "attn.attn_sink", None),
    # the indexer: HF nests it in the CSA compressor, the official code and dsv4 beside it
    (r"self_attn\.compressor\.indexer\.q_b_proj\.weight", "attn.indexer.wq_b",
     _linear_heads("indexer_heads", "indexer_head_dim")),
    (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight", "attn.indexer.weights_proj", _t),
    (r"self_attn\.compressor\.indexer\.kv_proj\.weight", "attn.indexer.compressor.wkv", _t),
    (r"self_attn\.compressor\.indexer\.gate_proj\.weight", "attn.indexer.compressor.wgate", _t),
    (r"self_attn\.compressor\.indexer\.position_bias", "attn.indexer.compressor.ape", None),
    (r"self_attn\.compressor\.indexer\.kv_norm\.weight", "attn.indexer.compressor.norm.weight", None),
    (r"self_attn\.compressor\.kv_proj\.weight", "attn.compressor.wkv", _t),
    (r"self_attn\.compressor\.gate_proj\.weight", "attn.compressor.wgate", _t),
    (r"self_attn\.compressor\.position_bias", "attn.compressor.ape", None),
    (r"self_attn\.compressor\.kv_norm\.weight", "attn.compressor.norm.weight", None),
    (r"mlp\.gate\.weight", "ffn.gate.weight", _t),
    (r"mlp\.gate\.e_score_correction_bias", "ffn.gate.bias", None),
    (r"mlp\.gate\.tid2eid", "ffn.gate.tid2eid", None),
    (r"mlp\.experts\.gate_up_proj", "ffn.experts.w1", _experts_half(0)),
    (r"mlp\.experts\.gate_up_proj", "ffn.experts.w3", _experts_half(1)),
    (r"mlp\.experts\.down_proj", "ffn.experts.w2", lambda a, c: a.transpose(0, 2, 1)),
    (r"mlp\.shared_experts\.gate_proj\.weight", "ffn.shared_experts.w1", _t),
    (r"mlp\.shared_experts\.up_proj\.weight", "ffn.shared_experts.w3", _t),
    (r"mlp\.shared_experts\.down_proj\.weight", "ffn.shared_experts.w2", _t),
]
ROOT_RULES = [
    (r"model\.embed_tokens\.weight", "embed", None),
    (r"lm_head\.weight", "head", _t),
    (r"model\.norm\.weight", "norm.weight", None),
    (r"model\.hc_head\.hc_fn", "hc_head.fn", _hc_fn),
    (r"model\.hc_head\.hc_base", "hc_head.base", None),
    (r"model\.hc_head\.hc_scale", "hc_head.scale", None),
]


def hf_to_dsv4(hf_params: dict[str, np.ndarray], dims: dict[str, int]) -> dict[str, np.ndarray]:
    """HF state dict -> {dsv4 logical path: array in dsv4 layout}.

    Logical paths name layer i as `layers.{i}.<block path>` whatever the model's scan grouping
    (`set_params` places them); root parameters keep their names (`embed`, `head`, ...).
    Raises if an HF tensor matches no rule.
    """
    out = {}
    for name, value in hf_params.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        rules, prefix, rest = (LAYER_RULES, f"layers.{m.group(1)}.", m.group(2)) if m else (ROOT_RULES, "", name)
        hits = [(re.fullmatch(p, rest), target, conv) for p, target, conv in rules]
        hits = [(h, target, conv) for h, target, conv in hits if h]
        if not hits:
            raise KeyError(f"HF tensor {name} has no dsv4 counterpart in the name map")
        for h, target, conv in hits:
            out[prefix + h.expand(target)] = value if conv is None else conv(value, dims)
    return out


def _block_slot(model: Transformer, layer: int):
    """(Block module, index into its stacked leading axis or None) of decoder layer `layer`."""
    for segment, (start, unit, reps) in zip(model.layers, model.segments):
        if start <= layer < start + unit * reps:
            if reps == 1:
                return segment, None
            j, u = divmod(layer - start, unit)
            return segment.blocks[u], j
    raise IndexError(f"layer {layer} is in no segment of {model.segments}")


def _variable(module, path: str) -> nnx.Variable:
    """The variable at dotted `path` under `module` (digits index nnx.List entries)."""
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    if not isinstance(module, nnx.Variable):
        raise KeyError(f"dsv4 path {path} is not a variable (got {type(module).__name__})")
    return module


def set_params(model: Transformer, params: dict[str, np.ndarray]) -> set[int]:
    """Write the mapped arrays into `model`; returns the ids of the variables written."""
    written = set()
    for path, value in params.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
        if m:
            block, j = _block_slot(model, int(m.group(1)))
            var = _variable(block, m.group(2))
        else:
            var, j = _variable(model, path), None
        current = var.get_value()  # an array, or a ShapeDtypeStruct in an abstract model
        want = current.shape if j is None else current.shape[1:]
        assert tuple(value.shape) == tuple(want), f"{path}: HF gives {value.shape}, dsv4 has {want}"
        value = jnp.asarray(value, current.dtype)
        if j is not None:  # one slice of a scanned (stacked) parameter
            stack = current if isinstance(current, jax.Array) else jnp.zeros(current.shape, current.dtype)
            value = stack.at[j].set(value)
        var.set_value(value)
        written.add(id(var))
    return written


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fx():
    with np.load(FIXTURE) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays.pop("config_json")))
    return meta, arrays


@pytest.fixture(scope="module")
def cfg(fx):
    meta, _ = fx
    overrides = [f"{k}={json.dumps(v)}" for k, v in meta["dsv4_overrides"].items()]
    return load_config("deepseek4-tiny", overrides=overrides)


@pytest.fixture(scope="module")
def loaded(fx, cfg):
    """(model with HF's weights, the set of variable ids written)."""
    _, arrays = fx
    # Abstract construction (nothing initialised): every variable is then set from the fixture,
    # which test_name_map_covers_every_parameter checks.
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    dims = dict(n=cfg.mhc_expansion_rate, emb=cfg.emb, heads=cfg.num_heads, head_dim=cfg.head_dim,
                indexer_heads=cfg.indexer_n_heads, indexer_head_dim=cfg.indexer_head_dim,
                o_groups=cfg.o_groups)
    hf = {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
    written = set_params(model, hf_to_dsv4(hf, dims))
    return model, written


@pytest.fixture(scope="module")
def inputs(fx):
    _, arrays = fx
    tokens = jnp.asarray(arrays["tokens"], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return tokens, positions, jnp.ones_like(tokens)


@pytest.fixture(scope="module")
def forward(loaded, inputs):
    model, _ = loaded
    return model(*inputs, mode="eval", collect=True)


def _maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _close(name, ours, theirs, tol):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{name}: shape {ours.shape} vs HF {theirs.shape}"
    diff = _maxdiff(ours, theirs)
    assert diff < tol, f"{name}: max |dsv4 - HF| = {diff:.3e} (tolerance {tol:.0e}, HF max |x| = {np.abs(theirs).max():.2f})"


# ----------------------------------------------------------------------------- the map itself


def test_name_map_covers_every_parameter(fx, cfg, loaded):
    """Every HF tensor is used and every dsv4 parameter, selection bias and hash table is set."""
    _, arrays = fx
    model, written = loaded
    assert cfg.layer_kinds == ("swa", "csa", "hca", "csa") and cfg.first_num_hash_layers == 2
    variables = [(path, var) for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Variable)]
    missing = [".".join(map(str, path)) for path, var in variables if id(var) not in written]
    assert not missing, f"dsv4 variables the HF fixture does not set: {missing}"
    ours = sum(math.prod(var.get_value().shape) for _, var in variables)
    theirs = sum(v.size for k, v in arrays.items() if k.startswith("param/"))
    assert ours == theirs, f"dsv4 holds {ours} mapped values, HF {theirs}: a tensor is mapped twice or dropped"


# ----------------------------------------------------------------------------- whole forward


def test_logits_match_hf(fx, forward):
    _, arrays = fx
    logits, _ = forward
    _close("logits", logits, arrays["logits"], LOGIT_TOL)


def test_indexer_scores_and_compressed_kv_match_hf(fx, cfg, forward):
    """Per CSA layer (1, 3): indexer scores as continuous values, and the main compressed kv.

    CONVENTION: HF's recorded scores cover every block (it masks the future ones with -inf only
    afterwards); dsv4 masks invisible blocks with NEG. Compared on visible blocks w < (t+1)//4.
    """
    _, arrays = fx
    _, aux = forward
    t = np.arange(cfg.max_target_length)
    w = np.arange(cfg.max_target_length // 4)
    visible = w[None, :] < ((t + 1) // 4)[:, None]
    for slot, layer in enumerate(cfg.csa_layers):
        ours = np.asarray(aux["index_scores"][slot, 0])
        theirs = arrays[f"inter/layer{layer}/indexer_scores"]
        _close(f"layer {layer} indexer scores", ours[visible], theirs[visible], STEP_TOL)
        assert np.all(np.asarray(aux["topk_valid"][slot, 0]).sum(-1) == visible.sum(-1)), \
            "indexer_topk = W must select every visible block"
        _close(f"layer {layer} compressed kv", aux["compressed_kv"][slot, 0],
               arrays[f"inter/layer{layer}/compressed_kv"], STEP_TOL)


# ----------------------------------------------------------------------------- layer by layer


def _layer_input(arrays, cfg, layer):
    if layer == 0:
        emb = arrays["param/model.embed_tokens.weight"][arrays["tokens"][0]]
        return expand(jnp.asarray(emb)[None], cfg.mhc_expansion_rate)
    return jnp.asarray(arrays[f"inter/layer{layer - 1}/stream_out"])[None]


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_layer_in_isolation_matches_hf(fx, cfg, loaded, inputs, layer):
    """Layer `layer` fed HF's input stream: attention sublayer, compressors, routing, MoE, output."""
    _, arrays = fx
    model, _ = loaded
    tokens, positions, segments = inputs
    block, j = _block_slot(model, layer)
    assert j is None, "the fixture's plan (0, 4, 128, 4) with 2 hash layers is never scanned"
    x = _layer_input(arrays, cfg, layer)
    pre = f"inter/layer{layer}/"

    y, post, comb = block.hc_attn.pre(x)
    if layer == 0:
        _close("layer 0 mHC collapse y", y[0], arrays[pre + "attn_hc_collapsed"], SIMPLE_TOL)
        _close("layer 0 mHC post", post[0], arrays[pre + "attn_hc_post"], SIMPLE_TOL)
        _close("layer 0 mHC comb", comb[0], arrays[pre + "attn_hc_comb"], SIMPLE_TOL)
    h = block.attn_norm(y)
    attn_out, _ = block.attn(h, positions, segments)
    _close(f"layer {layer} attention output", attn_out[0], arrays[pre + "attn_out"], STEP_TOL)
    if cfg.compress_ratios[layer]:
        _close(f"layer {layer} compressed kv", block.attn.compressor(h, positions)[0],
               arrays[pre + "compressed_kv"], STEP_TOL)
    if cfg.compress_ratios[layer] == 4:
        c_q = block.attn.q_norm(jnp.einsum("btm,mr->btr", h, block.attn.wq_a[...]))
        _, k_idx, _ = block.attn.indexer.project(h, c_q, positions)
        _close(f"layer {layer} indexer keys", k_idx[0], arrays[pre + "indexer_k"], STEP_TOL)

    # MoE sublayer on the stream that HF's attention output produces
    x_mid = HyperConnection.post(jnp.asarray(arrays[pre + "attn_out"])[None], x, post, comb)
    y2, _, _ = block.hc_ffn.pre(x_mid)
    moe_out, _ = block.ffn(block.ffn_norm(y2), tokens, segments > 0)
    _check_routing(block, block.ffn_norm(y2), tokens, arrays, layer)
    _close(f"layer {layer} MoE output", moe_out[0], arrays[pre + "moe_out"], STEP_TOL)

    out, _ = block(x, tokens, positions, segments, dense=False, indexer_loss=False, collect=False)
    _close(f"layer {layer} output stream", out[0], arrays[pre + "stream_out"], STEP_TOL)


def _check_routing(block, h_btm, tokens, arrays, layer):
    """Chosen experts (as sets: HF's top-k is unsorted) and their combine weights."""
    moe = block.ffn
    logits = jnp.einsum("btm,me->bte", h_btm, moe.gate.weight[...])
    if moe.hash_routed:
        idx = moe.gate.tid2eid[...][tokens]
        weights = combine_weights(router_scores(logits), idx, scaling=moe.scaling, normalize=moe.normalize)
    else:
        idx, weights, _ = route(logits, moe.gate.bias[...], moe.k, scaling=moe.scaling, normalize=moe.normalize)
    idx, weights = np.asarray(idx[0]), np.asarray(weights[0])
    hf_idx = arrays[f"inter/layer{layer}/route_experts"]
    hf_w = arrays[f"inter/layer{layer}/route_weights"]
    o_ours, o_hf = np.argsort(idx, axis=-1), np.argsort(hf_idx, axis=-1)
    sorted_ours = np.take_along_axis(idx, o_ours, -1)
    sorted_hf = np.take_along_axis(hf_idx, o_hf, -1)
    assert np.array_equal(sorted_ours, sorted_hf), \
        f"layer {layer}: experts differ for {int(np.any(sorted_ours != sorted_hf, -1).sum())} tokens"
    _close(f"layer {layer} combine weights", np.take_along_axis(weights, o_ours, -1),
           np.take_along_axis(hf_w, o_hf, -1), SIMPLE_TOL)


def test_head_matches_hf(fx, cfg, loaded):
    """hc_head collapse, final norm and LM head fed HF's last stream."""
    _, arrays = fx
    model, _ = loaded
    x = jnp.asarray(arrays[f"inter/layer{cfg.num_layers - 1}/stream_out"])[None]
    collapsed = model.hc_head(x)
    _close("head mHC collapse", collapsed[0], arrays["inter/hc_head_out"], STEP_TOL)
    logits = jnp.einsum("btm,mv->btv", model.norm(collapsed), model.head[...])
    _close("head logits", logits, arrays["logits"], STEP_TOL)
