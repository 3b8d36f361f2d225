"""Collectives that XLA:CPU may start out of program order, read from a compiled program's HLO text.

XLA:CPU's thunk executor orders a device's collectives by scheduling edges: a collective may start
once the one before it has started. A loop (`while`; a conditional or call alike) whose body holds
collectives counts as started once its body goes asynchronous, so a later collective that does not
read the loop's output (no data path from it) may run before the loop's remaining collectives, and
devices then reach collectives in different orders (docs/scaling.md#collective-order-on-the-cpu).
`at_risk_pairs` lists those (loop, collective) pairs in every scheduled computation (the entry and
every loop body, branch and called computation, each in its own schedule); a program with none is
safe from it. core/ops/placement.py makes the model's collectives read the loops they follow.
"""

from __future__ import annotations

import re

_COLLECTIVE = re.compile(r"= [^=]*?\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_CONTROL = re.compile(r"\b(while|conditional|call)\(")
_NAME = re.compile(r"(?:ROOT )?%?([\w.\-]+) = ")


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            cur = head.group(1)
            comps[cur] = []
        elif cur and line.startswith("  ") and " = " in line:
            comps[cur].append(line.strip())
    return comps


def _called(instruction: str) -> list[str]:
    names = re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", instruction)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", instruction):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def at_risk_pairs(text: str) -> tuple[int, int, list[tuple[str, str]]]:
    """Read an after-optimizations HLO text (`jax.stages.Compiled.as_text()` or an XLA dump; each
    computation's instructions in their schedule's order).

    Returns:
      (loops holding collectives, collectives outside loops, the at-risk (loop, collective) pairs:
      a collective scheduled after a loop of its computation that holds collectives, with no data
      path from the loop to it).
    """
    comps = _computations(text)
    memo: dict[str, bool] = {}

    def holds(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False
            memo[comp] = any(_COLLECTIVE.search(i) or any(c in comps and holds(c) for c in _called(i))
                             for i in comps.get(comp, []))
        return memo[comp]

    n_loops, n_coll, pairs = 0, 0, []
    for instructions in comps.values():
        ancestors: dict[str, set[str]] = {}
        loops: list[str] = []
        for ins in instructions:
            name = _NAME.match(ins).group(1)
            operands = set(re.findall(r"%([\w.\-]+)", ins.split(" = ", 1)[1].split("metadata=")[0]))
            ancestors[name] = set().union(*(ancestors[o] | {o} for o in operands if o in ancestors))
            if _COLLECTIVE.search(ins):
                n_coll += 1
                pairs += [(loop, name) for loop in loops if loop not in ancestors[name]]
            elif _CONTROL.search(ins) and any(holds(c) for c in _called(ins) if c in comps):
                loops.append(name)
        n_loops += len(loops)
    return n_loops, n_coll, pairs
