"""The compiled train step's HLO text, read for the plan: FLOPs, bytes accessed, collectives (DESIGN.md, "Planning").

XLA's `cost_analysis()` counts a while loop's body once (HloCostAnalysis does not know how often
it runs), so for a step whose layers are a scan, and whose attention, indexer and loss scan over
chunks, it undercounts by about the trip counts; for compile-only GPUs it gives nothing at all.
This module reads the optimised HLO instead and weighs each instruction by how often one step
runs its computation (`runs`): the product of the while-loop trip counts along its call chain
(XLA's `known_trip_count`, else the bound of the loop condition's `i < N`), summed over call sites.

- `matmul_flops`: 2 * output elements * contracted size of every dot and convolution (fused or
  not; cuBLAS gemm custom calls too), times its runs: the tensor-core / MXU work that the peak
  bf16 FLOP/s applies to; a grouped-matmul kernel's (a Pallas / Mosaic custom call) from its
  shapes, and a convolution that XLA:TPU runs masked by group for the 1/G it runs. Elementwise
  arithmetic is not counted.
- `bytes_accessed`: per executed instruction outside fusions, the bytes of its operands and
  output (a fusion's parameter read only through slices counts the slices; an in-place
  dynamic-update-slice counts its update, an in-place scatter the rows it reads and writes, not
  its whole operand), times its runs; the model of HloCostAnalysis, except for in-place scatters,
  which it charges the whole operand (an accumulator scattered into once per loop step, such as
  a weight gradient gathered per chunk, would count its full size every step). Both branches of
  a conditional count at every run: a skipped branch (the tiled MoE's empty chunks) counts as
  executed, so the figure is an upper bound there.
- `collectives`: bytes each all-gather / all-reduce / reduce-scatter / all-to-all / ragged-all-to-all /
  collective-permute produces per device, per mesh axis (from its replica groups), times its runs (a
  ragged one's output buffer, an upper bound of the rows it receives).

Everything is per device (an SPMD program is one device's program). Shapes are read without
layouts or tiling.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
               "f4e2m1fn": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
# instructions that move no bytes of their own (structure, control, the second half of async pairs)
_NO_BYTES = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
             "opt-barrier", "after-all", "partition-id", "replica-id", "add-dependency", "domain"}
_SLICES = ("slice", "dynamic-slice", "gather")


@dataclasses.dataclass
class Instruction:
    name: str
    type_text: str   # the result type: an array, or a tuple of them
    opcode: str
    operands: list[str]
    args: str        # the text inside the parentheses (operand names, or a constant's literal)
    attrs: str       # the text after them


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    types: dict[str, str]                 # instruction name -> result type
    entry: str
    fused: set[str]                       # computations that a fusion calls (their bytes are the fusion's)


def parse(hlo_text: str) -> Module:
    """The computations and instructions of an HLO module's text."""
    computations: dict[str, list[Instruction]] = {}
    types: dict[str, str] = {}
    fused: set[str] = set()
    current, entry = None, ""
    for line in hlo_text.splitlines():
        if not line.startswith(" ") and (m := _COMPUTATION.match(line)):
            current = m.group(1)
            computations[current] = []
            entry = current if line.startswith("ENTRY") else entry
            continue
        if current is None or not (m := _INSTRUCTION.match(line)):
            continue
        args, attrs = _split_args(m.group(4))
        inst = Instruction(m.group(1), m.group(2), m.group(3), re.findall(r"%([\w.\-]+)", args), args, attrs)
        computations[current].append(inst)
        types[inst.name] = inst.type_text
        if inst.opcode == "fusion" and (callee := re.search(r"\bcalls=%?([\w.\-]+)", attrs)):
            fused.add(callee.group(1))
    return Module(computations, types, entry, fused)


def _split_args(text: str) -> tuple[str, str]:
    """(the text inside the parentheses, the attributes after them) of the text after `opcode(`."""
    depth = 1
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[:i], text[i + 1:]
    return text, ""


def array_bytes(type_text: str) -> int:
    """Bytes of an HLO type: an array, or the sum over a tuple's arrays."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dt] for dt, dims in _ARRAY.findall(type_text))


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


# ----------------------------------------------------------------------------- how often each computation runs


def _trip_count(module: Module, inst: Instruction) -> int:
    """A while loop's trip count: XLA's known_trip_count, else N of its condition's `i < N` (i from 0), else 1."""
    if m := _TRIP.search(inst.attrs):
        return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", inst.attrs)
    body = module.computations.get(cond.group(1), []) if cond else []
    constants = {i.name: i.args for i in body if i.opcode == "constant"}
    for i in body:
        if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2:
            if (bound := constants.get(i.operands[1], "").strip()).isdigit():
                return max(int(bound), 1)
    return 1


def runs(module: Module, loops: bool = True) -> dict[str, int]:
    """Computation -> how often one step runs it: the sum over its call sites of the caller's runs,
    times the trip count for a while loop's body and condition (1 for the entry and the uncalled).
    Every branch of a conditional (an index's `branch_computations`, a predicate's
    `true_computation` / `false_computation`) counts as often as the conditional runs.
    `loops=False` takes every trip count as 1: each loop body once, as XLA's cost analysis does."""
    calls: dict[str, list[tuple[str, int]]] = {}
    for comp, insts in module.computations.items():
        for inst in insts:
            trips = _trip_count(module, inst) if inst.opcode == "while" and loops else 1
            for kind, callee in _CALLEE.findall(inst.attrs):
                calls.setdefault(callee, []).append((comp, trips if kind in ("body", "condition") else 1))
            branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
            for callee in (re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else
                           re.findall(r"\b(?:true|false)_computation=%?([\w.\-]+)", inst.attrs)):
                calls.setdefault(callee, []).append((comp, 1))  # each branch at every run (an upper bound)
    memo: dict[str, int] = {}

    def times(comp: str, depth: int = 0) -> int:
        if comp not in memo:
            callers = calls.get(comp, [])
            memo[comp] = 1 if not callers or depth > 64 else sum(n * times(c, depth + 1) for c, n in callers)
        return memo[comp]

    return {comp: times(comp) for comp in module.computations}


# ----------------------------------------------------------------------------- FLOPs and bytes


def _contracted(module: Module, inst: Instruction) -> int:
    """The contracted size per output element of a dot, a convolution or a cuBLAS gemm (0 otherwise)."""
    lhs = _dims(module.types.get(inst.operands[0], "")) if inst.operands else []
    if inst.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
        return math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 0
    if inst.opcode == "convolution" and len(inst.operands) > 1:
        rhs = _dims(module.types.get(inst.operands[1], ""))
        labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs)
        out = _dims(inst.type_text)
        if not rhs or not labels or "i" not in labels.group(2) or (len(lhs), len(out)) != (len(labels[1]), len(labels[3])):
            return 0
        return rhs[labels.group(2).index("i")] * _mean_taps(inst.attrs, lhs, out, labels.groups())
    if inst.opcode == "custom-call" and "gemm" in inst.attrs and (
            m := re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)):
        return math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1))) if lhs else 0
    return 0


def _window(attrs: str, key: str, n: int) -> list[str]:
    """A convolution window's `key` field, one text per spatial dimension ("1" each when absent)."""
    m = re.search(rf"\b{key}=([\dx_\-]+)", attrs)
    return m.group(1).split("x") if m else ["1"] * n


def _mean_taps(attrs: str, lhs: list[int], out: list[int], labels: tuple[str, str, str]) -> float:
    """The window taps per output element of a convolution that meet real input, averaged over its
    outputs: taps on padding or on the holes of a dilated input multiply nothing. XLA:TPU writes a
    batched matmul as a window of size d over an input dilated by d (one tap each), and an outer
    product as a size-n window over one element padded by n - 1 (one tap each, not n)."""
    lhs_labels, _, out_labels = labels
    spatial = sorted(c for c in lhs_labels if c.isdigit())
    n = len(spatial)
    sizes, strides, lhs_dilate, rhs_dilate = ([int(v) for v in _window(attrs, k, n)]
                                              for k in ("size", "stride", "lhs_dilate", "rhs_dilate"))
    pad_lo = [int(p.split("_")[0]) if "_" in p else 0 for p in _window(attrs, "pad", n)]
    mean = 1.0
    for d, c in enumerate(spatial):
        n_in, n_out = lhs[lhs_labels.index(c)], out[out_labels.index(c)]
        pairs = sum(outputs_meeting(n_in, n_out, strides[d], w * rhs_dilate[d] - pad_lo[d], lhs_dilate[d])
                    for w in range(sizes[d]))
        mean *= pairs / max(n_out, 1)
    return mean


def outputs_meeting(n_in: int, n_out: int, stride: int, offset: int, dilate: int) -> int:
    """How many outputs o in [0, n_out) read a real input through one tap: o * stride + offset lands
    on [0, (n_in - 1) * dilate] at a multiple of `dilate` (the input's elements, not its holes)."""
    lo = max(0, -(offset // stride))                              # first o with o * stride + offset >= 0
    hi = min(n_out - 1, ((n_in - 1) * dilate - offset) // stride)  # last o on the input's last element
    g = math.gcd(stride, dilate)
    if hi < lo or offset % g:
        return 0
    period = dilate // g  # o * stride = -offset (mod dilate): one residue class of o mod period
    first = (-offset) // g * pow(stride // g, -1, period) % period
    start = lo + (first - lo) % period
    return 0 if start > hi else (hi - start) // period + 1


def matmul_flops(module: Module, times: dict[str, int] | None = None) -> float:
    """2 * output elements * contracted size of every dot / convolution / gemm, and a grouped-matmul
    kernel's from its shapes, times its runs (`times`: `runs(module)` by default; `runs(module,
    loops=False)` counts each loop body once, as XLA does). A convolution that XLA:TPU runs masked
    by group counts the 1/G it runs (`masked_groups`)."""
    times = runs(module) if times is None else times
    groups = {m.group(1): masked_groups(module, inst) for insts in module.computations.values() for inst in insts
              if inst.opcode == "fusion" and (m := re.search(r"\bcalls=%?([\w.\-]+)", inst.attrs))}
    return sum(matmul_flops_of(module, inst) * times.get(comp, 1) / groups.get(comp, 1)
               for comp, insts in module.computations.items() for inst in insts)


def matmul_flops_of(module: Module, inst: Instruction) -> float:
    """2 * output elements * contracted size of one dot, convolution or gemm; a Pallas/Mosaic
    kernel's (`tpu_custom_call`) by the FLOPs its `cost_estimate` declares (`pl.CostEstimate`, as
    core/ops/fused_attention.py's kernels and XLA's ragged_dot declare them), else by
    `grouped_matmul_flops`; 0 for other instructions."""
    if inst.opcode in ("dot", "convolution", "custom-call") and (k := _contracted(module, inst)):
        return 2.0 * math.prod(_dims(inst.type_text)) * k
    if inst.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in inst.attrs:
        declared = declared_flops(inst)
        return declared if declared is not None else grouped_matmul_flops(module, inst)
    return 0.0


def declared_flops(inst: Instruction) -> float | None:
    """The FLOPs a kernel's custom call declares (its `cost_estimate`); None where it declares none or 0."""
    declared = re.search(r'"cost_estimate":\{[^{}]*"flops":"(\d+)"', inst.attrs)
    return float(declared.group(1)) if declared and int(declared.group(1)) else None


def grouped_matmul_flops(module: Module, inst: Instruction) -> float:
    """A grouped-matmul kernel's FLOPs from its shapes (the HLO does not show a kernel's body):
    out [S, N] from lhs [S, K] and rhs [G, K, N] or [G, N, K] (ragged_dot, megablox gmm), or out
    [G, K, N] from [S, K] or [K, S] and [S, N] (the weights' gradient, tgmm): 2 * S * K * N.
    0 for a kernel of another shape (splash attention, ...): its FLOPs stay unknown."""
    shape = grouped_matmul_shape(module, inst)
    return 2.0 * math.prod(shape) if shape else 0.0


def grouped_matmul_shape(module: Module, inst: Instruction) -> tuple[int, int, int] | None:
    """(S rows, K, N) of a grouped-matmul kernel's shapes (`grouped_matmul_flops`), None for another."""
    out = _dims(inst.type_text)
    shapes = [_dims(module.types.get(o, "")) for o in inst.operands]
    two, three = [d for d in shapes if len(d) == 2], [d for d in shapes if len(d) == 3]
    if len(out) == 2:
        rows, n = out
        for lhs in (d for d in two if d[0] == rows):
            if any(rhs[1:] in ([lhs[1], n], [n, lhs[1]]) for rhs in three):
                return rows, lhs[1], n
    if len(out) == 3:
        k, n = out[1:]
        for lhs in (d for d in two if k in d):
            rows = lhs[1] if lhs[0] == k else lhs[0]
            if [rows, n] in two:
                return rows, k, n
    return None


def masked_groups(module: Module, fusion: Instruction) -> int:
    """G when XLA:TPU runs a convolution fusion masked by group, else 1: a ragged dot's transpose is
    a convolution over every group with a pred[G, rows] mask (each row in one group), and its
    iteration skipper (`mask_aggregator_config` with mask dimensions) runs only each row's group."""
    if '"mask_dim_to_iteration_index":["' not in fusion.attrs:
        return 1
    masks = [_dims(t) for t in (module.types.get(o, "") for o in fusion.operands) if t.startswith("pred[")]
    return max([m[0] for m in masks if len(m) == 2] or [1])


def _update_of(module: Module, inst: Instruction) -> int:
    """Bytes an in-place update writes: a dynamic-update-slice's update (operand 1), a scatter's
    updates (operand 2 of operand, indices, updates); 0 when that operand is missing."""
    index = 1 if inst.opcode == "dynamic-update-slice" else 2
    return array_bytes(module.types.get(inst.operands[index], "")) if len(inst.operands) > index else 0


def _fusion_bytes(module: Module, inst: Instruction) -> int:
    """Bytes a fusion reads and writes: each parameter in full, or only the slices taken of it;
    an in-place dynamic-update-slice root writes (and its buffer operand costs) only the update,
    an in-place scatter root reads and writes only the rows of its updates."""
    callee = re.search(r"\bcalls=%?([\w.\-]+)", inst.attrs)
    body = module.computations.get(callee.group(1), []) if callee else []
    params = {i.name: int(re.match(r"\s*(\d+)", i.args).group(1)) for i in body
              if i.opcode == "parameter" and re.match(r"\s*\d+", i.args)}
    users: dict[str, list[Instruction]] = {}
    for i in body:
        for pos, name in enumerate(i.operands):
            users.setdefault(name, []).append((pos, i))
    root = body[-1] if body else None
    in_place = root is not None and (root.opcode == "dynamic-update-slice" or
                                     (root.opcode == "scatter" and len(root.operands) == 3))
    total = (_update_of(module, root) * (2 if root.opcode == "scatter" else 1) if in_place
             else array_bytes(inst.type_text))
    for name, index in params.items():
        if index >= len(inst.operands):
            continue
        full = array_bytes(module.types.get(inst.operands[index], ""))
        uses = users.get(name, [])
        if uses and all(pos == 0 and u.opcode in _SLICES for pos, u in uses):
            total += min(full, sum(array_bytes(u.type_text) for _, u in uses))
        elif in_place and uses and all(pos == 0 and u is root for pos, u in uses):
            continue  # the buffer updated in place
        else:
            total += full
    return total


def instruction_bytes(module: Module, inst: Instruction) -> int:
    """Bytes one execution of `inst` (outside fusions) reads and writes."""
    if inst.opcode in _NO_BYTES or inst.opcode.endswith("-done"):
        return 0
    if inst.opcode == "fusion":
        return _fusion_bytes(module, inst)
    if inst.opcode in _SLICES:
        return 2 * array_bytes(inst.type_text)
    if inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1:
        return 2 * _update_of(module, inst)
    if inst.opcode == "scatter" and len(inst.operands) == 3:  # indices and updates read; the rows read, then written
        return sum(array_bytes(module.types.get(o, "")) for o in inst.operands[1:]) + 2 * _update_of(module, inst)
    return array_bytes(inst.type_text) + sum(array_bytes(module.types.get(o, "")) for o in inst.operands)


def bytes_accessed(module: Module, times: dict[str, int] | None = None) -> float:
    """Bytes the step's executed instructions (outside fusions and reducers) read and write, times their runs."""
    times = runs(module) if times is None else times
    reducers = {c for insts in module.computations.values() for i in insts
                for c in re.findall(r"\bto_apply=%?([\w.\-]+)", i.attrs)}
    return float(sum(instruction_bytes(module, inst) * times.get(comp, 1)
                     for comp, insts in module.computations.items() if comp not in module.fused and comp not in reducers
                     for inst in insts))


# ----------------------------------------------------------------------------- collectives per mesh axis


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
    """The mesh axes (joined by '+') whose device groups are `groups`; 'none' or 'other' otherwise."""
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


def collectives(module: Module, mesh, times: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes per device that the step's collectives produce (their largest array), per mesh axis, times their runs."""
    times = runs(module) if times is None else times
    out: dict[str, int] = {}
    for comp, insts in module.computations.items():
        for inst in insts:
            kind = inst.opcode.removesuffix("-start")
            if kind not in _COLLECTIVES:
                continue
            sizes = [array_bytes(f"{dt}[{dims}]") for dt, dims in _ARRAY.findall(inst.type_text)]
            axis = _axis_of(_groups(inst.attrs), mesh)
            if sizes and axis != "none":
                out[axis] = out.get(axis, 0) + max(sizes) * times.get(comp, 1)
    return out


def summary(hlo_text: str, mesh) -> dict[str, Any]:
    """{"matmul_flops", "matmul_flops_loops_once", "bytes_accessed", "collective_bytes"} of a compiled step."""
    module = parse(hlo_text)
    times = runs(module)
    return {"matmul_flops": matmul_flops(module, times),
            "matmul_flops_loops_once": matmul_flops(module, runs(module, loops=False)),
            "bytes_accessed": bytes_accessed(module, times), "collective_bytes": collectives(module, mesh, times)}
