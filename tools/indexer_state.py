"""Per CSA layer of a checkpoint: KL, KL of a uniform student, kl_captured, score spread, dead rows;
then the indexer parameters' gradients of the warm-up loss on one training batch.

    .venv/bin/python tools/indexer_state.py RUN [KEY=VALUE ...]

One held-out batch (4 x max_target_length) for the per-layer lines; `allzero` is the share of rows
whose every visible score is exactly 0 (every head's ReLU off on every block: a dead row, which
gets no gradient). Gradient lines: RMS and median |g| per parameter (compare with adam_eps).
Figures: docs/benchmarks.md#why-the-defaults (the warm-up preset).
"""
import sys
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from core.checkpoint import store as ckpt
from core.config.schema import load_config
from core.data.batches import train_batches, eval_batches
from core.model.attention import collect
from core.spec.resolve import data_spec, resolve
from tests.dense_eval import dense_teacher, row_kl  # the dense reference of core/eval/metrics.py

path = sys.argv[1]
cfg = load_config("deepseek4-tiny", sys.argv[2:], stage="warmup", options={"steps": 100})
_, d, step = ckpt.resolve_checkpoint(path)
model, _, meta = ckpt.restore_model(d, step, resolve(cfg, jax.default_backend()).model)
batch = next(iter(eval_batches(data_spec(cfg), 4, 1)))
arr = [jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")]

@nnx.jit
def fwd(model, t, p, s):
    _, aux = model(t, p, s, mode="eval_dense", probe=collect)
    return aux
aux = fwd(model, *arr)
vis = np.asarray(aux["visible"]); sc = np.asarray(aux["index_scores"])
P = jax.vmap(dense_teacher)(aux["teacher_query"], aux["compressed_kv"], aux["visible"])
kl = jax.vmap(row_kl)(P, aux["index_scores"], aux["visible"])
klu = jax.vmap(row_kl)(P, jnp.zeros_like(P), aux["visible"])
valid = vis.any(-1)
for i, layer in enumerate(cfg.csa_layers):
    v = vis[i]; s = np.where(v, sc[i], np.nan)
    std = np.nanstd(s, axis=-1); many = v.sum(-1) > 1
    dead = np.mean(std[many] == 0); zero = np.mean(np.nanmax(np.abs(s), -1)[valid[i]] == 0)
    k = float(kl[i].sum() / valid[i].sum()); ku = float(klu[i].sum() / valid[i].sum())
    print(f"layer {layer:2d} kl {k:.4f} kl_u {ku:.4f} cap {1-k/ku:+.3f} score_std {np.nanmean(std[many]):.3f} const_rows {dead:.3f} allzero {zero:.3f}")

# gradient magnitudes of the indexer loss (warm-up scale) on one train batch
tb = next(iter(train_batches(data_spec(cfg), 4)))
targ = [jnp.asarray(tb[k]) for k in ("tokens", "positions", "segment_ids")]
filt = nnx.All(nnx.Param, nnx.PathContains("indexer"))
@nnx.jit
def grads(model, t, p, s):
    def loss(m):
        _, aux = m(t, p, s, mode="train")
        return aux["indexer_loss"]
    return nnx.value_and_grad(loss, argnums=nnx.DiffState(0, filt))(model)
val, g = grads(model, *targ)
print("indexer_loss", float(val))
for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g)):
    name = "/".join(str(getattr(k, 'key', k)) for k in path)
    a = np.asarray(leaf)
    print(f"{name:60s} shape {a.shape} rms {np.sqrt(np.mean(a**2)):.2e} median|g| {np.median(np.abs(a)):.2e}")
