"""The step-time model of a compiled program, per executed instruction (DESIGN.md "Planning";
the model and its calibration on a TPU v5e chip: docs/step-time-model.md).

One step is the sum, over the instructions it executes (in the compiler's schedule order, each
while loop's body as often as it runs), of each instruction's time

    t = max(F / (peak x mxu), (H + vmem x V) / (HBM bandwidth x hbm), R x row_s) + op_s

- F: its matmul FLOPs: dots and convolutions, fused or not (`hlo.matmul_flops`' rules), at `mxu`
  of the peak; a Pallas / Mosaic kernel's (`tpu_custom_call`, whose body the HLO does not show:
  as it declares them, else a grouped matmul's from its operand and result shapes, three bf16
  passes of the MXU when an operand is float32) at `mxu_kernel`; XLA:TPU's masked convolution of
  a ragged dot's transpose runs 1/G of its G groups (its iteration skipper skips the rows of the
  other groups);
- H: the bytes it reads and writes in HBM, each array padded to its layout's tiles (`T(8,128)`
  pads a minor dimension of 24 to 128); a fusion's operand read only through slices or gathers
  counts what they take, an in-place dynamic-update-slice or scatter its update (also as one
  output of a multi-output fusion);
- V: the bytes it reads and writes in on-chip memory (memory space `S(1)`, a TPU's VMEM);
- R: the rows it gathers or scatters, one per index: a TPU moves them one at a time;
- op_s: a fixed cost per executed array instruction.

Asynchronous copies (copy-start / slice-start ... -done: XLA:TPU's prefetches into VMEM and its
evictions) queue on one DMA engine, first in first out, at the HBM rate; they advance during the HBM
time that the instructions between start and done leave idle, and a -done waits for what remains
of its copy and of those queued before it.

A collective moves a ring's bytes per device over the links its group spans: all-gather and
reduce-scatter (n - 1) / n of the unsharded array, all-reduce twice that, a permute its array to one
peer over one link. A group of n devices spans the fewest torus axes whose sizes multiply to n, each
axis 2 links per device on a ring (wrapped around), 1 on a line (`Ceilings.links`); through a switch
(NVLink) a device has one port. A group that spans GPU hosts moves its bytes at the network's rate
per device (its own NIC) instead; an all-to-all there the parts bound for other hosts alone (those
within the host cross NVLink beside them). Asynchronous collectives (-start ... -done, or a synchronous one
that XLA:TPU runs as an asynchronous collective fusion, `async_collective_name`) are in flight
together, each at its own links' rate (no contention between them), beside the instructions that
follow; the first instruction that reads the value waits for the rest (a fused one overlaps that
first user too). Synchronous ones, alone or fused (XLA:TPU's reduce-scatter is a fusion around an
all-reduce), take their time in line. A conditional costs all its branches (as `hlo.runs` counts
them). Everything is per device.

The efficiencies (`V5E`) were fitted on a v5e chip's profiles; v5p and GPU targets use the same
model and constants with their own published peaks and bandwidths (a GPU's gathered row at
one DRAM sector's bytes: `gpu_efficiency`); on v5p the model was checked
against MaxText's published runs (tools/maxtext_step_check.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Mapping

from core.plan import hlo

_LAID_OUT = re.compile(r"\b(" + "|".join(sorted(hlo.DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\](?:\{([^}]*)\})?")
_TILE = re.compile(r"^([\d,]*):T\(([\d,]+)\)")
_SPACE = re.compile(r"S\((\d+)\)")
VMEM = 1  # XLA:TPU's memory space of on-chip vector memory; 0 is HBM, others hold scalars and flags
_FREE_CALLS = ("AllocateBuffer", "ConcatBitcast", "AssumeGatherIndicesInBound")  # no data moved
_ROWS = ("gather", "scatter")
_ALL_TO_ALL = ("all-to-all", "ragged-all-to-all")
# the frontend attribute of a collective that XLA:TPU runs as an asynchronous collective fusion
# (--xla_tpu_enable_async_collective_fusion): written synchronous, it overlaps what runs up to its first user
_ASYNC_FUSED = "async_collective_name="


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The fitted constants of the model (module docstring), each a physical rate or cost."""

    mxu: float     # fraction of the peak FLOP/s an XLA matmul (dot or convolution, fused or not) reaches
    mxu_kernel: float  # ... a Pallas / Mosaic kernel's matmul reaches
    hbm: float     # fraction of the HBM bandwidth a streaming instruction reaches
    vmem: float    # cost of an on-chip byte, as a fraction of an HBM byte's
    row_s: float   # seconds per gathered or scattered row
    op_s: float    # seconds per executed array instruction


# fitted on a TPU v5e chip's profiles (docs/step-time-model.md)
V5E = Efficiency(mxu=0.93, mxu_kernel=0.72, hbm=0.84, vmem=0.07, row_s=8e-9, op_s=0.6e-6)
SECTOR_BYTES = 32  # a GPU's unit of DRAM access: a gathered row reads at least one sector


def gpu_efficiency(hbm_bandwidth: float) -> Efficiency:
    """A GPU's constants: V5E's (uncalibrated there), but a row no dearer than one DRAM sector at the
    HBM rate: a GPU's threads gather rows in parallel, where a TPU moves them one at a time
    (docs/step-time-model.md#published-ceilings)."""
    return dataclasses.replace(V5E, row_s=SECTOR_BYTES / (hbm_bandwidth * V5E.hbm))


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """A device's published ceilings (core.plan.targets.Chip's)."""

    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float  # bytes/s one way: per link on a torus, per device through a switch
    torus: tuple[tuple[int, int], ...] = ()  # (devices, links per device) along each axis; () a switch
    network_bandwidth: float = 0.0  # bytes/s one way per device across hosts (its NIC); 0: not priced apart
    hosts: tuple[int, ...] = ()  # the host of each device of the program, by its id in the replica groups

    def crosses_hosts(self, groups: list[frozenset[int]] | None) -> bool:
        """Whether a collective's groups span devices of more than one host (priced at the network's rate)."""
        if not self.network_bandwidth or not self.hosts or not groups:
            return False
        return any(len({self.hosts[i] for i in g if i < len(self.hosts)}) > 1 for g in groups)

    def same_host(self, groups: list[frozenset[int]]) -> int:
        """The most members of one group that share a host."""
        counts = [sum(self.hosts[i] == self.hosts[j] for j in g if j < len(self.hosts)) for g in groups for i in g
                  if i < len(self.hosts)]
        return max(counts, default=1)

    def links(self, devices: int) -> int:
        """The links per device of a group of `devices`: those of the torus axes it spans (the
        largest first: a mesh axis fills whole physical axes), 1 through a switch."""
        spanned, links = 1, 0
        for size, count in sorted(self.torus, reverse=True):
            if spanned >= devices:
                break
            spanned, links = spanned * size, links + count
        return max(links, 1)


@dataclasses.dataclass
class Work:
    """What one execution of an instruction does (module docstring's F, H, V, R)."""

    flops: float = 0.0
    hbm_bytes: int = 0
    vmem_bytes: int = 0
    rows: int = 0
    kernel: bool = False  # its matmuls run in a Pallas / Mosaic kernel


# ----------------------------------------------------------------------------- arrays as laid out


def laid_out(type_text: str) -> list[tuple[int, int]]:
    """(bytes padded to the layout's first tile, memory space) of each array of an HLO type."""
    out = []
    for dtype, dims_text, layout in _LAID_OUT.findall(type_text):
        dims = [int(d) for d in dims_text.split(",") if d]
        space = int(m.group(1)) if layout and (m := _SPACE.search(layout)) else 0
        if layout and dims and (m := _TILE.match(layout)):
            minor_to_major = [int(d) for d in m.group(1).split(",") if d]
            for axis, tile in zip(minor_to_major, reversed([int(t) for t in m.group(2).split(",")])):
                dims[axis] = -(-dims[axis] // tile) * tile
        out.append((math.prod(dims) * hlo.DTYPE_BYTES[dtype], space))
    return out


def _add(work: Work, type_text: str, times: int = 1) -> None:
    for size, space in laid_out(type_text):
        if space == VMEM:
            work.vmem_bytes += size * times
        elif space == 0:
            work.hbm_bytes += size * times


def _rows(module: hlo.Module, inst: hlo.Instruction) -> int:
    """Indices of a gather or scatter: its indices' elements over the index vector's length."""
    index = hlo._dims(module.types.get(inst.operands[1], "")) if len(inst.operands) > 1 else []
    m = re.search(r"index_vector_dim=(\d+)", inst.attrs)
    vector = index[int(m.group(1))] if m and int(m.group(1)) < len(index) else 1
    return math.prod(index) // max(vector, 1)


def _callee(inst: hlo.Instruction) -> str:
    m = re.search(r"\bcalls=%?([\w.\-]+)", inst.attrs)
    return m.group(1) if m else ""


# ----------------------------------------------------------------------------- one instruction's work


def _fused_work(module: hlo.Module, comp: str) -> Work:
    """Matmul FLOPs and gathered/scattered rows of a fused computation, nested fusions included."""
    work = Work()
    for inst in module.computations.get(comp, []):
        work.flops += hlo.matmul_flops_of(module, inst)
        if inst.opcode in _ROWS:
            work.rows += _rows(module, inst)
        elif inst.opcode == "fusion":
            inner = _fused_work(module, _callee(inst))
            work.flops, work.rows = work.flops + inner.flops, work.rows + inner.rows
    return work


def _in_place(module: hlo.Module, root: hlo.Instruction | None) -> tuple[str, int] | None:
    """(the update's type, 2 if its rows are read and written else 1) when `root` updates its
    operand 0 in place: a dynamic-update-slice (unless across part of the buffer's minor tiles), a
    scatter, or a fusion whose root so updates its parameter 0; None otherwise."""
    if root is None or not root.operands:
        return None
    if root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
        update = module.types.get(root.operands[1], "")
        return None if _lane_partial(update, root.type_text) else (update, 1)
    if root.opcode == "scatter" and len(root.operands) == 3:
        return module.types.get(root.operands[2], ""), 2
    body = module.computations.get(_callee(root), []) if root.opcode == "fusion" else []
    inner = _in_place(module, body[-1]) if body else None
    buffer = next((i for i in body if i.name == body[-1].operands[0]), None) if inner else None
    return inner if buffer is not None and buffer.opcode == "parameter" and buffer.args.strip() == "0" else None


def _lane_partial(update_text: str, buffer_text: str) -> bool:
    """Whether an update covers part of its buffer's minor tiles: narrower than the buffer along the
    layout's minor dimension by a width its tile does not divide (RoPE's 64 features written over the
    last of 512). XLA:TPU then rewrites the whole buffer, as measured on a v5e
    (docs/tpu.md#where-the-sparse-steps-time-goes)."""
    update, buffer = _LAID_OUT.findall(update_text), _LAID_OUT.findall(buffer_text)
    if len(update) != 1 or len(buffer) != 1 or not (m := _TILE.match(buffer[0][2] or "")):
        return False
    minor, lane = int(m.group(1).split(",")[0] or -1), int(m.group(2).split(",")[-1])
    dims_u, dims_b = ([int(d) for d in t[1].split(",") if d] for t in (update[0], buffer[0]))
    if not 0 <= minor < len(dims_b) or len(dims_u) != len(dims_b):
        return False
    return dims_u[minor] < dims_b[minor] and dims_u[minor] % lane != 0


def _users(body: list[hlo.Instruction]) -> dict[str, list[tuple[int, hlo.Instruction]]]:
    """Each value of a computation -> (operand position, instruction) of its uses."""
    users: dict[str, list[tuple[int, hlo.Instruction]]] = {}
    for i in body:
        for pos, name in enumerate(i.operands):
            users.setdefault(name, []).append((pos, i))
    return users


def _taken(module: hlo.Module, uses: list[tuple[int, hlo.Instruction]]) -> list[str] | None:
    """The types of what a fused computation reads of a value with these `uses` ((operand position,
    instruction)) when it reads it only through slices or gathers (as their operand 0), also inside
    nested fusions; None where anything reads it whole."""
    taken = []
    for pos, use in uses:
        if pos == 0 and use.opcode in ("slice", "dynamic-slice", "gather"):
            taken.append(use.type_text)
            continue
        body = module.computations.get(_callee(use), []) if use.opcode == "fusion" else []
        inner = next((i for i in body if i.opcode == "parameter" and i.args.strip() == str(pos)), None)
        inner_taken = _taken(module, _users(body).get(inner.name, [])) if inner is not None else None
        if inner_taken is None:
            return None
        taken += inner_taken
    return taken


def _fusion(module: hlo.Module, inst: hlo.Instruction) -> Work:
    """A fusion's work: the bytes of its parameters (sliced ones by what the slices take, nested
    fusions' slices included) and outputs (each element of a root tuple; one updated in place by
    its update, its buffer parameter not read)."""
    body = module.computations.get(_callee(inst), [])
    work = _fused_work(module, _callee(inst))
    work.flops /= hlo.masked_groups(module, inst)
    users = _users(body)
    updated = []  # the outputs written in place
    outputs = _outputs(body)
    arrays = [m.group(0) for m in _LAID_OUT.finditer(inst.type_text)]  # as the fusion lays them out
    if len(arrays) != len(outputs):
        arrays = [out.type_text for out in outputs] if outputs else [inst.type_text]
    for out, text in itertools.zip_longest(outputs, arrays):
        in_place = _in_place(module, out) if out is not None else None
        if in_place:  # the update, written where the buffer lives (a scatter's rows read and written)
            space = (laid_out(text) or [(0, 0)])[0][1]
            _add(work, _in_space(in_place[0], space), in_place[1])
            updated.append(out)
        else:
            _add(work, text)
    for param in body:
        if param.opcode != "parameter":
            continue
        uses = users.get(param.name, [])
        # a buffer updated in place costs its update (above), not a read
        uses = [(pos, u) for pos, u in uses if not (pos == 0 and any(u is o for o in updated))]
        taken = _taken(module, uses)
        if taken is None:
            _add(work, param.type_text)
        else:
            space = (laid_out(param.type_text) or [(0, 0)])[0][1]
            for text in taken:
                _add(work, _in_space(text, space))
    return work


def _outputs(body: list[hlo.Instruction]) -> list[hlo.Instruction]:
    """The instructions whose values a fused computation returns: its root, or each element of a
    root tuple (a multi-output fusion, such as a scan step's update of its stacked output beside
    the value it passes on)."""
    if not body:
        return []
    root = body[-1]
    if root.opcode != "tuple":
        return [root]
    named = {i.name: i for i in body}
    return [named[n] for n in root.operands if n in named]


def _in_space(type_text: str, space: int) -> str:
    """`type_text` with its arrays in memory space `space` (an update lands where its buffer lives)."""
    text = re.sub(r"S\(\d+\)", "", type_text)
    return text if space == 0 else re.sub(r"\{([^}]*)\}", lambda m: "{" + m.group(1) + f"S({space})" + "}", text)


def _custom_call(module: hlo.Module, inst: hlo.Instruction, ragged: Mapping[int, float]) -> Work | None:
    target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
    target = target.group(1) if target else ""
    if target in _FREE_CALLS:
        return None
    work = Work(hlo.matmul_flops_of(module, inst), kernel=target == "tpu_custom_call")
    shaped = hlo.declared_flops(inst) is None  # FLOPs from a grouped matmul's shapes, not declared
    if shaped and target == "tpu_custom_call" and any(module.types.get(o, "").startswith("f32[") for o in inst.operands):
        work.flops *= 3  # a kernel's float32 matmul: three bf16 passes of the MXU
    if ragged and target == "tpu_custom_call" and (shape := hlo.grouped_matmul_shape(module, inst)):
        work.flops *= ragged.get(shape[0], shape[0]) / shape[0]  # the rows its group sizes cover
    for text in [inst.type_text] + [module.types.get(o, "") for o in inst.operands]:
        _add(work, text)
    return work


def instruction_work(module: hlo.Module, inst: hlo.Instruction, ragged: Mapping[int, float] = {}) -> Work | None:  # noqa: B006
    """What one execution of a synchronous instruction outside fusions does; None for those that
    move no data and cost no op (structure, scalars, buffer markers). `ragged`: `estimate`'s."""
    op = inst.opcode
    if op in hlo._NO_BYTES:
        return None
    if op == "fusion":
        return _fusion(module, inst)
    if op == "custom-call":
        return _custom_call(module, inst, ragged)
    if not any(d for _, d, _ in _LAID_OUT.findall(inst.type_text)):
        return None  # a scalar: the scalar unit's, hidden behind the vector work
    work = Work(hlo.matmul_flops_of(module, inst))
    if op in ("slice", "dynamic-slice"):
        _add(work, inst.type_text, 2)
    elif op == "dynamic-update-slice" and len(inst.operands) > 1:
        in_place = _in_place(module, inst)  # the update read and written, else the whole buffer
        _add(work, in_place[0] if in_place else inst.type_text, 2)
    elif op == "scatter" and len(inst.operands) == 3:
        work.rows = _rows(module, inst)
        _add(work, module.types.get(inst.operands[1], ""))
        _add(work, module.types.get(inst.operands[2], ""), 2)
    else:
        if op == "gather":
            work.rows = _rows(module, inst)
        for text in [inst.type_text] + [module.types.get(o, "") for o in inst.operands]:
            _add(work, text)
    return work


# ----------------------------------------------------------------------------- the schedule, walked


@dataclasses.dataclass
class Breakdown:
    """Seconds of one step (or of one computation's run), by what decides them."""

    compute_s: float = 0.0     # instructions whose matmul term is the largest
    memory_s: float = 0.0      # ... whose bytes term is (HBM and on-chip)
    gather_s: float = 0.0      # ... whose rows term is
    overhead_s: float = 0.0    # op_s per executed instruction
    dma_wait_s: float = 0.0    # -done waits for asynchronous copies
    collective_s: float = 0.0  # synchronous collectives and the waits for asynchronous ones
    hbm_busy_s: float = 0.0    # of all the above, the time the HBM is busy (no room for queued copies)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.memory_s + self.gather_s + self.overhead_s + self.dma_wait_s + self.collective_s

    def add(self, other: Breakdown, times: float = 1.0) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + times * getattr(other, field.name))


def _collective_s(module: hlo.Module, inst: hlo.Instruction, ceilings: Ceilings) -> float:
    """A collective's seconds on the links (module docstring): a ring's bytes per device over the
    links its group spans; 0 when every group is one device."""
    groups = hlo._groups(inst.attrs)
    if groups is not None and all(len(g) <= 1 for g in groups):
        return 0.0
    kind = inst.opcode.removesuffix("-start")
    arrays = [inst.type_text] + [module.types.get(o, "") for o in inst.operands]
    full = max((size for text in arrays for size, _ in laid_out(text)), default=0)  # the unsharded side
    across = ceilings.crosses_hosts(groups)
    if kind == "collective-permute":  # to one peer, over one link
        return full / (ceilings.network_bandwidth if across else ceilings.link_bandwidth)
    n = max(len(g) for g in groups) if groups else 0
    if across and kind in _ALL_TO_ALL:  # only the parts bound for other hosts cross the network
        return full * (n - ceilings.same_host(groups)) / n / ceilings.network_bandwidth
    moved = full * (n - 1) / n if n else full  # each device receives all but its own part
    rate = ceilings.network_bandwidth if across else ceilings.links(n) * ceilings.link_bandwidth
    return moved * (2 if kind == "all-reduce" else 1) / rate


def _drain(queue: list[list], seconds: float) -> None:
    """Advance a first-in-first-out transfer queue ([name, seconds left]) by `seconds`."""
    while queue and seconds > 0:
        step = min(seconds, queue[0][1])
        queue[0][1] -= step
        seconds -= step
        if queue[0][1] <= 0:
            queue.pop(0)


def _advance(flight: dict[str, float], seconds: float) -> None:
    """Advance transfers in flight concurrently (each on its own links) by `seconds`."""
    for name in list(flight):
        flight[name] -= seconds
        if flight[name] <= 0:
            del flight[name]


def _arrive(flight: dict[str, float], name: str) -> float:
    """Seconds until transfer `name` completes; the others advance as long."""
    left = max(flight.get(name, 0.0), 0.0)
    _advance(flight, left)
    flight.pop(name, None)
    return left


def _wait(queue: list[list], name: str) -> float:
    """Seconds until transfer `name` and those queued before it complete; they leave the queue."""
    names = [n for n, _ in queue]
    if name not in names:
        return 0.0
    upto = names.index(name) + 1
    waited = sum(left for _, left in queue[:upto])
    del queue[:upto]
    return waited


def _op(work: Work, ceilings: Ceilings, eff: Efficiency) -> Breakdown:
    terms = {"compute_s": work.flops / (ceilings.peak_flops * (eff.mxu_kernel if work.kernel else eff.mxu)),
             "memory_s": (work.hbm_bytes + eff.vmem * work.vmem_bytes) / (ceilings.hbm_bandwidth * eff.hbm),
             "gather_s": work.rows * eff.row_s}
    decides = max(terms, key=terms.get)
    part = Breakdown(overhead_s=eff.op_s, **{decides: terms[decides]})
    part.hbm_busy_s = min(work.hbm_bytes / (ceilings.hbm_bandwidth * eff.hbm), terms[decides])
    return part


def _walk(module: hlo.Module, comp: str, ceilings: Ceilings, eff: Efficiency, memo: dict[str, Breakdown],
          depth: int = 0, ragged: Mapping[int, float] = {}) -> Breakdown:  # noqa: B006
    """One run of computation `comp`, its instructions in schedule order (module docstring)."""
    if comp in memo or depth > 64:
        return memo.get(comp, Breakdown())
    total, dma, ici = Breakdown(), [], {}
    fused: set[str] = set()
    arriving: dict[str, str] = {}  # a collective's value (its -done's, or its own when fused) -> its transfer
    for inst in module.computations.get(comp, []):
        op, part, waited = inst.opcode, Breakdown(), 0.0
        if op == "while":
            trips = hlo._trip_count(module, inst)
            for callee in re.findall(r"\b(?:body|condition)=%?([\w.\-]+)", inst.attrs):
                part.add(_walk(module, callee, ceilings, eff, memo, depth + 1, ragged), trips)
            part.overhead_s += eff.op_s
        elif op.endswith("-start") and op.removesuffix("-start") in hlo._COLLECTIVES:
            ici[inst.name] = _collective_s(module, inst, ceilings)
        elif op == "async-start" and (wrapped := [i for i in module.computations.get(_callee(inst), [])
                                                  if i.opcode in hlo._COLLECTIVES]):
            ici[inst.name] = sum(_collective_s(module, i, ceilings) for i in wrapped)
        elif op in ("conditional", "call", "async-start"):
            branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
            callees = (re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else
                       re.findall(r"\b(?:true_computation|false_computation|to_apply|calls)=%?([\w.\-]+)", inst.attrs))
            for callee in callees:
                part.add(_walk(module, callee, ceilings, eff, memo, depth + 1, ragged))
        elif op.endswith("-start"):
            arrays = laid_out(inst.type_text)
            moved = arrays[1][0] if len(arrays) > 1 else 0  # (source, destination, context)
            dma.append([inst.name, moved / (ceilings.hbm_bandwidth * eff.hbm)])
        elif op.endswith("-done") and inst.operands:
            if inst.operands[0] in ici:
                arriving[inst.name] = inst.operands[0]  # waited for by its first user
            else:
                part.dma_wait_s = part.hbm_busy_s = _wait(dma, inst.operands[0])
        elif op in hlo._COLLECTIVES and _ASYNC_FUSED in inst.attrs:
            ici[inst.name] = _collective_s(module, inst, ceilings)
        elif op in hlo._COLLECTIVES:
            part.collective_s = _collective_s(module, inst, ceilings)
        elif (work := instruction_work(module, inst, ragged)) is not None:
            part = _op(work, ceilings, eff)
            if op == "fusion":  # XLA:TPU's reduce-scatter: a fusion around an all-reduce
                part.collective_s = sum(_collective_s(module, i, ceilings)
                                        for i in module.computations.get(_callee(inst), []) if i.opcode in hlo._COLLECTIVES)
        used = [n for n in inst.operands if n in arriving]
        for name in [n for n in used if n not in fused]:  # its first user waits for it
            waited += _arrive(ici, arriving.pop(name))
        _advance(ici, part.step_s)
        for name in [n for n in used if n in fused]:  # fused into its first user: overlaps it too
            waited += _arrive(ici, arriving.pop(name))
        _drain(dma, part.step_s - part.hbm_busy_s + waited)
        if op in hlo._COLLECTIVES and _ASYNC_FUSED in inst.attrs:
            arriving[inst.name] = inst.name
            fused.add(inst.name)
        part.collective_s += waited
        total.add(part)
    total.collective_s += sum(_arrive(ici, name) for name in arriving.values())
    memo[comp] = total
    return total


def estimate(hlo_text: str, ceilings: Ceilings, eff: Efficiency = V5E,
             ragged: Mapping[int, float] = {}) -> dict[str, Any]:  # noqa: B006
    """The step time of a compiled program's optimised HLO text, and what decides it.

    Args:
      ragged: {static rows: rows computed} of grouped-matmul kernels whose group sizes cover fewer
        rows than their buffers hold (`ragged_rows`): such a kernel's FLOPs are scaled to the rows
        it computes; its bytes stay the buffers'.
    Returns:
      {"step_s", "compute_s", "memory_s", "gather_s", "overhead_s", "dma_wait_s", "collective_s"}:
      the step and its parts (they sum to it), seconds per device.
    """
    module = hlo.parse(hlo_text)
    parts = _walk(module, module.entry, ceilings, eff, {}, ragged=ragged)
    out = {"step_s": parts.step_s}
    out.update({f.name: getattr(parts, f.name) for f in dataclasses.fields(parts) if f.name != "hbm_busy_s"})
    return out
