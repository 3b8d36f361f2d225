"""Measured time of the training step per component, from a jax.profiler trace (`dsv4 bench --train --profile`).

Which instruction belongs to which component is core/bench/hlo_owners.py's (from the compiled step's
HLO text). This module reads the trace, in one of two formats, told apart by its content:

- TPU (a plane "/device:TPU:<n>" with a line "XLA Ops"; the first such plane is read): "XLA Ops" has
  one event per executed instruction, named by the instruction's whole text
  (`%fusion.12 = bf16[...] fusion(...), kind=...`); "XLA Modules" one per run of a module (named
  `jit_step(<fingerprint>)`), "Steps" one per step. The ops counted are those that start inside a run
  of the step's module; the step time is the mean "Steps" event. "Async XLA Ops" (an async copy from
  its start to its done) is not read: the wait for a copy is its `copy-done` on "XLA Ops".
- CPU (no such plane): every executed thunk is an event carrying the stats `hlo_module` and `hlo_op`.

In both, an op's exclusive time is its duration minus that of the events nested in it on the same
line: a `while` loop's event encloses its body's, so the loop counts only its own overhead. The sum
over ops ("op time") is then compared with the step time: the difference is time outside XLA ops
(dispatch, host transfers) or, when two ops run at once, negative.

Nothing here prints: results are plain dicts.
"""

from __future__ import annotations

import glob
import re
import tempfile
import time
from collections import defaultdict
from typing import Any, Sequence

import jax
from jax.profiler import ProfileData

from core.bench import hlo_owners
from core.bench.components import COMPONENTS

_EVENT_OP = re.compile(r"^%?([\w.\-]+)")
HOWS = ("frame", "body", "producers", "users", "glue", "none")


def hlo_components(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (component, op_name), for every instruction of the HLO text with a stack frame
    of its own (rule 1 of core/bench/hlo_owners.py; the plan's temporaries). The profile attributes the
    instructions without one too (`profile_times`)."""
    module = hlo_owners.parse(hlo_text)
    owners = hlo_owners.Owners(module)
    return {name: (owners.frame_component(ins.frame), ins.op_name)
            for name, ins in module.instructions.items() if ins.frame is not None}


def _exclusive(events: list[list]) -> dict[str, float]:
    """op -> summed exclusive duration, for [start, end, op] events of one line (nested or disjoint)."""
    events = sorted(([s, e, op, e - s] for s, e, op in events), key=lambda ev: (ev[0], -ev[1]))
    stack: list[list] = []
    for event in events:
        while stack and stack[-1][1] <= event[0]:
            stack.pop()
        if stack:  # nested in the event below it: not that event's own time
            stack[-1][3] -= event[1] - event[0]
        stack.append(event)
    totals: dict[str, float] = defaultdict(float)
    for _, _, op, exclusive in events:
        totals[op] += exclusive
    return dict(totals)


def device_plane(profile):
    """The first TPU device plane with an "XLA Ops" line, or None (a CPU trace)."""
    planes = [p for p in profile.planes if p.name.startswith("/device:TPU:")
              and any(line.name == "XLA Ops" for line in p.lines)]
    return min(planes, key=lambda p: p.name, default=None)


def tpu_op_ns(plane, module: str) -> tuple[dict[str, float], int, list[float]]:
    """(op -> summed exclusive ns, runs of `module`, "Steps" durations in ns) of a TPU device plane."""
    lines = {line.name: line for line in plane.lines}
    runs = [(e.start_ns, e.start_ns + e.duration_ns) for e in getattr(lines.get("XLA Modules"), "events", [])
            if e.name.split("(")[0] == module]
    runs.sort()
    events = []
    for event in getattr(lines.get("XLA Ops"), "events", []):
        start = event.start_ns
        if any(a <= start < b for a, b in runs):
            events.append([start, start + event.duration_ns, _EVENT_OP.match(event.name).group(1)])
    steps = [e.duration_ns for e in getattr(lines.get("Steps"), "events", [])]
    return _exclusive(events), len(runs), steps


def cpu_op_ns(profile, module: str) -> dict[str, float]:
    """hlo_op -> summed exclusive ns of the events of HLO module `module` on every line of a CPU trace."""
    totals: dict[str, float] = defaultdict(float)
    for plane in profile.planes:
        for line in plane.lines:
            events = []
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("hlo_module") == module and "hlo_op" in stats:
                    events.append([event.start_ns, event.start_ns + event.duration_ns, str(stats["hlo_op"])])
            for op, ns in _exclusive(events).items():
                totals[op] += ns
    return dict(totals)


def profile_times(hlo_text: str, profile, steps: int = 1, top: int = 12) -> dict[str, Any]:
    """Attribute a trace of the compiled module `hlo_text` per component.

    Args:
      hlo_text: the compiled step's `as_text()`; profile: a `jax.profiler.ProfileData` of its runs.
      steps: how many steps a CPU trace holds (a TPU trace counts its module's runs itself).
    Returns:
      {"platform": "tpu" or "cpu", "steps", "components": {name: seconds per step}, "op_s": their sum,
       "step_s": the mean "Steps" event (TPU; None on a CPU), "named_share": the share of op time in
       components other than "other", "no_frame_s": op time of instructions without a stack frame of
       their own, "unattributed_s": that left without an owner after inference (in "other"), "by_how":
       {how: seconds per step} (hlo_owners.Owner.how), "other_sources": {project module or how:
       seconds per step} of the time in "other", "top_ops": the `top` costliest instructions
       [name, component, seconds per step, op_name, how]}.
    """
    module = hlo_owners.parse(hlo_text)
    owners = hlo_owners.Owners(module)
    plane = device_plane(profile)
    if plane is not None:
        ns, steps, step_ns = tpu_op_ns(plane, module.name)
        step_s = sum(step_ns) / len(step_ns) / 1e9 if step_ns else None
    else:
        ns, step_s = cpu_op_ns(profile, module.name), None
    per_step = 1e9 * max(steps, 1)
    comps = {c: 0.0 for c in COMPONENTS}
    by_how = {h: 0.0 for h in HOWS}
    other: dict[str, float] = defaultdict(float)
    rows = []
    for op, t in ns.items():
        owner = owners.owner(op)
        component, seconds = owner.component or "other", t / per_step
        comps[component] += seconds
        by_how[owner.how] += seconds
        if component == "other":  # framed: the module that owns the stack's innermost frame; else how
            other[(owner.source or "outside core") if owner.how == "frame" else f"({owner.how})"] += seconds
        rows.append([op, component, seconds, owner.op_name, owner.how])
    rows.sort(key=lambda row: -row[2])
    op_s = sum(comps.values())
    return {"platform": "cpu" if plane is None else "tpu", "steps": steps, "components": comps, "op_s": op_s,
            "step_s": step_s, "named_share": (op_s - comps["other"]) / op_s if op_s > 0 else 0.0,
            "no_frame_s": op_s - by_how["frame"], "unattributed_s": by_how["none"], "by_how": by_how,
            "other_sources": dict(sorted(other.items(), key=lambda kv: -kv[1])), "top_ops": rows[:top]}


def trace_step(step_fn, state, batches: Sequence[Any], top: int = 12) -> tuple[Any, dict[str, Any]]:
    """Run the compiled `step_fn` once per batch under jax.profiler and attribute its time per component.

    Args:
      step_fn: a compiled (AOT) train step `(state, batch) -> (state, metrics)`; already warm.
      state: its (donated) state; batches: the batches to trace, one step each.
    Returns:
      (new state, `profile_times`' dict plus "wall_step_s": host wall seconds per traced step and
       "traced_step_s": the trace's step time ("Steps" on a TPU), else the wall time per step).
    """
    with tempfile.TemporaryDirectory(prefix="dsv4-trace-") as tmp:
        jax.profiler.start_trace(tmp)
        start = time.perf_counter()
        for batch in batches:
            state, metrics = step_fn(state, batch)
            jax.block_until_ready(metrics)
        wall = (time.perf_counter() - start) / max(len(batches), 1)
        jax.profiler.stop_trace()
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        profile = ProfileData.from_file(paths[0]) if paths else ProfileData.from_serialized_xspace(b"")
        out = profile_times(step_fn.as_text(), profile, steps=len(batches), top=top)
    return state, {**out, "wall_step_s": wall, "traced_step_s": out["step_s"] or wall}
