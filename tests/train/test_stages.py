"""DeepSeek-V4's three stages as commands: `dsv4 pretrain`, `dsv4 warmup --init-from`
(also from a model without an indexer), the chain into `dsv4 sparse` and `dsv4 eval-indexer`, and
the warnings for a top-k that cannot bind. The chain runs once per session (conftest.stage_chain)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from tests.conftest import CHAIN_STEPS, TINY_OVERRIDES, tiny_config
from core.checkpoint import store as ckpt
from core import tree
from core.checkpoint import run_files
from core.train import run as train
from core.train import step as train_step
from core.errors import CheckpointError
from core.model.transformer import Transformer
from core.train.handoff import is_indexer, topk_warning
from dsv4cli.main import app

runner = CliRunner()


def _variables(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


def test_pretrain_trains_all_but_the_indexer(stage_chain):
    run, output = stage_chain["pretrain"]
    model, cfg, meta = ckpt.restore_model(run)
    assert meta["stage"] == "pretrain" and cfg.dense_pretraining and cfg.frozen_parameters_mask == (".*indexer.*",)
    initial = _params(Transformer(cfg, rngs=nnx.Rngs(cfg.init_weights_seed)))
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
    result = runner.invoke(app, ["eval-indexer", str(run), "--batches", "1", "--topk", "4,32", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["checkpoint"]["stage"] == "sparse" and report["topk_binds_share"] is None  # 16 not swept
    by_k = report["overall"]["by_k"]
    assert by_k[0]["informative_rows"] > 0 and by_k[1]["informative_rows"] == 0  # 128 tokens: <= 32 blocks
    assert report["warnings"] == [w for w in report["warnings"] if "k=32" in w] and len(report["warnings"]) == 1
    for e in by_k:
        assert -1 <= e["all"]["kl_captured"] <= 1
    assert by_k[1]["informative"]["gain"] is None
    table = runner.invoke(app, ["eval-indexer", str(run), "--batches", "1", "--topk", "4,32"])
    assert "gain@k" in table.stdout and "KL captured" in table.stdout and "top-k binds" in table.stdout
    assert "warning: top-k never binds at k=32" in table.stdout


def _save_without_indexer(run, cfg) -> None:
    """A run directory holding a use_indexer=false model, as a converted checkpoint would be."""
    setup = train_step.build(cfg.replace(use_indexer=False))
    saver = ckpt.RunCheckpointer(run, max_to_keep=1, async_save=False)
    saver.save(0, model=nnx.to_pure_dict(nnx.state(setup.model)), optimizer=nnx.to_pure_dict(nnx.state(setup.optimizer)),
               data={}, metadata={"config": setup.cfg.to_dict(), "stage": "pretrain", "step": 0})
    saver.close()


def test_warmup_from_a_model_without_indexer(tmp_path):
    src = tmp_path / "noidx"
    _save_without_indexer(src, tiny_config("pretrain", "init_weights_seed=3"))
    cfg = tiny_config("warmup", "checkpoint_period=4")
    setup = train_step.build(cfg)
    fresh = _variables(setup.model)
    train_step.load_init_weights(setup, src, fresh_indexer=True)
    loaded, source = _variables(setup.model), _variables(ckpt.restore_model(src)[0])
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


@pytest.mark.parametrize("overrides,warns", [
    ((), False),                                   # 128 tokens = 32 blocks > k = 16
    (("indexer_topk=31",), False),
    (("indexer_topk=32",), True),                  # k = every visible block of the longest row
    (("indexer_topk=32", "max_target_length=256"), False),
    (("indexer_topk=32", "use_indexer=false"), False),  # nothing to select with
])
def test_training_warns_exactly_when_topk_cannot_bind(overrides, warns):
    for stage in ("pretrain",) if "use_indexer=false" in overrides else ("pretrain", "sparse"):
        cfg = tiny_config(stage, *overrides)
        assert (topk_warning(cfg) is not None) == warns, (stage, overrides)
    if warns:
        assert "never binds" in topk_warning(tiny_config("warmup", *overrides))


def test_trainer_carries_the_warning_once(tmp_path):
    cfg = tiny_config("warmup", "indexer_topk=32")
    trainer = train.Trainer(cfg, stage="warmup", run_dir=tmp_path / "w")
    trainer.ckpt.close()
    assert trainer.info["warnings"] == [topk_warning(cfg)] and trainer.info["notices"] == []


def test_pretrain_forward_is_dense_with_the_head_and_no_indexer_loss():
    """mode="train" under dense_pretraining = the eval_dense forward (every visible block), not top-k."""
    import jax
    import jax.numpy as jnp

    cfg = tiny_config("pretrain", "indexer_topk=2", "per_device_batch_size=1")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, cfg.max_target_length), 0, cfg.vocab_size)
    positions = jnp.arange(cfg.max_target_length)[None]
    segments = jnp.ones_like(tokens)
    run = nnx.jit(lambda m, mode: m(tokens, positions, segments, mode=mode), static_argnums=1)
    (train_logits, aux), (dense_logits, _), (topk_logits, _) = (run(model, m) for m in ("train", "eval_dense", "eval"))
    assert float(aux["indexer_loss"]) == 0.0 and train_logits is not None
    np.testing.assert_array_equal(np.asarray(train_logits), np.asarray(dense_logits))
    assert np.abs(np.asarray(train_logits) - np.asarray(topk_logits)).max() > 1e-6  # top-2 of 32 blocks binds


@pytest.mark.parametrize("override,needle", [
    ("indexer_loss_scaling_factor=0.1", "leaves the indexer idle"),
    ("dense_pretraining=false", "dense_pretraining=false in dsv4 pretrain"),
    ("frozen_parameters_mask=[]", "add '.*indexer.*' to frozen_parameters_mask"),
    ("frozen_parameters_mask=['(']", "not a valid regex"),
])
def test_pretrain_bad_inputs_exit_2_with_one_line(tmp_path, override, needle):
    result = runner.invoke(app, ["pretrain", "--steps", "1", "--output", str(tmp_path / "p"), *TINY_OVERRIDES, override])
    assert result.exit_code == 2 and needle in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_warmup_preset_is_constant_lr_without_decay_and_its_help_lists_it():
    """The warm-up recipe chosen in docs/benchmarks.md#why-the-defaults: lr 1e-2 constant after the linear
    warm-up, no weight decay, adam_eps below the warm-up's gradients, adam_b1 0.7; `dsv4 warmup --help` (and
    `dsv4 pretrain --help`) list every preset key."""
    from core.config.schema import load_config
    from core.train.step import learning_rate_schedule

    cfg = load_config("deepseek4-tiny", (), stage="warmup", options={"steps": 100})
    assert (cfg.learning_rate, cfg.adam_weight_decay, cfg.adam_eps, cfg.adam_b1) == (1e-2, 0.0, 1e-12, 0.7)
    lr = [float(learning_rate_schedule(cfg)(s)) for s in (4, 50, 99)]
    assert lr == pytest.approx([1e-2] * 3, rel=1e-6)
    for stage in ("warmup", "pretrain"):
        _help_lists_preset(stage)


def _help_lists_preset(stage):
    import re

    import yaml

    from core.config.files import stage_presets

    preset = stage_presets(stage)
    text = " ".join(runner.invoke(app, [stage, "--help"], terminal_width=400).output.split())
    for key, value in preset.items():
        shown = re.search(rf"(?<!\w){key}=(\S+)", text)
        assert shown, key
        parsed = yaml.safe_load(shown.group(1))
        assert (float(parsed) if isinstance(value, float) else parsed) == value, (key, shown.group(1), value)


@pytest.mark.parametrize("stage, zero", [("pretrain", True), ("warmup", True), ("sparse", False)])
def test_indexer_weights_init_reaches_the_indexer(stage, zero):
    """`indexer_weights_init` (zeros in the pretrain and warm-up presets) is how a CSA layer's
    indexer weights_proj starts; the sparse preset keeps the random fan-in init."""
    from core.model.attention import Attention, AttentionSpec

    cfg = tiny_config(stage)
    layer = cfg.compress_ratios.index(4)
    attn = Attention(AttentionSpec.from_config(cfg, layer), rngs=nnx.Rngs(0))
    assert cfg.indexer_weights_init == ("zeros" if zero else "fan_in")
    assert np.any(np.asarray(attn.indexer.weights_proj[...])) != zero
