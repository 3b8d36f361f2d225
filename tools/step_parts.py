"""Where a compiled step's estimated time goes, by instruction and by source op: the plan's step-time
model (core/plan/cost.py) taken apart.

    python tools/step_parts.py HLO.txt [--target v5p-128] [--top 40] [--by op|instruction]

HLO.txt is a compiled step's optimised HLO (`dsv4 plan`'s child, with `--xla_dump_to`, writes it as
`module_*.jit_step.*.after_optimizations.txt`). Each instruction outside fusions is priced as
`cost.estimate` prices it (FLOPs, bytes, rows, or a collective's ring bytes over its links), times
the executions per step of its computation (`hlo.runs`: a loop body as often as it runs), and
labelled by what decides it (compute, memory, gather, collective) and by its JAX op name, with the
layer scan's and the loops' nesting shortened (`W` a loop body, `T(...)` a transpose). Collectives
are summed whole here, not overlapped with what follows them, so the total is an upper bound of the
estimate's. Prints the totals by part and by phase (forward `jvp`, backward `T`, recomputed under
remat, other), then the largest groups. Developer tool: docs/planning.md#v4-flash.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.plan import cost, hlo  # noqa: E402
from core.plan import targets as tg  # noqa: E402

_STRUCTURE = ("while", "call", "conditional", "tuple", "get-tuple-element", "parameter", "bitcast", "constant")


def short(op_name: str) -> str:
    """A JAX op name with the step's prefix dropped and its loop nesting shortened."""
    name = op_name.removeprefix("jit(step)/")
    name = re.sub(r"/while/body/closed_call", "/W", name)
    return re.sub(r"transpose\(jvp\(([^)]*)\)\)", r"T(\1)", name)


def parts(text: str, ceilings: cost.Ceilings, eff: cost.Efficiency = cost.V5E):
    """(seconds per step, executions, part, kind, instruction, type, op name) per instruction."""
    module = hlo.parse(text)
    runs = hlo.runs(module)
    # the computations an async-start wraps: priced once, at their async-start
    wrapped_by_start = {cost._callee(i) for insts in module.computations.values() for i in insts
                        if i.opcode == "async-start"}
    out = []
    for comp, insts in module.computations.items():
        if comp in module.fused or comp in wrapped_by_start or not runs.get(comp, 0):
            continue
        for inst in insts:
            op, kind = inst.opcode, inst.opcode
            if op in _STRUCTURE or op.endswith("-done"):
                continue
            wrapped = [inst]
            if op == "async-start":
                wrapped = [i for i in module.computations.get(cost._callee(inst), []) if i.opcode in hlo._COLLECTIVES]
                kind = "async " + wrapped[0].opcode if wrapped else op
            if op.removesuffix("-start") in hlo._COLLECTIVES or (op == "async-start" and wrapped):
                seconds, part = sum(cost._collective_s(module, i, ceilings) for i in wrapped), "collective"
            elif op.endswith("-start") or (work := cost.instruction_work(module, inst)) is None:
                continue
            else:
                b = cost._op(work, ceilings, eff)
                if op == "fusion":
                    kind = "fusion " + re.search(r"kind=(\w+)", inst.attrs).group(1)
                    b.collective_s += sum(cost._collective_s(module, i, ceilings) for i in
                                          module.computations.get(cost._callee(inst), []) if i.opcode in hlo._COLLECTIVES)
                seconds = b.step_s
                part = max(("compute", "memory", "gather", "collective"), key=lambda p: getattr(b, f"{p}_s"))
            name = re.search(r'op_name="([^"]*)"', inst.attrs)
            out.append((seconds * runs[comp], runs[comp], part, kind, inst.name, inst.type_text,
                        short(name.group(1)) if name else ""))
    return out


def phase(op_name: str) -> str:
    return ("recomputed" if "rematted_computation" in op_name else "backward" if op_name.startswith("T(")
            else "forward" if op_name.startswith("jvp") else "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hlo", type=Path)
    parser.add_argument("--target", default="v5p-128")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--by", choices=("op", "instruction"), default="op")
    args = parser.parse_args()
    target = tg.parse_target(args.target)
    # a GPU target's devices by id, 8 to a host (the hybrid mesh's order when each axis's hosts are its
    # major part, as the model file's layouts are)
    hosts = tuple(i // tg.GPUS_PER_HOST for i in range(target.devices)) if target.platform == "cuda" else ()
    rows = parts(args.hlo.read_text(), tg.ceilings(target, hosts), tg.efficiency(target))
    total = collections.Counter()
    for seconds, _, part, _, _, _, name in rows:
        total[part] += seconds
        total[(phase(name), part)] += seconds
    print(f"{sum(r[0] for r in rows):.4f} s (collectives not overlapped): "
          + ", ".join(f"{p} {total[p]:.4f}" for p in ("compute", "memory", "gather", "collective")))
    for ph in ("forward", "backward", "recomputed", "other"):
        print(f"  {ph:10s} " + ", ".join(f"{p} {total[(ph, p)]:.4f}" for p in ("compute", "memory", "gather", "collective")))
    groups, count = collections.Counter(), collections.Counter()
    for seconds, n, part, kind, inst, type_text, name in rows:
        key = (part, kind, name) if args.by == "op" else (part, kind, f"{inst} {type_text[:70]} {name}")
        groups[key] += seconds
        count[key] += n
    for (part, kind, label), seconds in groups.most_common(args.top):
        print(f"{seconds:9.4f} s {count[(part, kind, label)]:7d}x  {part:10s} {kind:20s} {label[-120:]}")


if __name__ == "__main__":
    main()
