"""`dsv4 plan`: the planner's figures against the training command's own build and compiled step.

- cpu:1 through the child process, compared with `build` and the step the training command
  compiles ahead (core/train/program.py) in this process;
- cpu:8 inside one child process with 8 fake devices (the planner's in-process half and the real
  build side by side);
- bad input: one line, exit 2, before anything compiles.

The accelerator targets (v5p-8 through libtpu, h200x8 through the CUDA plugin) are
tests/plan/test_plan_accelerators.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import CHAIN_STEPS, TINY_OVERRIDES, resolved
from tests.plan import invoke_plan

# The stage chain's warm-up (tests/train/test_stages.py, which pytest-xdist runs before this file on the same
# worker: tests/conftest.py's order): steps only sets the schedule's length, so the FLOP count's plan is
# the chain's warm-up step, and its child reads it from the compilation cache (the same figures as a
# compile; only the buffer assignment's top temporaries need a real compile, so the cpu:1 test keeps
# a program of its own). Run alone, this file compiles it itself.
WARMUP_TINY = (*TINY_OVERRIDES, f"steps={CHAIN_STEPS['warmup']}")
# One sliding-window layer: the cpu:1 comparison with the training command's own figures holds for
# any model (the 8-device one below compares the shrunken deepseek4-tiny's scanned layers); one child
# plans it for both cpu:1 tests (`cpu1_plan`).
ONE_LAYER = (*TINY_OVERRIDES, "compress_ratios=[0]", "base_num_decoder_layers=1", "first_num_hash_layers=0")

FIELDS = ("parameter_bytes", "optimizer_bytes", "batch_bytes", "argument_bytes", "temp_bytes", "code_bytes",
          "total_bytes", "usable_bytes")


def _one_line_exit_2(result, *needles: str) -> None:
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def real_state_bytes(setup) -> int:
    """The most loaded device's bytes of the built model and optimizer, from the real shards."""
    import jax
    from flax import nnx

    per_device: dict = {}
    for leaf in jax.tree.leaves(nnx.state((setup.model, setup.optimizer))):
        for shard in getattr(leaf, "addressable_shards", ()):
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def ahead_temp_bytes(cfg) -> int:
    """Temp bytes of the training command's own step as it compiles it ahead of the build
    (core/train/program.py's `lowered_step`, which its `compile_ahead` compiles; the Trainer runs that
    executable when the built state matches it, tests/train/test_compile_ahead.py).

    When the planner compiled the same program (HLO, compile options, backend) in this worker's
    session, this reads JAX's persistent compilation cache (tests/conftest.py) instead of compiling
    it again: a cache hit is itself the proof that the two programs are one. Another program
    compiles here and must still give the same figures.
    """
    from core.train.program import lowered_step

    compiled = lowered_step(*resolved(cfg))[0].compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


# ----------------------------------------------------------------------------- targets and bad input


def test_targets_by_name():
    from core.plan.targets import GIB, parse_target

    v5p = parse_target("v5p-128")
    assert (v5p.devices, v5p.topology, v5p.chip_config, v5p.extra) == (64, "v5:4x4x4", "megacore", "tpu")
    assert v5p.chip.hbm_bytes == int(95.74 * GIB)
    assert (parse_target("v4-8").devices, parse_target("v5e-16").devices, parse_target("v6e-8").topology) == (4, 16, "v6e:2x4")
    h200 = parse_target("h200x16")
    assert (h200.devices, h200.topology, h200.platform, h200.chip.hbm_bytes) == (16, "1x2x8", "cuda", 151397597184)
    assert parse_target("cpu:8").approximate and parse_target("cpu:8").devices == 8


def test_gpu_specs_parse_without_fields_jax_rejects():
    from core.plan.targets import GPUS, gpu_spec_text

    for spec, *_ in GPUS.values():
        text = "\n".join(line for line in gpu_spec_text(spec).splitlines() if not line.startswith("#"))
        assert "gpu_device_info {" in text and "collective_memory_granularity" not in text
        assert text.count("{") == text.count("}"), spec


@pytest.mark.parametrize("target", ["v5p-7", "tpu-8", "h200x12", "cpu:0"])
def test_unknown_target_is_one_line_exit_2(target):
    _one_line_exit_2(invoke_plan("--target", target), "--target")


def test_mesh_that_does_not_divide_is_one_line_exit_2():
    _one_line_exit_2(invoke_plan("--target", "cpu:8", *TINY_OVERRIDES, "ici_data_parallelism=3"), "ici_")


def test_missing_extra_is_one_line_exit_2(monkeypatch):
    from core.plan import targets

    monkeypatch.setattr(targets, "extra_installed", lambda target: False)
    _one_line_exit_2(invoke_plan("--target", "v5p-8", *TINY_OVERRIDES), 'pip install "dsv4[tpu]"')
    _one_line_exit_2(invoke_plan("--target", "h200x8", *TINY_OVERRIDES), 'pip install "dsv4[cuda]"')


def test_out_of_memory_refusal_is_a_verdict():
    from core.plan.report import refusal

    message = textwrap.dedent("""\
        RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 605.03G of 95.74G hbm. Exceeded hbm capacity by 509.29G.

        Total hbm usage >= 605.53G:
            reserved        530.00M
            program         605.00G
            arguments        14.60G

        Program hbm requirement 605.00G:
            global            1.2K
            HLO temp        604.99G (100.0% utilization)

          Largest program allocations in hbm:

          1. Size: 16.00G
             Operator: op_name="jit(step)/transpose(jvp())/dot_general" source_file="/x/core/model/moe.py" source_line=10
             Shape: f32[64,4096,16384]{2,1,0}
             Allocation type: HLO temp
          2. Size: 8.00G
             Shape: bf16[8,4096,131072]{2,1,0}
        """)
    r = refusal(message)
    assert r["used_bytes"] == int(605.03 * (1 << 30)) and r["limit_bytes"] == int(95.74 * (1 << 30))
    assert r["reserved_bytes"] == 530 << 20 and r["arguments_bytes"] == int(14.6 * (1 << 30))
    assert [a["bytes"] for a in r["allocations"]] == [16 << 30, 8 << 30]
    assert r["allocations"][0]["shape"].startswith("f32[64,4096,16384]")
    assert refusal("INVALID_ARGUMENT: something else") is None


# ----------------------------------------------------------------------------- cpu:1 and cpu:8


@pytest.fixture(scope="module")
def cpu1_plan():
    """(config, temp bytes of the training command's own step, the cpu:1 plan with --top 3) for ONE_LAYER's
    sparse step: one child serves both tests below. The step compiles in this process first, so it is in
    JAX's persistent cache when the child plans it (tests/conftest.py sets JAX_COMPILATION_CACHE_DIR, as
    a user may); the child compiles it again with the cache off, for the buffer assignment it dumps."""
    from core.config.schema import load_config
    from core.plan.compile import plan

    cfg = load_config("deepseek4-tiny", list(ONE_LAYER), stage="sparse")
    temp = ahead_temp_bytes(cfg)  # now in the cache
    return cfg, temp, plan("deepseek4-tiny", "sparse", "cpu:1", ONE_LAYER, top=3, analytic=False)


@pytest.mark.slow
def test_cpu1_state_bytes_and_temp_equal_the_training_commands_own(cpu1_plan):
    from core.train.materialise import build

    cfg, temp, result = cpu1_plan
    assert set(FIELDS) <= set(result["per_device"]), sorted(result["per_device"])
    assert {"target", "devices", "mesh", "fits", "flops_per_step", "estimated_step_s", "estimated_tokens_per_s",
            "top_temporaries"} <= set(result)
    setup = build(*resolved(cfg))
    d = result["per_device"]
    state = d["parameter_bytes"] + d["optimizer_bytes"]
    assert state == real_state_bytes(setup), (state, real_state_bytes(setup))
    assert d["argument_bytes"] == state + d["batch_bytes"]
    assert d["temp_bytes"] == temp
    assert result["fits"] and result["flops_per_step"] > 0 and result["approximate"]


def test_top_temporaries_survive_a_warm_persistent_cache(cpu1_plan):
    """The top temporaries come from the buffer assignment XLA dumps while it compiles. With the
    step already in JAX's persistent cache (`cpu1_plan` compiled it in this process first), a child
    that read it back dumped nothing and listed no temporaries; with --top the child compiles with
    the cache off."""
    _, temp, result = cpu1_plan
    assert result["per_device"]["temp_bytes"] == temp
    top = result["top_temporaries"]
    assert len(top) == 3 and all(t["bytes"] > 0 and t["shape"] and t["component"] for t in top), top


_CPU8 = """
import json
from core.config.schema import load_config
from core.plan.compile import compile_plan
from core.plan.targets import parse_target
from core.train.materialise import build
from tests.plan.test_plan import ahead_temp_bytes, real_state_bytes
from tests.conftest import TINY_OVERRIDES, resolved

cfg = load_config("deepseek4-tiny", [*TINY_OVERRIDES, "ici_data_parallelism=2", "ici_fsdp_parallelism=4"], stage="warmup")
r = compile_plan(resolved(cfg)[0], parse_target("cpu:8"), top=0, analytic=False)
setup = build(*resolved(cfg))
print("__OUT__" + json.dumps({"plan": r["per_device"], "mesh": r["mesh"], "state": real_state_bytes(setup),
                              "temp": ahead_temp_bytes(cfg)}))
"""


@pytest.mark.slow
def test_cpu8_state_bytes_and_temp_equal_the_training_commands_own():
    from core.plan.targets import child_env, parse_target

    env = child_env(parse_target("cpu:8"))
    proc = subprocess.run([sys.executable, "-c", _CPU8], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = [line for line in proc.stdout.splitlines() if line.startswith("__OUT__")]
    assert out, proc.stderr[-3000:]
    r = json.loads(out[0][len("__OUT__"):])
    d = r["plan"]
    assert r["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
    assert d["parameter_bytes"] + d["optimizer_bytes"] == r["state"], r
    assert d["frozen_parameter_bytes"] > 0 and d["trainable_parameter_bytes"] > 0  # the warm-up trains the indexer only
    assert d["temp_bytes"] == r["temp"], r


def test_collective_bytes_per_mesh_axis_from_hlo():
    import collections

    from core.plan.hlo import collectives, parse

    class Mesh:  # what collectives reads of a jax Mesh
        shape = collections.OrderedDict(data=2, fsdp=4, tensor=1, expert=1)
        size = 8

    hlo = textwrap.dedent("""\
        %body.1 (p: f32[4]) -> f32[4] {
          %ag = bf16[8,16]{1,0} all-gather(bf16[2,16]{1,0} %x), replica_groups=[2,4]<=[8], dimensions={0}
        }

        ENTRY %main.2 (a: f32[4]) -> f32[4] {
          %w = f32[4] while(f32[4] %a), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
          %ar = f32[100]{0} all-reduce(f32[100]{0} %y), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
          %m = f32[10]{0} all-reduce(f32[10]{0} %z), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}
        }
        """)
    assert collectives(parse(hlo), Mesh) == {"fsdp": 3 * 8 * 16 * 2, "data": 400, "data+fsdp": 40}


# ----------------------------------------------------------------------------- FLOPs


def test_flops_of_the_compiled_program_agree_with_the_analytic_count():
    """The compiled program's matmul FLOPs, loops counted, equal the jaxpr's matmul FLOPs (XLA folds a
    few tiny dots into elementwise work: within 1 %); XLA's cost analysis counts each loop body once."""
    from core.plan.compile import plan

    r = plan("deepseek4-tiny", "warmup", "cpu:1", WARMUP_TINY, top=0, analytic=True)
    hlo, analytic = r["flops_per_step"], r["analytic_matmul_flops_per_device"]
    assert abs(hlo - analytic) <= 0.01 * analytic, (hlo, analytic)
    assert analytic <= r["analytic_flops_per_device"]  # the analytic total adds the elementwise work
    # the layer scan and the chunk scans: each body once is what XLA's own count sees
    assert r["matmul_flops_loops_once"] <= r["xla_cost_analysis_flops"] < hlo / 2, r
    assert r["xla_cost_analysis_bytes"] < r["bytes_accessed"] and "loop" in r["flops_rule"]


# ----------------------------------------------------------------------------- the training header's memory note


def test_training_header_memory_note():
    from core.train.memory import memory_note, step_memory_note

    class Memory:
        argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 10 << 30, 10 << 30, 9 << 30
        temp_size_in_bytes, generated_code_size_in_bytes = 20 << 30, 1 << 30

    class Compiled:
        def memory_analysis(self):
            return Memory()

    class Device:
        def __init__(self, platform, stats):
            self.platform, self.stats = platform, stats

        def memory_stats(self):
            return self.stats

    assert memory_note(32 << 30, 100 << 30) == "step needs 32.0 GiB of 100.0 GiB per device (32 %)"
    gpu = Device("gpu", {"bytes_limit": 100 << 30})
    assert step_memory_note(Compiled(), gpu) == memory_note(32 << 30, 100 << 30)  # 10 + 20 + 1 + (10 - 9)
    assert step_memory_note(Compiled(), Device("cpu", {"bytes_limit": 100 << 30})) is None  # CPU output unchanged
    assert step_memory_note(Compiled(), Device("tpu", None)) is None and step_memory_note(None, gpu) is None


def test_model_mfu_is_the_model_flops_over_the_estimate_devices_and_peak():
    """`dsv4 plan`'s model MFU: core/train/flops.py's count over the step's global batch, divided by the
    estimated step, the target's devices and its chip's peak; none without an estimate (fake CPU devices)."""
    from core.train.flops import model_flops_per_step
    from core.plan.compile import model_utilization
    from core.plan.targets import parse_target
    from tests.conftest import tiny_config

    cfg = tiny_config("sparse")
    target = parse_target("v5p-128")
    rows = cfg.per_device_batch_size * target.devices
    flops = model_flops_per_step(cfg, rows)["total"]
    got = model_utilization(cfg, target, {"global_batch": rows, "estimated_step_s": 0.5})
    assert got["model_flops_per_step"] == flops
    assert got["model_mfu"] == pytest.approx(flops / 0.5 / target.devices / target.chip.peak_flops, rel=1e-12)
    assert got["model_tflops_per_device"] == pytest.approx(flops / 0.5 / target.devices / 1e12, rel=1e-12)
    none = model_utilization(cfg, parse_target("cpu:8"), {"global_batch": 8, "estimated_step_s": None})
    assert none["model_mfu"] is None and none["model_flops_per_step"] > 0
