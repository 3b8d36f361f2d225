"""One program: `dsv4 plan` and `dsv4 bench --train` lower the very step a training command runs
(core/train/program.py's `StepProgram`: `abstract_inputs` and `jit_step` over core/train/step.py's
`step_fn`). The lowered StableHLO carries the shapes, dtypes, shardings, donation and
mesh-dependent paths; the compile options travel beside it. Lowering only: no compile."""

from __future__ import annotations

from core.config.schema import load_config

# two layers (SWA, then CSA: the indexer and its loss), the sparse stage's LM loss and the guard
TWO_LAYERS = ("compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=1", "vocab_size=512",
              "max_target_length=64", "per_device_batch_size=1", "dataset_type=synthetic",
              "xla_backend_optimization_level=2")  # a level of its own: the jitted step this file caches is its own


def _program(lowered) -> tuple:
    # the options sit on the lowering, not in its text (JAX's persistent cache keys on both)
    return lowered.as_text(), lowered._lowering._compiler_options_kvs, lowered.donate_argnums


def test_bench_and_plan_lower_the_training_commands_step(monkeypatch):
    from flax import nnx

    from core.data.batches import train_batches
    from core.spec.resolve import data_spec
    from core.parallel.sharding import shard_batch
    from core.plan.compile import lower_plan
    from core.plan.targets import parse_target
    from core.train.materialise import build
    from core.train.program import StepProgram, lowered_step
    from tests.conftest import resolved

    monkeypatch.setenv("XLA_FLAGS", "")  # the suite's level (tests/conftest.py) would drop the options to compare
    cfg = load_config("deepseek4-tiny", list(TWO_LAYERS), stage="sparse")
    # a training command's step on its built state and a drawn batch (the Trainer's jitted path)
    specs, mesh = resolved(cfg)
    setup = build(specs, mesh)
    graphdef, state = nnx.split((setup.model, setup.optimizer))
    batch = shard_batch(next(train_batches(data_spec(cfg), setup.batch_size)), setup.mesh)
    train = _program(StepProgram.of(specs, graphdef, state, mesh).lower(state, batch))
    assert train[1] == (("xla_backend_optimization_level", 2),) and train[2], train[1:]
    assert "sdy.sharding" in train[0] and "tf.aliasing_output" in train[0]  # shardings and donation are in the text
    # what bench --train compiles (core/bench/train.py: compile_train_step), also the ahead-of-time compile
    bench, _ = lowered_step(specs, mesh)
    assert _program(bench) == train
    # what dsv4 plan --target cpu:1 compiles, in its child
    plan, _ = lower_plan(resolved(cfg)[0], parse_target("cpu:1"))
    assert _program(plan) == train
