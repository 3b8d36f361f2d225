"""core/bench/trace.py and core/bench/hlo_owners.py without a chip: the attribution rules on a small
hand-written HLO module, and the TPU trace parsing on a saved TPU v5e trace (tests/fixtures/tpu_trace/,
one warm-up step of deepseek4-284b, made by tools/trim_tpu_trace.py; tests/fixtures/tpu_trace.md)."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import pytest

from core.bench import hlo_owners, trace

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tpu_trace"

# Stack frames in files of another checkout (as a chip's HLO names them): 1 MoE, 2 attention, 3 the step.
SMALL_HLO = """HloModule jit_f, is_scheduled=true

FileNames
1 "/elsewhere/core/model/moe.py"
2 "/elsewhere/core/model/attention.py"
3 "/elsewhere/core/train/step.py"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
2 {file_name_id=2 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
3 {file_name_id=3 function_name_id=1 line=1 end_line=1 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=0}
3 {file_location_id=3 parent_frame_id=0}

%fused_body (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %mul = f32[4]{0} multiply(%p0, %p0), metadata={op_name="jit(f)/mul" stack_frame_id=2}
}

%loop_body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %copy.1 = f32[4]{0} copy(%x)
  %exp = f32[4]{0} exponential(%copy.1), metadata={op_name="jit(f)/exp" stack_frame_id=1}
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %exp)
}

%loop_cond (arg.1: (s32[], f32[4])) -> pred[] {
  %arg.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: f32[4], b: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %attn = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_body
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %attn)
  %while.1 = (s32[], f32[4]{0}) while(%init), condition=%loop_cond, body=%loop_body, metadata={op_name="jit(f)/while" stack_frame_id=3}
  %out = f32[4]{0} get-tuple-element(%while.1), index=1
  %copy.2 = f32[4]{0} copy(%out)
  %copy.3 = f32[4]{0} copy(%b)
  %add = f32[4]{0} add(%copy.2, %copy.3), metadata={op_name="jit(f)/add" stack_frame_id=2}
  %g = f32[4]{0} negate(%b), metadata={op_name="jit(f)/neg" stack_frame_id=3}
  %both = f32[4]{0} subtract(%g, %add)
  %copy.5 = f32[4]{0} copy(%g)
  %copy.6 = f32[4]{0} copy(%b)
  ROOT %r = f32[4]{0} copy(%both), backend_config={"a":{"b":"}"}}
}
"""


def test_frameless_instructions_take_their_body_or_nearest_framed_neighbour():
    module = hlo_owners.parse(SMALL_HLO)
    owners = hlo_owners.Owners(module)
    got = {name: owners.owner(name)[:2] for name in
           ("exp", "while.1", "attn", "copy.1", "copy.2", "copy.3", "both", "copy.5", "copy.6", "r")}
    assert got == {
        "exp": ("MoE", "frame"), "while.1": ("other", "frame"),  # the step's frame: a verdict, not a gap
        "attn": ("attention", "body"),  # a fusion without a frame: its body's
        "copy.1": ("attention", "producers"),  # loop parameter -> the loop's operand -> element 1 of its tuple
        "copy.2": ("MoE", "producers"),  # the loop's result -> element 1 of the body's root
        "copy.3": ("attention", "users"),  # an entry parameter has no producer: its user decides
        "both": ("attention", "producers"),  # a named neighbour wins over an equally near "other"
        "copy.5": ("other", "glue"),  # only "other" nearby
        "copy.6": (None, "none"),  # nothing at all
        "r": ("attention", "producers"),
    }, got
    assert owners.owner("while.1").source == "train/step" and module.name == "jit_f"
    assert module.instructions["r"].operands == ["both"] and module.entry == "main"


@pytest.fixture(scope="module")
def chip():
    """(HLO text, ProfileData) of the saved TPU step."""
    from jax.profiler import ProfileData

    hlo = gzip.decompress((FIXTURE / "hlo.txt.gz").read_bytes()).decode()
    return hlo, ProfileData.from_serialized_xspace(gzip.decompress((FIXTURE / "trace.xplane.pb.gz").read_bytes()))


def _events(profile, line: str) -> list[tuple[float, float, str]]:
    plane = trace.device_plane(profile)
    (found,) = [x for x in plane.lines if x.name == line]
    return [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in found.events]


def _union_ns(spans) -> float:
    """Length of the union of [start, end) spans (merging, not nesting: independent of trace._exclusive)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


# Exclusive op time per component on the fixture, ns (the output of tools/trim_tpu_trace.py on it).
KNOWN_NS = {"attention": 52495898, "compressor": 1550196, "indexer": 23484208, "MoE": 42279359, "mHC": 6462960,
            "head": 0, "optimizer": 996205, "other": 833235}
FRAMED_NS = {"attention": 49668656, "compressor": 1447863, "indexer": 22246988, "MoE": 14211801, "mHC": 6356028,
             "optimizer": 719900, "other": 833172}  # ops with a frame of their own; the rest, 32617653 ns, have none


def test_tpu_components_add_up_to_the_fixtures_totals(chip):
    """Per-component sums, and op time = the union of the XLA Ops events (async copies not counted)."""
    hlo, profile = chip
    out = trace.profile_times(hlo, profile)
    assert out["platform"] == "tpu" and out["steps"] == 1
    assert {c: round(s * 1e9) for c, s in out["components"].items()} == KNOWN_NS
    ops = _events(profile, "XLA Ops")
    assert out["op_s"] * 1e9 == pytest.approx(_union_ns((s, e) for s, e, _ in ops), abs=1)
    assert out["op_s"] * 1e9 == pytest.approx(sum(KNOWN_NS.values()), abs=1)
    async_ns = sum(e - s for s, e, _ in _events(profile, "Async XLA Ops"))
    assert async_ns > out["op_s"] * 1e9  # counting them would show
    owners = hlo_owners.Owners(hlo_owners.parse(hlo))
    ns, _, _ = trace.tpu_op_ns(trace.device_plane(profile), "jit_step")
    framed = Counter()
    for op, t in ns.items():
        owner = owners.owner(op)
        framed[owner.component if owner.how == "frame" else "(no frame)"] += t
    assert {c: round(t) for c, t in framed.items()} == {**FRAMED_NS, "(no frame)": 32617653}
    assert out["no_frame_s"] * 1e9 == pytest.approx(32617653, abs=1) and out["unattributed_s"] == 0


def test_tpu_named_components_hold_90_percent_after_inference(chip):
    hlo, profile = chip
    out = trace.profile_times(hlo, profile)
    named_framed = sum(t for c, t in FRAMED_NS.items() if c != "other") / 1e9
    assert named_framed / out["op_s"] < 0.75 <= 0.9 <= out["named_share"], (named_framed, out["named_share"])
    assert {"producers", "users", "body"} <= {how for how, s in out["by_how"].items() if s > 0}
    assert sum(out["other_sources"].values()) == pytest.approx(out["components"]["other"], rel=1e-9)
    top = out["top_ops"]
    assert len(top) == 12 and all(row[1] in KNOWN_NS and row[2] > 0 for row in top)
    assert any(row[3].endswith("ragged-dot-none") and row[1] == "MoE" and row[4] == "producers" for row in top), top


def test_tpu_while_loops_count_only_their_own_time(chip):
    """A while's event encloses its body's: its exclusive time is its duration minus the union of the
    events inside it."""
    _, profile = chip
    ns, _, _ = trace.tpu_op_ns(trace.device_plane(profile), "jit_step")
    ops = _events(profile, "XLA Ops")
    loops = [(s, e, name.split(" ")[0].lstrip("%")) for s, e, name in ops if " while(" in name]
    assert len(loops) >= 10
    for start, end, op in loops:
        inside = [(s, e) for s, e, _ in ops if start <= s and e <= end and (s, e) != (start, end)]
        assert ns[op] == pytest.approx(end - start - _union_ns(inside), abs=1e-3), op
        assert ns[op] < 0.1 * (end - start), op  # the body's ops are the body's


def test_tpu_step_time_comes_from_the_steps_line(chip):
    hlo, profile = chip
    out = trace.profile_times(hlo, profile)
    ((start, end, _),) = _events(profile, "Steps")
    ((run_start, run_end, run),) = _events(profile, "XLA Modules")
    assert out["step_s"] == pytest.approx((end - start) / 1e9, rel=1e-12)
    assert run.startswith("jit_step(") and run_end - run_start < end - start  # not the module's run


def test_tpu_profile_renders(chip):
    from rich.console import Console

    from dsv4cli.bench_train import render_time

    hlo, profile = chip
    out = trace.profile_times(hlo, profile)
    console = Console(record=True, width=250)
    render_time(console, {**out, "traced_step_s": out["step_s"], "wall_step_s": 0.2})
    text = console.export_text()
    assert "on the TPU" in text and "(Steps line)" in text and "model/transformer" in text, text
    assert "without an owner" in text and "ragged-dot-none" in text and "producers" in text, text
