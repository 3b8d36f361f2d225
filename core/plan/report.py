"""The plan's report per device: exact state bytes, the compiler's memory, the verdict, FLOPs, roofline.

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
- FLOPs per device: the compiler's `cost_analysis()`, beside the analytic jaxpr count of
  `core.bench.train.component_flops` split evenly over the devices;
- collectives: bytes each all-gather / all-reduce / reduce-scatter / all-to-all / collective-permute
  of the compiled HLO moves, per mesh axis (from its replica groups), times its loop trip counts;
- roofline: step time >= max(FLOPs / peak, bytes accessed / HBM bandwidth, collective bytes / link
  bandwidth), i.e. perfect overlap at the published peaks: an optimistic estimate.

A TPU compile refused for memory (RESOURCE_EXHAUSTED) is a verdict: `refusal` reads the
compiler's own usage figures and largest allocations from its message.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from typing import Any

from core.plan.targets import JAX_PREALLOCATE_FRACTION, Target

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
               "f4e2m1fn": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


# ----------------------------------------------------------------------------- exact state bytes


def shard_bytes(x) -> int:
    """Bytes of one device's shard of an abstract (or concrete) array with a sharding."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return math.prod(shape) * x.dtype.itemsize


def state_bytes(cfg, state, batch: dict[str, Any]) -> dict[str, int]:
    """Per-device bytes of the split (model, optimizer) `state` and the `batch`, from shardings.

    Returns:
      {"trainable_parameter_bytes", "frozen_parameter_bytes", "other_model_bytes" (router biases and
       other non-Param model state), "parameter_bytes" (their sum), "optimizer_bytes", "batch_bytes"}.
    """
    from flax import nnx

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


def _header(cfg, target: Target, mesh) -> dict[str, Any]:
    from core.config.stages import stage_of

    return {"target": target.name, "platform": target.platform, "devices": target.devices,
            "mesh": {a: int(n) for a, n in mesh.shape.items()}, "model": cfg.model_name, "stage": stage_of(cfg).name,
            "per_device_batch_size": cfg.per_device_batch_size, "max_target_length": cfg.max_target_length,
            "global_batch": cfg.per_device_batch_size * target.devices, "approximate": target.approximate}


def compiled_report(cfg, target: Target, mesh, state_info: dict[str, int], compiled, *, top: int = 10,
                    buffer_text: str = "", analytic: bool = True) -> dict[str, Any]:
    """The report of a step that compiled (module docstring); `--json`'s fixed fields at top level."""
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    usable, rule = usable_memory(target)
    per_device = {**state_info,
                  "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
                  "alias_bytes": int(mem.alias_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
                  "code_bytes": int(mem.generated_code_size_in_bytes)}
    per_device["total_bytes"] = (per_device["argument_bytes"] + per_device["temp_bytes"] + per_device["code_bytes"]
                                 + max(per_device["output_bytes"] - per_device["alias_bytes"], 0))
    per_device["usable_bytes"] = usable
    cost = _cost(compiled)
    comm = collectives(hlo, mesh)
    out = {**_header(cfg, target, mesh), **verdict(per_device), "per_device": per_device, "usable_rule": rule,
           "flops_per_step": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
           "analytic_flops_per_device": analytic_flops(cfg) if analytic else None,
           "collective_bytes": comm, "top_temporaries": top_temporaries(buffer_text, hlo, top) if top else []}
    out.update(roofline(target, out["flops_per_step"], out["bytes_accessed"], sum(comm.values()),
                        out["global_batch"] * cfg.max_target_length))
    return out


def refused_report(cfg, target: Target, mesh, state_info: dict[str, int], refusal: dict[str, Any]) -> dict[str, Any]:
    """The report of a step the compiler refused for memory: its figures are the verdict's detail."""
    usable, rule = usable_memory(target, refusal.get("limit_bytes"))
    per_device = {**state_info, "argument_bytes": refusal.get("arguments_bytes"), "temp_bytes": refusal.get("temp_bytes"),
                  "code_bytes": None, "total_bytes": refusal.get("used_bytes"), "usable_bytes": usable}
    return {**_header(cfg, target, mesh), "fits": False,
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


def analytic_flops(cfg) -> float | None:
    """core.bench.train's jaxpr FLOP count of the whole step, split evenly over this process's devices."""
    import jax

    from core.bench.train import component_flops

    return component_flops(cfg, compile=False)["total_flops"] / jax.device_count()


_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _array_bytes(type_text: str) -> list[int]:
    return [math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dt] for dt, dims in _ARRAY.findall(type_text)]


def _multipliers(hlo_text: str) -> dict[str, int]:
    """Computation -> how often one step runs it (while-loop trip counts along its callers)."""
    calls: dict[str, list[tuple[str, int]]] = {}
    current = None
    for line in hlo_text.splitlines():
        if (m := _COMPUTATION.match(line)) and not line.startswith(" "):
            current = m.group(1)
            continue
        trips = int(t.group(1)) if (t := _TRIP.search(line)) else 1
        for kind, callee in re.findall(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)", line):
            calls.setdefault(callee, []).append((current, trips if kind in ("body", "condition") else 1))
    memo: dict[str, int] = {}

    def times(comp: str, depth: int = 0) -> int:
        if comp not in memo:
            callers = calls.get(comp, [])
            memo[comp] = 1 if not callers or depth > 50 else max(n * times(c, depth + 1) for c, n in callers if c)
        return memo[comp]

    return {comp: times(comp) for comp in calls}


def _groups(text: str) -> list[frozenset[int]] | None:
    """Replica groups of an HLO collective: explicit {{0,1},{2,3}}, iota [G,S]<=[dims]T(perm), a mesh
    (mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: groups along the listed axes), or permute pairs."""
    import numpy as np

    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", text):
        sizes = {name: int(n) for name, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        along = [list(sizes).index(name) for name in re.findall(r"'([^']+)'", m.group(2))]
        ids = np.moveaxis(np.arange(math.prod(sizes.values())).reshape(list(sizes.values())), along,
                          range(-len(along), 0))
        return [frozenset(map(int, row)) for row in ids.reshape(-1, math.prod(ids.shape[-len(along):]))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
        ids = np.arange(math.prod(int(d) for d in m.group(3).split(","))).reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return [frozenset(map(int, row)) for row in ids.reshape(int(m.group(1)), int(m.group(2)))]
    if m := re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", text):
        groups = [frozenset(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return _merge(groups) if "source_target_pairs" in m.group(0) else groups
    return None


def _merge(pairs: list[frozenset[int]]) -> list[frozenset[int]]:
    """Connected components of collective-permute's source/target pairs."""
    groups: list[set[int]] = []
    for pair in pairs:
        touching = [g for g in groups if g & pair]
        merged = set(pair).union(*touching)
        groups = [g for g in groups if not g & pair] + [merged]
    return [frozenset(g) for g in groups]


def _axis_of(groups: list[frozenset[int]] | None, mesh) -> str:
    """The mesh axes (joined by '+') whose device groups are `groups`; 'all' / 'other' otherwise."""
    import numpy as np

    names = [a for a, n in mesh.shape.items() if n > 1]
    if not groups or all(len(g) <= 1 for g in groups):
        return "none"
    ids = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    axes = list(mesh.shape)
    wanted = set(groups)
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(names, r):
            moved = np.moveaxis(ids, [axes.index(a) for a in subset], range(-len(subset), 0))
            found = {frozenset(map(int, row)) for row in moved.reshape(-1, math.prod(mesh.shape[a] for a in subset))}
            if found == wanted:
                return "+".join(subset)
    return "other"


def collectives(hlo_text: str, mesh) -> dict[str, int]:
    """Bytes per device that the step's collectives produce, per mesh axis (module docstring)."""
    times = _multipliers(hlo_text)
    out: dict[str, int] = {}
    current = None
    for line in hlo_text.splitlines():
        if (m := _COMPUTATION.match(line)) and not line.startswith(" "):
            current = m.group(1)
            continue
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        sizes = _array_bytes(m.group(1))
        axis = _axis_of(_groups(m.group(3)), mesh)
        if sizes and axis != "none":
            out[axis] = out.get(axis, 0) + max(sizes) * times.get(current, 1)
    return out


def roofline(target: Target, flops: float | None, bytes_accessed: float | None, comm_bytes: int,
             tokens: int) -> dict[str, Any]:
    """estimated_step_s = max(FLOPs / peak, bytes / HBM bandwidth, collective bytes / link bandwidth)."""
    if target.chip is None or not flops:
        return {"estimated_step_s": None, "estimated_tokens_per_s": None,
                "roofline": "no estimate: fake CPU devices have no peak figures" if target.chip is None
                else "no estimate: the compiler gave no FLOP count"}
    chip = target.chip
    parts = {"compute_s": flops / chip.peak_flops, "hbm_s": (bytes_accessed or 0.0) / chip.hbm_bandwidth,
             "collective_s": comm_bytes / chip.link_bandwidth}
    step = max(parts.values())
    return {"estimated_step_s": step, "estimated_tokens_per_s": tokens / step if step else None,
            "roofline": {**parts, "peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth,
                         "link_bandwidth": chip.link_bandwidth,
                         "assumptions": "estimate: the compiler's FLOPs and bytes at the chip's published dense bf16 "
                                        "peak and HBM bandwidth, collectives at one link's bandwidth, all three "
                                        "overlapped perfectly; no kernel, launch or host overhead"}}
