"""Collectives that XLA:CPU may start out of program order, read from a compiled step's HLO dump.

XLA:CPU orders a device's collectives by scheduling edges only: a loop (`while`, or a conditional
or call) whose body holds collectives counts as started once its body goes asynchronous, and the
next collective may then start before the loop's remaining ones. A top-level collective that
follows such a loop in the schedule and does not read its output (no data path from the loop) is
at risk: devices can reach it and the loop's collectives in different orders, which hangs gloo
across processes (docs/scaling.md#collective-order-on-the-cpu). This lists those (loop, collective)
pairs; a step with none is safe from it.

Usage (from the repository root), on a dump of the 8-device sparse step:

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dump_to=DUMP" JAX_PLATFORMS=cpu \\
      dsv4 sparse --steps 1 base_num_decoder_layers=4 ... ici_fsdp_parallelism=4 ici_tensor_parallelism=2
    python tools/collective_order.py DUMP/module_*.jit_step.cpu_after_optimizations.txt
"""

from __future__ import annotations

import re
import sys

_COLLECTIVE = re.compile(r"= [^=]*?\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_NAME = re.compile(r"(?:ROOT )?%?([\w.\-]+) = ")


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    cur, entry = None, ""
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif cur and line.startswith("  ") and " = " in line:
            comps[cur].append(line.strip())
    return comps, entry


def _called(instruction: str) -> list[str]:
    names = re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", instruction)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", instruction):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def at_risk_pairs(text: str) -> tuple[int, int, list[tuple[str, str]]]:
    """(loops holding collectives, top-level collectives, at-risk (loop, collective) pairs) of the
    ENTRY computation of an after-optimizations HLO text (its order is the schedule)."""
    comps, entry = _computations(text)
    memo: dict[str, bool] = {}

    def holds(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False
            memo[comp] = any(_COLLECTIVE.search(i) or any(c in comps and holds(c) for c in _called(i))
                             for i in comps.get(comp, []))
        return memo[comp]

    ancestors: dict[str, set[str]] = {}
    loops, pairs, n_coll = [], [], 0
    for ins in comps[entry]:
        name = _NAME.match(ins).group(1)
        operands = set(re.findall(r"%([\w.\-]+)", ins.split(" = ", 1)[1].split("metadata=")[0]))
        ancestors[name] = set().union(*(ancestors[o] | {o} for o in operands if o in ancestors))
        if _COLLECTIVE.search(ins):
            n_coll += 1
            pairs += [(loop, name) for loop in loops if loop not in ancestors[name]]
        elif re.search(r"\b(while|conditional|call)\(", ins) and any(holds(c) for c in _called(ins) if c in comps):
            loops.append(name)
    return len(loops), n_coll, pairs


def main(path: str) -> None:
    with open(path) as f:
        n_loops, n_coll, pairs = at_risk_pairs(f.read())
    print(f"loops holding collectives {n_loops}, top-level collectives {n_coll}, at-risk pairs {len(pairs)}, "
          f"collectives at risk {len({c for _, c in pairs})}")
    for loop, coll in pairs:
        print(f"  {loop} -> {coll}")


if __name__ == "__main__":
    main(sys.argv[1])
