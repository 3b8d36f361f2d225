"""Training end to end through the CLI (`dsv4 warmup`) on a shrunken deepseek4-tiny: a fresh
warm-up, local data files, bad input; plus float64 references for the LM loss and the
learning-rate schedule.

The fresh warm-up (a module fixture) is shared by several tests; it takes as many steps as the
stage chain's warm-up (tests/train/test_stages.py), whose compiled step it then shares when both
files run in one process. The sparse stage end to end (and an interrupted, resumed run) is
tests/train/test_stages.py's, on the chain's runs.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from tests.conftest import CHAIN_STEPS, TINY_OVERRIDES, init_model, tiny_config
from core.checkpoint import store as ckpt
from core import tree
from core.checkpoint import run_files
from core.loss import lm as lm_loss
from core.spec.resolve import optimizer_spec
from core.train import step as train_step
from core.errors import ConfigError
from dsv4cli import display
from dsv4cli.main import app

runner = CliRunner()
WARMUP_STEPS = CHAIN_STEPS["warmup"]


def _invoke(*args):
    return runner.invoke(app, [*args, *TINY_OVERRIDES, "checkpoint_period=4"])


def _variables(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "warm"
    result = _invoke("warmup", "--steps", str(WARMUP_STEPS), "--output", str(run))
    assert result.exit_code == 0, result.output
    return run, result.output


# ----------------------------------------------------------------------------- the warm-up


def test_warmup_trains_only_the_indexer(warm):
    run, output = warm
    rows = run_files.read_metrics(run)
    assert [r["step"] for r in rows] == list(range(WARMUP_STEPS))
    for r in rows:
        assert r["lm_loss"] == 0.0
        assert 0 < r["indexer_loss"] < 1 and math.isfinite(r["indexer_loss"]) and r["moe_lb_loss"] > 0
        np.testing.assert_allclose(r["total_loss"], r["indexer_loss"] + r["moe_lb_loss"], rtol=1e-6)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [3, 5]
    assert "(compile)" in output and "lm_loss" in output and "checkpoint" in output

    model, cfg, meta = ckpt.restore_model(run)
    assert meta["stage"] == "warmup" and meta["step"] == WARMUP_STEPS - 1
    trained = _variables(model)
    initial = _variables(init_model(cfg, cfg.init_weights_seed))
    assert trained.keys() == initial.keys()
    indexer = [k for k in trained if "indexer" in k]
    assert indexer and len(indexer) < len(trained)
    for k in trained:
        if "indexer" in k:
            assert not np.array_equal(trained[k], initial[k]), f"{k} did not train"
        else:  # frozen weights and the router biases stay bit for bit
            assert trained[k].tobytes() == initial[k].tobytes(), f"{k} changed in the warm-up"
    opt_paths = ckpt.read_tree(run, item="optimizer")
    assert any(p.endswith("/mu/" + k) for p in opt_paths for k in indexer[:1])
    assert all("indexer" in p or p.split("/")[-1] in ("count", "step") for p in opt_paths), \
        [p for p in opt_paths if "indexer" not in p][:5]


# ----------------------------------------------------------------------------- data and errors


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_local_data_files(tmp_path, warm, kind):
    texts = [f"local document number {i}. " * 20 for i in range(8)]
    path = tmp_path / f"docs.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), path)
    else:
        path.write_text("\n\n".join(texts))
    result = _invoke("warmup", "--steps", str(WARMUP_STEPS), "--output", str(tmp_path / "run"), f"hf_path={path}")
    assert result.exit_code == 0, result.output
    assert str(path) in result.output and len(run_files.read_metrics(tmp_path / "run")) == WARMUP_STEPS


@pytest.mark.parametrize("args,needle", [
    (["warmup", "hf_path=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
    (["warmup", "tokenizer_path=/nonexistent/tokenizer.json"], "/nonexistent/tokenizer.json"),
    (["warmup", "vocab_size=200"], "vocab_size=200"),
    (["warmup", "trainable_parameters_mask=[nothing]"], "matches no parameter"),
    (["sparse", "--init-from", "/nonexistent/run"], "/nonexistent/run"),
])
def test_bad_inputs_exit_2_with_one_line(tmp_path, args, needle):
    command, *rest = args
    result = runner.invoke(app, [command, "--steps", str(WARMUP_STEPS), "--output", str(tmp_path / "run"),
                                 *TINY_OVERRIDES, *rest])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_resume_with_another_shape_names_the_parameter(warm):
    result = runner.invoke(app, ["warmup", "--steps", str(WARMUP_STEPS + 2), "--output", str(warm[0]),
                                 *TINY_OVERRIDES, "base_moe_mlp_dim=32"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ffn/experts/w1' of shape" in lines[0], result.stderr
    assert len(run_files.read_metrics(warm[0])) == WARMUP_STEPS  # nothing overwritten


# ----------------------------------------------------------------------------- pieces


def test_lm_loss_matches_float64_reference(x64):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)) * 3
    targets = rng.integers(0, 7, size=(2, 5))
    mask = rng.integers(0, 2, size=(2, 5))
    mask[0, 0] = 1
    total, count = 0.0, 0
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                row = logits[b, t]
                total += math.log(sum(math.exp(x) for x in row)) - row[targets[b, t]]
                count += 1
    got = float(lm_loss.lm_loss(jax.numpy.asarray(logits), jax.numpy.asarray(targets), jax.numpy.asarray(mask)))
    np.testing.assert_allclose(got, total / count, rtol=1e-12)
    assert float(lm_loss.lm_loss(np.zeros((1, 2, 3)), np.zeros((1, 2), np.int32), np.zeros((1, 2)))) == 0.0


def test_learning_rate_schedule_matches_reference():
    cfg = tiny_config("sparse", "warmup_steps_fraction=0.1", "cosine_learning_rate_final_fraction=0.2",
                      "learning_rate=0.01", steps=50)
    warm = 5
    for step in range(50):
        if step < warm:
            want = 0.01 * (step + 1) / warm
        else:
            frac = (step - warm) / (50 - 1 - warm)
            want = 0.002 + 0.5 * (0.01 - 0.002) * (1 + math.cos(math.pi * frac))
        np.testing.assert_allclose(float(train_step.learning_rate_schedule(optimizer_spec(cfg))(step)), want, rtol=1e-6)


def test_trainable_mask_fully_matches_paths():
    match = train_step.path_matcher([".*indexer.*", "embed"])
    assert match(("layers", 1, "attn", "indexer", "wq_b")) and match(("embed",))
    assert not match(("layers", 1, "attn", "wq_a")) and not match(("embedder",))
    assert train_step.path_matcher([])(("anything",))
    model = init_model(tiny_config(), 0)
    with pytest.raises(ConfigError, match="matches no parameter"):
        train_step.trainable_labels(model, ["indexer"])


def test_live_table_keeps_the_compile_step():
    from rich.console import Console

    console = Console(force_terminal=True, record=True, width=160)
    view = display.TrainDisplay(console)
    row = dict(step=0, total_loss=1.0, lm_loss=0.9, indexer_loss=0.01, moe_lb_loss=4e-4, step_time_s=9.0,
               tokens_per_s=10.0, compile=True)
    with view.steps():
        for s in range(30):
            view.row({**row, "step": s, "compile": s == 0})
    text = console.export_text()
    assert "(compile)" in text and "⋮" in text and " 29 " in text


def test_the_optimizer_is_built_beside_the_parameters_not_over_a_copy():
    """`new_optimizer` (core/parallel/sharding.py's `create_sharded`) reads the placed model and
    allocates only the moments: the model keeps its very arrays (a program that returned the model
    would have replaced each with a new array, a second copy of every parameter at the build's peak:
    docs/planning.md#on-a-chip)."""
    from core.parallel.mesh import make_mesh
    from core.parallel.sharding import shard_state
    from core.train.materialise import new_optimizer

    cfg = tiny_config("sparse")
    mesh = make_mesh(cfg)
    model = shard_state(init_model(cfg, cfg.init_weights_seed), mesh)
    before = tree.flatten(nnx.to_pure_dict(nnx.state(model)))
    optimizer = new_optimizer(optimizer_spec(cfg), model, mesh)
    after = tree.flatten(nnx.to_pure_dict(nnx.state(model)))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before), \
        [k for k in before if after[k] is not before[k]][:3]
    moments = jax.tree.leaves(nnx.state(optimizer))
    assert moments and all(not np.any(np.asarray(m)) for m in moments)  # zero moments, step 0


def test_each_step_reports_model_tflops_and_mfu(warm):
    """metrics.jsonl and the live table carry the model's TFLOP/s per device and MFU: the analytic model
    FLOPs of the step (core.train.flops) over the step's time and, for MFU, over the device's peak (on a
    CPU the measured matmul ceiling, named in the header)."""
    from core.spec.resolve import resolve
    from core.config.schema import loads
    from core.train.flops import model_flops_per_step

    run, output = warm
    cfg = resolve(loads((run / run_files.CONFIG_FILE).read_text()), "cpu").cfg
    flops = model_flops_per_step(cfg, cfg.per_device_batch_size)["total"]
    for r in run_files.read_metrics(run):
        assert r["tflops_per_device"] == pytest.approx(flops / r["step_time_s"] / 1e12, rel=1e-9)
        assert 0 < r["mfu"] < 1 and r["mfu"] * r["tflops_per_device"] > 0
    assert "MFU over the CPU: measured f32 matmul ceiling" in output
    assert "TFLOP/s/dev" in output and "MFU" in output
