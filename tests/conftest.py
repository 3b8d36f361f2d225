"""Shared test setup: offline Hugging Face caches, one compilation cache, a shrunken deepseek4-tiny.

HF_HOME points at a temporary directory and the hub is switched offline before any test module
imports `datasets` (they read these variables once, at import), so no test touches the network or
the user's cache. JAX's persistent compilation cache lives in another temporary directory for the
session (this process and its subprocesses); both are removed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# The process that makes a temporary home owns it: the subprocesses tests start (which import this module
# again) inherit the environment and share the same directories; only the owner removes them, when its
# pytest run ends. HF_HOME is per pytest run: each pytest-xdist worker makes its own. XDG_CACHE_HOME (the
# compilation cache below) is the session's: the first process (xdist's controller, or the one process
# of `-n 0`) makes it, and both workers and every process they start share it. JAX's cache key holds the
# cache's directory (jax._src.cache_key hashes the compile options, and JAX sets
# xla_gpu_per_fusion_autotune_cache_dir under that directory on every platform), so with a directory
# per worker the same program compiled on both workers had two keys and compiled twice.
_OWNER, _CACHE_OWNER = "DSV4_TEST_HOMES_OWNER", "DSV4_TEST_CACHE_OWNER"
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "" outside xdist; inherited by a worker's subprocesses
if os.environ.get(_OWNER) is None or os.environ.get("DSV4_TEST_HOMES_WORKER") != _WORKER:
    os.environ["DSV4_TEST_HOMES_WORKER"] = _WORKER
    os.environ[_OWNER] = str(os.getpid())
    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="dsv4-test-hf-")
if os.environ.get(_CACHE_OWNER) is None:
    os.environ[_CACHE_OWNER] = str(os.getpid())
    # The CLI's persistent compilation cache (jax_cache_dir: default) lands here, not in ~/.cache.
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="dsv4-test-cache-")
_HF_HOME, _CACHE_HOME = os.environ["HF_HOME"], os.environ["XDG_CACHE_HOME"]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# One persistent compilation cache for the whole session, the CLI's own directory: a program that
# several tests compile (the same model's step, forward or initialisers, traced anew in each test)
# is compiled once and read back after that, also by the worker processes tests start (JAX reads
# these variables at import). Every program is written, however fast it compiled.
_COMPILE_CACHE = os.path.join(_CACHE_HOME, "dsv4", "jax")
os.makedirs(_COMPILE_CACHE, exist_ok=True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=_COMPILE_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
# The suite is compile-bound (dozens of small programs, each run for a few steps). XLA's CPU
# backend compiles them much faster at optimisation level 0 and with its older fusion emitters
# (`xla_cpu_use_fusion_emitters=false`); the tests' programs run no slower so
# (docs/development.md#tests). It also splits each program's LLVM module into parts it compiles on
# several threads (`xla_cpu_parallel_codegen_split_count`): on the suite's two busy cores the parts
# only add work (the shrunken deepseek4-tiny's sparse step: about a fifth of its compile's CPU
# seconds), so the suite keeps one part (the buffer assignment is the same). Set before any test
# imports jax; every program of the session, the subprocesses that inherit this environment, and
# those given FAST_COMPILE use the same flags.
# XLA aborts on a flag it does not know, so the first process of the session asks a child whether
# this jaxlib knows these two flags, and every later one inherits the answer.
_EMITTERS, _KNOWS_EMITTERS = "--xla_cpu_use_fusion_emitters=false", "DSV4_TEST_XLA_KNOWS_EMITTERS"
_ONE_PART, _KNOWS_ONE_PART = "--xla_cpu_parallel_codegen_split_count=1", "DSV4_TEST_XLA_KNOWS_ONE_PART"
if os.environ.get(_KNOWS_EMITTERS) is None or os.environ.get(_KNOWS_ONE_PART) is None:
    import subprocess
    import sys

    def _knows(*flags: str) -> bool:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                               env={**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"})
        return probe.returncode == 0

    _both = _knows(_EMITTERS, _ONE_PART)  # one child when this jaxlib knows both, as it should
    os.environ[_KNOWS_EMITTERS] = "1" if _both or _knows(_EMITTERS) else "0"
    os.environ[_KNOWS_ONE_PART] = "1" if _both or _knows(_ONE_PART) else "0"
_OLDER_EMITTERS = os.environ[_KNOWS_EMITTERS] == "1"
FAST_COMPILE = " ".join(["--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
                         *([_EMITTERS] if _OLDER_EMITTERS else []),
                         *([_ONE_PART] if os.environ[_KNOWS_ONE_PART] == "1" else [])])
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), FAST_COMPILE]))
# Compiler options (`jax.jit(..., compiler_options=)`, over XLA_FLAGS) that restore XLA:CPU's own
# fusion emitters, as `dsv4` compiles with them: for the tests whose claim is that two programs
# (the guard's two forms, held and dequantised weights) round bit for bit alike, which holds for
# the fusions XLA:CPU makes by default and not for the older emitters' fusions.
PRODUCT_FUSION = {"xla_cpu_use_fusion_emitters": True} if _OLDER_EMITTERS else {}

# libtpu (the tpu extra) allows one process at a time unless told otherwise: tests on both xdist
# workers (the planner's children, test_granules' compile-only topologies) may load it at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from core.parallel.mesh import prepare_cpu_runtime  # noqa: E402  (imports jax; XLA reads XLA_FLAGS later, at its start)

# The XLA flags every `dsv4` command adds before JAX starts (the CPU collectives' time-outs), set
# here before this process's XLA starts. A command run in-process by a test (typer's CliRunner)
# adds them to os.environ too late to reach this process's XLA, yet JAX's persistent cache keys on
# XLA_FLAGS: without them here, every program compiled after a test's first in-process command
# would miss the cache against the same program compiled before it and in the processes tests
# start. PJRT_NPROC stays unset: it is per device count, and each child of another count sets its own.
os.environ["XLA_FLAGS"] = prepare_cpu_runtime(dict(os.environ)).get("XLA_FLAGS", os.environ["XLA_FLAGS"])

import jax  # noqa: E402  (after the environment above: JAX and XLA read it once)

from core.process import tune_garbage_collector  # noqa: E402
from core.spec.resolve import resolve

# The collector as `dsv4` tunes it in each of its processes: the test processes trace and lower
# thousands of programs.
tune_garbage_collector()

# Also when jax was imported before this file (a plugin): the cache is on before the first compile.
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Five layers (SWA, then CSA/HCA twice: the hash-routed first layer stays unrolled, the repeating
# CSA/HCA pair is scanned), 128-token rows (HCA needs a multiple of 128), two rows per step: every
# layer and routing kind and the scanned path, compiled in seconds.
TINY_OVERRIDES = (
    "compress_ratios=[0,4,128,4,128]", "base_num_decoder_layers=5", "first_num_hash_layers=1",
    "vocab_size=512", "max_target_length=128", "per_device_batch_size=2",
)


def tiny_config(stage: str | None = None, *overrides: str, **options):
    """deepseek4-tiny shrunk by TINY_OVERRIDES, then `overrides` ("key=value") and `options`."""
    from core.config.schema import load_config

    return load_config("deepseek4-tiny", [*TINY_OVERRIDES, *overrides], stage=stage, options=options or None)


def tiny_data(*overrides: str):
    """`tiny_config(None, *overrides)`'s DataSpec (core.spec.resolve `data_spec`): what core/data reads."""
    from core.spec.resolve import data_spec

    return data_spec(tiny_config(None, *overrides))


def resolved(cfg, mesh=None):
    """(`cfg` resolved for `mesh` as an entry point resolves it: core.spec.resolve, `mesh`); `mesh`
    by default the run's own (`make_mesh(cfg)`)."""
    from core.parallel.mesh import make_mesh, mesh_platform

    mesh = make_mesh(cfg) if mesh is None else mesh
    return resolve(cfg, mesh_platform(mesh), mesh.shape), mesh


def tpu_child(code: str, target: str, *args: str, timeout: int = 900) -> dict:
    """Run Python `code` (with `args`) in a child process whose JAX compiles for TPU `target` (e.g.
    "v5e-1") through libtpu, as `dsv4 plan`'s child does, and return the JSON of its last stdout line
    that starts with "__RESULT__"."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from core.plan import targets as tg

    root = Path(__file__).resolve().parents[1]
    env = tg.child_env(tg.parse_target(target))
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("__RESULT__")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("__RESULT__"):])


def device_worker(script, devices: int = 8, timeout: int = 1200) -> dict:
    """Run `script` (a test file whose __main__ computes on `devices` fake CPU devices) in a child
    process, as XLA fixes the device count at its start, and return the JSON of its last stdout line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {os.environ.get('XLA_FLAGS', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("JAX_ENABLE_X64", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def init_model(cfg, seed: int):
    """`Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(seed))`, drawn as the training commands' `build` draws it:
    inside `bucketed_draws()` (core/model/init_draws.py) a few shared random programs serve every
    parameter shape instead of one compile per shape; the values are bitwise those of the plain
    constructor (tests/model/test_init_draws.py)."""
    from flax import nnx

    from core.model.init_draws import bucketed_draws
    from core.model.transformer import Transformer

    with bucketed_draws():
        return Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(seed))


def pytest_unconfigure(config):
    """Each owner removes its temporary home: HF_HOME, XDG_CACHE_HOME (the compilation cache)."""
    if os.environ.get(_OWNER) == str(os.getpid()):
        shutil.rmtree(_HF_HOME, ignore_errors=True)
    if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(_CACHE_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Test files in the order pytest-xdist's --dist loadfile hands them to its workers: first the
    files that hold `slow` tests (most of them first), then the others by test count (xdist's own
    --loadscope-reorder rule, which pyproject.toml's addopts turns off for this order). A long file
    started last runs on alone while the other worker idles; started first, the short files fill
    in around it. The tests inside a file keep their order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    slow = {f: sum(i.get_closest_marker("slow") is not None for i in tests) for f, tests in files.items()}
    order = sorted(files, key=lambda f: (-slow[f], -len(files[f])))  # stable: ties keep collection order
    items[:] = [item for f in order for item in files[f]]


@pytest.fixture
def x64():
    """float64 JAX for the duration of one test (float64 reference parity)."""
    import jax

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def packed(lengths, t):
    """positions / segment ids of documents of `lengths` packed into one row, padded to t."""
    import numpy as np

    pos, seg = np.zeros(t, np.int32), np.zeros(t, np.int32)
    start = 0
    for doc, n in enumerate(lengths, start=1):
        pos[start:start + n], seg[start:start + n] = np.arange(n), doc
        start += n
    return pos, seg


# Steps of the stage chain pretrain -> warmup -> sparse through the CLI (issue 11; the
# `stage_chain` fixture of tests/train/test_stages.py, which holds every test that uses it, so
# that one xdist worker runs it once). tests/train/test_train.py's fresh warm-up takes as many
# steps, so the two compile one step when they share a process. Pretraining runs long enough that
# its LM loss ends well below test_stages' bound (the last steps' mean under 0.8 of the first
# steps'), not longer.
CHAIN_STEPS = {"pretrain": 20, "warmup": 6, "sparse": 12}
