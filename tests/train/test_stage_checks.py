"""The stages' options and checks that need no training run: the warnings for a top-k that cannot
bind, the pre-training forward (dense, with the head, no indexer loss), `dsv4 pretrain`'s bad
inputs, the warm-up preset and the indexer's initialisation per stage. The stage chain itself
(pretrain -> warmup -> sparse) is tests/train/test_stages.py's."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from tests.conftest import TINY_OVERRIDES, init_model, tiny_config
from core.train.preflight import preflight, topk_warning
from core.spec.resolve import resolve
from dsv4cli.main import app

runner = CliRunner()


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


def test_preflight_carries_the_warning_once(tmp_path):
    cfg = tiny_config("warmup", "indexer_topk=32")  # the warning needs no built model, no compiled step
    plan = preflight(cfg, "warmup", tmp_path / "w")
    assert plan.warnings == (topk_warning(cfg),) and plan.notices == ()
    assert not (tmp_path / "w").exists(), "preflight wrote to the run directory"


def test_pretrain_forward_is_dense_with_the_head_and_no_indexer_loss():
    """mode="train" under dense_pretraining = the eval_dense forward (every visible block), not top-k."""
    import jax
    import jax.numpy as jnp

    cfg = tiny_config("pretrain", "indexer_topk=2", "per_device_batch_size=1")
    model = init_model(cfg, 0)
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
    """The warm-up recipe chosen in docs/benchmarks.md#why-the-defaults and docs/indexer-init.md: the teacher
    start, lr 3e-3 constant after the linear warm-up, no weight decay, adam_eps below the warm-up's gradients,
    adam_b1 0.7; `dsv4 warmup --help` (and `dsv4 pretrain --help`) list every preset key."""
    from core.config.schema import load_config
    from core.train.step import learning_rate_schedule
    from core.spec.resolve import optimizer_spec

    cfg = load_config("deepseek4-tiny", (), stage="warmup", options={"steps": 100})
    assert (cfg.learning_rate, cfg.adam_weight_decay, cfg.adam_eps, cfg.adam_b1) == (3e-3, 0.0, 1e-12, 0.7)
    assert cfg.indexer_init == "teacher"
    lr = [float(learning_rate_schedule(optimizer_spec(cfg))(s)) for s in (4, 50, 99)]
    assert lr == pytest.approx([3e-3] * 3, rel=1e-6)
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
    from core.model.attention import Attention

    cfg = tiny_config(stage)
    layer = cfg.compress_ratios.index(4)
    attn = Attention(resolve(cfg, "cpu").model.blocks[layer].attn, rngs=nnx.Rngs(0))
    assert cfg.indexer_weights_init == ("zeros" if zero else "fan_in")
    assert np.any(np.asarray(attn.indexer.weights_proj[...])) != zero
