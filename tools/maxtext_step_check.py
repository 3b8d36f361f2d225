"""The step-time model against MaxText's published multi-chip runs (issue 58; docs/step-time-model.md).

For each recipe: MaxText's own `train_compile` compiles its train step ahead of time for the
recipe's slice with the recipe's keys and libtpu flags (LIBTPU_INIT_ARGS as its script or
benchmark entry sets them), in MaxText's venv, and writes the compiled (optimised, scheduled) HLO
and MaxText's model FLOPs per device per step (`calculate_tflops_training_per_device` for those
keys). Then, here, core/plan/cost.py estimates the step from that HLO with the target's ceilings
(core/plan/targets.py), beside the published step: the model FLOPs over the published TFLOP/s per
chip.

Recipes (MaxText e591f30):
- `64b`: src/maxtext/configs/tpu/v5p/64b.sh on v5p-128, 323 TFLOP/s per chip, 70.31 %
  (src/maxtext/configs/tpu/v5p/README.md);
- `mixtral-8x7b`: benchmarks/maxtext_trillium_model_configs.py's `mixtral_8x7b_dropless` keys and
  flags on v5p-128, 251.94 TFLOP/s per chip, 54.89 % (tests/end_to_end/tpu/mixtral/Run_Mixtral.md;
  the only Mixtral 8x7B training config in benchmarks/).

Prerequisites: MaxText in its own venv (`bash tools/setup_maxtext.sh MAXTEXT_GIT_DIR`, which prints
MAXTEXT_SRC and MAXTEXT_VENV) plus its TPU compiler, `$MAXTEXT_VENV/bin/uv pip install --python
$MAXTEXT_VENV/bin/python jax==0.10.2 jaxlib==0.10.2 libtpu==0.0.42.1`. A compile takes minutes and
several GiB of RAM; recipes run one after another.

Usage (from the repository root; DIR, default runs/maxtext_step_check, is created):

    python tools/maxtext_step_check.py                        # both recipes
    python tools/maxtext_step_check.py 64b --json
    python tools/maxtext_step_check.py mixtral-8x7b --reuse   # re-estimate DIR's HLO, no compile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The recipes' libtpu flags, as their script (64b.sh) or benchmark entry (xla_flags_library's
# MOE_VMEM_LIMIT_FLAG + CF_FOR_ALL_GATHER + DATA_PARALLEL_OVERLAP) sets them.
_CF_FOR_ALL_GATHER = ("--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
                      "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
                      "--xla_enable_async_all_gather=true")
_DATA_PARALLEL_OVERLAP = "--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true"
RECIPES = {
    "64b": {
        "target": "v5p-128", "published_tflops": 323.0, "published_mfu": 0.7031,
        "source": "src/maxtext/configs/tpu/v5p/64b.sh; README.md beside it",
        "libtpu": ("--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true --xla_tpu_megacore_fusion_allow_ags=false "
                   "--xla_enable_async_collective_permute=true --xla_tpu_enable_ag_backward_pipelining=true "
                   "--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true "
                   "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_multiple_steps=true "
                   "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"),
        "keys": ["per_device_batch_size=3", "remat_policy=minimal", "global_parameter_scale=64", "ici_fsdp_parallelism=-1",
                 "ici_tensor_parallelism=4", "max_target_length=2048", "use_iota_embed=true", "reuse_example_batch=1",
                 "attention=flash", "quantization="],
    },
    "mixtral-8x7b": {
        "target": "v5p-128", "published_tflops": 251.94, "published_mfu": 0.5489,
        "source": "tests/end_to_end/tpu/mixtral/Run_Mixtral.md; benchmarks/maxtext_trillium_model_configs.py mixtral_8x7b_dropless",
        "libtpu": f"--xla_tpu_scoped_vmem_limit_kib=81920 {_CF_FOR_ALL_GATHER} {_DATA_PARALLEL_OVERLAP}",
        "keys": ["model_name=mixtral-8x7b", "per_device_batch_size=12", "ici_fsdp_parallelism=-1", "max_target_length=4096",
                 "remat_policy=full", "attention=flash", "use_iota_embed=true", "reuse_example_batch=1", "sa_block_q=2048",
                 "sa_block_q_dkv=2048", "sa_block_q_dq=2048", "megablox=True", "sparse_matmul=True"],
    },
}
# keys every recipe gets: synthetic data, no checkpoints or metrics upload, compile-only
_COMMON = ["dataset_type=synthetic", "enable_checkpointing=false", "gcs_metrics=false", "compile_topology_num_slices=1",
           "steps=1"]


# ----------------------------------------------------------------------------- in MaxText's venv


def compile_in_maxtext(out: Path, argv: list[str]) -> None:
    """MaxText's train_compile `main` on `argv`, writing OUT/step.hlo (the compiled step's HLO text)
    and OUT/maxtext.json (its model TFLOP per device per step)."""
    from absl import app
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils

    compile_step = train_compile.jit_and_compile

    def compile_and_write(*args, **kwargs):
        compiled = compile_step(*args, **kwargs)
        config = args[8] if len(args) > 8 else kwargs["config"]
        total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
        (out / "step.hlo").write_text(compiled.as_text())
        (out / "maxtext.json").write_text(json.dumps({"tflops_per_device": total, "weight_tflops": weights,
                                                      "attention_tflops": attention}))
        return compiled

    train_compile.jit_and_compile = compile_and_write
    app.run(train_compile.main, argv=["train_compile"] + argv)


# ----------------------------------------------------------------------------- here


def run_compile(name: str, out: Path, maxtext_src: Path, maxtext_venv: Path) -> float:
    """Compile recipe `name` in MaxText's venv (log: OUT/compile.log); its wall seconds."""
    recipe = RECIPES[name]
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS=recipe["libtpu"],
               TPU_WORKER_HOSTNAMES="localhost", TF_CPP_MIN_LOG_LEVEL="3")
    argv = ([str(maxtext_src / "src/maxtext/configs/base.yml")] + recipe["keys"] + _COMMON +
            [f"compile_topology={recipe['target']}", f"run_name={name}", f"base_output_directory={out}"])
    cmd = [str(maxtext_venv / "bin/python"), str(Path(__file__).resolve()), "--in-maxtext", str(out)] + argv
    start = time.monotonic()
    with open(out / "compile.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=maxtext_src, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc or not (out / "step.hlo").exists():
        sys.exit(f"{name}: MaxText's compile failed (rc {rc}); see {out / 'compile.log'}")
    return time.monotonic() - start


def check(name: str, out: Path) -> dict:
    """The estimate of OUT's HLO beside the recipe's published step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from core.plan import cost, targets

    recipe = RECIPES[name]
    model_tflops = json.loads((out / "maxtext.json").read_text())["tflops_per_device"]
    published_s = model_tflops / recipe["published_tflops"]
    parts = cost.estimate((out / "step.hlo").read_text(), targets.ceilings(targets.parse_target(recipe["target"])))
    return {"recipe": name, "target": recipe["target"], "model_tflops_per_device": model_tflops,
            "published_tflops_per_chip": recipe["published_tflops"], "published_mfu": recipe["published_mfu"],
            "published_step_s": published_s, "estimated_step_s": parts["step_s"],
            "error": parts["step_s"] / published_s - 1, "estimate_parts": parts}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--in-maxtext":
        compile_in_maxtext(Path(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=list(RECIPES), help=f"of {', '.join(RECIPES)}")
    parser.add_argument("--dir", type=Path, default=Path("runs/maxtext_step_check"))
    parser.add_argument("--maxtext-src", type=Path, default=Path(os.environ.get("MAXTEXT_SRC", "~/maxtext-src")).expanduser())
    parser.add_argument("--maxtext-venv", type=Path,
                        default=Path(os.environ.get("MAXTEXT_VENV", "~/maxtext-venv")).expanduser())
    parser.add_argument("--reuse", action="store_true", help="estimate DIR/RECIPE's HLO from an earlier run, no compile")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        print(f"unknown recipe {unknown[0]!r}: use {', '.join(RECIPES)}", file=sys.stderr)
        sys.exit(2)
    rows = []
    for name in args.recipes:
        out = (args.dir / name).resolve()
        out.mkdir(parents=True, exist_ok=True)
        compile_s = None if args.reuse else run_compile(name, out, args.maxtext_src, args.maxtext_venv)
        rows.append(check(name, out) | {"compile_s": compile_s})
        row = rows[-1]
        if not args.json:
            p = row["estimate_parts"]
            print(f"{name} on {row['target']}: published {row['published_step_s']:.3f} s "
                  f"({row['model_tflops_per_device']:.1f} TFLOP / {row['published_tflops_per_chip']} TFLOP/s, "
                  f"MFU {row['published_mfu']:.2%}); estimate {row['estimated_step_s']:.3f} s, error {row['error']:+.1%} "
                  f"(matmul {p['compute_s']:.3f} / memory {p['memory_s']:.3f} / gathers {p['gather_s']:.3f} / "
                  f"overhead {p['overhead_s']:.3f} / copy waits {p['dma_wait_s']:.3f} / collectives {p['collective_s']:.3f} s)",
                  flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
