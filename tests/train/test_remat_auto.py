"""remat_policy=auto (core/train/remat.py `remat_that_fits` and its screen): `full` by the platform rule;
on a TPU mesh, `none` where the step without layer remat compiles within the device's memory, its executable kept
for the run, else `projections`, else `experts` where that step does; `full` where the screen rules them out, the
compiler refuses them or their memory analysis exceeds the device. The TPU's branches run here on a CPU mesh with the
platform patched; the planner's through libtpu."""

from __future__ import annotations

import functools
import importlib.util

import jax
import pytest
from flax import nnx

from core.config.schema import load_config
from core.spec.platform import resolve_config
from core.spec.resolve import resolve
from core.train import memory, program, remat

# two CSA layers of 64 tokens, scanned: every part of the sparse step, a compile of seconds, and residuals
# across layers that outweigh the rest of the step's memory (with one layer, none's step is XLA:CPU's smallest)
SMALL = ("compress_ratios=[4,4]", "base_num_decoder_layers=2", "first_num_hash_layers=0", "vocab_size=512",
         "max_target_length=64", "per_device_batch_size=2")
HUGE = 1 << 50


def _configs(*extra, stage="sparse", platform="tpu"):
    """(the remat_policy asked, the config's specs resolved for `platform`'s choices on the run's CPU mesh,
    the mesh): a TPU's specs take the remat choice's TPU path; their steps compile on the CPU."""
    asked = load_config("deepseek4-tiny", [*SMALL, *extra], stage=stage)
    from core.parallel.mesh import make_mesh

    mesh = make_mesh(asked)
    return asked.remat_policy, resolve(asked, platform, mesh.shape), mesh


@pytest.fixture(scope="module", autouse=True)
def residuals_traced_once_per_config():
    """`kept_bytes_per_row` traces the step's backward; its answer depends on the config alone, and the
    screen asks it again for each call of `remat_that_fits`: this file traces each config once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(remat, "kept_bytes_per_row", functools.cache(remat.kept_bytes_per_row))
        yield


def _no_compile(monkeypatch, replacement=None) -> None:
    """StepProgram.compile replaced (by default: the test fails if anything compiles)."""
    monkeypatch.setattr(program.StepProgram, "compile", replacement or (lambda *a, **k: pytest.fail("compiled")))


def test_auto_is_full_until_a_compile_says_otherwise():
    for platform in ("cpu", "gpu", "tpu"):
        assert resolve_config(load_config("deepseek4-tiny", ["remat_policy=auto"]), platform).remat_policy == "full"
    asked, cfg, mesh = _configs("remat_policy=auto", platform="cpu")
    assert remat.remat_that_fits(asked, cfg, mesh, HUGE) is cfg  # the CPU's specs: nothing compiled


def test_no_remat_where_it_fits_and_its_compile_is_kept_for_the_run():
    asked, cfg, mesh = _configs("remat_policy=auto")
    light = remat.remat_that_fits(asked, cfg, mesh, HUGE)
    assert light.cfg.remat_policy == "none" and light.replace(remat_policy="full") == cfg
    assert program.abstract_program(light, mesh)[0].compiled() is not None
    assert program.has_specs(light)  # the run's compile_ahead starts no second compile


def _compiled_total(specs, mesh):
    """The step of `specs` compiled (or found compiled) on `mesh`: its total bytes and its program."""
    step, inputs = program.abstract_program(specs, mesh)
    return memory.compiled_memory(step.compile(inputs.state, inputs.batch))["total_bytes"], step


def test_auto_takes_none_then_projections_then_experts_then_full_as_the_device_shrinks(monkeypatch):
    asked, cfg, mesh = _configs("remat_policy=auto")  # the previous test's: its compile of none is cached
    (none, none_step), (kept, kept_step), (moe, moe_step) = (_compiled_total(cfg.replace(remat_policy=p), mesh)
                                                             for p in ("none", "projections", "experts"))
    assert none > kept > moe, (none, kept, moe)
    monkeypatch.setattr(remat, "remat_worth_compiling", lambda *a: True)  # past the screen, the compile decides
    assert remat.remat_that_fits(asked, cfg, mesh, none).cfg.remat_policy == "none"  # exactly the device: fits
    assert remat.remat_that_fits(asked, cfg, mesh, none - 1).cfg.remat_policy == "projections"
    assert none_step.compiled() is None  # the executable that does not fit is not kept
    assert remat.remat_that_fits(asked, cfg, mesh, kept).cfg.remat_policy == "projections"
    assert remat.remat_that_fits(asked, cfg, mesh, kept - 1).cfg.remat_policy == "experts"
    assert kept_step.compiled() is None
    assert remat.remat_that_fits(asked, cfg, mesh, moe - 1) is cfg  # full: compiled by the run itself
    assert moe_step.compiled() is None


def test_the_screen_passes_over_a_policy_alone(monkeypatch):
    """A policy the screen rules out is not compiled; the next one is."""
    asked, cfg, mesh = _configs("remat_policy=auto")
    on_cpu = _configs("remat_policy=auto", platform="cpu")[1]
    monkeypatch.setattr(remat, "remat_worth_compiling", lambda c, *a: c.cfg.remat_policy == "projections")
    assert remat.remat_candidates(asked, cfg, dict(mesh.shape), HUGE) == ("projections",)
    assert remat.remat_candidates(asked, on_cpu, dict(mesh.shape), HUGE) == ()
    # a GPU's candidates: none and experts (projections' host offload is a wait the step-time model does not price)
    monkeypatch.setattr(remat, "remat_worth_compiling", lambda *a: True)
    on_gpu = _configs("remat_policy=auto", platform="gpu")[1]
    assert remat.remat_candidates(asked, on_gpu, dict(mesh.shape), HUGE) == ("none", "experts")
    monkeypatch.setattr(remat, "remat_worth_compiling", lambda c, *a: c.cfg.remat_policy == "projections")
    assert remat.remat_candidates(asked, cfg, dict(mesh.shape), None) == ()
    assert remat.remat_that_fits(asked, cfg, mesh, HUGE).cfg.remat_policy == "projections"


def test_full_where_the_screen_rules_it_out_or_the_compiler_refuses(monkeypatch):
    asked, cfg, mesh = _configs("remat_policy=auto")  # the earlier tests' config: its screen's traces are cached
    calls = []
    real = program.StepProgram.compile
    _no_compile(monkeypatch, lambda *a, **k: calls.append(1) or real(*a, **k))
    assert remat.remat_that_fits(asked, cfg, mesh, 1 << 20) is cfg and not calls  # the state alone is larger

    def refuse(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.77G of 15.75G hbm.")

    _no_compile(monkeypatch, refuse)
    assert remat.remat_that_fits(asked, cfg, mesh, HUGE) is cfg

    def broken(*args, **kwargs):
        raise RuntimeError("INTERNAL: a compiler bug")

    _no_compile(monkeypatch, broken)
    with pytest.raises(RuntimeError, match="compiler bug"):  # only a refusal for memory is a verdict
        remat.remat_that_fits(asked, cfg, mesh, HUGE)


def test_the_warm_up_keeps_full_without_compiling(monkeypatch):
    """Its backward keeps nothing across layers under any policy: no remat to save, no compile to spend."""
    asked, cfg, mesh = _configs("remat_policy=auto", stage="warmup")
    _no_compile(monkeypatch)
    assert remat.remat_that_fits(asked, cfg, mesh, HUGE) is cfg and cfg.cfg.remat_policy == "full"


@pytest.mark.parametrize("policy", ["none", "minimal", "projections", "experts", "full"])
def test_an_explicit_policy_is_kept(monkeypatch, policy):
    asked, cfg, mesh = _configs(f"remat_policy={policy}")
    _no_compile(monkeypatch)
    assert remat.remat_that_fits(asked, cfg, mesh, HUGE) is cfg and cfg.cfg.remat_policy == policy


def test_what_the_backward_keeps_per_row():
    """More without remat than with either policy; none at all in the warm-up, whose indexer takes its gradient
    within each layer (core/model/transformer.py: no gradient crosses a layer, under any policy)."""
    def kept(policy, stage):  # the specs of the screens above (none, projections: their traces are cached)
        return remat.kept_bytes_per_row(_configs(f"remat_policy={policy}", stage=stage)[1])

    sparse = {p: kept(p, "sparse") for p in ("none", "minimal", "projections", "full")}
    assert sparse["none"] > sparse["minimal"] > sparse["full"] > 0, sparse
    assert sparse["none"] > sparse["projections"] > sparse["full"], sparse
    assert kept("none", "warmup") == kept("full", "warmup") == 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "dsv4[tpu]"')
def test_the_plan_for_a_tpu_takes_no_remat_where_it_fits():
    from core.plan.compile import plan

    auto = plan("deepseek4-tiny", "sparse", "v5e-1", (*SMALL, "remat_policy=auto"), top=1, analytic=False)
    assert auto["fits"] and auto["remat_policy"] == "none", auto.get("error")


@pytest.mark.parametrize("policy", ["projections", "experts"])
def test_the_screen_of_a_named_policy_counts_the_gradient_and_stays_under_the_compile(policy):
    """Under `projections` and `experts` the screen adds the trainable parameters' gradient to the state and
    what the policy keeps, and stays a lower bound of the compiled step's total: it never rules out a step
    that fits. Without the gradient `projections` passed V4-Flash's screen on v5p-128 and compiled over it."""
    asked, cfg, mesh = _configs("remat_policy=auto")
    specs = cfg.replace(remat_policy=policy)
    total, _ = _compiled_total(specs, mesh)
    screen = remat.screen_bytes(specs, dict(mesh.shape))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(remat, "SCREEN_WITH_GRADIENT", ())
        without = remat.screen_bytes(specs, dict(mesh.shape))
    model, _ = program.abstract_model_and_optimizer(specs)
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert 0 < screen - without <= params, (screen, without, params)  # the gradient: at most every parameter's
    assert without < screen <= total, (without, screen, total)
    assert remat.remat_worth_compiling(specs, dict(mesh.shape), total)
    assert not remat.remat_worth_compiling(specs, dict(mesh.shape), screen - 1)
