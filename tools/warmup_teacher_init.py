"""Step-0 figures of `indexer_init: teacher`, per CSA layer, without training (docs/indexer-init.md).

    .venv/bin/python tools/warmup_teacher_init.py SRC [KEY=VALUE ...]

Restores SRC (a trained run) as `dsv4 warmup --init-from SRC` would, with the warm-up preset and the
overrides, initialises every indexer from its teacher (core/train/indexer_init.py) and prints per
layer: the share of the nope logits' variance the DI - R subspace keeps, the head weights' fit, the
temperature chosen, and kl_captured on the calibration rows; then the whole model's kl_captured and
gain@k on the held-out eval batches (`dsv4 eval-indexer`'s numbers at step 0) for the preset's
random start and for the teacher start.

The bound: on the same held-out rows, the kl_captured of the teacher itself with its nope logits
q_n . K_n replaced by their rank-r approximation (q_n B)(C^T K_n) (core/model/indexer_init.py),
for r = DI - R and wider: what the best subspace of that width keeps at step 0 before any
indexer approximation (no ReLU, no head weights, no per-token query norm lost).
"""
import jax
from flax import nnx
import numpy as np
import sys

from core.checkpoint import store as ckpt
from core.config.schema import load_config
from core.data.batches import eval_batches, train_batches
from core.eval.evaluate import evaluate_indexer
from core.loss.indexer_kl import EPS
from core.model.attention import collect
from core.model.indexer_init import principal_maps
from core.spec.resolve import data_spec, resolve
from core.train.indexer_init import calibration_batches, layer_stats, teacher_init

src, overrides = sys.argv[1], sys.argv[2:]
model_name = ckpt.config_of(*ckpt.resolve_checkpoint(src)[1:]).model_name
cfg = load_config(model_name, overrides, stage="warmup")
specs = resolve(cfg, jax.default_backend())
model, _, _ = ckpt.restore_model(src, None, specs.model)
cfg = specs.cfg
calibration = calibration_batches(train_batches(data_spec(cfg), cfg.per_device_batch_size * jax.device_count()), cfg.indexer_init_batches)


def held_out(label):
    r = evaluate_indexer(model, specs, eval_batches(data_spec(cfg), cfg.per_device_batch_size, 4)).overall["by_k"][0]
    print(f"{label:8s} held-out kl_captured {r['all']['kl_captured']:.4f}  gain@{cfg.indexer_topk} "
          f"{r['informative']['gain']:.4f}", flush=True)


def bound(ranks):
    """Held-out kl_captured of the teacher with rank-r nope logits, for each r (module docstring)."""
    stats = layer_stats(model, calibration)
    n = cfg.head_dim - cfg.qk_rope_head_dim
    maps = []
    for st in stats:
        mean = st.k_sum[:n] / st.blocks
        ck = st.k_m2[:n, :n] / st.blocks - np.outer(mean, mean)
        maps.append({r: principal_maps(ck, st.q_m2[:n, :n] / st.tokens, r)[:2] for r in ranks})
    fwd = nnx.jit(lambda m, *a: m(*a, mode="eval_dense", probe=collect)[1])
    kl, kl_u = np.zeros(len(ranks)), 0.0
    for batch in eval_batches(data_spec(cfg), cfg.per_device_batch_size, 4):
        aux = fwd(model, batch["tokens"], batch["positions"], batch["segment_ids"])
        qs, ks, vis = (np.asarray(aux[k], np.float64) for k in ("teacher_query", "compressed_kv", "visible"))
        for layer in range(qs.shape[0]):
            q, k, v = qs[layer], ks[layer], vis[layer].astype(bool)
            rope_bhtw = np.einsum("bthd,bwd->bhtw", q[..., n:], k[..., n:])

            def mixture(logits):
                z = np.where(v[:, None], logits, -np.inf)
                z = np.exp(z - z.max(-1, keepdims=True, initial=-1e30))
                with np.errstate(invalid="ignore"):  # rows that see no block: 0 / 0, set to 0
                    p = np.nan_to_num(z / z.sum(-1, keepdims=True)).sum(1)
                return p / (p.sum(-1, keepdims=True) + EPS)

            def kl_to(p, p2):
                keep = v & (p > 0)
                return np.sum(np.where(keep, p * (np.log(p + EPS) - np.log(np.where(keep, p2, 1.0) + 1e-30)), 0.0))

            p = mixture(np.einsum("bthd,bwd->bhtw", q, k))
            uniform = v / np.maximum(v.sum(-1, keepdims=True), 1)
            kl_u += kl_to(p, uniform)
            for i, r in enumerate(ranks):
                kmap, qmap = maps[layer][r]
                nope = np.einsum("bthr,bwr->bhtw", q[..., :n] @ qmap, k[..., :n] @ kmap)
                kl[i] += kl_to(p, mixture(nope + rope_bhtw))
    for r, value in zip(ranks, kl):
        print(f"bound   rank {r:3d} of {n}: held-out kl_captured {1 - value / kl_u:.4f} (the teacher with rank-{r} nope logits)")


rank = cfg.indexer_head_dim - cfg.qk_rope_head_dim
bound(sorted({rank, min(2 * rank, cfg.head_dim - cfg.qk_rope_head_dim), cfg.head_dim - cfg.qk_rope_head_dim}))
held_out("random")
report = teacher_init(model, calibration)
print(report.line())
print(" layer  kept   fit    temperature  kl_captured (calibration)")
for i, layer in enumerate(report.layers):
    print(f" {layer:5d}  {report.kept[i]:.3f}  {report.weight_fit[i]:.3f}  {report.temperature[i]:11.4f}  "
          f"{1 - report.kl[i] / report.kl_uniform[i]:.4f}")
held_out("teacher")
