"""What a checkpoint holds, from Orbax metadata only: no array is read (`dsv4 inspect-ckpt`).

Built on `core.checkpoint.store`'s public readers: `resolve_checkpoint` (which step), `read_metadata`
(the JSON item: config, stage, step, metrics), `read_tree` (shapes and dtypes of the model and
optimizer items from Orbax's tree metadata). Sizes on disk come from the step directory's files.

Variable kinds are told apart by path, following core/model/moe.py's names: `.../gate/tid2eid` is the
hash-routing table (not a parameter), `.../gate/bias` the router selection bias (moved by the
load-balance update, not by gradients), everything else an `nnx.Param`. A frozen weight held in the
released format (core/model/quant.py) is two leaves: `.../codes`, kind `held_fp8` (float8_e4m3fn)
or `held_fp4` (e2m1 packed two per int8 byte: its count is bytes, the weight has twice as many
elements), never trainable, and `.../scales` (kind `scales`, float8_e8m0fnu); `held()` sums them. Totals are
`core.model.params.count_parameters`, the one count the training header and `core.model.transformer.param_counts`
also use: parameters = the nnx.Params + the router biases (the official inventory, MTP excluded)
= trainable + frozen + router bias; the hash tables are listed beside it, not counted. Trainable
is `core.model.params.mask_matcher`, the rule the train step applies too: a
`trainable_parameters_mask` regex fully matches the '/'-joined path (empty mask = all) and no
`frozen_parameters_mask` regex does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

from core.checkpoint import store as ckpt
from core.errors import CheckpointError
from core.model.params import count_parameters, mask_matcher, variable_kind

INDEXER_KEYS = ("use_indexer", "indexer_n_heads", "indexer_head_dim", "indexer_topk",
                "indexer_loss_scaling_factor", "indexer_sparse_training", "indexer_teacher",
                "dense_pretraining", "trainable_parameters_mask", "frozen_parameters_mask")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One saved model variable: '/'-joined path, shape, dtype name, kind and mask status."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    kind: str          # one of KINDS, or held_fp8 / held_fp4 for the codes of a weight held released
    trainable: bool    # kind == "param" and matched by the run's trainable mask

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.count * _itemsize(self.dtype)


def _itemsize(dtype: str) -> int:
    import numpy as np

    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # bfloat16, float8_*: NumPy knows them only as ml_dtypes' types
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype)).itemsize


def leaf_kind(path: str, dtype: str) -> str:
    """`core.model.params.variable_kind`, with held_fp8 / held_fp4 for a held weight's `.../codes`."""
    if path.endswith("/codes"):
        return "held_fp4" if dtype == "int8" else "held_fp8"
    return variable_kind(path)


def fold(leaves: Sequence[Leaf], depth: int | None) -> list[dict[str, Any]]:
    """Group leaves by their first `depth` path components (None or 0: every leaf on its own).

    Returns:
      [{"path", "leaves", "count", "bytes", "trainable", "dtypes", "shape"}] in first-seen
      order; "shape" is the leaf's shape for a single leaf, None for a folded group; "trainable"
      counts the group's trainable elements.
    """
    groups: dict[str, dict[str, Any]] = {}
    for leaf in leaves:
        parts = leaf.path.split("/")
        key = "/".join(parts[:depth]) if depth and len(parts) > depth else leaf.path
        g = groups.setdefault(key, {"path": key, "leaves": 0, "count": 0, "bytes": 0, "trainable": 0,
                                    "dtypes": [], "shape": list(leaf.shape), "kind": leaf.kind})
        g["leaves"] += 1
        g["count"] += leaf.count
        g["bytes"] += leaf.bytes
        g["trainable"] += leaf.count if leaf.trainable else 0
        if leaf.dtype not in g["dtypes"]:
            g["dtypes"].append(leaf.dtype)
        if g["leaves"] > 1:
            g["shape"] = None
            g["kind"] = g["kind"] if g["kind"] == leaf.kind else "mixed"
    return list(groups.values())


def dir_bytes(path: Path) -> int:
    """Total size of the regular files under `path`."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


@dataclasses.dataclass(frozen=True)
class CheckpointSummary:
    """A checkpoint step described from metadata. `to_dict(depth)` is the `--json` schema."""

    run_dir: str
    checkpoint: str            # the step directory
    step: int
    steps: list[int]           # every finished step of the run
    stage: str | None
    model_name: str | None
    version: str | None
    indexer: dict[str, Any]    # INDEXER_KEYS from the saved config, plus csa_layers
    metrics: dict[str, Any]    # the metrics saved with this step
    leaves: list[Leaf]         # the model item, in saved order
    optimizer_count: int       # elements of optimizer state
    optimizer_bytes: int
    disk_bytes: int            # files of this step directory

    def totals(self) -> dict[str, int]:
        trained = {l.path for l in self.leaves if l.trainable}
        counts = count_parameters({l.path: l.shape for l in self.leaves}, trained.__contains__)
        return {
            "parameters": counts["parameters"],
            "trainable": counts["trainable"],
            "frozen": counts["frozen"],
            "parameter_bytes": sum(l.bytes for l in self.leaves if l.kind != "hash_table"),
            "router_bias": counts["router_bias"],
            "hash_table": counts["hash_table"],
            "optimizer_state": self.optimizer_count,
            "optimizer_bytes": self.optimizer_bytes,
            "disk_bytes": self.disk_bytes,
        }

    def held(self) -> dict[str, int]:
        """The weights held released: {"leaves" (codes leaves), "elements" (FP4: two per byte), "bytes" (codes +
        scales)}."""
        codes = [l for l in self.leaves if l.kind in ("held_fp8", "held_fp4")]
        return {"leaves": len(codes), "elements": sum(l.count * (2 if l.kind == "held_fp4" else 1) for l in codes),
                "bytes": sum(l.bytes for l in self.leaves if l.kind in ("held_fp8", "held_fp4", "scales"))}

    def to_dict(self, depth: int | None = None) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir, "checkpoint": self.checkpoint, "step": self.step, "steps": self.steps,
            "stage": self.stage, "model_name": self.model_name, "version": self.version,
            "indexer": self.indexer, "metrics": self.metrics, "depth": depth,
            "tree": fold(self.leaves, depth), "totals": self.totals(),
        }


def summarize_checkpoint(path: str | Path, step: int | None = None) -> CheckpointSummary:
    """Describe one checkpoint step without reading any array.

    Args:
      path: a run directory, its checkpoints/ directory or one step directory.
      step: the step to describe (default: the latest finished one).

    Raises:
      CheckpointError: missing path, not a checkpoint, or unreadable / truncated metadata.
    """
    run_dir, ckpt_dir, step = ckpt.resolve_checkpoint(path, step)
    step_dir = ckpt_dir / str(step)
    with _quiet_absl():
        meta = ckpt.read_metadata(ckpt_dir, step)
        model_tree = ckpt.read_tree(ckpt_dir, step, "model") if isinstance(meta, dict) else {}
        opt = ckpt.read_tree(ckpt_dir, step, "optimizer") if isinstance(meta, dict) else {}
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"checkpoint {str(step_dir)!r} has no saved config in its metadata: "
                              "it was not written by dsv4 or is corrupted; use another step (--step) or retrain.")
    config = meta["config"]
    trainable = mask_matcher(config.get("trainable_parameters_mask") or [], config.get("frozen_parameters_mask") or [])
    leaves = [Leaf(p, shape, dtype, kind := leaf_kind(p, dtype), kind == "param" and trainable(p))
              for p, (shape, dtype) in model_tree.items()]
    indexer = {k: config.get(k) for k in INDEXER_KEYS}
    indexer["csa_layers"] = [i for i, r in enumerate(config.get("compress_ratios") or []) if r == 4]
    return CheckpointSummary(
        run_dir=str(run_dir), checkpoint=str(step_dir), step=step, steps=ckpt.finished_steps(ckpt_dir),
        stage=meta.get("stage"), model_name=meta.get("model_name") or config.get("model_name"),
        version=meta.get("dsv4_version", meta.get("version")), indexer=indexer, metrics=_plain_json(meta.get("metrics") or {}),
        leaves=leaves, optimizer_count=sum(math.prod(s) for s, _ in opt.values()),
        optimizer_bytes=sum(math.prod(s) * _itemsize(d) for s, d in opt.values()),
        disk_bytes=dir_bytes(step_dir))


@contextlib.contextmanager
def _quiet_absl():
    """Orbax logs an absl warning before the CheckpointError we raise; keep errors one line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _plain_json(value: Any) -> Any:
    """JSON-safe copy (metrics come back from Orbax's JSON item already plain; be defensive)."""
    return json.loads(json.dumps(value, default=float))
