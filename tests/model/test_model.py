"""The decoder: parameter counts, scan = unrolled, causality, packing, modes, gradient isolation.

Shrunken configs keep every layer kind, hash and learned routing, the scanned unit and a tail:
  A: compress_ratios [0, 4, 128, 4, 128, 4], first_num_hash_layers 1 -> segments: layer 0,
     scanned (CSA, HCA) x 2, layer 5 (CSA); T = 128 so the HCA block exists.
  B: [4, 4], learned routing, T = 32: cheap stage and gradient checks (one scanned CSA pair).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.config.schema import load_config
from core.model.attention import collect
from core.model.transformer import Transformer, layer_plan, param_counts
from core.model.moe import HashTable
from core.spec.resolve import resolve

SMALL = ["vocab_size=512", "sliding_window_size=8", "indexer_topk=4", "first_num_hash_layers=1",
         "hc_sinkhorn_iters=3"]  # fewer Sinkhorn steps only to compile faster
CFG_A = SMALL + ["compress_ratios=[0,4,128,4,128,4]", "base_num_decoder_layers=6", "max_target_length=128"]
CFG_B = SMALL + ["compress_ratios=[4,4]", "base_num_decoder_layers=2", "max_target_length=32",
                 "first_num_hash_layers=0"]
SPARSE = ["indexer_loss_scaling_factor=0.1", "indexer_sparse_training=true"]
WARMUP = ["indexer_loss_scaling_factor=0.01", "indexer_sparse_training=false"]


# ----------------------------------------------------------------------------- parameter counts


def official_inventory(cfg):
    """Parameter count from the official checkpoint's tensor list (independent of our modules)."""
    m, h, d, ql, g, ol = cfg.emb, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    e, f, k, n = cfg.num_experts, cfg.moe_mlp_dim, cfg.num_experts_per_tok, cfg.mhc_expansion_rate
    hi, di, mix = cfg.indexer_n_heads, cfg.indexer_head_dim, (2 + n) * n
    total = active = 0
    for layer, r in enumerate(cfg.compress_ratios):
        attn = m * ql + ql + ql * h * d + m * d + d + h * d * ol + g * ol * m + h  # wq_a..attn_sink
        if r:
            c = 2 if r == 4 else 1
            attn += r * c * d + 2 * m * c * d + d                                   # compressor
        if r == 4:
            attn += ql * hi * di + m * hi + 4 * 2 * di + 2 * m * 2 * di + di        # indexer
        gate = m * e + (e if layer >= cfg.first_num_hash_layers else 0)             # weight, bias
        moe = gate + (e + cfg.shared_experts) * 3 * m * f
        block = attn + moe + 2 * m + 2 * (mix * n * m + mix + 3)                    # norms, hc_*
        total += block
        active += block - (e - k) * 3 * m * f
    top = 2 * cfg.vocab_size * m + m + n * n * m + n + 1                            # embed, head, norm, hc_head
    return total + top, active + top - cfg.vocab_size * m


def test_param_counts_exact():
    want = {"deepseek4-284b": (284_332_240_471, 13_270_101_591),
            "deepseek4-1.6t": (1_572_997_201_763, 48_852_402_019)}
    for name, (total, active) in want.items():
        cfg = load_config(name)
        assert official_inventory(cfg) == (total, active)
        assert param_counts(resolve(cfg, "cpu").model) == {"total": total, "active": active}, name
    tiny = load_config("deepseek4-tiny")
    total, active = official_inventory(tiny)
    assert param_counts(resolve(tiny, "cpu").model) == {"total": total, "active": active}


def test_layer_plan():
    def plan(name, *overrides, scan=True):
        cfg = load_config(name, list(overrides))
        return layer_plan(resolve(cfg, "cpu").model.blocks, scan)

    assert plan("deepseek4-tiny") == ((0, 1, 2), (2, 1, 1), (3, 2, 20))
    assert plan("deepseek4-tiny", scan=False) == tuple((i, 1, 1) for i in range(43))
    assert plan("deepseek4-1.6t") == ((0, 1, 2), (2, 1, 1), (3, 2, 29))
    assert plan("deepseek4-tiny", *CFG_A) == ((0, 1, 1), (1, 2, 2), (5, 1, 1))
    assert plan("deepseek4-tiny", *CFG_B) == ((0, 1, 2),)


# ----------------------------------------------------------------------------- shared model A


def tokens_for(seed, shape, vocab=512):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def with_params(cfg, source):
    """A model of `cfg` holding `source`'s parameters (same structure): no second initialisation."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(source))


def stacked_from_unrolled(cfg, src):
    """A scanned model of `cfg` whose parameters are those of the unrolled model `src`."""
    abstract = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    src_flat = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(src))}  # host: no compiles

    def source(path):
        if path[0] != "layers":
            return src_flat[path]
        start, unit, reps = abstract.segments[path[1]]
        if reps == 1:
            return src_flat[("layers", start) + path[2:]]
        u = path[3]  # ("layers", s, "blocks", u, ...): stack layers start + j * unit + u
        return np.stack([src_flat[("layers", start + j * unit + u) + path[4:]] for j in range(reps)])

    for path, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(source(path)))
    return nnx.merge(graphdef, state)


def random_model(cfg, seed):
    """`cfg`'s model with every variable drawn on the host (no per-shape XLA init compiles).

    Weights ~ N(0, 1/fan_in); the parameters the model initialises to constants (norm scales,
    sinks, ape, mHC bases and scales, router biases) get random values too, so the tests do not
    lean on their initial values. Hash tables: k distinct experts per token.
    """
    abstract = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        stacked = (var.get_metadata().get("out_sharding") or (None,))[0] == "layers"
        core = var.shape[1:] if stacked else var.shape
        name = path[-1]
        if isinstance(var, HashTable):
            noise = rng.random(var.shape[:-1] + (cfg.num_experts,))
            value = np.argsort(noise, axis=-1)[..., : var.shape[-1]].astype(np.int32)
        elif isinstance(var, nnx.BatchStat) or name in ("attn_sink", "ape", "base"):
            value = 0.3 * rng.standard_normal(var.shape)
        elif name == "scale":
            value = 0.05 + 0.05 * rng.random(var.shape)
        elif len(core) == 1:  # RMSNorm scales
            value = 1.0 + 0.1 * rng.standard_normal(var.shape)
        else:
            value = rng.standard_normal(var.shape) / np.sqrt(core[-2])
        var.set_value(jnp.asarray(value, var.dtype))
    return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=None)
def model_a(scan: bool = True):
    unrolled_cfg = load_config("deepseek4-tiny", CFG_A + ["scan_layers=false"])
    if not scan:
        return unrolled_cfg, random_model(unrolled_cfg, 0)
    cfg = unrolled_cfg.replace(scan_layers=True)
    return cfg, stacked_from_unrolled(cfg, model_a(False)[1])


@functools.lru_cache(maxsize=None)
def model_b():
    cfg = load_config("deepseek4-tiny", CFG_B + SPARSE)
    return cfg, random_model(cfg, 1)


@nnx.jit
def eval_fwd(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids, mode="eval", probe=collect)


def rows_of(*docs, t=128):
    """positions, segment_ids for rows made of documents (lengths), padded with segment 0."""
    pos, seg = np.zeros((len(docs), t), np.int32), np.zeros((len(docs), t), np.int32)
    for b, lengths in enumerate(docs):
        start = 0
        for i, n in enumerate(lengths):
            pos[b, start:start + n], seg[b, start:start + n] = np.arange(n), i + 1
            start += n
    return jnp.asarray(pos), jnp.asarray(seg)


def test_scan_equals_unrolled():
    cfg_u, unrolled = model_a(False)
    _, scanned = model_a(True)
    assert scanned.segments == ((0, 1, 1), (1, 2, 2), (5, 1, 1)) and len(unrolled.segments) == 6
    tokens = tokens_for(0, (2, 128))
    pos, seg = rows_of([128], [100])
    logits_s, aux_s = eval_fwd(scanned, tokens, pos, seg)
    logits_u, aux_u = eval_fwd(unrolled, tokens, pos, seg)
    np.testing.assert_allclose(logits_s, logits_u, atol=1e-5, rtol=1e-5)
    assert set(aux_s) == set(aux_u)
    for key in aux_s:
        np.testing.assert_allclose(np.asarray(aux_s[key], np.float64), np.asarray(aux_u[key], np.float64),
                                   atol=1e-5, rtol=1e-5, err_msg=key)
    e = cfg_u.num_experts
    assert aux_s["expert_load"].shape == (6, e) and aux_s["index_scores"].shape == (3, 2, 128, 32)
    assert aux_s["topk_idx"].shape == (3, 2, 128, 4) and aux_s["teacher_query"].shape == (3, 2, 128, 4, 32)
    np.testing.assert_allclose(aux_s["expert_load"].sum(-1), cfg_u.num_experts_per_tok, rtol=1e-6)
    assert float(aux_s["indexer_loss"]) == 0.0 and float(aux_s["moe_lb_loss"]) > 0


def test_causality_through_compressed_blocks():
    _, model = model_a(True)
    pos, seg = rows_of([128], [128])
    tokens = tokens_for(1, (2, 128))
    t0 = 70  # CSA blocks up to 70 are visible; row 1 perturbs only the last token (HCA block 0 is complete only at t = 127)
    later = jnp.arange(128) > t0
    tokens2 = tokens.at[0].set(jnp.where(later, (tokens[0] + 7) % 512, tokens[0]))
    tokens2 = tokens2.at[1, 127].set((tokens[1, 127] + 7) % 512)
    logits, aux = eval_fwd(model, tokens, pos, seg)
    logits2, aux2 = eval_fwd(model, tokens2, pos, seg)
    np.testing.assert_allclose(logits[0, :t0 + 1], logits2[0, :t0 + 1], atol=1e-6)
    np.testing.assert_allclose(aux["index_scores"][:, 0, :t0 + 1], aux2["index_scores"][:, 0, :t0 + 1], atol=1e-6)
    np.testing.assert_allclose(logits[1, :127], logits2[1, :127], atol=1e-6)
    assert float(jnp.max(jnp.abs(logits[0, t0 + 1:] - logits2[0, t0 + 1:]))) > 1e-4


def test_packed_documents_equal_each_alone():
    """Documents starting at block boundaries: packed outputs = outputs of each alone (padded)."""
    _, model = model_a(True)
    a, b = tokens_for(2, (64,)), tokens_for(3, (64,))
    pad = jnp.zeros(64, jnp.int32)
    pos, seg = rows_of([64, 64], [64])
    logits, _ = eval_fwd(model, jnp.stack([jnp.concatenate([a, b]), jnp.concatenate([a, pad])]), pos, seg)
    np.testing.assert_allclose(logits[0, :64], logits[1, :64], atol=2e-5)
    logits_b, _ = eval_fwd(model, jnp.stack([jnp.concatenate([b, pad]), jnp.concatenate([a, b])]),
                           pos[::-1], seg[::-1])
    np.testing.assert_allclose(logits[0, 64:], logits_b[0, :64], atol=2e-5)


# ----------------------------------------------------------------------------- stages and gradients


def split_grads(model, tokens, pos, seg, mode):
    """Gradients of (LM loss, indexer loss) w.r.t. every parameter, by path, plus the values."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def losses(p, r):
        logits, aux = nnx.merge(graphdef, p, r, copy=True)(tokens, pos, seg, mode=mode)
        lm = jnp.zeros(()) if logits is None else -jnp.mean(
            jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))
        return lm, aux["indexer_loss"]

    @jax.jit
    def run(p, r):
        (lm, idx), pull = jax.vjp(lambda q: losses(q, r), p)
        # one batched backward pass for both cotangents (1, 0) and (0, 1)
        grads = jax.vmap(lambda c: pull((c[0], c[1]))[0])(jnp.eye(2))
        return lm, idx, grads

    lm, idx, grads = run(params, rest)
    g_lm = {".".join(map(str, k)): np.asarray(v[...])[0] for k, v in nnx.to_flat_state(grads)}  # sliced on the host
    g_idx = {".".join(map(str, k)): np.asarray(v[...])[1] for k, v in nnx.to_flat_state(grads)}
    return float(lm), float(idx), g_lm, g_idx


def assert_isolated(g_idx, g_lm=None):
    indexer = [k for k in g_idx if "indexer" in k]
    assert {k.split("indexer.")[1] for k in indexer} == {
        "wq_b", "weights_proj", "compressor.wkv", "compressor.wgate", "compressor.ape",
        "compressor.norm.weight"}
    for k, g in g_idx.items():
        if "indexer" in k:
            assert np.any(g != 0), f"indexer loss gives no gradient to {k}"
        else:
            assert np.all(g == 0), f"indexer loss leaks into {k}: {np.abs(g).max()}"
    if g_lm is not None:
        for k in indexer:
            assert np.all(g_lm[k] == 0), f"LM loss reaches {k}"
        assert np.any(g_lm["head"] != 0)


def test_sparse_training_forward_backward_and_isolation():
    """Sparse stage: logits and indexer loss, each loss's gradients on its own side only.

    (The streamed loss and the joint teacher are checked at the layer: test_attention.py.)
    """
    cfg, model = model_b()
    tokens = tokens_for(4, (2, 32))
    pos, seg = rows_of([32], [16, 14], t=32)
    lm, idx, g_lm, g_idx = split_grads(model, tokens, pos, seg, "train")
    assert np.isfinite(lm) and lm > 0 and idx > 0
    assert_isolated(g_idx, g_lm)
    assert all(np.all(np.isfinite(g)) for g in g_lm.values())


def test_stage_table():
    """(CSA attends all visible blocks, indexer loss computed, LM head run) per stage and mode."""
    def flags(*overrides):
        cfg = load_config("deepseek4-tiny", CFG_B + list(overrides))
        return nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))._flags

    warmup, sparse, off = flags(*WARMUP), flags(*SPARSE), flags("indexer_loss_scaling_factor=0")
    assert warmup("train") == (True, True, False)
    assert sparse("train") == (False, True, True)
    assert off("train") == (False, False, True)
    for f in (warmup, sparse, off):
        assert f("eval") == (False, False, True) and f("eval_dense") == (True, False, True)
    no_indexer = flags("use_indexer=false")
    assert no_indexer("train") == (False, False, True)
    cfg = load_config("deepseek4-tiny", CFG_B + ["use_indexer=false"])
    assert not any("indexer" in ".".join(map(str, p)) for p, _ in
                   nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0))))))


def test_dense_warmup_runs_no_head_and_isolates():
    cfg = load_config("deepseek4-tiny", CFG_B + WARMUP)
    model = with_params(cfg, model_b()[1])
    pos, seg = rows_of([32], [20, 12], t=32)
    lm, idx, _, g_idx = split_grads(model, tokens_for(5, (2, 32)), pos, seg, "train")
    assert lm == 0.0 and idx > 0  # the LM head is not run in the dense warm-up
    assert_isolated(g_idx)


def test_modes_are_validated():
    _, model = model_a(True)
    with pytest.raises(ValueError, match="mode"):
        model(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32), mode="test")


def test_initialisation():
    """The real initialiser: zero sinks, unit norms, fan-in scale, one hash table per layer.

    Layers 0 and 1 are hash-routed SWA layers stacked in one scanned segment: their tables differ.
    """
    cfg = load_config("deepseek4-tiny", SMALL + ["compress_ratios=[0,0]", "base_num_decoder_layers=2",
                                                  "max_target_length=32", "first_num_hash_layers=2"])
    model = nnx.jit(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))()  # one compile, not one per shape
    assert model.segments == ((0, 1, 2),)
    block = model.layers[0].blocks[0]
    np.testing.assert_array_equal(block.attn.attn_sink[...], 0.0)
    np.testing.assert_array_equal(block.attn_norm.weight[...], 1.0)
    assert 0.5 < float(jnp.std(block.attn.wq_a[...]) * np.sqrt(cfg.emb)) < 1.5
    tables = np.asarray(model.layers[0].blocks[0].ffn.gate.tid2eid[...])
    assert tables.shape == (2, cfg.vocab_size, cfg.num_experts_per_tok)
    assert all(len(set(row)) == len(row) for row in tables.reshape(-1, cfg.num_experts_per_tok))
    assert np.mean(tables[0] != tables[1]) > 0.5


def test_parameter_paths_and_axes():
    cfg = load_config("deepseek4-tiny", CFG_A)
    model = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    paths = {".".join(map(str, k)): v for k, v in state}
    assert "layers.1.blocks.0.attn.indexer.wq_b" in paths and "layers.2.attn.indexer.weights_proj" in paths
    assert "layers.0.ffn.gate.weight" in paths and "layers.1.blocks.1.attn.compressor.ape" in paths
    for path, var in paths.items():
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == len(var.shape), path
        assert (axes[0] == "layers") == path.startswith("layers.1."), path
    assert paths["layers.1.blocks.0.attn.wq_b"].get_metadata()["out_sharding"] == ("layers", "q_lora", "heads", "kv")
    assert paths["embed"].get_metadata()["out_sharding"] == ("vocab", "embed")


def test_router_bias_update_reaches_every_learned_layer():
    cfg, model = model_a(True)
    model = nnx.clone(model)
    e = cfg.num_experts
    load = jnp.full((6, e), cfg.num_experts_per_tok / e).at[:, 0].set(1.0)  # expert 0 overloaded
    biases = lambda m: [m.layers[1].blocks[0].ffn.gate.bias[...], m.layers[1].blocks[1].ffn.gate.bias[...],
                        m.layers[2].ffn.gate.bias[...][None]]
    before = biases(model)
    model.update_router_biases(load, 0.01)
    assert model.layers[0].ffn.gate.bias is None  # hash-routed layer: no bias
    for old, new in zip(before, biases(model)):
        np.testing.assert_allclose(new[:, 0] - old[:, 0], -0.01, atol=1e-7)
        np.testing.assert_allclose(new[:, 1:] - old[:, 1:], 0.01, atol=1e-7)


def test_moe_impl_key_reaches_every_block_and_paths_agree():
    """`moe_impl` picks every layer's expert computation; tiled and dense give the same logits."""
    cfg, tiled = model_b()
    dense_cfg = cfg.replace(moe_impl="dense")
    dense = with_params(dense_cfg, tiled)
    impls = lambda m: {x.spec.impl for _, x in nnx.iter_graph(m) if type(x).__name__ == "MoE"}  # noqa: E731
    assert impls(tiled) == {"tiled"} and impls(dense) == {"dense"}
    tokens = tokens_for(3, (2, 32))
    pos, seg = rows_of([32], [20, 12], t=32)
    logits_t, _ = eval_fwd(tiled, tokens, pos, seg)
    logits_d, _ = eval_fwd(dense, tokens, pos, seg)
    np.testing.assert_allclose(logits_t, logits_d, atol=1e-5, rtol=1e-5)
