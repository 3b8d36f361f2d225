"""What each training stage switches on and off: DESIGN.md's stage table, written once.

Three config keys decide a run's row: `dense_pretraining`, `indexer_loss_scaling_factor` and
`indexer_sparse_training`. `stage_of(cfg)` reads them into one `Stage`; config validation, the
train step and the model read that `Stage` and nothing else, so what "warm-up" means lives here.

| row          | keys                                   | CSA attends   | indexer loss | LM loss  | trained |
|--------------|----------------------------------------|---------------|--------------|----------|---------|
| pretrain     | dense_pretraining, factor 0, not sparse | every visible | off          | computed | all but the indexer |
| warmup       | factor > 0, not sparse                  | every visible | dense        | bypassed | the indexer |
| sparse       | factor > 0, sparse                      | top-k         | sparse       | computed | all |
| no_indexer_loss | factor 0, not dense_pretraining      | top-k         | off          | computed | all |

"trained" is what the stage presets in configs/base.yml set through the masks; the row records it
so that a stage command can check the masks it was given; `STAGE_COMMANDS` says which rows each
stage command runs.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Stage:
    """One row of the stage table.

    Attributes:
      name: "pretrain" | "warmup" | "sparse" | "no_indexer_loss".
      csa_topk: True when the CSA forward attends the indexer's top-k blocks in training, False when
        it attends every visible block (evaluation always uses top-k).
      indexer_loss: "off" | "dense" | "sparse": whether the KL is computed, and over which blocks.
      lm_loss: False when the head is not run in training and lm_loss is reported as 0.0.
      trains_indexer: the indexer's parameters get gradients.
      trains_rest: every other parameter gets gradients.
    """

    name: str
    csa_topk: bool
    indexer_loss: str
    lm_loss: bool
    trains_indexer: bool
    trains_rest: bool


PRETRAIN = Stage("pretrain", csa_topk=False, indexer_loss="off", lm_loss=True, trains_indexer=False, trains_rest=True)
WARMUP = Stage("warmup", csa_topk=False, indexer_loss="dense", lm_loss=False, trains_indexer=True, trains_rest=False)
SPARSE = Stage("sparse", csa_topk=True, indexer_loss="sparse", lm_loss=True, trains_indexer=True, trains_rest=True)
NO_INDEXER_LOSS = Stage("no_indexer_loss", csa_topk=True, indexer_loss="off", lm_loss=True, trains_indexer=True,
                        trains_rest=True)
TABLE = (PRETRAIN, WARMUP, SPARSE, NO_INDEXER_LOSS)
# the stage commands and the rows each one runs, its preset's row first; `dsv4 sparse` also runs the
# no-indexer-loss row (indexer_loss_scaling_factor=0: sparse training with the indexer's KL off)
STAGE_COMMANDS = {"pretrain": (PRETRAIN,), "warmup": (WARMUP,), "sparse": (SPARSE, NO_INDEXER_LOSS)}


def stage_of(cfg) -> Stage:
    """The row of the stage table that `cfg`'s three stage keys select.

    Args:
      cfg: a Config (or anything with `dense_pretraining`, `indexer_loss_scaling_factor` and
        `indexer_sparse_training`).
    Returns:
      The `Stage`. A config with dense_pretraining and an indexer loss or sparse training matches
      no row; validation rejects it (core/config/validate.py), and here it reads as pretrain.
    """
    if cfg.dense_pretraining:
        return PRETRAIN
    if cfg.indexer_loss_scaling_factor > 0:
        return SPARSE if cfg.indexer_sparse_training else WARMUP
    return NO_INDEXER_LOSS
