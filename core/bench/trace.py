"""Measured time of the training step per component, from a jax.profiler trace (`dsv4 bench --train --profile`).

How a step's time is attributed:

1. The compiled step's HLO text gives, for every instruction (fusions, custom calls, loops), its
   `stack_frame_id`, and the module's StackFrames / FileLocations / FileNames tables give that
   id's whole Python call stack (transposed and rematerialised instructions keep the stack of the
   forward equation they come from). The stack's file names map to a component with the same rule
   as the FLOP count (`components.component_of_files`: innermost non-helper project module;
   optax's frames are the optimizer). A fusion counts as a whole for its own metadata (its root's).
2. `jax.profiler` traces a few executions of the compiled step. On CPU every executed thunk is an
   event carrying its `hlo_op` and `hlo_module`; its exclusive time (its duration minus the
   events nested in it on the same thread, so a `while` loop counts only its own overhead) is
   added to its instruction's component.
3. The per-step sum over components ("op time") is compared with the traced wall time per step:
   the difference is time outside XLA ops (dispatch, host transfers) or, when XLA runs two thunks
   at once on different threads, negative.

Nothing here prints: results are plain dicts.
"""

from __future__ import annotations

import glob
import re
import tempfile
import time
from collections import defaultdict
from typing import Any, Sequence

from core.bench.components import COMPONENTS, component_of_files

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*?)stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
    """The FileNames / FunctionNames / FileLocations / StackFrames tables of an HLO module's text."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(stripped, {})
            continue
        match = _TABLE_ROW.match(stripped) if current is not None else None
        if match:
            current[int(match.group(1))] = match.group(2)
        elif current is not None and stripped:
            current = None
    return tables


def _stack_files(frame_id: int, tables: dict[str, dict[int, str]]) -> list[str]:
    """Source file names of stack frame `frame_id`'s call stack, innermost first."""
    files, frames, locations = tables.get("FileNames", {}), tables.get("StackFrames", {}), tables.get("FileLocations", {})
    out, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        fields = dict((k, int(v)) for k, v in _FIELD.findall(frames[frame_id]))
        location = dict((k, int(v)) for k, v in _FIELD.findall(locations.get(fields.get("file_location_id", -1), "")))
        out.append(files.get(location.get("file_name_id", -1), "").strip('"'))
        frame_id = fields.get("parent_frame_id", 0) - 1  # the text prints the parent's id + 1; 0 = no parent
    return out


def hlo_components(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (component, op_name), for every instruction of the HLO text with a stack frame."""
    tables = _tables(hlo_text)
    cache: dict[int, str] = {}
    out = {}
    for line in hlo_text.splitlines():
        match = _INSTR.match(line)
        if match:
            frame = int(match.group(3))
            if frame not in cache:
                cache[frame] = component_of_files(_stack_files(frame, tables))
            op_name = _OP_NAME.search(match.group(2))
            out[match.group(1)] = (cache[frame], op_name.group(1) if op_name else "")
    return out


def module_name(hlo_text: str) -> str:
    """`HloModule <name>, ...` -> name."""
    match = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
    return match.group(1) if match else ""


def op_exclusive_ns(profile, module: str) -> dict[str, float]:
    """hlo_op -> summed exclusive duration (ns) of the events of HLO module `module` in a ProfileData."""
    totals: dict[str, float] = defaultdict(float)
    for plane in profile.planes:
        for line in plane.lines:
            events = []
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("hlo_module") == module and "hlo_op" in stats:
                    events.append([event.start_ns, event.start_ns + event.duration_ns, str(stats["hlo_op"]),
                                   event.duration_ns])
            events.sort(key=lambda e: (e[0], -e[1]))
            stack: list[list] = []
            for event in events:
                while stack and stack[-1][1] <= event[0]:
                    stack.pop()
                if stack:  # nested in the event below it: not that event's own time
                    stack[-1][3] -= event[1] - event[0]
                stack.append(event)
            for _, _, op, exclusive in events:
                totals[op] += exclusive
    return dict(totals)


def trace_step(step_fn, state, batches: Sequence[Any], top: int = 12) -> tuple[Any, dict[str, Any]]:
    """Run the compiled `step_fn` once per batch under jax.profiler and attribute its time per component.

    Args:
      step_fn: a compiled (AOT) train step `(state, batch) -> (state, metrics)`; already warm.
      state: its (donated) state; batches: the batches to trace, one step each.
    Returns:
      (new state, {"components": {name: seconds per step}, "op_s": their sum, "traced_step_s": wall
       seconds per traced step, "unmatched_s": per-step time of ops without a stack frame (in "other"),
       "top_ops": the `top` costliest instructions [name, component, seconds per step, op_name],
       "steps": len(batches)}).
    """
    import jax
    from jax.profiler import ProfileData

    hlo = step_fn.as_text()
    owner, module = hlo_components(hlo), module_name(hlo)
    with tempfile.TemporaryDirectory(prefix="dsv4-trace-") as tmp:
        jax.profiler.start_trace(tmp)
        start = time.perf_counter()
        for batch in batches:
            state, metrics = step_fn(state, batch)
            jax.block_until_ready(metrics)
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        ns = op_exclusive_ns(ProfileData.from_file(paths[0]), module) if paths else {}
    steps = max(len(batches), 1)
    comps = {c: 0.0 for c in COMPONENTS}
    unmatched = 0.0
    rows = []
    for op, t in ns.items():
        component, op_name = owner.get(op, ("other", ""))
        comps[component] += t / 1e9 / steps
        unmatched += 0.0 if op in owner else t / 1e9 / steps
        rows.append([op, component, t / 1e9 / steps, op_name])
    rows.sort(key=lambda row: -row[2])
    return state, {"components": comps, "op_s": sum(comps.values()), "traced_step_s": wall / steps,
                   "unmatched_s": unmatched, "top_ops": rows[:top], "steps": len(batches)}
