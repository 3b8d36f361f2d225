"""The training step compiled ahead of time for a target, in a child process (DESIGN.md, "Planning").

The program is the training commands' own (`lower_plan`): core/train/program.py's `StepProgram` of
the config resolved for the target (once, in the child) over `abstract_inputs` on `make_mesh`'s mesh
over the target's devices (program.py's `jit_step`: donated state, the state's rule shardings out, the
compiler options of the target's platform). Nothing is allocated: the inputs are ShapeDtypeStructs.

Parent side, `plan(...)`: validates the config and the mesh (bad input fails here, exit 2), then
runs `python -m core.plan.compile` with `targets.child_env(target)`, so the platform and the fake
device count are set before JAX starts and an extra's start-up messages stay in the child. The
child prints one JSON line (marker `__PLAN__`): the report of core/plan/report.py, or an error.
`run_child` is that parent side for any such child (core/plan/search.py's state pass is another).
`--stage eval` compiles the evaluation's two programs instead (`compile_eval_plan`).
XLA's buffer assignment, for the largest temporaries, is read from an XLA dump in a temporary
directory of the child (a dump does not change the program).

One deviation from `make_mesh`: compile-only TPU devices of one slice carry no `slice_index`,
and `make_mesh` would count their hosts as granules (dcn_* would then span ICI). For that case
`device_mesh` builds the one-granule mesh as `make_mesh` builds it for one granule.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import core
from core.spec.resolve import resolve
from core.errors import ConfigError
from core.plan import targets as tg
from core.process import tune_garbage_collector

MARKER = "__PLAN__"


# ----------------------------------------------------------------------------- parent side


EVAL = "eval"  # --stage eval: the evaluation's step (core/eval/evaluate.py), on the warm-up preset's config


def load(model: str, stage: str | None, overrides: Sequence[str], config_file: str | None = None):
    """The Config of a plan, exactly as the training command of `stage` resolves it (for EVAL the
    warm-up's: the evaluation's programs do not depend on the stage; its masks allow frozen_weights=released)."""
    from core.config.schema import load_config

    return load_config(model, list(overrides), config_file=config_file, stage="warmup" if stage == EVAL else stage)


def check_eval_batch(stage: str | None, overrides: Sequence[str], batch_rows: int | None) -> None:
    """ConfigError for a batch size that does not apply: --batch-rows outside EVAL, per_device_batch_size in it."""
    from core.config.schema import canonical_key
    from core.config.values import parse_override

    if stage != EVAL:
        if batch_rows is not None:
            raise ConfigError(f"--batch-rows sizes --stage {EVAL}'s batch: drop it, or plan --stage {EVAL} "
                              "(a training stage takes per_device_batch_size=N).")
        return
    if any(canonical_key(parse_override(text)[0], f"override {text!r}") == "per_device_batch_size" for text in overrides):
        raise ConfigError(f"--stage {EVAL} runs the evaluation's own rows, not the training batch: drop "
                          "per_device_batch_size and give --batch-rows N (as dsv4 eval-indexer takes it).")
    if batch_rows is not None and batch_rows < 1:
        raise ConfigError(f"--batch-rows {batch_rows} must be at least 1 (or left out: one per batch shard).")


class CompileTimeout(ConfigError):
    """A child compile that ran past its time limit (`plan(timeout_s=...)`)."""


def plan(model: str, stage: str | None, target_name: str, overrides: Sequence[str] = (), *,
         config_file: str | None = None, top: int = 10, analytic: bool = True, batch_rows: int | None = None,
         timeout_s: float | None = None, on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Compile `model`'s train step of `stage` for `target_name` in a child process and report.

    Args:
      batch_rows: EVAL only: the evaluation's rows per step (`dsv4 eval-indexer --batch-rows`;
        None: one per batch shard); the training batch (per_device_batch_size) plays no part there.
      top: how many of the largest temporaries to list; analytic: also count the step's FLOPs from
        its jaxpr (core.bench.train), a second trace of the step beside the compile.
      timeout_s: the child's time limit (None: none).
      on_start: called once the input is valid, before the child starts compiling.
    Returns:
      core/plan/report.py's report (a dict; its `fits` is the verdict).
    Raises:
      ConfigError: unknown target, bad config, a mesh that does not divide the target's devices.
      MissingExtraError: the target's extra is not installed.
      CompileTimeout: the compile ran past `timeout_s`.
    """
    from core.parallel.mesh import plan_mesh

    target = tg.parse_target(target_name)
    check_eval_batch(stage, overrides, batch_rows)
    cfg = load(model, stage, overrides, config_file)
    plan_mesh(cfg, target.devices, target.granules)  # a mesh that does not divide fails before any compile
    tg.require_extra(target)
    if on_start is not None:
        on_start()
    args = {"model": model, "stage": stage, "overrides": list(overrides), "config_file": config_file,
            "target": target_name, "top": top, "analytic": analytic, "batch_rows": batch_rows}
    with tempfile.TemporaryDirectory(prefix="dsv4-plan-") as dump:
        # The top temporaries come from the buffer assignment XLA dumps as it compiles; an executable
        # read back from JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) dumps none.
        return run_child("core.plan.compile", {**args, "dump": dump}, target, timeout_s=timeout_s,
                         xla_flags=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*jit_step.*",
                         persistent_cache=top == 0)


def run_child(module: str, args: dict[str, Any], target: tg.Target, *, timeout_s: float | None = None,
              xla_flags: str = "", what: str = "the compile", persistent_cache: bool = True) -> dict[str, Any]:
    """`python -m module '<args as JSON>'` in `targets.child_env(target)`; the JSON of its MARKER line.

    `persistent_cache=False` turns JAX's persistent compilation cache off in the child (neither read
    nor written), whatever the environment sets.

    The child prints one line `MARKER + json` (a result, or {"error": message} for a DsvError);
    anything else it prints stays in the child.
    Raises:
      ConfigError: the child's error, or its last error line when it died without a result.
      CompileTimeout: it ran past `timeout_s`.
    """
    env = tg.child_env(target)
    root = str(Path(core.__file__).parent.parent)  # the checkout or site-packages that holds this core
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {xla_flags}".strip()
    if not persistent_cache:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    try:
        proc = subprocess.run([sys.executable, "-m", module, json.dumps(args)], capture_output=True, text=True,
                              env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CompileTimeout(f"--target {target.name}: {what} ran past {timeout_s:.0f} s.") from None
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            out = json.loads(line[len(MARKER):])
            if isinstance(out, dict) and "error" in out:
                raise ConfigError(out["error"])
            return out
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    tail = (errors or lines or [f"exit code {proc.returncode}"])[-1]
    raise ConfigError(f"--target {target.name}: {what} failed (exit code {proc.returncode}): {tail[:400]}")


# ----------------------------------------------------------------------------- child side


def device_mesh(cfg, devices: Sequence[Any]):
    """`make_mesh(cfg, devices)`, with one granule for compile-only TPU devices without slice_index."""
    from core.parallel.mesh import make_mesh

    if devices[0].platform != "tpu" or hasattr(devices[0], "slice_index"):
        return make_mesh(cfg, devices)
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    from core.parallel.mesh import mesh_axes, plan_mesh

    ici, _ = plan_mesh(cfg, len(devices), 1)
    names = mesh_axes(ici)
    array = mesh_utils.create_device_mesh([ici[a] for a in names], list(devices), allow_split_physical_axes=True)
    return Mesh(array, names, axis_types=(AxisType.Auto,) * len(names))


def lower_plan(specs, target: tg.Target):
    """In the child: the train step of `specs` (core.spec.resolve, for the target) lowered for `target`'s
    devices as a training command lowers it (core/train/program.py's `lowered_step`); returns
    (jax.stages.Lowered, program.StepInputs)."""
    from core.train.program import lowered_step

    return lowered_step(specs, device_mesh(specs.cfg, tg.compile_devices(target)))


def compile_eval_plan(specs, target: tg.Target, *, top: int = 10, dump: str | None = None,
                      batch_rows: int | None = None) -> dict[str, Any]:
    """In the child: compile the evaluation's two programs (core.eval.evaluate.lowered_eval, at the
    config's indexer_topk, `batch_rows` rows per step as eval-indexer runs them) for `target` and
    report the one with the larger total (they run one after the other), with stage "eval", each
    program's temporaries under "eval_programs", and the rows per step as global_batch."""
    from core.eval.evaluate import lowered_eval
    from core.eval.rows import EvalSet
    from core.plan import report

    cfg = specs.cfg
    mesh = device_mesh(cfg, tg.compile_devices(target))
    lowered, (_, state, batch, mesh) = lowered_eval(specs, (cfg.indexer_topk,), mesh, EvalSet(batch_rows=batch_rows))
    rows = batch["rows"].shape[0]
    state_info = report.state_bytes(cfg, state, batch)
    reports = {}
    for part, program in lowered.items():
        try:
            compiled = program.compile()
        except Exception as e:  # noqa: BLE001  (only an out-of-memory refusal is a verdict)
            refusal = report.refusal(str(e))
            if refusal is None:
                raise
            return {**report.refused_report(cfg, target, mesh, state_info, refusal, global_batch=rows), "stage": EVAL,
                    "eval_program": part}
        reports[part] = report.compiled_report(cfg, target, mesh, state_info, compiled, top=top, analytic=False,
                                               buffer_text=read_buffer_assignment(dump, f"jit_step_{part}"),
                                               global_batch=rows)
    part = max(reports, key=lambda p: reports[p]["per_device"]["total_bytes"])
    return {**reports[part], "stage": EVAL, "eval_program": part,
            "eval_programs": {p: r["per_device"]["temp_bytes"] for p, r in reports.items()}}


def compile_plan(specs, target: tg.Target, *, top: int = 10, analytic: bool = True,
                 dump: str | None = None, stage: str | None = None, batch_rows: int | None = None) -> dict[str, Any]:
    """In the child: compile the step of `specs` (core.spec.resolve, for the target) for `target` and
    build the report (core/plan/report.py); batch_rows: EVAL's rows per step (`compile_eval_plan`)."""
    from core.plan import report

    if stage == EVAL:
        return compile_eval_plan(specs, target, top=top, dump=dump, batch_rows=batch_rows)
    cfg = specs.cfg
    lowered, (_, state, batch, mesh) = lower_plan(specs, target)
    state_info = report.state_bytes(cfg, state, batch)
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001  (only an out-of-memory refusal is a verdict)
        refusal = report.refusal(str(e))
        if refusal is None:
            raise
        return report.refused_report(cfg, target, mesh, state_info, refusal)
    out = report.compiled_report(cfg, target, mesh, state_info, compiled, top=top, analytic=analytic,
                                 buffer_text=read_buffer_assignment(dump))
    return {**out, **model_utilization(cfg, target, out)}


def model_utilization(cfg, target: tg.Target, out: dict[str, Any]) -> dict[str, Any]:
    """model_flops_per_step (core/train/flops.py over the step's global batch, all devices) and, with a
    step estimate, model_mfu: those FLOPs / the estimated step / devices / the chip's peak (None without)."""
    from core.train.flops import model_flops_per_step
    from core.parallel.chips import utilization

    flops = model_flops_per_step(cfg, out["global_batch"])["total"]
    step = out.get("estimated_step_s")
    if not step or target.chip is None:
        return {"model_flops_per_step": flops, "model_mfu": None, "model_tflops_per_device": None}
    used = utilization(flops, step, target.devices, target.chip.peak_flops)
    return {"model_flops_per_step": flops, "model_mfu": used["mfu"], "model_tflops_per_device": used["tflops_per_device"]}


def read_buffer_assignment(dump: str | None, module: str = "jit_step") -> str:
    """The train step's (or `module`'s) buffer assignment text from an XLA dump directory ("" if none)."""
    if not dump:
        return ""
    files = sorted(Path(dump).glob(f"*{module}*after_optimizations-buffer-assignment.txt"))
    return files[-1].read_text() if files else ""


def _child(args: dict[str, Any]) -> dict[str, Any]:
    from core.errors import DsvError
    from core.plan.report import usable_memory
    from core.train.remat import remat_candidates

    try:
        target = tg.parse_target(args["target"])
        cfg = load(args["model"], args["stage"], args["overrides"], args["config_file"])
        mesh = device_mesh(cfg, tg.compile_devices(target))
        specs = resolve(cfg, target.platform, mesh.shape)  # once: the plan's entry point
        kw = dict(top=args["top"], analytic=args["analytic"], dump=args.get("dump"), stage=args["stage"],
                  batch_rows=args.get("batch_rows"))
        trials = () if args["stage"] == EVAL else remat_candidates(cfg.remat_policy, specs, dict(mesh.shape),
                                                                   usable_memory(target)[0])
        for policy in trials:  # the run's choice, as the run makes it (core/train/remat.py `remat_that_fits`)
            light = compile_plan(specs.replace(remat_policy=policy), target, **kw)
            if light["fits"]:
                return light
        return compile_plan(specs, target, **kw)
    except DsvError as e:
        return {"error": str(e)}


if __name__ == "__main__":  # python -m core.plan.compile '{"model": ..., "target": ..., ...}'
    tune_garbage_collector()
    print(MARKER + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
