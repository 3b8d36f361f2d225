"""`indexer_init: teacher` in a warm-up (core/train/indexer_init.py): deterministic, a step-0 KL below
the random start's on a trained model, run once (a resume does not redo it) and resumed bitwise.

One module fixture pre-trains the shrunken deepseek4-tiny for a few steps and runs three short
warm-ups from it: A straight for two steps, B for one step and then resumed to two.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from tests.conftest import tiny_config
from core import tree
from core.checkpoint import store as ckpt
from core.errors import ConfigError
from core.train import run as train
from core.train.handoff import is_indexer
from core.train.indexer_init import teacher_init

pytestmark = pytest.mark.slow  # a pre-training and three warm-ups, each compiled
PRETRAIN_STEPS = 4


def _warmup(run_dir, source, steps: int):
    # one schedule for every run length: A, B and B's resume share one compiled step
    cfg = tiny_config("warmup", "indexer_init=teacher", "indexer_init_batches=2", "learning_rate_schedule_steps=2",
                      steps=steps, checkpoint_period=1)
    trainer = train.Trainer(cfg, stage="warmup", run_dir=run_dir, init_from=source)
    rows = list(trainer.run())
    return trainer.info, rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher-init")
    pre = train.Trainer(tiny_config("pretrain", steps=PRETRAIN_STEPS), stage="pretrain", run_dir=root / "pre")
    list(pre.run())
    out = {"pre": root / "pre"}
    out["a"] = (root / "a", *_warmup(root / "a", root / "pre", 2))
    out["b1"] = (root / "b", *_warmup(root / "b", root / "pre", 1))
    out["b2"] = (root / "b", *_warmup(root / "b", root / "pre", 2))
    return out


def _state(run_dir, step):
    model, _, _ = ckpt.restore_model(run_dir, step)
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}


def test_the_initialisation_runs_once_and_resumes_bitwise(runs):
    """A and B initialised independently from the same source: the same step 0, bitwise; B's resume
    says nothing of an initialisation and reaches A's step 1 bitwise."""
    inits = [[n for n in runs[k][1]["notices"] if n.startswith("indexer_init=teacher:")] for k in ("a", "b1", "b2")]
    assert [len(n) for n in inits] == [1, 1, 0], inits
    assert runs["b2"][1]["resumed_from"] == 0
    a0, b0 = _state(runs["a"][0], 0), _state(runs["b1"][0], 0)
    assert all(np.array_equal(a0[k], b0[k]) for k in a0), "step 0 differs: the initialisation is not deterministic"
    a1, b1 = _state(runs["a"][0], 1), _state(runs["b2"][0], 1)
    diff = {k: float(np.max(np.abs(a1[k] - b1[k]))) for k in a1 if not np.array_equal(a1[k], b1[k])}
    assert not diff, f"resumed != straight: {diff}"
    assert [r["indexer_loss"] for r in runs["a"][2]][1] == runs["b2"][2][0]["indexer_loss"]


def test_step0_kl_is_below_the_random_start_and_only_the_indexer_changes(runs):
    """On the trained model's calibration rows, every layer's KL to its teacher after the initialisation
    is below the warm-up preset's random start (weights_proj = 0: a uniform student, KL_uniform), and
    nothing but the indexers' parameters moved."""
    cfg = tiny_config("warmup", "indexer_init=teacher", "indexer_init_batches=2")
    model, _, _ = ckpt.restore_model(runs["pre"], None, cfg)
    before = {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}
    assert all(not v.any() for k, v in before.items() if k.endswith("indexer/weights_proj"))  # the random start
    report = teacher_init(model, cfg)
    assert len(report.layers) == len(cfg.csa_layers) and all(0 < t for t in report.temperature)
    assert all(k < u for k, u in zip(report.kl, report.kl_uniform)), (report.kl, report.kl_uniform)
    assert report.kl_captured > 0.3, report
    after = {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(is_indexer(k) for k in changed), sorted(changed)


def test_teacher_init_belongs_to_the_warmup():
    for stage in ("pretrain", "sparse"):
        with pytest.raises(ConfigError, match="indexer_init=teacher in dsv4 " + stage):
            tiny_config(stage, "indexer_init=teacher")
