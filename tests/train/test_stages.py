"""DeepSeek-V4's three stages as commands, chained: `dsv4 pretrain`, `dsv4 warmup --init-from` it
(and from a model without an indexer; other mismatches stay one-line errors), `dsv4 sparse
--init-from` the warm-up (what it trains; an interrupted and resumed run against the straight one)
and `dsv4 eval-indexer` on the result; `indexer_init: teacher` warm-ups from the chain's pre-training
(core/train/indexer_init.py: deterministic, a step-0 KL below the random start's, run once and resumed
bitwise).

The chain runs once, in the `stage_chain` fixture, and every test that needs one of its runs or
compiled steps lives in this file: under pytest-xdist's --dist loadfile one worker builds it,
once. The stages' options and checks that need no chain are tests/train/test_stage_checks.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from tests.conftest import CHAIN_STEPS, TINY_OVERRIDES, init_model, resolved, tiny_config
from core.checkpoint import store as ckpt
from core import tree
from core.checkpoint import run_files
from core.train import run as train
from core.errors import CheckpointError, ConfigError
from core.train.handoff import is_indexer
from core.data.batches import train_batches
from core.spec.resolve import data_spec
from core.train.indexer_init import calibration_batches, teacher_init
from core.train.materialise import build, materialise
from core.train.preflight import preflight
from core.train.write_errors import tree_bytes
from dsv4cli import display
from dsv4cli.main import app

pytestmark = pytest.mark.slow  # the chain: three compiled steps, 38 steps trained
runner = CliRunner()
LOSS_KEYS = ("total_loss", "lm_loss", "indexer_loss", "moe_lb_loss", "grad_norm", "learning_rate")
WARMUP_STEPS, SPARSE_STEPS = CHAIN_STEPS["warmup"], CHAIN_STEPS["sparse"]


def _invoke(*args):
    return runner.invoke(app, [*args, *TINY_OVERRIDES, "checkpoint_period=4"])


@pytest.fixture(scope="module")
def stage_chain(tmp_path_factory):
    """{"pretrain" | "warmup" | "sparse": (run dir, CLI output)}, each run --init-from the previous.

    CHAIN_STEPS steps each, checkpoint_period=4 (the resumed sparse run below restarts the chain's
    sparse run with the same period and must match it row for row)."""
    root, runs, previous = tmp_path_factory.mktemp("chain"), {}, None
    for stage, steps in CHAIN_STEPS.items():
        run = root / stage
        init = ["--init-from", str(previous)] if previous else []
        result = _invoke(stage, "--steps", str(steps), "--output", str(run), *init)
        assert result.exit_code == 0, result.output
        runs[stage], previous = (run, result.output), run
    return runs


def _variables(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def test_pretrain_trains_all_but_the_indexer(stage_chain):
    run, output = stage_chain["pretrain"]
    model, cfg, meta = ckpt.restore_model(run)
    assert meta["stage"] == "pretrain" and cfg.dense_pretraining and cfg.frozen_parameters_mask == (".*indexer.*",)
    initial = _params(init_model(cfg, cfg.init_weights_seed))
    trained = _params(model)
    indexer = [k for k in trained if is_indexer(k)]
    assert indexer and len(indexer) < len(trained)
    for k, v in trained.items():
        if is_indexer(k):
            np.testing.assert_array_equal(v, initial[k], err_msg=f"{k} moved")
        else:
            assert not np.array_equal(v, initial[k]), f"{k} did not train"
    opt_paths = list(ckpt.read_tree(run / "checkpoints", CHAIN_STEPS["pretrain"] - 1, "optimizer"))
    assert opt_paths and not [p for p in opt_paths if is_indexer(p)]  # no optimizer state for the indexer
    rows = run_files.read_metrics(run)
    assert all(r["indexer_loss"] == 0.0 and r["lm_loss"] > 0 for r in rows)
    first, last = np.mean([r["lm_loss"] for r in rows[:3]]), np.mean([r["lm_loss"] for r in rows[-3:]])
    assert last < 0.8 * first, (first, last)
    assert "dsv4 pretrain" in output and "warning" not in output


def test_warmup_from_pretrain_keeps_its_weights(stage_chain):
    (src, _), (run, output) = stage_chain["pretrain"], stage_chain["warmup"]
    source, _, _ = ckpt.restore_model(src)
    warm, _, meta = ckpt.restore_model(run)
    assert meta["stage"] == "warmup" and f"initialised from {src}" in output and "indexer initialised fresh" not in output
    before, after = _variables(source), _variables(warm)
    assert before.keys() == after.keys()
    for k in before:  # router biases included: the warm-up freezes every router
        if is_indexer(k):
            assert not np.array_equal(before[k], after[k]), f"{k} did not train"
        else:
            np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_chain_into_sparse_and_eval(stage_chain):
    run, output = stage_chain["sparse"]
    assert f"initialised from {stage_chain['warmup'][0]}" in output
    rows = run_files.read_metrics(run)
    assert len(rows) == CHAIN_STEPS["sparse"] and all(r["indexer_loss"] > 0 and r["lm_loss"] > 0 for r in rows)
    result = runner.invoke(app, ["eval-indexer", str(run), "--rows", "1", "--topk", "4,32", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["checkpoint"]["stage"] == "sparse" and report["topk_binds_share"] is None  # 16 not swept
    by_k = report["overall"]["by_k"]
    assert by_k[0]["informative_rows"] > 0 and by_k[1]["informative_rows"] == 0  # 128 tokens: <= 32 blocks
    assert report["warnings"] == [w for w in report["warnings"] if "k=32" in w] and len(report["warnings"]) == 1
    for e in by_k:
        assert -1 <= e["all"]["kl_captured"] <= 1
    assert by_k[1]["informative"]["gain"] is None
    table = runner.invoke(app, ["eval-indexer", str(run), "--rows", "1", "--topk", "4,32"])
    assert "gain@k" in table.stdout and "KL captured" in table.stdout and "top-k binds" in table.stdout
    assert "warning: top-k never binds at k=32" in table.stdout


def test_sparse_from_warmup_trains_everything(stage_chain):
    warm, (run, output) = stage_chain["warmup"], stage_chain["sparse"]
    assert f"initialised from {warm[0]} (step {WARMUP_STEPS - 1})" in output.replace("\n", "")
    rows = run_files.read_metrics(run)
    assert len(rows) == SPARSE_STEPS and all(r["lm_loss"] > 0 and r["indexer_loss"] > 0 for r in rows)
    first, last = np.mean([r["total_loss"] for r in rows[:5]]), np.mean([r["total_loss"] for r in rows[-5:]])
    assert last < first - 0.1, (first, last)

    start, _, _ = ckpt.restore_model(warm[0])
    end, _, meta = ckpt.restore_model(run)
    assert meta["stage"] == "sparse"
    before, after = _variables(start), _variables(end)
    moved = {k: not np.array_equal(before[k], after[k]) for k in before}
    fixed = [k for k, m in moved.items() if not m]
    assert fixed == [k for k in before if k.endswith("tid2eid")], fixed  # only the hash tables stay
    assert any(k.endswith("gate/bias") and moved[k] for k in moved)  # router biases moved too
    opt_paths = ckpt.read_tree(run, item="optimizer")
    assert any(p.endswith("/mu/embed") for p in opt_paths) and any("/mu/" in p and "indexer" in p for p in opt_paths)


def test_interrupted_and_resumed_run_matches_the_straight_one(stage_chain, tmp_path, monkeypatch):
    run = tmp_path / "resumed"
    original = display.TrainDisplay.row

    def row_then_ctrl_c(self, row):
        original(self, row)
        if row["step"] == 4:  # logged while step 5 runs (metrics are read one step late): the run stops after
            # step 5, not a checkpoint_period step, so the interrupt itself must save
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(display.TrainDisplay, "row", row_then_ctrl_c)
    args = ("sparse", "--steps", str(SPARSE_STEPS), "--output", str(run), "--init-from", str(stage_chain["warmup"][0]))
    first = _invoke(*args)
    assert first.exit_code == 130, first.output
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [3, 5]
    monkeypatch.setattr(display.TrainDisplay, "row", original)
    reads = []
    read_metrics = run_files.read_metrics
    monkeypatch.setattr(run_files, "read_metrics", lambda *a, **k: reads.append(a) or read_metrics(*a, **k))
    second = _invoke(*args)
    assert second.exit_code == 0, second.output
    assert len(reads) == 2, reads  # metrics.jsonl read once to resume, once for the summary
    monkeypatch.setattr(run_files, "read_metrics", read_metrics)
    assert "resuming from checkpoint step 5" in second.output
    straight, resumed = run_files.read_metrics(stage_chain["sparse"][0]), run_files.read_metrics(run)
    assert [r["step"] for r in resumed] == list(range(SPARSE_STEPS))
    for a, b in zip(straight, resumed):
        for k in LOSS_KEYS:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
    again = _invoke(*args)  # the run is complete: nothing to do, nothing overwritten
    assert again.exit_code == 0 and "nothing to do" in again.output
    assert run_files.read_metrics(run) == resumed


def _save_without_indexer(run, cfg) -> None:
    """A run directory holding a use_indexer=false model, as a converted checkpoint would be."""
    setup = build(*resolved(cfg.replace(use_indexer=False)))
    saver = ckpt.RunCheckpointer(run, max_to_keep=1, async_save=False)
    saver.save(0, model=nnx.to_pure_dict(nnx.state(setup.model)), optimizer=nnx.to_pure_dict(nnx.state(setup.optimizer)),
               data={}, metadata={"config": setup.specs.cfg.to_dict(), "stage": "pretrain", "step": 0})
    saver.close()


def test_warmup_from_a_model_without_indexer(tmp_path):
    src = tmp_path / "noidx"
    _save_without_indexer(src, tiny_config("pretrain", "init_weights_seed=3"))
    cfg = tiny_config("warmup", "checkpoint_period=4", "indexer_init=random")
    fresh = _variables(build(*resolved(cfg)).model)
    plan = preflight(cfg, "warmup", tmp_path / "phases", init_from=src)  # the two phases alone
    assert plan.source.fresh_indexer
    made = materialise(plan.specs, plan.mesh, plan.labels, plan.abstract, plan.source, plan.data)
    loaded, source = _variables(made.setup.model), _variables(ckpt.restore_model(src)[0])
    assert [k for k in loaded if is_indexer(k)] and not [k for k in source if is_indexer(k)]
    for k, v in loaded.items():
        np.testing.assert_array_equal(v, fresh[k] if is_indexer(k) else source[k], err_msg=k)

    result = runner.invoke(app, ["warmup", "--steps", str(CHAIN_STEPS["warmup"]), "--output", str(tmp_path / "w"),
                                 "--init-from", str(src), *TINY_OVERRIDES, "checkpoint_period=4"])
    assert result.exit_code == 0, result.output
    assert "indexer initialised fresh" in result.output and "has no indexer parameters" in result.output


def test_other_mismatches_stay_one_line_errors(tmp_path):
    src = tmp_path / "noidx"
    _save_without_indexer(src, tiny_config("pretrain", "base_emb_dim=32"))
    result = runner.invoke(app, ["warmup", "--steps", "2", "--output", str(tmp_path / "w"), "--init-from", str(src),
                                 *TINY_OVERRIDES])
    assert result.exit_code == 2 and "shape" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="shape"):
        train.Trainer(tiny_config("sparse"), stage="sparse", run_dir=tmp_path / "s", init_from=src)


# ----------------------------------------------------------------------------- indexer_init: teacher

def _teacher_warmup(run_dir, source, steps: int):
    """A warm-up with indexer_init=teacher from `source`. The chain's warm-up schedule (WARMUP_STEPS long)
    for every run length: A, B and B's resume compile the chain warm-up's program (read back from the
    compilation cache), not one of their own."""
    cfg = tiny_config("warmup", "indexer_init=teacher", "indexer_init_batches=2",
                      f"learning_rate_schedule_steps={WARMUP_STEPS}", steps=steps, checkpoint_period=1)
    trainer = train.Trainer(cfg, stage="warmup", run_dir=run_dir, init_from=source)
    rows = list(trainer.run())
    return trainer.info, rows


@pytest.fixture(scope="module")
def teacher_runs(stage_chain, tmp_path_factory):
    """Three short teacher-initialised warm-ups from the chain's pre-training: A straight for two steps,
    B for one step and then resumed to two. {"a" | "b1" | "b2": (run dir, trainer info, metric rows)}."""
    root, pre = tmp_path_factory.mktemp("teacher-init"), stage_chain["pretrain"][0]
    return {"a": (root / "a", *_teacher_warmup(root / "a", pre, 2)),
            "b1": (root / "b", *_teacher_warmup(root / "b", pre, 1)),
            "b2": (root / "b", *_teacher_warmup(root / "b", pre, 2))}


def _state(run_dir, step):
    model, _, _ = ckpt.restore_model(run_dir, step)
    return _variables(model)


def test_the_teacher_initialisation_runs_once_and_resumes_bitwise(teacher_runs):
    """A and B initialised independently from the same source: the same step 0, bitwise; B's resume
    says nothing of an initialisation and reaches A's step 1 bitwise."""
    runs = teacher_runs
    inits = [[n for n in runs[k][1]["notices"] if n.startswith("indexer_init=teacher:")] for k in ("a", "b1", "b2")]
    assert [len(n) for n in inits] == [1, 1, 0], inits
    assert runs["b2"][1]["resumed_from"] == 0
    a0, b0 = _state(runs["a"][0], 0), _state(runs["b1"][0], 0)
    assert all(np.array_equal(a0[k], b0[k]) for k in a0), "step 0 differs: the initialisation is not deterministic"
    a1, b1 = _state(runs["a"][0], 1), _state(runs["b2"][0], 1)
    diff = {k: float(np.max(np.abs(a1[k] - b1[k]))) for k in a1 if not np.array_equal(a1[k], b1[k])}
    assert not diff, f"resumed != straight: {diff}"
    assert [r["indexer_loss"] for r in runs["a"][2]][1] == runs["b2"][2][0]["indexer_loss"]


def test_teacher_step0_kl_is_below_the_random_start_and_only_the_indexer_changes(stage_chain):
    """On the pre-trained model's calibration rows, every layer's KL to its teacher after the initialisation
    is below the warm-up preset's random start (weights_proj = 0: a uniform student, KL_uniform), and
    nothing but the indexers' parameters moved. On the run's mesh with sharded batches, as a warm-up
    initialises (core/train/materialise.py): the chain's warm-up compiled these two programs."""
    from core.parallel.mesh import make_mesh

    cfg = tiny_config("warmup", "indexer_init=teacher", "indexer_init_batches=2")
    mesh = make_mesh(cfg)
    model, _, _ = ckpt.restore_model(stage_chain["pretrain"][0], None, resolved(cfg, mesh)[0].model, mesh=mesh)
    before = _variables(model)
    assert all(not v.any() for k, v in before.items() if k.endswith("indexer/weights_proj"))  # the random start
    batches = calibration_batches(train_batches(data_spec(cfg), cfg.per_device_batch_size * jax.device_count()),
                                  cfg.indexer_init_batches, mesh)
    report = teacher_init(model, batches, mesh)
    assert len(report.layers) == len(cfg.csa_layers) and all(0 < t for t in report.temperature)
    assert all(k < u for k, u in zip(report.kl, report.kl_uniform)), (report.kl, report.kl_uniform)
    assert report.kl_captured > 0.3, report
    after = _variables(model)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(is_indexer(k) for k in changed), sorted(changed)


def test_teacher_init_belongs_to_the_warmup():
    for stage in ("pretrain", "sparse"):
        with pytest.raises(ConfigError, match="indexer_init=teacher in dsv4 " + stage):
            tiny_config(stage, "indexer_init=teacher")


# ----------------------------------------------------------------------------- one copy of the state

def _count_calls(monkeypatch, fn, calls: list) -> None:
    """Every core module's name for `fn` replaced by a wrapper that appends its name to `calls` at each call."""
    import sys

    def counted(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    for module in [m for name, m in sys.modules.items() if name.startswith("core.")]:
        if getattr(module, fn.__name__, None) is fn:
            monkeypatch.setattr(module, fn.__name__, counted)


def _new_bytes(before: set[int]) -> int:
    """Bytes of the live JAX arrays not among `before` (ids of arrays alive earlier)."""
    return sum(a.nbytes for a in jax.live_arrays() if id(a) not in before)


@pytest.mark.parametrize("how", ["resume", "init_from"])
def test_a_state_read_from_a_checkpoint_is_not_initialised_first(stage_chain, tmp_path, monkeypatch, how):
    """A resumed run and an --init-from build their model (and optimizer) from shapes and let the checkpoint
    fill it: when the checkpoint is read, nothing of a random state is on the devices (at full size a
    throwaway state beside the one read would double the state's memory), and the run goes on from it.
    The run's phases make the mesh, check the masks and read the checkpoint's trees once each."""
    from core.parallel.mesh import make_mesh
    from core.train.step import check_masks

    once = []
    for fn in (make_mesh, check_masks, ckpt._read_trees):
        _count_calls(monkeypatch, fn, once)
    at_read = []
    if how == "resume":  # the chain's sparse run without its last checkpoint: resumed from the one before
        run, stage, init = tmp_path / "sparse", "sparse", None
        shutil.copytree(stage_chain["sparse"][0], run)
        last = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
        shutil.rmtree(run / "checkpoints" / str(last))
    else:
        run, stage, init = tmp_path / "warm", "warmup", stage_chain["pretrain"][0]
    restore = ckpt.restore
    monkeypatch.setattr(ckpt, "restore", lambda *a, **k: at_read.append(_new_bytes(before)) or restore(*a, **k))
    cfg = tiny_config(stage, steps=CHAIN_STEPS[stage], checkpoint_period=4)  # the chain's compiled steps
    before = {id(a) for a in jax.live_arrays()}
    trainer = train.Trainer(cfg, stage=stage, run_dir=run, init_from=init)
    state_bytes = tree_bytes(trainer.state)
    assert len(at_read) == 1 and at_read[0] < 0.01 * state_bytes, (at_read, state_bytes)
    assert sorted(once) == ["_read_trees", "check_masks", "make_mesh"], once
    rows = list(trainer.run())
    assert rows and all(np.isfinite(r["total_loss"]) for r in rows)
    if how == "resume":  # and goes on as the straight run did
        straight = run_files.read_metrics(stage_chain["sparse"][0])
        assert trainer.info["resumed_from"] < last and [r["step"] for r in rows] == list(range(trainer.start_step, last + 1))
        assert [[r[k] for k in LOSS_KEYS] for r in rows] == [[r[k] for k in LOSS_KEYS] for r in straight[trainer.start_step:]]
