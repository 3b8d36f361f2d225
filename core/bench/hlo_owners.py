"""Which model component owns each instruction of a compiled HLO module, read from its text: the
attribution behind `dsv4 bench --train --profile` (core/bench/trace.py reads the traces).

An instruction's owner, in order:

1. Its own stack frame. The module's StackFrames / FileLocations / FileNames tables give the frame's
   whole Python call stack (transposed and rematerialised instructions keep the stack of the forward
   equation they come from); its file names map to a component with the rule the FLOP count uses
   (`components.component_of_files`). A stack with no owning module (the step's guard, the
   embedding) is "other": that is a frame's verdict, not a gap.
2. A fusion or call without a frame of its own takes the frame of what it computes: the framed
   instructions nearest its called computation's root, walking up the body's data flow.
3. Anything else without a frame (copies, async copy/slice pairs, dynamic-update-slices of scan
   stacking, Pallas calls such as `ragged-dot`, scatters that XLA built from frameless transposes)
   did its work for the data it moves: it takes the component most common among its nearest
   producers that rules 1-2 name (fewest data-flow steps up; a loop body's parameter and
   get-tuple-element lead to the loop's operand, a loop's result to its body's root, a tuple
   element to that element only; an instruction that only moves or renames data, such as a copy
   or a get-tuple-element, is no step), else among its nearest such users. Ties go to the first
   found. Neighbours labelled "other" do not decide: the modules behind "other" own no work of
   their own (components.py's glue), so a copy between the step's guard and an MoE kernel is the
   MoE's. An instruction that reaches only "other" neighbours is "other" ("glue").
4. An instruction none of these reach has no owner (`None`): the caller counts it as "other" and
   reports its time as unattributed.

Rules 2 and 3 are an inference, not a source attribution: `Owner.how` names the rule that decided, so a
report can give the time without a frame before the inference and after it.
"""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from core.bench.components import CORE, HELPERS, MODULES, component_of_files, core_module

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")
_METADATA = re.compile(r'metadata=\{((?:[^}"]|"(?:[^"\\]|\\.)*")*)\}')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"\bstack_frame_id=(\d+)")
_GTE_INDEX = re.compile(r"^,\s*index=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")
# opcodes that only move or rename data (with every async *-start / *-done): no step of the walk
_PLUMBING = {"get-tuple-element", "tuple", "parameter", "bitcast", "copy", "opt-barrier", "add-dependency"}
# called computations that run as part of the caller's work (not a scalar reducer's `to_apply`)
_BODY_CALLS = {"calls", "body", "condition", "branch_computations", "called_computations"}


class Owner(NamedTuple):
    """Who owns an instruction. how: "frame" (rule 1), "body" (2), "producers" or "users" (3),
    "glue" (3, only "other"-framed neighbours) or "none" (4). source: for a framed instruction, the
    innermost project module on its stack that is no helper ("train/step_guard"), "" for none."""

    component: str | None
    how: str
    op_name: str
    source: str


@dataclass
class Instruction:
    """One instruction of the HLO text: what the attribution needs of it."""

    name: str
    computation: str
    opcode: str
    operands: list[str]
    called: list[tuple[str, str]]  # (attribute, computation): ("calls", "%fused_computation.3"), ("body", ...)
    frame: int | None
    op_name: str
    index: int = -1  # get-tuple-element's tuple index, parameter's number


@dataclass
class Module:
    """An HLO module's instructions, computations and call sites."""

    name: str
    entry: str = ""  # the ENTRY computation
    instructions: dict[str, Instruction] = field(default_factory=dict)
    roots: dict[str, str] = field(default_factory=dict)  # computation -> its ROOT instruction
    params: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    callers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # computation -> instructions
    users: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    tables: dict[str, dict[int, str]] = field(default_factory=dict)


def _moves_data(opcode: str) -> bool:
    """Whether an instruction only moves or renames its operand's data (no arithmetic of its own)."""
    return opcode in _PLUMBING or opcode.endswith(("-start", "-done"))


def _close(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _instruction(name: str, computation: str, rest: str) -> Instruction | None:
    """Parse the text after `%name = `: the type, opcode, operands and attributes."""
    start = _close(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    match = _OPCODE.match(rest, max(start, 0))
    if match is None:
        return None
    end = _close(rest, match.end() - 1)
    args, attrs = rest[match.end():end], rest[end + 1:]
    called = []
    for key, value in _CALLED.findall(attrs):
        if key in _BODY_CALLS or match.group(1) == "call":
            called += [(key, callee) for callee in _NAME.findall(value)]
    metadata = _METADATA.search(attrs)
    frame = _FRAME.search(metadata.group(1)) if metadata else None
    op_name = _OP_NAME.search(metadata.group(1)) if metadata else None
    opcode = match.group(1)
    index = _GTE_INDEX.match(attrs) if opcode == "get-tuple-element" else None
    if opcode == "parameter":
        index = re.match(r"\s*(\d+)", args)
    return Instruction(name, computation, opcode, [] if opcode == "parameter" else _NAME.findall(args), called,
                       int(frame.group(1)) if frame else None, op_name.group(1) if op_name else "",
                       int(index.group(1)) if index else -1)


def parse(hlo_text: str) -> Module:
    """The HLO module's text (`compiled.as_text()`) as a `Module`."""
    header = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
    module = Module(header.group(1) if header else "")
    computation, table = None, None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = module.tables.setdefault(stripped, {})
            continue
        row = _TABLE_ROW.match(stripped) if table is not None else None
        if row:
            table[int(row.group(1))] = row.group(2)
            continue
        table = None
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            module.entry = computation if line.startswith("ENTRY") else module.entry
            continue
        match = _INSTRUCTION.match(line) if computation else None
        instruction = _instruction(match.group(2), computation, line[match.end():]) if match else None
        if instruction is None:
            continue
        module.instructions[instruction.name] = instruction
        if match.group(1):
            module.roots[computation] = instruction.name
        if instruction.opcode == "parameter":
            module.params[computation][instruction.index] = instruction.name
        for operand in instruction.operands:
            module.users[operand].append(instruction.name)
        for _, callee in instruction.called:
            module.callers[callee].append(instruction.name)
    return module


def _project_files(files: dict[int, str]) -> dict[int, str]:
    """FileNames with the project's files moved under this checkout's core/.

    The HLO names the files of the machine that compiled it (a chip's checkout, a saved fixture): a
    prefix counts as the project's when one of its `<prefix>/core/<module>.py` is a module that
    components.py lists.
    """
    known = MODULES
    names = {k: v.strip('"') for k, v in files.items()}
    roots = set()
    for name in names.values():
        match = re.match(r"^(.*)/core/(.+)\.py$", name)
        if match and match.group(2).removesuffix("/__init__") in known:
            roots.add(match.group(1) + "/core/")
    out = {}
    for k, name in names.items():
        root = next((r for r in roots if name.startswith(r)), None)
        out[k] = os.path.join(CORE, name[len(root):]) if root else name
    return out


class Owners:
    """Owner of each instruction of a parsed module, by the rules of this module's docstring.

    `owner(name)` -> an `Owner`.
    """

    def __init__(self, module: Module):
        self.m = module
        self.files = _project_files(module.tables.get("FileNames", {}))
        self.functions = {k: v.strip('"') for k, v in module.tables.get("FunctionNames", {}).items()}
        self._frames: dict[int, str] = {}
        self._labels: dict[str, str | None] = {}

    def _stack(self, frame_id: int) -> tuple[list[str], list[str]]:
        """(source files, function names) of stack frame `frame_id`'s call stack, innermost first."""
        frames, locations = self.m.tables.get("StackFrames", {}), self.m.tables.get("FileLocations", {})
        files, functions, seen = [], [], set()
        while frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            fields = {k: int(v) for k, v in _FIELD.findall(frames[frame_id])}
            location = {k: int(v) for k, v in _FIELD.findall(locations.get(fields.get("file_location_id", -1), ""))}
            files.append(self.files.get(location.get("file_name_id", -1), ""))
            functions.append(self.functions.get(location.get("function_name_id", -1), ""))
            frame_id = fields.get("parent_frame_id", 0) - 1  # the text prints the parent's id + 1; 0 = no parent
        return files, functions

    def _stack_files(self, frame_id: int) -> list[str]:
        """Source files of stack frame `frame_id`'s call stack, innermost first."""
        return self._stack(frame_id)[0]

    def frame_component(self, frame_id: int) -> str:
        """Component of stack frame `frame_id`'s call stack (components.component_of_files)."""
        if frame_id not in self._frames:
            self._frames[frame_id] = component_of_files(*self._stack(frame_id))
        return self._frames[frame_id]

    def frame_source(self, frame_id: int) -> str:
        """The innermost project module on stack frame `frame_id`'s stack that is no helper, "" for none."""
        return next((m for m in map(core_module, self._stack_files(frame_id)) if m and m not in HELPERS), "")

    def label(self, name: str) -> str | None:
        """Component from the instruction's own frame, else from its called body's (rules 1-2)."""
        if name not in self._labels:
            self._labels[name] = None  # a cycle through calls finds nothing
            ins = self.m.instructions[name]
            if ins.frame is not None:
                self._labels[name] = self.frame_component(ins.frame)
            else:
                roots = [self.m.roots[c] for key, c in ins.called if key != "condition" and c in self.m.roots]
                found, other = self._nearest(roots, lambda x: self.m.instructions[x].operands)
                self._labels[name] = found or ("other" if other else None)
        return self._labels[name]

    def _nearest(self, starts: list[str], step, depth: int = 64) -> tuple[str | None, bool]:
        """(The commonest named component among the labelled instructions fewest `step`s from
        `starts`, whether an instruction labelled "other" was passed on the way).

        The walk stops at labelled instructions. Steps are counted in instructions that compute: one
        that only moves or renames data (a tuple, a get-tuple-element, a bitcast, a copy, an async
        start/done pair) is no step of its own.
        """
        frontier, seen, other = list(starts), set(starts), False
        for _ in range(depth):
            nxt, i = [], 0
            while i < len(frontier):  # `frontier` grows as plumbing is looked through
                x = frontier[i]
                i += 1
                if self.label(x) is not None:
                    continue
                ahead = frontier if _moves_data(self.m.instructions[x].opcode) else nxt
                for y in step(x):
                    if y not in seen and y in self.m.instructions:
                        seen.add(y)
                        ahead.append(y)
            found = [c for c in map(self.label, frontier) if c is not None]
            named = [c for c in found if c != "other"]
            other = other or len(named) < len(found)
            if named:
                return Counter(named).most_common(1)[0][0], other
            if not nxt:
                break
            frontier = nxt
        return None, other

    def _caller_operands(self, ins: Instruction) -> list[str]:
        """What parameter `ins` is bound to at each call site of its computation."""
        out = []
        for caller in self.m.callers.get(ins.computation, []):
            c = self.m.instructions[caller]
            if c.opcode == "while":
                out.append(c.operands[0])
            elif c.opcode == "conditional":
                branch = [callee for _, callee in c.called].index(ins.computation)
                out += c.operands[branch + 1:branch + 2]
            elif 0 <= ins.index < len(c.operands):
                out.append(c.operands[ins.index])
        return out

    def _element(self, name: str, i: int, depth: int = 0) -> list[str]:
        """The instructions producing element `i` of tuple-valued `name`."""
        ins = self.m.instructions.get(name)
        if ins is None or depth > 32:
            return []
        if ins.opcode == "tuple":
            return ins.operands[i:i + 1]
        if ins.opcode == "get-tuple-element":
            return [z for y in self._element(ins.operands[0], ins.index, depth + 1) for z in self._element(y, i, depth + 1)]
        if ins.opcode == "parameter":
            return [z for y in self._caller_operands(ins) for z in self._element(y, i, depth + 1)]
        if ins.opcode in ("while", "call", "conditional"):
            roots = [self.m.roots[c] for key, c in ins.called if key != "condition" and c in self.m.roots]
            return [z for root in roots for z in self._element(root, i, depth + 1)]
        return [name]

    def producers(self, name: str) -> list[str]:
        """Data-flow predecessors, across loop and call boundaries, a tuple element at a time."""
        ins = self.m.instructions[name]
        if ins.opcode == "get-tuple-element":
            return self._element(ins.operands[0], ins.index)
        if ins.opcode == "parameter":
            return self._caller_operands(ins)
        if ins.opcode in ("while", "call", "conditional"):
            return [self.m.roots[c] for key, c in ins.called if key != "condition" and c in self.m.roots]
        return ins.operands

    def _element_users(self, name: str, i: int, depth: int = 0) -> list[str]:
        """The instructions reading element `i` of tuple-valued `name`."""
        if depth > 32:
            return []
        out = []
        for user in self.m.users.get(name, []):
            u = self.m.instructions[user]
            if u.opcode == "get-tuple-element" and u.index == i:
                out.append(user)
            elif u.opcode == "while":
                body = next((c for key, c in u.called if key == "body"), None)
                out += self._element_users(self.m.params.get(body, {}).get(0, ""), i, depth + 1)
        ins = self.m.instructions.get(name)
        if ins is not None and self.m.roots.get(ins.computation) == name:
            for caller in self.m.callers.get(ins.computation, []):
                c = self.m.instructions[caller]
                if c.opcode in ("while", "call", "conditional"):
                    out += self._element_users(caller, i, depth + 1)
                if c.opcode == "while":
                    out += self._element_users(self.m.params.get(ins.computation, {}).get(0, ""), i, depth + 1)
        return out

    def users(self, name: str) -> list[str]:
        """Data-flow successors, across loop and call boundaries, a tuple element at a time."""
        out = []
        for user in self.m.users.get(name, []):
            u = self.m.instructions[user]
            if u.opcode == "tuple":
                out += [y for k, o in enumerate(u.operands) if o == name for y in self._element_users(user, k)]
            elif u.opcode not in ("while", "call", "conditional"):
                out.append(user)
        ins = self.m.instructions[name]
        if self.m.roots.get(ins.computation) == name and ins.opcode != "tuple":
            for caller in self.m.callers.get(ins.computation, []):
                if self.m.instructions[caller].opcode in ("call", "conditional"):
                    out.append(caller)
        return out

    def owner(self, name: str) -> Owner:
        """Owner of instruction `name` (rules of the module docstring)."""
        ins = self.m.instructions.get(name)
        if ins is None:
            return Owner(None, "none", "", "")
        label, source = self.label(name), self.frame_source(ins.frame) if ins.frame is not None else ""
        if label is not None:
            return Owner(label, "frame" if ins.frame is not None else "body", ins.op_name, source)
        saw_other = False
        for how, step in (("producers", self.producers), ("users", self.users)):
            found, other = self._nearest(step(name), step)
            if found is not None:
                return Owner(found, how, ins.op_name, source)
            saw_other = saw_other or other
        return Owner("other", "glue", ins.op_name, source) if saw_other else Owner(None, "none", ins.op_name, source)
