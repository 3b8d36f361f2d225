"""Hashes of the programs a refactor must leave alone: the training step lowered as the run lowers it.

    python tools/program_hashes.py [--skip-tpu] [--tpu-only]     (PROGRAM_HASHES_DUMP=DIR: the texts too)

Prints one line per program, `NAME sha256[:16]` of its StableHLO text (`Lowered.as_text()`, no
source locations, so moving code between files changes nothing):

- `tiny-pretrain`, `tiny-warmup`, `tiny-sparse`: deepseek4-tiny's step of each stage, lowered on
  this process's CPU (one device) from abstract inputs, the config resolved for the CPU;
- `tiny-eval-dense`, `tiny-eval-topk`: deepseek4-tiny's evaluation programs (`dsv4 eval`'s, as
  `core.eval.evaluate.lowered_eval` lowers them) on the CPU, at its top-k, one row per step;
- `S-v5e-1-<remat>`: `dsv4 plan --model deepseek4-284b --stage sparse --target v5e-1 $S`'s step
  (docs/planning.md#on-a-chip), lowered (not compiled) for libtpu's compile-only v5e device in a
  child process set up as the planner's (core/plan/targets.py `child_env`), once per remat policy
  the plan may take there: `none`, `projections` (its trials, docs/tpu.md) and `full` (auto's
  fallback). Lowering alone: the plan's choice among them needs the compile, which the hash does not.
  The Pallas kernels' bodies are hashed without their source locations (`strip_kernel_locations`).

Developer tool: a refactor that claims "no program changes" runs it before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K = "max_target_length=4096 per_device_batch_size=1 dataset_type=synthetic enable_tensorboard=false"
S = (f"base_num_decoder_layers=2 compress_ratios=[4,128] first_num_hash_layers=1 num_experts=8 vocab_size=32768 {K}")
S_REMATS = ("none", "projections", "full")


DUMP = os.environ.get("PROGRAM_HASHES_DUMP")  # a directory: each program's text written there, NAME.mlir


def _digest(lowered, name: str) -> str:
    text = lowered.as_text()
    if DUMP:
        Path(DUMP).mkdir(parents=True, exist_ok=True)
        (Path(DUMP) / f"{name}.mlir").write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lowered(cfg, platform: str, mesh):
    """The step of `cfg` resolved for `platform` and `mesh` as a run resolves it, lowered on `mesh`."""
    from core.spec.resolve import resolve
    from core.train.program import lowered_step

    return lowered_step(resolve(cfg, platform, mesh.shape), mesh)[0]


def tiny_hashes() -> dict[str, str]:
    """deepseek4-tiny's three stages lowered on the CPU (JAX_PLATFORMS=cpu, one device)."""
    from core.config.schema import load_config
    from core.parallel.mesh import make_mesh

    out = {}
    for stage in ("pretrain", "warmup", "sparse"):
        cfg = load_config("deepseek4-tiny", ["dataset_type=synthetic", "jax_cache_dir="], stage=stage)
        out[f"tiny-{stage}"] = _digest(_lowered(cfg, "cpu", make_mesh(cfg)), f"tiny-{stage}")
    return out


def tiny_eval_hashes() -> dict[str, str]:
    """deepseek4-tiny's two evaluation programs lowered on the CPU."""
    from core.eval.evaluate import lowered_eval
    from core.eval.rows import EvalSet
    from core.parallel.mesh import make_mesh
    from core.plan.compile import load
    from core.spec.resolve import resolve

    cfg = load("deepseek4-tiny", "eval", ["dataset_type=synthetic", "jax_cache_dir="])
    mesh = make_mesh(cfg)
    lowered, _ = lowered_eval(resolve(cfg, "cpu", mesh.shape), (cfg.indexer_topk,), mesh, EvalSet(batch_rows=1))
    return {f"tiny-eval-{part}": _digest(program, f"tiny-eval-{part}") for part, program in lowered.items()}


def strip_kernel_locations() -> None:
    """A Pallas kernel's Mosaic body (a tpu_custom_call's backend_config) carries the source locations of
    the code that traced it: file paths and line numbers, which move with a checkout and any edit of
    those files. Here they are stripped (MLIR's strip-debuginfo) before the body is serialized, so the
    hash is of the kernel's operations alone; the rest of the text carries no locations."""
    from jax._src import tpu_custom_call
    from jaxlib.mlir.passmanager import PassManager

    serialize = tpu_custom_call._lower_mosaic_module_to_asm

    def stripped(module, **kw):
        with module.context:
            PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)
        return serialize(module, **kw)

    tpu_custom_call._lower_mosaic_module_to_asm = stripped


def tpu_child() -> dict[str, str]:
    """In the planner's child environment: $S's step for v5e-1 under each of S_REMATS, lowered."""
    strip_kernel_locations()
    from core.config.schema import load_config
    from core.plan import targets as tg
    from core.plan.compile import device_mesh

    target = tg.parse_target("v5e-1")
    out = {}
    for remat in S_REMATS:
        cfg = load_config("deepseek4-284b", [*S.split(), f"remat_policy={remat}", "jax_cache_dir="], stage="sparse")
        mesh = device_mesh(cfg, tg.compile_devices(target))
        out[f"S-v5e-1-{remat}"] = _digest(_lowered(cfg, target.platform, mesh), f"S-v5e-1-{remat}")
    return out


def tpu_hashes() -> dict[str, str]:
    from core.plan import targets as tg

    env = tg.child_env(tg.parse_target("v5e-1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--tpu-child"], env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"the v5e-1 lowering failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tpu", action="store_true", help="the CPU programs only")
    parser.add_argument("--tpu-only", action="store_true", help="the v5e-1 programs only")
    parser.add_argument("--tpu-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tpu_child:
        print(json.dumps(tpu_child()), flush=True)
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(ROOT))
    from core.process import tune_garbage_collector

    tune_garbage_collector()
    hashes = {} if args.tpu_only else {**tiny_hashes(), **tiny_eval_hashes()}
    if not args.skip_tpu:
        hashes.update(tpu_hashes())
    for name, digest in hashes.items():
        print(f"{name:24s} {digest}", flush=True)


if __name__ == "__main__":
    main()
