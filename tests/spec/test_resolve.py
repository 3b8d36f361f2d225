"""core/spec/resolve.py: a step's specs are what its program computes; the run-only keys never reach them."""

from core.config.schema import load_config
from core.spec.resolve import resolve

RUN_ONLY = ("checkpoint_period=7", "max_checkpoints=2", "async_checkpointing=false", "enable_tensorboard=false",
            "compile_ahead=false", "data_shuffle_seed=9", "run_name=other", "allow_data_change=true", "jax_cache_dir=")


def _specs(*overrides, steps=None):
    cfg = load_config("deepseek4-tiny", ["learning_rate_schedule_steps=50", *overrides], stage="sparse")
    specs = resolve(cfg if steps is None else cfg.replace(steps=steps), "cpu")
    return specs.model, specs.step


def test_run_only_keys_leave_the_specs_alone_and_a_step_key_does_not():
    base = _specs()
    assert _specs(*RUN_ONLY) == base
    assert _specs(steps=base[1].optimizer.schedule_steps + 7) == base  # a fixed schedule: the run's length is not the step's
    assert _specs("learning_rate=3e-3")[1].optimizer != base[1].optimizer
    assert _specs("routed_bias_update_rate=0.5")[1] != base[1]
    assert _specs("per_device_batch_size=3")[1].rows == 3 != base[1].rows


def test_the_specs_of_a_resolved_config_hold_no_config():
    resolved = resolve(load_config("deepseek4-tiny", stage="sparse"), "cpu")
    specs = resolved.specs
    assert not hasattr(specs, "cfg") and (specs.platform, specs.model, specs.step) == (
        resolved.platform, resolved.model, resolved.step)
