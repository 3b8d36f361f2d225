"""Compiled temp memory of one attention layer's forward + backward (XLA memory analysis, no run).

    python -m tests.attention_memory deepseek4-284b 32768 float32 [KEY=VALUE ...]

prints the temp memory of layer 2 (a CSA layer in the Flash plan) in GiB; the layer runs as the
stage the overrides describe (indexer loss on when indexer_loss_scaling_factor > 0, top-k
selection). Deterministic, so tests compare lengths with it.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from core.model.attention import Attention, AttentionSpec
from core.spec.resolve import resolve


def layer_train_temp_bytes(s: AttentionSpec, t: int, dtype=jnp.float32, batch: int = 1, **flags) -> int:
    """Temp bytes of jax.grad over (parameters, x) of sum(layer(x)) + its indexer loss, compiled."""
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: Attention(s, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=dtype)))

    def step(state, x, pos, seg):
        def loss(state, x):
            y, aux = nnx.merge(graphdef, state)(x, pos, seg, **flags)
            return jnp.sum(y.astype(jnp.float32)) + aux.get("indexer_loss", 0.0)
        return jax.grad(loss, argnums=(0, 1))(state, x)

    sds = jax.ShapeDtypeStruct
    args = (state, sds((batch, t, s.emb), dtype), sds((batch, t), jnp.int32), sds((batch, t), jnp.int32))
    return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes


def main(argv: list[str]) -> None:
    from core.config.schema import load_config

    model, t, dtype, *overrides = argv
    cfg = load_config(model, [f"max_target_length={t}", *overrides])
    s = resolve(cfg, "cpu").model.blocks[2].attn
    temp = layer_train_temp_bytes(s, int(t), jnp.dtype(dtype), indexer_loss=s.loss_scale > 0)
    print(f"{model} layer 2 T={t} {dtype} {' '.join(overrides)}: temp {temp / 2**30:.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
