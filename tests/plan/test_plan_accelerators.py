"""`dsv4 plan` for accelerator targets through their compile-only clients (no TPU or GPU needed):
v5p-8 through libtpu (the `tpu` extra), h200x8 through the CUDA plugin (the `cuda` extra), each
skipped without its extra; and no CUDA plugin noise in the other commands. The CPU targets, the
figures against the training command's own and bad input are tests/plan/test_plan.py's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import TINY_OVERRIDES

# One CSA layer of 64 tokens (the smallest model with every part of the sparse stage): the TPU
# compiler's verdict on the training step does not depend on the model's size, and the smaller
# the model, the shorter its compile.
SMALL = ("compress_ratios=[4]", "base_num_decoder_layers=1", "first_num_hash_layers=0", "vocab_size=512",
         "max_target_length=64", "per_device_batch_size=2")


# ----------------------------------------------------------------------------- TPU


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "dsv4[tpu]"')
def test_v5p8_compiles_with_libtpu_and_fits():
    from core.plan.compile import plan
    from core.plan.targets import GIB

    result = plan("deepseek4-tiny", "sparse", "v5p-8", SMALL, top=3, analytic=False)
    assert result["platform"] == "tpu" and result["devices"] == 4
    assert result["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1, "expert": 1}
    d = result["per_device"]
    assert result["fits"] and d["usable_bytes"] == int(95.74 * GIB) and d["temp_bytes"] > 0 and d["code_bytes"] > 0
    assert result["flops_per_step"] > 0 and result["estimated_tokens_per_s"] > 0
    assert 0 < result["model_mfu"] < 1 and result["model_flops_per_step"] > 0
    assert result["top_temporaries"]


# ----------------------------------------------------------------------------- GPU (the CUDA plugin, no GPU needed)


_CUDA = any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


@pytest.mark.slow
@pytest.mark.skipif(not _CUDA, reason='needs the CUDA plugin: pip install "dsv4[cuda]"')
def test_h200x8_compiles_with_the_cuda_plugin_and_fits():
    from core.plan.compile import plan
    from core.plan.targets import gpu_spec_fields

    result = plan("deepseek4-tiny", "warmup", "h200x8", TINY_OVERRIDES, top=3, analytic=False)
    assert result["platform"] == "cuda" and result["devices"] == 8
    assert result["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}
    d = result["per_device"]
    assert d["usable_bytes"] == int(0.75 * gpu_spec_fields("h200")["device_memory_size"])
    assert result["fits"] and d["temp_bytes"] > 0 and d["argument_bytes"] > 0  # XLA:GPU's arguments: 2 KiB off the state's
    # the compile-only GPU client has no cost analysis: the FLOPs and bytes come from its HLO
    assert result["xla_cost_analysis_flops"] is None and result["flops_per_step"] > 0 and result["bytes_accessed"] > 0
    assert result["estimated_tokens_per_s"] > 0 and result["top_temporaries"]


@pytest.mark.skipif(not _CUDA, reason='needs the CUDA plugin: pip install "dsv4[cuda]"')
def test_no_cuda_plugin_noise_in_other_commands(tmp_path):
    """With the plugin installed and no GPU, `dsv4 --help` is clean and a one-line error that JAX's
    start-up precedes (the device count of a mesh) stays one line."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    run = [sys.executable, "-c", "from dsv4cli.main import main; main()"]
    help_out = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert help_out.returncode == 0 and help_out.stderr == "", help_out.stderr
    bad = subprocess.run([*run, "warmup", "--output", str(tmp_path / "run"), *TINY_OVERRIDES, "ici_data_parallelism=3"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), bad.stderr


_RAGGED_ON_GPU = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
from core.plan import hlo, targets as tg
target = tg.parse_target("h200x8")
device = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                      target_config=tg.gpu_spec_text(target.spec_file)).devices[0]
shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
ragged = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.bfloat16))
text = ragged.lower(shape(256, 64), shape(8, 64, 32), shape(8, dtype=jnp.int32)).compile().as_text()
print(hlo.matmul_flops(hlo.parse(text)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _CUDA, reason='needs the CUDA plugin: pip install "dsv4[cuda]"')
def test_xla_gpu_runs_ragged_dot_as_a_dense_matmul_over_every_group():
    """Why `moe_impl: auto` is never ragged on a GPU (core/spec/platform.py `_moe_impl`): XLA:GPU rewrites
    ragged_dot [S, K] x [G, K, N] as dense matmuls of every row with every group's weights (the rows
    zeroed outside their group), G times the grouped matmul's 2 S K N FLOPs by the plan's own count.
    If this fails, XLA:GPU has a grouped matmul of its own and `ragged` deserves a plan beside `tiled`."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _RAGGED_ON_GPU], capture_output=True, text=True, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) == 8 * 2 * 256 * 64 * 32, out.stdout  # G x 2 S K N


_BATCHED_ON_GPU = """
import functools
import jax, jax.numpy as jnp
from jax.experimental import topologies
from core.model.moe import swiglu_hidden
from core.ops.batched_experts import batched_experts
from core.plan import hlo, targets as tg
target = tg.parse_target("h200x8")
device = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                      target_config=tg.gpu_spec_text(target.spec_file)).devices[0]
shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
hidden = functools.partial(swiglu_hidden, limit=10.0)
run = jax.jit(lambda x, i, w, w1, w2, w3: batched_experts(x, i, w, w1, w2, w3, capacity=96, hidden=hidden))
text = run.lower(shape(1, 256, 64), shape(1, 256, 2, dtype=jnp.int32), shape(1, 256, 2, dtype=jnp.float32),
                 shape(8, 64, 32), shape(8, 32, 64), shape(8, 64, 32)).compile().as_text()
print(text.count("gemm_fusion_dot"), hlo.matmul_flops(hlo.parse(text)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _CUDA, reason='needs the CUDA plugin: pip install "dsv4[cuda]"')
def test_xla_gpu_runs_the_batched_experts_as_gemms_of_their_rows():
    """Why `moe_impl: auto` is batched on a GPU under expert parallelism (core/spec/platform.py `_moe_impl`):
    the three matmuls over [E, C] rows of 8 experts of capacity 96 are XLA:GPU GEMM fusions (gate and up
    in one) of 2 E C K N FLOPs each, not a dense expansion over every expert as ragged_dot's."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _BATCHED_ON_GPU], capture_output=True, text=True, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    gemms, flops = out.stdout.strip().splitlines()[-1].split()
    assert int(gemms) >= 2 and float(flops) == 3 * 2 * 8 * 96 * 64 * 32, out.stdout
