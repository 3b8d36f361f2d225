"""The training step's speed and memory over shapes, and its FLOPs per component (`dsv4 bench --train`).

Tools on the training commands' own step program: core/train/program.py's `StepProgram` on the real
build or on program.py's abstract inputs, of specs resolved where the benchmark starts (`sweep_point`:
core.spec.resolve, then the run's remat phase).

- `compile_train_step(specs, mesh)`: the step compiled ahead of time from abstract inputs (nothing is
  allocated), as the training commands compile it: compile seconds, XLA's compiled memory
  analysis (temp bytes) and cost analysis.
- `run_train_sweep(stages, seqs, batches)`: for each (stage, T, B) one fresh subprocess builds
  the model, compiles the step, runs it and reports tokens/s, step time, compile time, the
  compiled temp memory, the process's peak RSS (`resource.getrusage` max RSS of that
  subprocess, so each shape's peak is its own, not the running maximum of one process), and the
  model TFLOP/s per device and MFU (core/train/flops.py's model FLOPs over the device's peak,
  core/parallel/chips.py).
- `component_flops(specs, mesh)`: FLOPs of one step attributed to attention, compressor, indexer, MoE,
  mHC, head, optimizer and the rest, counted from the live equations of the jaxpr of `step_fn` (dead
  code eliminated, as XLA prunes it) on the abstract inputs (traced outside the mesh's abstract
  mesh: the model's maths on the global batch, without expert parallelism's per-device exchange,
  which moves tokens and computes nothing): every dot_general's
  2 * batch * free * contracted sizes (scan bodies times their trip count, remat recomputation
  and the backward pass included, as XLA will run them) and one FLOP per output element for the
  other arithmetic. An equation belongs to the innermost project module on its traceback
  (transposed and recomputed equations keep their forward equation's traceback), helpers
  (core/bench/components.py) to whoever called them. XLA's own total (`cost_analysis`) is
  reported beside it as a cross-check. `profile_step` puts the analytic model FLOPs per component
  beside it and, timed, both MFUs: the model's and the compiled one (these matmul FLOPs: remat's
  recomputation and the implementation's own counted).
Nothing here prints: results are plain dicts.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from core.bench.components import COMPONENTS, component_of_files
from core.bench.trace import trace_step
from core.config.schema import load_config
from core.data.batches import train_batches
from core.parallel.chips import matmul_ceiling, peak_flops, utilization
from core.parallel.mesh import make_mesh
from core.parallel.sharding import shard_batch
from core.process import tune_garbage_collector
from core.spec.resolve import Resolved, data_spec, resolve
from core.train import program, remat
from core.train.flops import model_flops_per_step
from core.train.materialise import build
from core.train.step import step_fn

_SIZES = "__SIZES__"  # marker of the subprocess's one JSON line


def compile_train_step(specs: Resolved, mesh) -> dict[str, Any]:
    """The step of `specs` (resolved for `mesh`) lowered from abstract inputs and compiled, as a training
    command compiles it ahead of its build (core/train/program.py's `lowered_step`), on `mesh`.

    Returns:
      {"compile_s" (abstract inputs, lower and compile), "temp_bytes" (XLA temporaries), "argument_bytes",
       "output_bytes", "xla_flops" (XLA cost analysis of the whole program; -1 if unavailable)}.
    """
    start = time.perf_counter()
    compiled = program.lowered_step(specs, mesh)[0].compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return {"compile_s": compile_s, "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
            "xla_flops": _xla_flops(compiled)}


def _xla_flops(compiled) -> float:
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("flops", -1.0))
    except Exception:  # not every backend implements cost analysis
        return -1.0


# ----------------------------------------------------------------------------- FLOPs per component


def _component(traceback) -> str:
    """Component of an equation: its innermost non-helper project frame (optax's frames: optimizer)."""
    frames = traceback.frames if traceback is not None else []
    return component_of_files([f.file_name for f in frames], [f.function_name for f in frames])


def _eqn_flops(eqn) -> tuple[float, float]:
    """(matmul FLOPs, other FLOPs) of one equation without sub-jaxprs (a Pallas call: its kernel's
    own cost estimate, the megablox grouped matmuls', as matmul FLOPs)."""
    outs = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape")]
    if eqn.primitive.name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[d] for d in contract)
        return 2.0 * math.prod(outs[0].shape) * k, 0.0
    if eqn.primitive.name == "ragged_dot_general":  # each lhs row meets one group: 2 x lhs x rhs's free dims
        numbers = eqn.params["ragged_dot_dimension_numbers"]
        (_, contract), (_, batch) = numbers.dot_dimension_numbers
        rhs = eqn.invars[1].aval.shape
        bound = set(contract) | set(batch) | set(numbers.rhs_group_dimensions)
        free = math.prod(n for i, n in enumerate(rhs) if i not in bound)
        return 2.0 * math.prod(eqn.invars[0].aval.shape) * free, 0.0
    if eqn.primitive.name == "pallas_call":
        estimate = eqn.params.get("cost_estimate")
        return (float(estimate.flops), 0.0) if estimate is not None else (0.0, 0.0)
    if eqn.primitive.name in ("reshape", "broadcast_in_dim", "squeeze", "transpose", "convert_element_type",
                              "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather",
                              "scatter", "select_n", "iota", "copy", "copy_p", "device_put", "stop_gradient"):
        return 0.0, 0.0
    return 0.0, float(sum(math.prod(a.shape) for a in outs))


def _walk(jaxpr, mult: float, totals: dict[str, list[float]]) -> None:
    for eqn in jaxpr.eqns:
        subs = []
        for value in eqn.params.values():
            for v in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(v, jcore.ClosedJaxpr):
                    subs.append(v.jaxpr)
                elif isinstance(v, jcore.Jaxpr):
                    subs.append(v)
        if eqn.primitive.name == "cond":  # one branch runs: count the most expensive
            scratch = [{c: [0.0, 0.0] for c in COMPONENTS} for _ in subs]
            for sub, acc in zip(subs, scratch):
                _walk(sub, mult, acc)
            best = max(scratch, key=lambda acc: sum(map(sum, acc.values())))
            for c, (mm, other) in best.items():
                totals[c][0] += mm
                totals[c][1] += other
            continue
        if subs and eqn.primitive.name != "pallas_call":  # a kernel counts by its estimate, not its body
            inner = mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
            for sub in subs:
                _walk(sub, inner, totals)
            continue
        mm, other = _eqn_flops(eqn)
        c = _component(eqn.source_info.traceback)
        totals[c][0] += mm * mult
        totals[c][1] += other * mult


def live_jaxpr(closed):
    """The closed jaxpr less the equations none of its outputs needs, inside loops and calls too
    (`pe.dce_jaxpr`): what XLA runs of it, the dead work pruned (in the warm-up, the last layer's
    experts: nothing reads them)."""
    jaxpr = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)[0]
    return jcore.ClosedJaxpr(jaxpr, closed.consts)


def jaxpr_flops(closed) -> dict[str, dict[str, float]]:
    """FLOPs of a closed jaxpr per component (module docstring): {name: {"matmul_flops", "other_flops"}}."""
    totals = {c: [0.0, 0.0] for c in COMPONENTS}
    _walk(closed.jaxpr, 1.0, totals)
    return {c: {"matmul_flops": mm, "other_flops": other} for c, (mm, other) in totals.items()}


def component_flops(specs: Resolved, mesh, *, compile: bool = True) -> dict[str, Any]:
    """FLOPs of one train step of `specs` per component (module docstring), from its jaxpr.

    Args:
      specs, mesh: the step's resolved specs and its mesh (they were resolved for); the batch is its global one.
    Returns:
      {"components": {name: {"matmul_flops", "other_flops"}}, "total_flops", "tokens_per_step",
       "xla_flops", "temp_bytes"} (the last two from compiling the step; None without `compile`).
    """
    _, (graphdef, state, batch, _) = program.abstract_program(specs, mesh)
    components = jaxpr_flops(live_jaxpr(jax.make_jaxpr(step_fn(specs, graphdef))(state, batch)))
    compiled = compile_train_step(specs, mesh) if compile else {"xla_flops": None, "temp_bytes": None}
    tokens = batch["tokens"].shape[0] * batch["tokens"].shape[1]
    return {"components": components, "total_flops": sum(sum(c.values()) for c in components.values()),
            "xla_flops": compiled["xla_flops"], "temp_bytes": compiled["temp_bytes"], "tokens_per_step": tokens}


# ----------------------------------------------------------------------------- speed over shapes


def compiled_shape(specs: Resolved, mesh, batches: int) -> dict[str, Any]:
    """Build the model and optimizer of `specs` on `mesh`, draw `batches` sharded batches and compile the
    train step for them, in this process (what `measure_shape` and tools/step_ab.py time).

    Returns:
      {"step" (jax.stages.Compiled, the `StepProgram`'s), "state", "batches", "tokens_per_step",
       "batch_rows" (the global batch), "devices" (the mesh's), "compile_s" (lower + compile),
       "temp_bytes" (XLA's memory analysis)}.
    """
    cfg = specs.cfg
    setup = build(specs, mesh)
    graphdef, state = nnx.split((setup.model, setup.optimizer))
    data = train_batches(data_spec(cfg), setup.batch_size)
    drawn = [shard_batch(next(data), setup.mesh) for _ in range(batches)]
    start = time.perf_counter()
    step_program = program.StepProgram.of(specs, graphdef, state, setup.mesh)
    step = step_program.compiled() or step_program.lower(state, drawn[0]).compile()  # remat_that_fits compiled it
    return {"step": step, "state": state, "batches": drawn, "tokens_per_step": setup.batch_size * cfg.max_target_length,
            "batch_rows": setup.batch_size, "devices": setup.mesh.size, "compile_s": time.perf_counter() - start,
            "temp_bytes": int(step.memory_analysis().temp_size_in_bytes)}


def measure_shape(specs: Resolved, mesh, steps: int, trace_steps: int = 0) -> dict[str, Any]:
    """Build, compile (timed, memory analysed) and run `steps` + 1 train steps of `specs` on `mesh` in
    this process.

    With `trace_steps`, that many more steps then run under jax.profiler (core/bench/trace.py).

    Returns:
      {"compile_s" (lower + compile), "first_step_s", "step_time_s" (median of the timed steps),
       "tokens_per_step", "tokens_per_s", "temp_bytes", "peak_rss_bytes" (this process's max RSS),
       "devices", "model_flops" (one step's, core/train/flops.py), "peak_flops" and "peak_source" (a
       device's, core/parallel/chips.py), "tflops_per_device", "mfu", "last": the last step's
       metrics, and with trace_steps "time": core.bench.trace.trace_step's dict}.
    """
    shape = compiled_shape(specs, mesh, steps + 1 + trace_steps)
    step_fn, state = shape["step"], shape["state"]
    batches, traced = shape["batches"][:steps + 1], shape["batches"][steps + 1:]
    times, metrics = [], {}
    for batch in batches:
        start = time.perf_counter()
        state, metrics = step_fn(state, batch)
        metrics = jax.device_get(metrics)
        times.append(time.perf_counter() - start)
    tokens = shape["tokens_per_step"]
    step_time = float(np.median(times[1:])) if steps else times[0]
    extra = {}
    if traced:
        state, extra["time"] = trace_step(step_fn, state, traced)
    return {**extra, "compile_s": shape["compile_s"], "first_step_s": times[0], "step_time_s": step_time,
            "tokens_per_step": tokens, "tokens_per_s": tokens / step_time, "temp_bytes": shape["temp_bytes"],
            "peak_rss_bytes": peak_rss_bytes(), **_utilization(specs.cfg, shape, step_time),
            "last": {k: float(v) for k, v in metrics.items()}}


def _utilization(cfg, shape, step_time: float) -> dict[str, Any]:
    """The step's model FLOPs, a device's peak (measured after the timed steps on a CPU) and both ratios."""
    flops = model_flops_per_step(cfg, shape["batch_rows"])["total"]
    peak, source = peak_flops(jax.local_devices()[0], cfg.dtype)
    return {"devices": shape["devices"], "model_flops": flops, "peak_flops": peak, "peak_source": source,
            **utilization(flops, step_time, shape["devices"], peak)}


def peak_rss_bytes() -> int:
    """Max resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def sweep_config(stage: str, seq: int, batch: int, overrides: Sequence[str] = (), model: str = "deepseek4-tiny"):
    """The config one sweep point runs: the stage preset, then T, B and synthetic data, then overrides
    (what a parent checks before any child starts: it must not open the accelerator its children need)."""
    return load_config(model, ["dataset_type=synthetic", f"max_target_length={seq}", f"per_device_batch_size={batch}",
                               *overrides], stage=stage)


def sweep_point(cfg) -> tuple[Resolved, Any]:
    """The benchmark's entry point, in the process that runs the point: `cfg` resolved for the run's mesh
    (core.spec.resolve) and through the run's remat phase (core/train/remat.py `remat_that_fits`),
    with that mesh."""
    mesh = make_mesh(cfg)
    return remat.remat_that_fits(cfg.remat_policy, resolve(cfg, jax.default_backend(), mesh.shape), mesh), mesh


def run_train_sweep(stages: Sequence[str], seqs: Sequence[int], batches: Sequence[int], *, steps: int = 3,
                    overrides: Sequence[str] = (), model: str = "deepseek4-tiny", timeout_s: float | None = None,
                    on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every (stage, T, B), each in its own subprocess (`python -m core.bench.train`).

    Returns:
      {"model", "steps", "rows": [{"stage", "seq", "batch", **measure_shape's keys or "error"}]}.
      A point that fails (out of memory, killed, timed out) gets "error" and the sweep goes on.
    """
    for stage in stages:  # bad input fails here, before any subprocess
        for seq in seqs:
            for b in batches:
                sweep_config(stage, seq, b, overrides, model)
    rows = []
    for stage in stages:
        for seq in seqs:
            for b in batches:
                rows.append({"stage": stage, "seq": seq, "batch": b,
                             **_run_point(stage, seq, b, steps, overrides, model, timeout_s)})
                if on_progress:
                    on_progress(f"{stage} {b} x {seq}")
    return {"model": model, "steps": steps, "rows": rows}


def _run_point(stage, seq, batch, steps, overrides, model, timeout_s, trace_steps: int = 0,
               what: str = "measure") -> dict[str, Any]:
    """One sweep point in a child process: `measure_shape`'s dict, or with what="profile" `profile_here`'s."""
    point = [stage, seq, batch, steps, list(overrides), model, trace_steps, what]
    args = [sys.executable, "-m", "core.bench.train", json.dumps(point)]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_SIZES):
            return json.loads(line[len(_SIZES):])
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return {"error": f"exit code {proc.returncode}: {tail}"[:300]}


def profile_step(stage: str = "sparse", seq: int = 256, batch: int = 1, *, steps: int = 3, timed: bool = True,
                 overrides: Sequence[str] = (), model: str = "deepseek4-tiny") -> dict[str, Any]:
    """`profile_here` of one sweep point; timed, in a child process, so that this process never opens
    the accelerator (one process at a time may hold a TPU). A child that fails gives {"error"}."""
    sweep_config(stage, seq, batch, overrides, model)  # bad input fails here, before any subprocess
    if timed:
        return _run_point(stage, seq, batch, steps, overrides, model, None, trace_steps=steps, what="profile")
    return profile_here(stage, seq, batch, steps=steps, timed=False, overrides=overrides, model=model)


def profile_here(stage: str = "sparse", seq: int = 256, batch: int = 1, *, steps: int = 3, timed: bool = True,
                 overrides: Sequence[str] = (), model: str = "deepseek4-tiny") -> dict[str, Any]:
    """`component_flops` of one sweep point beside its model FLOPs and, with `timed`, its measured step
    (traced), the matmul ceiling and both MFUs, all in this process.

    Returns:
      component_flops's dict plus {"model", "stage", "seq", "batch", "model_flops" (core.train.flops.
      model_flops_per_step's dict for the step's batch)} and, when timed, "measured" (measure_shape's
      dict, its "time" from core/bench/trace.py), "matmul_gflops" (float32) and "mfu": {"model",
      "compiled" (the jaxpr's matmul FLOPs over the same peak), "peak_flops", "peak_source"}.
    """
    specs, mesh = sweep_point(sweep_config(stage, seq, batch, overrides, model))
    out = component_flops(specs, mesh)
    out.update(model=model, stage=stage, seq=seq, batch=batch,
               model_flops=model_flops_per_step(specs.cfg, out["tokens_per_step"] // seq))
    if timed:
        measured = out["measured"] = measure_shape(specs, mesh, steps, steps)
        out["matmul_gflops"] = matmul_ceiling() / 1e9

        def mfu(flops: float) -> float:
            return utilization(flops, measured["step_time_s"], measured["devices"], measured["peak_flops"])["mfu"]

        compiled = sum(c["matmul_flops"] for c in out["components"].values())
        out["mfu"] = {"model": mfu(out["model_flops"]["total"]), "compiled": mfu(compiled),
                      "peak_flops": measured["peak_flops"], "peak_source": measured["peak_source"]}
    return out


if __name__ == "__main__":  # one point: python -m core.bench.train '[stage, seq, batch, steps, overrides, model, trace, what]'
    tune_garbage_collector()
    _stage, _seq, _batch, _steps, _overrides, _model, _trace, _what = json.loads(sys.argv[1])
    if _what == "profile":
        _out = profile_here(_stage, _seq, _batch, steps=_steps, overrides=_overrides, model=_model)
    else:
        _out = measure_shape(*sweep_point(sweep_config(_stage, _seq, _batch, _overrides, _model)), _steps, _trace)
    print(_SIZES + json.dumps(_out), flush=True)
