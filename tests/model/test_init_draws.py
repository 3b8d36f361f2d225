"""core.model.init_draws: bucketed flat draws give bitwise the per-shape initial weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import tree
from core.model import init_draws
from core.model.init_draws import MIN_BUCKET, FanInTruncatedNormal, bucket, bucketed_draws
from core.model.transformer import Transformer
from core.spec.resolve import resolve
from tests.conftest import resolved, tiny_config


def _weights(cfg) -> dict[str, np.ndarray]:
    model = Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(cfg.init_weights_seed))
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}


def test_bucket_sizes():
    assert bucket(1) == bucket(MIN_BUCKET) == MIN_BUCKET
    assert bucket(MIN_BUCKET + 1) == 2 * MIN_BUCKET and bucket(129280 * 64) == 1 << 23


def test_real_model_initial_weights_are_bitwise_the_per_shape_draws(monkeypatch):
    """Every variable of the shrunken deepseek4-tiny (hash, SWA and the scanned CSA/HCA pair:
    plain and vmapped keys), bucketed vs JAX's own per-shape initialisers."""
    cfg = tiny_config()
    reference = _weights(cfg)
    cuts, cut = [], init_draws._cut
    monkeypatch.setattr(init_draws, "_cut", lambda flat, std, shape: cuts.append(shape) or cut(flat, std, shape))
    with bucketed_draws():
        bucketed = _weights(cfg)
    assert len(cuts) > 20  # the bucketed path served the model's weight matrices
    assert reference.keys() == bucketed.keys() and len(reference) > 50
    for path, value in reference.items():
        assert bucketed[path].dtype == value.dtype, path
        np.testing.assert_array_equal(bucketed[path], value, err_msg=path, strict=True)


def test_large_odd_shapes_and_batched_keys_match_variance_scaling():
    """Shapes beyond one bucket and not a power of two, with keys batched as under nnx.vmap."""
    init = FanInTruncatedNormal(in_axis=1, out_axis=2, batch_axis=(0,))
    shape, keys = (3, 100, 250), jax.random.split(jax.random.key(7), 2)
    expected = jax.vmap(lambda k: init.reference(k, shape, jnp.float32))(keys)
    with bucketed_draws():
        got = jax.vmap(lambda k: init(k, shape, jnp.float32))(keys)
        single = init(keys[0], shape, jnp.bfloat16)
    assert got.shape == (2, *shape) and bucket(int(np.prod(shape))) > MIN_BUCKET
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), strict=True)
    np.testing.assert_array_equal(np.asarray(single, np.float32),
                                  np.asarray(init.reference(keys[0], shape, jnp.bfloat16), np.float32))


def test_rbg_keys_fall_back_to_the_per_shape_draw():
    """The prefix property is threefry's: rbg keys keep JAX's own draw (which bucketing would change)."""
    init = FanInTruncatedNormal(in_axis=1, out_axis=2, batch_axis=(0,))
    shape, keys = (3, 129, 1000), jax.random.split(jax.random.key(3, impl="rbg"), 2)
    expected = jax.vmap(lambda k: init.reference(k, shape, jnp.float32))(keys)
    with bucketed_draws():
        got = jax.vmap(lambda k: init(k, shape, jnp.float32))(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), strict=True)


def test_build_makes_the_optimizer_state_of_eager_init_in_one_program():
    """`build` creates the optimizer state under one jit on a CPU process: bitwise, and with the
    very shardings, what op-by-op `nnx.Optimizer` creation gives (which the compiled-ahead step
    was compiled for)."""
    from core.parallel.sharding import shard_state
    from core.train.materialise import build
    from core.train.optimizer import make_optimizer
    from core.spec.resolve import optimizer_spec

    cfg = tiny_config("sparse")
    setup = build(*resolved(cfg))
    eager = shard_state(nnx.Optimizer(setup.model, make_optimizer(optimizer_spec(cfg)), wrt=nnx.Param), setup.mesh)
    got, want = nnx.state(setup.optimizer), nnx.state(eager)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    pairs = list(zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)))
    assert len(pairs) > 50
    for (path, a), b in pairs:
        assert a.sharding == b.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path), strict=True)
