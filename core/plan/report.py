"""The plan's report per device: exact state bytes, the compiler's memory, the verdict, FLOPs, step-time estimate.

Everything is per device, for the most loaded one. The figures and where they come from:

- parameters (trainable and frozen apart, plus the model's other state such as router biases),
  optimizer state and the batch: exact, from each array's shape, dtype and sharding
  (`sharding.shard_shape`); the rule shardings split only dimensions that their mesh axes divide,
  so every device holds the same bytes;
- temporaries, generated code, arguments, outputs: the compiler's `memory_analysis()`;
  total = arguments + temporaries + code + outputs not aliased with the (donated) arguments;
- usable memory, by a named rule: TPU the compiler's HBM limit; GPU the smaller of XLA's limit
  and JAX's 75 % preallocation; CPU the host's RAM over the devices (approximate);
- the largest temporaries: the values of XLA's buffer assignment in temporary allocations,
  attributed to a component through the instruction's source stack (`core.bench.trace.hlo_components`,
  the attribution `bench --profile` uses);
- FLOPs per device (core/plan/hlo.py): the matmuls of the compiled program, each while loop's
  body counted as often as it runs; beside it XLA's `cost_analysis()` (which counts each loop
  body once, so it undercounts a scanned step by about its trip counts, and is absent for
  compile-only GPUs) and the analytic jaxpr count of `core.bench.train.component_flops` for the
  step's global batch, over the devices;
- bytes accessed and collectives per mesh axis: read from the compiled HLO, loops counted;
- the step-time estimate: core/plan/cost.py's model of each executed instruction (its matmuls at
  the peak, its bytes at the HBM bandwidth, gathers by the row, a fixed cost per instruction,
  asynchronous copies and collectives overlapped), at the chip's published peaks with efficiencies
  fitted on a TPU v5e chip (docs/step-time-model.md).

A TPU compile refused for memory (RESOURCE_EXHAUSTED) is a verdict: `refusal` reads the
compiler's own usage figures and largest allocations from its message.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from core.plan.targets import JAX_PREALLOCATE_FRACTION, Target, ceilings, efficiency

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


# ----------------------------------------------------------------------------- exact state bytes


def state_bytes(cfg, state, batch: dict[str, Any]) -> dict[str, int]:
    """Per-device bytes of the split (model, optimizer) `state` and the `batch`, from shardings.

    Returns:
      {"trainable_parameter_bytes", "frozen_parameter_bytes", "other_model_bytes" (router biases and
       other non-Param model state), "parameter_bytes" (their sum), "optimizer_bytes", "batch_bytes"}.
    """
    from flax import nnx

    from core.model.quant import Released
    from core.parallel.sharding import shard_bytes
    from core.train.step import config_matcher

    trainable = config_matcher(cfg)
    out = dict.fromkeys(("trainable_parameter_bytes", "frozen_parameter_bytes", "other_model_bytes",
                         "optimizer_bytes"), 0)
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if not hasattr(value, "shape"):
            continue
        if path[0] != 0:
            key = "optimizer_bytes"
        elif isinstance(var, nnx.Param):
            key = "trainable_parameter_bytes" if trainable(path[1:]) else "frozen_parameter_bytes"
        elif isinstance(var, Released):  # a frozen weight held as the release stores it (codes, scales)
            key = "frozen_parameter_bytes"
        else:
            key = "other_model_bytes"
        out[key] += shard_bytes(value)
    out["parameter_bytes"] = out["trainable_parameter_bytes"] + out["frozen_parameter_bytes"] + out["other_model_bytes"]
    out["batch_bytes"] = sum(shard_bytes(x) for x in batch.values())
    return out


# ----------------------------------------------------------------------------- usable memory and verdict


def usable_memory(target: Target, compiler_limit: int | None = None) -> tuple[int, str]:
    """(usable bytes per device, the rule that gave them)."""
    if target.platform == "tpu":
        if compiler_limit:
            return compiler_limit, "the TPU compiler's HBM limit (from its message)"
        return target.chip.hbm_bytes, "the TPU compiler's HBM limit per chip"
    if target.platform == "cuda":
        preallocated = int(JAX_PREALLOCATE_FRACTION * target.chip.hbm_bytes)
        if compiler_limit and compiler_limit < preallocated:
            return compiler_limit, "XLA's GPU memory limit (smaller than JAX's 75 % preallocation)"
        return preallocated, "JAX's 75 % preallocation of the GPU's memory (XLA's limit is larger)"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // target.devices, f"approximate: this host's RAM over {target.devices} fake CPU device(s)"


def verdict(per_device: dict[str, int]) -> dict[str, Any]:
    """fits and headroom (usable - total, negative when it does not fit)."""
    return {"fits": per_device["total_bytes"] <= per_device["usable_bytes"],
            "headroom_bytes": per_device["usable_bytes"] - per_device["total_bytes"]}


def _header(cfg, target: Target, mesh, global_batch: int | None = None) -> dict[str, Any]:
    """global_batch: the step's rows (default per_device_batch_size x devices; the evaluation's own
    rows per step for --stage eval, then per_device_batch_size is their share per device)."""
    from core.config.stages import stage_of

    rows = cfg.per_device_batch_size * target.devices if global_batch is None else global_batch
    return {"target": target.name, "platform": target.platform, "devices": target.devices,
            "mesh": {a: int(n) for a, n in mesh.shape.items()}, "model": cfg.model_name, "stage": stage_of(cfg).name,
            "per_device_batch_size": rows // target.devices if rows % target.devices == 0 else rows / target.devices,
            "max_target_length": cfg.max_target_length, "global_batch": rows, "remat_policy": cfg.remat_policy,
            "approximate": target.approximate}


def compiled_report(cfg, target: Target, mesh, state_info: dict[str, int], compiled, *, top: int = 10,
                    buffer_text: str = "", analytic: bool = True, global_batch: int | None = None) -> dict[str, Any]:
    """The report of a step that compiled (module docstring); `--json`'s fixed fields at top level."""
    from core.plan import hlo
    from core.train.memory import compiled_memory

    text = compiled.as_text()
    usable, rule = usable_memory(target)
    per_device = {**state_info, **compiled_memory(compiled), "usable_bytes": usable}
    program = hlo.summary(text, mesh)
    cost = _cost(compiled)
    out = {**_header(cfg, target, mesh, global_batch), **verdict(per_device), "per_device": per_device, "usable_rule": rule,
           "flops_per_step": program["matmul_flops"], "bytes_accessed": program["bytes_accessed"],
           "collective_bytes": program["collective_bytes"],
           **flop_figures(cfg, mesh, program, cost, analytic),
           "top_temporaries": top_temporaries(buffer_text, text, top) if top else []}
    out.update(step_estimate(target, text, out["global_batch"] * cfg.max_target_length,
                             ragged_rows(cfg, mesh, out["global_batch"]),
                             hosts=tuple(d.process_index for d in mesh.devices.flat)))
    return out


def refused_report(cfg, target: Target, mesh, state_info: dict[str, int], refusal: dict[str, Any], *,
                   global_batch: int | None = None) -> dict[str, Any]:
    """The report of a step the compiler refused for memory: its figures are the verdict's detail."""
    usable, rule = usable_memory(target, refusal.get("limit_bytes"))
    per_device = {**state_info, "argument_bytes": refusal.get("arguments_bytes"), "temp_bytes": refusal.get("temp_bytes"),
                  "code_bytes": None, "total_bytes": refusal.get("used_bytes"), "usable_bytes": usable}
    return {**_header(cfg, target, mesh, global_batch), "fits": False,
            "headroom_bytes": None if per_device["total_bytes"] is None else usable - per_device["total_bytes"],
            "per_device": per_device, "usable_rule": rule, "refused": refusal, "flops_per_step": None,
            "estimated_step_s": None, "estimated_tokens_per_s": None,
            "top_temporaries": refusal.get("allocations", [])}


# ----------------------------------------------------------------------------- the compiler's refusal


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()]) if m else 0


def refusal(message: str) -> dict[str, Any] | None:
    """The figures of an out-of-memory compile error, or None if `message` is not one.

    Returns:
      {"message" (its first line), "used_bytes", "limit_bytes", "reserved_bytes", "program_bytes",
       "arguments_bytes", "temp_bytes", "allocations": [{"bytes", "shape", "op_name", "component"}]}
      with the figures the message gives (absent ones None).
    """
    if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
        return None
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    used = re.search(r"Used ([\d.]+[KMGT]?i?B?) of ([\d.]+[KMGT]?i?B?) (\w+)", message)

    def figure(label: str) -> int | None:
        m = re.search(rf"^\s*{label}\s+([\d.]+[KMGT]?i?B?)\s*", message, re.MULTILINE | re.IGNORECASE)
        return _size(m.group(1)) if m else None

    allocations = []
    for block in re.split(r"\n\s*\d+\.\s+Size:", message)[1:]:
        size = re.match(r"\s*([\d.]+[KMGT]?i?B?)", block)
        shape = re.search(r"Shape:\s*(\S+)", block)
        op = re.search(r'op_name="([^"]*)"', block)
        source = re.search(r'source_file="([^"]*)"', block)
        allocations.append({"bytes": _size(size.group(1)) if size else 0, "shape": shape.group(1) if shape else "",
                            "op_name": op.group(1) if op else "", "component": _component_of_file(source)})
    return {"message": first[:300], "used_bytes": _size(used.group(1)) if used else None,
            "limit_bytes": _size(used.group(2)) if used else None, "reserved_bytes": figure("reserved"),
            "program_bytes": figure("program"), "arguments_bytes": figure("arguments"),
            "temp_bytes": figure("HLO temp"), "allocations": allocations}


def _component_of_file(match) -> str:
    from core.bench.components import component_of_files

    return component_of_files([match.group(1)]) if match else "other"


# ----------------------------------------------------------------------------- largest temporaries


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):\s*$")
_VALUE = re.compile(r"^\s*value: <\d+ ([^\s>]+?)(?:\{[\d,]*\})? @\d+> \(size=(\d+),offset=\d+\): (.+)$")
_NOT_TEMP = ("parameter", "output", "constant", "thread-local", "live-out", "entry computation")


def top_temporaries(buffer_text: str, hlo_text: str, n: int) -> list[dict[str, Any]]:
    """The `n` largest values in temporary allocations of XLA's buffer assignment.

    Returns:
      [{"bytes", "shape", "instruction", "op_name", "component"}], largest first; [] without a
      buffer assignment.
    """
    from core.bench.trace import hlo_components

    values, temp = {}, False
    for line in buffer_text.splitlines():
        if m := _ALLOCATION.match(line):
            temp = not any(word in m.group(3) for word in _NOT_TEMP)
        elif temp and (m := _VALUE.match(line)):
            name, size, shape = m.group(1), int(m.group(2)), m.group(3).strip()
            if size > values.get(name, (0, ""))[0] and not shape.startswith("("):
                values[name] = (size, re.sub(r"\{[^}]*\}", "", shape))
    owners = hlo_components(hlo_text) if values else {}
    rows = sorted(values.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"bytes": size, "shape": shape, "instruction": name, "op_name": owners.get(name, ("other", ""))[1],
             "component": owners.get(name, ("other", ""))[0]} for name, (size, shape) in rows]


# ----------------------------------------------------------------------------- FLOPs and collectives


def _cost(compiled) -> dict[str, float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001  (not every backend has a cost model)
        return {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {k: float(v) for k, v in (cost or {}).items() if k in ("flops", "bytes accessed")}


def analytic_flops(cfg, mesh) -> dict[str, float]:
    """core.bench.train's jaxpr FLOP count of the step on `mesh` (its global batch), over its devices:
    {"total", "matmul"} per device."""
    from core.bench.train import component_flops
    from core.parallel.mesh import mesh_platform
    from core.spec.resolve import resolve

    # `cfg` is the plan child's, resolved already (core/plan/compile.py): its specs, cached there
    counts = component_flops(resolve(cfg, mesh_platform(mesh), mesh.shape), mesh, compile=False)
    matmul = sum(c["matmul_flops"] for c in counts["components"].values())
    return {"total": counts["total_flops"] / mesh.size, "matmul": matmul / mesh.size}


def flop_figures(cfg, mesh, program: dict[str, Any], cost: dict[str, float], analytic: bool) -> dict[str, Any]:
    """The FLOP counts beside the estimate's (module docstring) and which one it uses, and why."""
    counts = analytic_flops(cfg, mesh) if analytic else {"total": None, "matmul": None}
    return {"analytic_flops_per_device": counts["total"], "analytic_matmul_flops_per_device": counts["matmul"],
            "xla_cost_analysis_flops": cost.get("flops"), "xla_cost_analysis_bytes": cost.get("bytes accessed"),
            "matmul_flops_loops_once": program["matmul_flops_loops_once"],
            "flops_rule": "flops_per_step is the compiled program's matmul FLOPs (grouped-matmul kernels from their "
                          "shapes) with each loop body counted as often as it runs; XLA's cost analysis counts each "
                          "while-loop body once (the layer scan, the chunked attention and loss), and the analytic "
                          "jaxpr count also counts elementwise work, which the peak bf16 FLOP/s does not apply to"}


def ragged_rows(cfg, mesh, global_batch: int) -> dict[str, Any] | None:
    """How the step-time model prices the expert-parallel grouped matmuls when drop-free: each
    destination's kernels run over static receive buffers of C = P n min(k, E/P) rows
    (core/ops/expert_parallel.py `capacity`), of which the group sizes cover the slots it receives,
    n k under a balanced load; priced at those n k rows. None where the buffers are the rows the
    kernels compute (a capacity factor: C = ceil(f n k)), or no grouped-matmul kernel runs them."""
    from core.ops.expert_parallel import capacity
    from core.ops.placement import expert_axis_size, token_shards

    devices = expert_axis_size(mesh)
    if devices <= 1 or cfg.moe_capacity_factor > 0 or cfg.moe_impl not in ("gmm", "ragged") or not cfg.num_experts:
        return None
    n, k = global_batch * cfg.max_target_length // token_shards(mesh), cfg.num_experts_per_tok
    static = capacity(n, k, cfg.num_experts, devices, 0.0)
    tm = min(cfg.moe_gmm_tiles[6] if cfg.moe_gmm_tiles else 512, -(-static // 8) * 8)  # tgmm pads rows to its tile
    return {"static_rows": static, "padded_rows": -(-static // tm) * tm, "priced_rows": n * k,
            "rule": "drop-free expert parallelism: each grouped-matmul kernel priced at the n k rows a destination "
                    "receives under a balanced load, not at its static buffer's P n min(k, E/P) rows (the executed "
                    "rows follow the routing; elementwise work and bytes stay the buffer's)"}


def step_estimate(target: Target, hlo_text: str, tokens: int, ragged: dict[str, Any] | None = None,
                  hosts: tuple[int, ...] = ()) -> dict[str, Any]:
    """estimated_step_s, estimated_tokens_per_s and `step_estimate`, the model's parts (core/plan/cost.py);
    `ragged`: `ragged_rows`' pricing of the grouped matmuls, reported under step_estimate's ragged_rows;
    `hosts`: each device's host in the mesh's order (`targets.ceilings`)."""
    from core.plan import cost

    if target.chip is None:
        return {"estimated_step_s": None, "estimated_tokens_per_s": None,
                "step_estimate": "no estimate: fake CPU devices have no peak figures"}
    chip = target.chip
    rows = {ragged[r]: ragged["priced_rows"] for r in ("static_rows", "padded_rows")} if ragged else {}
    eff = efficiency(target)
    parts = cost.estimate(hlo_text, ceilings(target, hosts), eff, ragged=rows)
    step = parts.pop("step_s")
    return {"estimated_step_s": step, "estimated_tokens_per_s": tokens / step if step else None,
            "step_estimate": {**parts, **({"ragged_rows": ragged} if ragged else {}), "peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth,
                              "link_bandwidth": chip.link_bandwidth, "network_bandwidth": chip.network_bandwidth,
                              "efficiency": dataclasses.asdict(eff),
                              "model": "per executed instruction: max(matmul FLOPs / (peak x mxu), (HBM bytes + "
                                       "vmem x on-chip bytes) / (HBM bandwidth x hbm), rows x row_s) + op_s, loops "
                                       "counted; asynchronous copies and collectives overlapped with the "
                                       "instructions between start and done; efficiencies fitted on a TPU v5e "
                                       "(docs/step-time-model.md)"}}
