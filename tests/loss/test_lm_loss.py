"""The chunked LM loss (core/loss/lm.py) against the direct formula and a float64 loop reference;
its compiled memory; the model's hidden-state API feeding it; the remat policies of the layers."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import jax.extend.core  # noqa: F401  (jaxprs_in_params)
import jax.test_util  # noqa: F401  (check_grads)
import numpy as np
import pytest
from flax import nnx

from core.config.schema import load_config
from core.loss.lm import chunked_lm_loss, head_logits, lm_loss, lm_loss_from_hidden
from core.model.transformer import REMAT_POLICIES, Transformer
from core.spec.resolve import resolve
from tests.conftest import init_model


def reference_nll(h, w, targets, mask):
    """Loop-based float64: mean over masked tokens of log sum exp(h.w) - h.w[target]."""
    total, count = 0.0, 0
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            if mask[b, t]:
                row = [float(np.dot(h[b, t], w[:, v])) for v in range(w.shape[1])]
                top = max(row)
                total += top + math.log(sum(math.exp(x - top) for x in row)) - row[targets[b, t]]
                count += 1
    return total / max(count, 1)


def inputs(seed, b=2, t=7, m=5, v=11, dtype=np.float64):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(b, t, m)) * 2
    w = rng.normal(size=(m, v))
    targets = rng.integers(0, v, size=(b, t))
    mask = rng.integers(0, 2, size=(b, t))
    mask[0, 0] = 1
    return h.astype(dtype), w.astype(dtype), targets.astype(np.int32), mask.astype(np.int32)


def direct(h, w, targets, mask):
    return lm_loss(head_logits(h, w), targets, mask)


@pytest.mark.parametrize("chunk", [1, 3, 4, 14, 100])
def test_chunked_equals_reference_and_direct_float64(x64, chunk):
    """Value vs the loop reference; value and gradients (h, head) vs the direct path, float64.

    B * T = 14 tokens: chunk 3 and 4 leave a partial last chunk, 100 is larger than the batch."""
    h, w, targets, mask = inputs(0)
    got = chunked_lm_loss(jnp.asarray(h), jnp.asarray(w), targets, mask, chunk=chunk)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(float(got), reference_nll(h, w, targets, mask), rtol=1e-12)
    grad = jax.grad(lambda a, b: chunked_lm_loss(a, b, targets, mask, chunk=chunk), argnums=(0, 1))(h, w)
    want = jax.grad(lambda a, b: direct(a, b, targets, mask), argnums=(0, 1))(h, w)
    for g, ref in zip(grad, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-10, atol=1e-12,
                                   err_msg=f"max diff {np.abs(np.asarray(g) - np.asarray(ref)).max()}")
    jax.test_util.check_grads(lambda a, b: chunked_lm_loss(a, b, targets, mask, chunk=chunk), (h, w), order=1,
                              modes=("rev",), atol=1e-6, rtol=1e-6)


def _scan_lengths(jaxpr) -> list[int]:
    """The lengths of the scans in a (closed) jaxpr, nested ones included."""
    out = []
    for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        out += [e.params["length"]] if e.primitive.name == "scan" else []
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            out += _scan_lengths(sub)
    return out


def test_under_a_mesh_each_device_chunks_its_own_rows():
    """8 rows x 32 positions, chunk 16: on one device 2 positions of every row a step (16 steps of 16
    tokens); on a mesh of 8 batch shards (expert 8), each device's one row 16 positions a step (2 steps of
    8 x 16 tokens, 16 on each device), never a scan over chunks of the flattened rows that span devices."""
    from jax.sharding import AbstractMesh, AxisType

    h, w, targets, mask = inputs(0, b=8, t=32, dtype=np.float32)
    loss = functools.partial(chunked_lm_loss, chunk=16)
    assert _scan_lengths(jax.make_jaxpr(loss)(h, w, targets, mask)) == [16]
    mesh = AbstractMesh((1, 1, 1, 8), ("data", "fsdp", "tensor", "expert"), axis_types=(AxisType.Auto,) * 4)
    with jax.sharding.use_abstract_mesh(mesh):
        assert _scan_lengths(jax.make_jaxpr(loss)(h, w, targets, mask)) == [2]


def test_chunked_equals_direct_float32():
    h, w, targets, mask = inputs(1, b=3, t=50, m=16, v=300, dtype=np.float32)
    fns = {"chunked": lambda a, b: lm_loss_from_hidden(a, b, targets, mask, chunk=32),
           "direct": lambda a, b: lm_loss_from_hidden(a, b, targets, mask, chunk=0)}
    out = {k: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w) for k, f in fns.items()}
    (v1, g1), (v0, g0) = out["chunked"], out["direct"]
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    for a, b in zip(g1, g0):
        scale = np.abs(np.asarray(b)).max()
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * scale, np.abs(np.asarray(a) - np.asarray(b)).max()


def test_all_masked_gives_zero_and_no_nan():
    h, w, targets, _ = inputs(2, dtype=np.float32)
    zero = np.zeros(targets.shape, np.int32)
    value, grads = jax.value_and_grad(lambda a, b: chunked_lm_loss(a, b, targets, zero, chunk=4), argnums=(0, 1))(h, w)
    assert float(value) == 0.0
    assert all(np.all(np.asarray(g) == 0) for g in grads)


def _temp_bytes(fn, *specs) -> int:
    return jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_is_linear_and_bounded_by_the_chunk():
    """XLA's temp size of loss + gradients (h, head): chunked ~linear in T and far below direct.

    V = 8192, M = 64, chunk 256: the direct path keeps [T, V] float32 logits (32 MiB at T = 1024)."""
    m, v, chunk = 64, 8192, 256

    def temp(seq, c):
        def step(h, w, targets, mask):
            return jax.value_and_grad(lambda a, b: lm_loss_from_hidden(a, b, targets, mask, chunk=c), (0, 1))(h, w)
        f32, i32 = jnp.float32, jnp.int32
        return _temp_bytes(step, jax.ShapeDtypeStruct((1, seq, m), f32), jax.ShapeDtypeStruct((m, v), f32),
                           jax.ShapeDtypeStruct((1, seq), i32), jax.ShapeDtypeStruct((1, seq), i32))

    short, long = temp(1024, chunk), temp(4096, chunk)
    assert long <= 4.5 * short, (short, long)  # 4x the tokens: at most linear
    assert long - short <= 3 * (4096 - 1024) * (m + 4) * 4, (short, long)  # growth: a few [T, M] rows
    dense = temp(4096, 0)
    assert long < dense / 8, (long, dense)
    assert dense > 4096 * v * 4, dense  # the direct path does hold [T, V] logits: the test can tell


def test_bfloat16_head_is_never_copied_beside_the_forward():
    """A bfloat16 head enters the matmuls as it is: no float32 copy of it lives beside the forward's
    activations (XLA:CPU upcasts bfloat16 dot operands and could otherwise convert the head first thing).

    The "forward" here is one float32 [T, K] temporary, dead once h exists: the temp holds the larger
    of it and the head's float32 copy, not both."""
    t, k, m, v = 1024, 8192, 64, 16384

    def step(x, p, w, targets, mask):
        u_tk = jnp.tanh(x.astype(jnp.float32) * 3.0)
        return chunked_lm_loss((u_tk @ p).astype(jnp.bfloat16)[None], w, targets, mask, chunk=128)

    bf16, i32 = jnp.bfloat16, jnp.int32
    temp = _temp_bytes(step, jax.ShapeDtypeStruct((t, k), bf16), jax.ShapeDtypeStruct((k, m), jnp.float32),
                       jax.ShapeDtypeStruct((m, v), bf16), jax.ShapeDtypeStruct((1, t), i32),
                       jax.ShapeDtypeStruct((1, t), i32))
    assert temp < t * k * 4 + m * v * 4 // 2, (temp, t * k * 4, m * v * 4)


# ----------------------------------------------------------------------------- through the model

# An unrolled hash-routed layer, then a scanned pair of learned-routing layers (sliding window only:
# CSA layers compile slowly, and the head and remat do not depend on the layer kind; the sparse
# training runs of test_train.py go through CSA layers with the default policy). Small MoE and
# Sinkhorn to compile fast.
SMALL = ["vocab_size=512", "sliding_window_size=8", "first_num_hash_layers=1", "hc_sinkhorn_iters=2",
         "compress_ratios=[0,0,0]", "base_num_decoder_layers=3", "max_target_length=32", "num_experts=4",
         "num_experts_per_tok=2", "indexer_loss_scaling_factor=0"]


def _model(*overrides):
    cfg = load_config("deepseek4-tiny", SMALL + list(overrides))
    return cfg, init_model(cfg, 3)


@functools.lru_cache(maxsize=None)
def _policy_loss(policy: str, chunk: int, via_logits: bool = False):
    """_train_loss of one shared set of parameters under `policy` (cached: each compile counts)."""
    _, base = _base()
    cfg = base_cfg().replace(remat_policy=policy)
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))), nnx.state(base))
    return _train_loss(model, chunk, via_logits)


@functools.lru_cache(maxsize=None)
def _base():
    return _model("remat_policy=none")


def base_cfg():
    return _base()[0]


def _batch():
    tokens = jax.random.randint(jax.random.key(7), (2, 32), 0, 512)
    pos = jnp.stack([jnp.arange(32), jnp.concatenate([jnp.arange(20), jnp.arange(12)])]).astype(jnp.int32)
    seg = jnp.stack([jnp.ones(32), jnp.concatenate([jnp.ones(20), 2 * jnp.ones(12)])]).astype(jnp.int32)
    mask = (jnp.arange(32) < 31)[None].repeat(2, 0).astype(jnp.int32)
    return tokens, pos, seg, jnp.roll(tokens, -1, axis=1), mask


def _train_loss(model, chunk, via_logits=False):
    """(loss, grads by path) of the step's loss: LM + indexer (0 here) + load balance."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens, pos, seg, targets, mask = _batch()

    def loss(p):
        m = nnx.merge(graphdef, p, rest, copy=True)
        if via_logits:
            logits, aux = m(tokens, pos, seg, mode="train")
            lm = lm_loss(logits, targets, mask)
        else:
            h, aux = m.hidden(tokens, pos, seg, mode="train")
            lm = lm_loss_from_hidden(h, m.head[...], targets, mask, chunk=chunk)
        return lm + aux["indexer_loss"] + aux["moe_lb_loss"]

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    value, grads = compiled(params)
    grads = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)}
    return float(value), grads, compiled.memory_analysis().temp_size_in_bytes


def _assert_same(a, b, rtol):
    """Loss to `rtol`; gradients to `rtol` of the gradient's own magnitude (its largest entry over all
    parameters): a leaf whose entries are small sums of large cancelling terms (hc_head.base) carries
    the rounding of those terms, not of its tiny result (the MoE's and the loss's sums are ordered
    differently in the two programs)."""
    (va, ga, _), (vb, gb, _) = a, b
    np.testing.assert_allclose(va, vb, rtol=rtol)
    assert ga.keys() == gb.keys()
    scale = max(float(np.abs(g).max()) for g in gb.values())
    for k in ga:
        diff = float(np.abs(ga[k] - gb[k]).max())
        assert diff <= rtol * scale, f"{k}: max diff {diff} (largest gradient entry {scale})"


def test_model_hidden_path_equals_logits_path():
    """The step's chunked loss from `hidden` = lm_loss of `__call__`'s logits, gradients included
    (head, final norm, hc_head and every layer)."""
    want = _policy_loss("none", 0, via_logits=True)
    assert np.any(want[1]["head"] != 0) and np.any(want[1]["norm.weight"] != 0)
    _assert_same(_policy_loss("none", 7), want, 1e-6)  # 64 tokens, chunk 7: a partial last chunk


@pytest.mark.parametrize("policy", sorted(set(REMAT_POLICIES) - {"none"}))
def test_remat_policies_give_the_same_loss_and_gradients(policy):
    """Remat recomputes the same function; XLA may fuse and order the recomputation differently, so
    gradients agree to float32 rounding of the gradient's own magnitude (the largest entry over all
    parameters): a leaf whose entries are small sums of large cancelling terms (hc_head.base) carries
    the rounding of those terms, not of its tiny result."""
    (va, ga, _), (vb, gb, _) = _policy_loss(policy, 7), _policy_loss("none", 7)
    np.testing.assert_allclose(va, vb, rtol=1e-6)
    assert ga.keys() == gb.keys()
    scale = max(float(np.abs(g).max()) for g in gb.values())
    for k in ga:
        diff = float(np.abs(ga[k] - gb[k]).max())
        assert diff <= 1e-6 * scale, f"{k}: max diff {diff} (largest gradient entry {scale})"


def test_remat_reduces_compiled_temp_memory():
    """XLA's temp size of the loss + gradient programs above: full < minimal < none (deterministic)."""
    sizes = {p: _policy_loss(p, 7)[2] for p in REMAT_POLICIES}
    assert sizes["full"] < sizes["minimal"] < sizes["none"], sizes
