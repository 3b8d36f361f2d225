"""The TPU's collective scheduler options (core/parallel/xla_flags.py) reach the compile of the step's
jit (core/train/program.py `jit_step`, the training commands' and `dsv4 plan`'s), compiled for a v5p-8
through libtpu's compile-only client in a child process (no TPU needed; skipped without libtpu).

libtpu parses every option it is given and refuses one it does not know, or a value it cannot read:
the step compiles with the options, and the same step with one option's value spoiled fails naming
that option, so the options are read by the compiler, not dropped on the way.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core.parallel import xla_flags
from core.plan import targets as tg
from core.train.program import jit_step
from tests.conftest import tiny_config

devices = tg.compile_devices(tg.parse_target("v5p-8"))
mesh = Mesh(np.array(devices).reshape(-1), ("fsdp",))
rows = NamedSharding(mesh, P("fsdp"))
arg = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=rows)
step = lambda w, x: jnp.sum((x @ w.T) ** 2)  # the weight's all-gather feeds a matmul: a collective to schedule

def compiles():
    try:
        jit_step(step, tiny_config().xla_backend_optimization_level, mesh).lower(arg, arg).compile()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return str(e)[:400]

out = {"options": sorted(xla_flags.collective_options("tpu")), "with_options": compiles()}
xla_flags.TPU_COLLECTIVE_OPTIONS["xla_tpu_enable_async_collective_fusion"] = "notabool"
out["spoiled"] = compiles()
print("__RESULT__" + json.dumps(out))
"""


@pytest.mark.slow  # libtpu's start-up in a child process
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "dsv4[tpu]"')
def test_the_collective_options_reach_the_tpu_compile():
    from core.plan import targets as tg

    env = tg.child_env(tg.parse_target("v5p-8"))
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("__RESULT__")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("__RESULT__"):])
    assert "xla_tpu_enable_async_collective_fusion" in out["options"], out
    assert out["with_options"] == "ok", out
    assert "xla_tpu_enable_async_collective_fusion" in out["spoiled"], out
