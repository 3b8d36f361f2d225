"""Frozen weights in the released FP8 / FP4 format (core/ops/quant.py, core/model/quant.py).

float64 NumPy references written from notes/checkpoint-format.md section 2; the importer's decoder
(core/hf/safetensors_io.py) and layout converters (core/hf/names.py) must agree with ours bitwise;
a warm-up on held weights equals, bitwise, one on their float32 dequantisation.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from core import tree
from core.errors import ConfigError
from core.hf import names
from core.hf import safetensors_io as st
from core.model import quant as mq
from core.model.params import mask_matcher
from core.model.transformer import Transformer
from core.ops import quant as q
from core.spec.resolve import resolve
from tests.conftest import PRODUCT_FUSION, init_model, tiny_config

LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _weights(seed: int, shape) -> np.ndarray:
    """float32 weights whose rows span magnitudes 2^-20 .. 2^10, with an all-zero row block."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 10, shape[:-1])[..., None]
    w[..., :3, :] = 0.0
    return w.astype(np.float32)


def _scale64(amax: float, fmax: float) -> float:
    """Smallest power of two 2^k with amax / 2^k <= fmax (2^-127 for 0), in float64."""
    if amax == 0:
        return 2.0 ** -127
    k = math.ceil(math.log2(amax / fmax))
    return 2.0 ** k if amax / 2.0 ** k <= fmax else 2.0 ** (k + 1)


def _ref_fp8(w: np.ndarray, b: int = 128):
    o, i = w.shape
    codes, scales = np.zeros((o, i), ml_dtypes.float8_e4m3fn), np.zeros((-(-o // b), -(-i // b)))
    for r in range(0, o, b):
        for c in range(0, i, b):
            blk = w[r:r + b, c:c + b].astype(np.float64)
            s = scales[r // b, c // b] = _scale64(float(np.abs(blk).max()), 448.0)
            codes[r:r + b, c:c + b] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
    return codes, scales


def _ref_fp4(w: np.ndarray, b: int = 32):
    o, i = w.shape
    nib, scales = np.zeros((o, i), np.uint8), np.zeros((o, i // b))
    for r in range(o):
        for c in range(0, i, b):
            blk = w[r, c:c + b].astype(np.float64)
            s = scales[r, c // b] = _scale64(float(np.abs(blk).max()), 6.0)
            nib[r, c:c + b] = (blk / s).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).view(np.int8), scales


@pytest.mark.parametrize("shape", [(300, 260), (128, 256), (5, 7)])
def test_fp8_matches_float64_reference_and_dequantises_exactly(shape):
    w = _weights(0, shape)
    codes, scales = q.quantize_fp8(jnp.asarray(w))
    ref_codes, ref_scales = _ref_fp8(w)
    assert codes.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), ref_codes.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales).astype(np.float64), ref_scales)
    deq = np.asarray(q.dequantize_fp8(codes, scales))
    ref = ref_codes.astype(np.float64) * np.repeat(np.repeat(ref_scales, 128, 0), 128, 1)[:shape[0], :shape[1]]
    assert deq.dtype == np.float32 and np.array_equal(deq.astype(np.float64), ref), np.abs(deq - ref).max()
    # the importer's decoder: one definition of the format
    np.testing.assert_array_equal(st.dequant_fp8(np.asarray(codes), np.asarray(scales)), deq)
    assert np.abs(deq - w).max() <= np.abs(w).max() / 16  # 3 mantissa bits: a sanity bound, not the test


@pytest.mark.parametrize("shape", [(64, 96), (3, 32), (130, 64)])
def test_fp4_matches_float64_reference_and_dequantises_exactly(shape):
    w = _weights(1, shape)
    packed, scales = q.quantize_fp4(jnp.asarray(w))
    ref_packed, ref_scales = _ref_fp4(w)
    assert packed.dtype == jnp.int8 and packed.shape == (shape[0], shape[1] // 2)
    np.testing.assert_array_equal(np.asarray(packed), ref_packed)
    np.testing.assert_array_equal(np.asarray(scales).astype(np.float64), ref_scales)
    u = ref_packed.view(np.uint8)
    ref = np.stack([LUT[u & 15], LUT[u >> 4]], -1).reshape(shape) * np.repeat(ref_scales, 32, 1)
    deq = np.asarray(q.dequantize_fp4(packed, scales))
    assert deq.dtype == np.float32 and np.array_equal(deq.astype(np.float64), ref), np.abs(deq - ref).max()
    np.testing.assert_array_equal(st.dequant_fp4(np.asarray(packed), np.asarray(scales)), deq)


def test_e2m1_rounds_to_nearest_even_like_ml_dtypes():
    x = np.linspace(-6, 6, 4801).astype(np.float32)
    ref = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    np.testing.assert_array_equal(np.asarray(q.e2m1_codes(jnp.asarray(x))), ref)
    np.testing.assert_array_equal(np.asarray(q.e2m1_values(jnp.arange(16, dtype=jnp.uint8))), LUT.astype(np.float32))


def test_layouts_match_the_importers_converters():
    rng = np.random.default_rng(2)
    dims = {"heads": 4, "head_dim": 8, "o_groups": 3}
    cases = [((16, 24), names.LINEAR, dict(groups=1, out=(16,))),
             ((32, 12), names.heads("heads", "head_dim"), dict(groups=1, out=(4, 8))),
             ((3 * 5, 7), names.GROUPED, dict(groups=3, out=(5,)))]
    for official_shape, conv, kw in cases:
        off = rng.standard_normal(official_shape).astype(np.float32)
        ours = np.asarray(q.to_ours(jnp.asarray(off), **kw))
        np.testing.assert_array_equal(ours, conv.to_ours(off, dims))
        np.testing.assert_array_equal(np.asarray(q.to_official(jnp.asarray(ours[None]), stack=1, groups=kw["groups"])[0]),
                                      conv.to_hf(ours, dims))


# ----------------------------------------------------------------------------- held weights in the model


def _held_model(cfg, abstract: bool = False):
    def make():
        model = init_model(cfg, cfg.init_weights_seed)
        mq.hold_released(model, mask_matcher(cfg.trainable_parameters_mask, cfg.frozen_parameters_mask))
        return model
    return nnx.eval_shape(make) if abstract else make()


HELD_LAYERS = ("compress_ratios=[0,4,4]", "base_num_decoder_layers=3")


@pytest.fixture(scope="module")
def held_tiny():
    """(warm-up config, a concrete tiny model holding its frozen weights released): three layers (the
    hash-routed SWA layer, then two CSA layers, scanned), every released format and the scanned path."""
    cfg = tiny_config("warmup", "dataset_type=synthetic", *HELD_LAYERS)
    return cfg, _held_model(cfg)


def _variables(model, kind) -> dict:
    return tree.flatten(nnx.to_pure_dict(nnx.state(model, kind)))


@pytest.mark.parametrize("stage", ["warmup", "pretrain"])
def test_hold_released_holds_exactly_the_frozen_released_weights(stage):
    cfg = tiny_config(stage)
    plain = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    trainable = mask_matcher(cfg.trainable_parameters_mask, cfg.frozen_parameters_mask)
    want = {p for p in _variables(plain, nnx.Param) if mq.released_format(p) and not trainable(p)}
    model = _held_model(cfg, abstract=True)
    held = _variables(model, mq.Released)
    assert {p.rsplit("/", 1)[0] for p in held} == want and len(held) == 2 * len(want)
    params = _variables(model, nnx.Param)
    assert not want & set(params) and set(params) | want == set(_variables(plain, nnx.Param))
    assert any("indexer/wq_b" in p for p in (params if stage == "warmup" else want))
    assert all(v.dtype == jnp.float32 for v in params.values())  # weight_dtype
    for path, v in held.items():
        fp4 = "/experts/" in path
        want_dtype = (jnp.int8 if fp4 else jnp.float8_e4m3fn) if path.endswith("codes") else jnp.float8_e8m0fnu
        assert v.dtype == want_dtype, (path, v.dtype)
    # the optimizer (wrt=nnx.Param) holds no state for them
    opt = nnx.eval_shape(lambda: nnx.Optimizer(_held_model(cfg), optax.adam(1e-3), wrt=nnx.Param))
    assert not any("codes" in p or "scales" in p for p in tree.flatten(nnx.to_pure_dict(nnx.state(opt.opt_state))))


def test_bad_frozen_weights_values_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="frozen_weights='fp8' is unknown"):
        mq.holds_released("fp8")
    assert mq.holds_released("released") and not mq.holds_released("param_dtype")
    cfg = tiny_config("warmup", "base_moe_mlp_dim=48")  # w2's input width 48: not a multiple of 32
    with pytest.raises(ConfigError, match=r"ffn/experts/w2 in FP4, whose input width 48"):
        _held_model(cfg, abstract=True)


@pytest.mark.slow
def test_warmup_on_held_weights_equals_its_float32_dequantisation_bitwise(held_tiny):
    """5 warm-up steps of the real step: losses and indexer gradients bitwise equal (DESIGN.md)."""
    from core.data.batches import train_batches
    from core.train.optimizer import make_optimizer
    from core.spec.resolve import data_spec, optimizer_spec
    from core.train import step as train_step

    cfg, held = held_tiny
    held = nnx.clone(held)
    f32 = nnx.clone(held)
    assert mq.dequantize_held(f32) and not _variables(f32, mq.Released) and _variables(held, mq.Released)
    batches = train_batches(data_spec(cfg), cfg.per_device_batch_size)
    batches = [{k: jnp.asarray(v) for k, v in next(batches).items()} for _ in range(5)]
    trainable = train_step.config_matcher(cfg)
    grad_filter = nnx.All(nnx.Param, lambda path, _: trainable(path))

    def indexer_grads(model, batch):
        def loss(model):
            _, aux = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"], mode="train")
            return aux["indexer_loss"] + aux["moe_lb_loss"]
        return nnx.grad(loss, argnums=nnx.DiffState(0, grad_filter))(model)

    def run(model):
        graphdef, state = nnx.split((model, nnx.Optimizer(model, make_optimizer(optimizer_spec(cfg)), wrt=nnx.Param)))
        real_step, out = train_step.step_fn(resolve(cfg, "cpu"), graphdef), []

        # one program per model (each compile counts): the real step, and the indexer gradients at its input
        @functools.partial(jax.jit, compiler_options=PRODUCT_FUSION)
        def step(state, batch):
            return real_step(state, batch), indexer_grads(nnx.merge(graphdef, state)[0], batch)

        for batch in batches:
            (state, metrics), grads = step(state, batch)
            grads = tree.flatten(nnx.to_pure_dict(grads))
            out.append(({k: float(metrics[k]) for k in ("total_loss", "indexer_loss", "grad_norm")},
                        {k: np.asarray(v) for k, v in grads.items()}))
        return out

    for step_i, ((m_held, g_held), (m_f32, g_f32)) in enumerate(zip(run(held), run(f32))):
        assert m_held == m_f32, (step_i, m_held, m_f32)
        assert g_held.keys() == g_f32.keys() and all("indexer" in k for k in g_held)
        for k in g_held:
            assert np.array_equal(g_held[k], g_f32[k]), (step_i, k, np.abs(g_held[k] - g_f32[k]).max())
        assert m_held["indexer_loss"] > 0


def _save(run, model) -> None:
    from core.checkpoint import store as ckpt

    saver = ckpt.RunCheckpointer(run, max_to_keep=1, async_save=False)
    saver.save(0, model=nnx.to_pure_dict(nnx.state(model)), optimizer={"none": np.zeros((), np.int32)},
               data={"none": True}, metadata={"step": 0})
    saver.close()


def _restore(run, cfg, model, trainable, stage="warmup"):
    from core.checkpoint import store as ckpt
    from core.parallel.mesh import make_mesh
    from core.parallel.sharding import abstract_state

    target = nnx.to_pure_dict(abstract_state(model, make_mesh(cfg, jax.devices()[:1])))
    read, convert = mq.restore_target(target, ckpt.read_tree(run), trainable, stage)
    values, _ = ckpt.restore_model_state(run, read)
    return tree.flatten(convert(values))


def test_checkpoints_bridge_released_and_float_weights(held_tiny, tmp_path):
    """Held checkpoint -> float model: exactly the dequantisation; float checkpoint -> held model:
    the same held values; a stage that trains held weights: one-line ConfigError."""
    cfg, held = held_tiny
    trainable = mask_matcher(cfg.trainable_parameters_mask, cfg.frozen_parameters_mask)
    f32 = nnx.clone(held)
    mq.dequantize_held(f32)
    want_f32, want_held = (tree.flatten(nnx.to_pure_dict(nnx.state(m))) for m in (f32, held))
    _save(tmp_path / "held", held)
    _save(tmp_path / "f32", f32)
    plain = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    got = _restore(tmp_path / "held", cfg, plain, trainable)
    assert got.keys() == want_f32.keys()
    for k in got:
        assert np.array_equal(np.asarray(got[k]), np.asarray(want_f32[k])), k
    got = _restore(tmp_path / "f32", cfg, nnx.eval_shape(lambda: _held_model(cfg)), trainable)
    assert got.keys() == want_held.keys()
    for k in got:  # requantising a dequantisation gives the same values (bytes may differ at a tie)
        if k.endswith("/codes"):
            base = k[: -len("/codes")]
            fmt = mq.released_format(base)[0]
            deq = q.dequantize_fp8 if fmt == "fp8" else q.dequantize_fp4
            a, b = (deq(w[k], w[f"{base}/scales"]) for w in (got, want_held))
            assert np.array_equal(np.asarray(a), np.asarray(b)), k
        elif not k.endswith("/scales"):
            assert np.array_equal(np.asarray(got[k]), np.asarray(want_held[k])), k
    sparse = tiny_config("sparse", *HELD_LAYERS)
    with pytest.raises(ConfigError, match=r"^dsv4 sparse trains layers/\S+, which the checkpoint holds in the "
                       r"released FP8/FP4 format: re-import it without --keep-quantized") as err:
        _restore(tmp_path / "held", sparse, plain, mask_matcher(sparse.trainable_parameters_mask,
                                                                sparse.frozen_parameters_mask), "sparse")
    assert "\n" not in str(err.value)
