"""Step-0 figures of `indexer_init: teacher`, per CSA layer, without training (docs/indexer-init.md).

    .venv/bin/python tools/warmup_teacher_init.py SRC [KEY=VALUE ...]

Restores SRC (a trained run) as `dsv4 warmup --init-from SRC` would, with the warm-up preset and the
overrides, initialises every indexer from its teacher (core/train/indexer_init.py) and prints per
layer: the share of the nope logits' variance the DI - R subspace keeps, the head weights' fit, the
temperature chosen, and kl_captured on the calibration rows; then the whole model's kl_captured and
gain@k on the held-out eval batches (`dsv4 eval-indexer`'s numbers at step 0) for the preset's
random start and for the teacher start.
"""
import sys

from core.checkpoint import store as ckpt
from core.config.schema import load_config
from core.data.batches import eval_batches
from core.eval.evaluate import evaluate_indexer
from core.train.indexer_init import teacher_init

src, overrides = sys.argv[1], sys.argv[2:]
model_name = ckpt.config_of(*ckpt.resolve_checkpoint(src)[1:]).model_name
cfg = load_config(model_name, overrides, stage="warmup")
model, cfg, _ = ckpt.restore_model(src, None, cfg)


def held_out(label):
    r = evaluate_indexer(model, cfg, eval_batches(cfg, cfg.per_device_batch_size, 4)).overall["by_k"][0]
    print(f"{label:8s} held-out kl_captured {r['all']['kl_captured']:.4f}  gain@{cfg.indexer_topk} "
          f"{r['informative']['gain']:.4f}", flush=True)


held_out("random")
report = teacher_init(model, cfg)
print(report.line())
print(" layer  kept   fit    temperature  kl_captured (calibration)")
for i, layer in enumerate(report.layers):
    print(f" {layer:5d}  {report.kept[i]:.3f}  {report.weight_fit[i]:.3f}  {report.temperature[i]:11.4f}  "
          f"{1 - report.kl[i] / report.kl_uniform[i]:.4f}")
held_out("teacher")
