"""core/plan/cost.py: the step-time model on hand-written TPU HLO.

Round ceilings and efficiencies make each rule's figure exact: a dot is compute-bound at the peak
times mxu, a big copy memory-bound at the bandwidth times hbm, layouts pad minor dimensions to their
tiles, on-chip bytes cost vmem of an HBM byte, gathers cost by the row, loop bodies count as often
as they run, asynchronous copies overlap the HBM time that the instructions between start and done
leave idle (first in, first out), and grouped-matmul kernels count their FLOPs from their shapes.
"""

from __future__ import annotations

import pytest

from core.plan import cost, hlo

CEILINGS = cost.Ceilings(peak_flops=1e12, hbm_bandwidth=1e11, link_bandwidth=1e10)
EFF = cost.Efficiency(mxu=0.5, mxu_kernel=0.5, hbm=0.5, vmem=0.25, row_s=1e-8, op_s=1e-6)
BYTES_S = 1 / (1e11 * 0.5)  # seconds per HBM byte at hbm x the bandwidth
FLOP_S = 1 / (1e12 * 0.5)


def module(entry: str, *computations: str) -> str:
    body = "\n".join(f"  {line}" for line in entry.strip().splitlines())
    return "HloModule m, is_scheduled=true\n\n" + "\n\n".join(computations) + f"\n\nENTRY %main () -> f32[] {{\n{body}\n}}\n"


def estimate(text: str) -> dict[str, float]:
    return cost.estimate(text, CEILINGS, EFF)


DOT = """%fused_dot (p0: bf16[256,512], p1: bf16[512,1024]) -> f32[256,1024] {
  %p0 = bf16[256,512]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  ROOT %d = f32[256,1024]{1,0:T(8,128)S(1)} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
DOT_CALL = "%f = f32[256,1024]{1,0:T(8,128)S(1)} fusion(%a, %b), kind=kOutput, calls=%fused_dot"
DOT_ARGS = """%a = bf16[256,512]{1,0:T(8,128)(2,1)S(1)} parameter(0)
%b = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} parameter(1)"""
DOT_FLOPS = 2 * 256 * 512 * 1024
COPY = "%c = f32[1024,1024]{1,0:T(8,128)} copy(%x)"
COPY_BYTES = 2 * 1024 * 1024 * 4


def test_a_dot_is_compute_bound_at_the_peak_times_mxu():
    e = estimate(module(DOT_ARGS + "\n" + DOT_CALL, DOT))
    assert e["compute_s"] == pytest.approx(DOT_FLOPS * FLOP_S)
    assert e["memory_s"] == 0 and e["overhead_s"] == pytest.approx(1e-6)
    assert e["step_s"] == pytest.approx(DOT_FLOPS * FLOP_S + 1e-6)


def test_a_big_copy_is_memory_bound_and_on_chip_bytes_cost_vmem_of_an_hbm_byte():
    x = "%x = f32[1024,1024]{1,0:T(8,128)} parameter(0)\n"
    e = estimate(module(x + COPY))
    assert e["memory_s"] == pytest.approx(COPY_BYTES * BYTES_S) and e["compute_s"] == 0
    into_vmem = estimate(module(x + COPY.replace("T(8,128)}", "T(8,128)S(1)}", 1)))  # the result in VMEM
    assert into_vmem["memory_s"] == pytest.approx((COPY_BYTES / 2) * (1 + 0.25) * BYTES_S)


def test_layout_tiles_pad_small_minor_dimensions():
    assert cost.laid_out("f32[1024,24]{1,0:T(8,128)}") == [(1024 * 128 * 4, 0)]
    assert cost.laid_out("f32[24,1024]{0,1:T(8,128)}") == [(128 * 1024 * 4, 0)]  # dim 0 is the minor one
    assert cost.laid_out("bf16[3,1024]{1,0:T(8,128)(2,1)S(1)}") == [(8 * 1024 * 2, 1)]
    assert cost.laid_out("pred[65536]{0:T(1024)(128)(4,1)}") == [(65536, 0)]
    assert cost.laid_out("(f32[1024,24]{1,0}, s32[]{:S(2)})") == [(1024 * 24 * 4, 0), (4, 2)]  # no tile, no padding


def test_loop_trip_counts_multiply():
    body = """%body (p: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %p = (s32[], f32[1024,1024]{1,0:T(8,128)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024,1024]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %c = f32[1024,1024]{1,0:T(8,128)} copy(%x)
  ROOT %t = (s32[], f32[1024,1024]{1,0:T(8,128)}) tuple(%j, %c)
}"""
    cond = """%cond (q: (s32[], f32[1024,1024])) -> pred[] {
  %q = (s32[], f32[1024,1024]{1,0:T(8,128)}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}"""
    entry = """%init = (s32[], f32[1024,1024]{1,0:T(8,128)}) parameter(0)
%w = (s32[], f32[1024,1024]{1,0:T(8,128)}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}"""
    e = estimate(module(entry, body, cond))
    assert e["memory_s"] == pytest.approx(7 * COPY_BYTES * BYTES_S)
    assert e["overhead_s"] == pytest.approx(8e-6)  # seven copies and the loop


def _async(between: str) -> str:
    start = "%cs = (f32[1024,1024]{1,0:T(8,128)}, f32[1024,1024]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%y)"
    done = "%cd = f32[1024,1024]{1,0:T(8,128)S(1)} copy-done(%cs)"
    args = DOT_ARGS + "\n%y = f32[1024,1024]{1,0:T(8,128)} parameter(2)\n%x = f32[1024,1024]{1,0:T(8,128)} parameter(3)"
    return module("\n".join([args, start, between, done]), DOT)


def test_async_copies_overlap_what_leaves_hbm_idle():
    moved_s = (COPY_BYTES / 2) * BYTES_S
    alone = estimate(_async(""))
    assert alone["dma_wait_s"] == pytest.approx(moved_s) and alone["step_s"] == pytest.approx(moved_s)
    behind_a_dot = estimate(_async(DOT_CALL))  # the dot reads VMEM only: the copy runs beside it
    assert DOT_FLOPS * FLOP_S > moved_s and behind_a_dot["dma_wait_s"] == 0
    assert behind_a_dot["step_s"] == pytest.approx(DOT_FLOPS * FLOP_S + 1e-6)
    behind_a_copy = estimate(_async(COPY))  # HBM busy: only its fixed cost overlaps
    assert behind_a_copy["dma_wait_s"] == pytest.approx(moved_s - 1e-6)


def test_a_done_waits_for_the_copies_queued_before_it():
    big = "%big = (f32[1024,1024]{1,0:T(8,128)}, f32[1024,1024]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%y)"
    small = "%small = (s32[512]{0:T(512)}, s32[512]{0:T(512)S(1)}, u32[]{:S(2)}) copy-start(%z)"
    entry = f"""%y = f32[1024,1024]{{1,0:T(8,128)}} parameter(0)
%z = s32[512]{{0:T(512)}} parameter(1)
{big}
{small}
%sd = s32[512]{{0:T(512)S(1)}} copy-done(%small)
%bd = f32[1024,1024]{{1,0:T(8,128)S(1)}} copy-done(%big)"""
    e = estimate(module(entry))
    assert e["dma_wait_s"] == pytest.approx((1024 * 1024 * 4 + 512 * 4) * BYTES_S)


def test_gathers_cost_by_the_row_and_sliced_operands_by_the_slice():
    gather = """%fused_gather (t: bf16[1024,128], i: s32[65536]) -> bf16[65536,128] {
  %t = bf16[1024,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %i = s32[65536]{0:T(1024)S(1)} parameter(1)
  %r = s32[65536,1]{1,0:T(8,128)} reshape(%i)
  ROOT %g = bf16[65536,128]{1,0:T(8,128)(2,1)S(1)} gather(%t, %r), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,128}
}"""
    entry = """%t = bf16[1024,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
%i = s32[65536]{0:T(1024)S(1)} parameter(1)
%g = bf16[65536,128]{1,0:T(8,128)(2,1)S(1)} fusion(%t, %i), kind=kCustom, calls=%fused_gather"""
    text = module(entry, gather)
    e = estimate(text)
    assert e["gather_s"] == pytest.approx(65536 * 1e-8)
    m = hlo.parse(text)
    work = cost.instruction_work(m, m.computations["main"][-1])
    assert work.rows == 65536 and work.hbm_bytes == 0
    assert work.vmem_bytes == 2 * 65536 * 128 * 2 + 65536 * 4  # the rows read (not the table twice), written; indices


def test_an_operand_sliced_inside_a_nested_fusion_costs_the_slice():
    """XLA:TPU's output fusion in a query-chunk loop reads one chunk of the stacked queries through a
    nested loop fusion's dynamic-slice (the chunked attention, docs/step-time-model.md):
    the chunk's bytes count, not the whole stack's (32 x as many), in each of the loop's runs; an
    operand a nested fusion reads whole still counts whole."""
    take = """%take (s: bf16[32,128,512], j: s32[]) -> bf16[128,512] {
  %s = bf16[32,128,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %j = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,128,512]{2,1,0:T(8,128)(2,1)} dynamic-slice(%s, %j, %z, %z), dynamic_slice_sizes={1,128,512}
  ROOT %r = bf16[128,512]{1,0:T(8,128)(2,1)} bitcast(%ds)
}"""
    whole = """%whole (s: bf16[32,128,512], j: s32[]) -> bf16[128,512] {
  %s = bf16[32,128,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %j = s32[] parameter(1)
  %n = bf16[32,128,512]{2,1,0:T(8,128)(2,1)} negate(%s)
  %z = s32[] constant(0)
  %ds = bf16[1,128,512]{2,1,0:T(8,128)(2,1)} dynamic-slice(%n, %j, %z, %z), dynamic_slice_sizes={1,128,512}
  ROOT %r = bf16[128,512]{1,0:T(8,128)(2,1)} bitcast(%ds)
}"""
    out = """%out (s0: bf16[32,128,512], j0: s32[], k0: bf16[512,256]) -> f32[128,256] {
  %s0 = bf16[32,128,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %j0 = s32[] parameter(1)
  %k0 = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(2)
  %q = bf16[128,512]{1,0:T(8,128)(2,1)} fusion(%s0, %j0), kind=kLoop, calls=%CALLEE
  ROOT %d = f32[128,256]{1,0:T(8,128)} dot(%q, %k0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
    entry = """%s = bf16[32,128,512]{2,1,0:T(8,128)(2,1)} parameter(0)
%j = s32[] parameter(1)
%k = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(2)
%f = f32[128,256]{1,0:T(8,128)} fusion(%s, %j, %k), kind=kOutput, calls=%out"""
    chunk, keys, result, index = 128 * 512 * 2, 512 * 256 * 2, 128 * 256 * 4, 4
    for callee, read in (("take", chunk), ("whole", 32 * chunk)):
        m = hlo.parse(module(entry, take, whole, out.replace("CALLEE", callee)))
        work = cost.instruction_work(m, m.computations["main"][-1])
        assert work.hbm_bytes == read + keys + result + index, callee
        assert work.flops == 2 * 128 * 512 * 256


def test_in_place_updates_count_the_update_through_a_nested_fusion():
    inner = """%inner (b: f32[4096,512], i: s32[64,1], u: f32[64,512]) -> f32[4096,512] {
  %b = f32[4096,512]{1,0:T(8,128)} parameter(0)
  %i = s32[64,1]{1,0:T(8,128)} parameter(1)
  %u = f32[64,512]{1,0:T(8,128)} parameter(2)
  ROOT %s = f32[4096,512]{1,0:T(8,128)} scatter(%b, %i, %u), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}"""
    outer = """%outer (b0: f32[4096,512], i0: s32[64,1], u0: f32[64,512]) -> f32[4096,512] {
  %b0 = f32[4096,512]{1,0:T(8,128)} parameter(0)
  %i0 = s32[64,1]{1,0:T(8,128)} parameter(1)
  %u0 = f32[64,512]{1,0:T(8,128)} parameter(2)
  ROOT %n = f32[4096,512]{1,0:T(8,128)} fusion(%b0, %i0, %u0), kind=kCustom, calls=%inner
}"""
    add = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}"""
    entry = """%b = f32[4096,512]{1,0:T(8,128)} parameter(0)
%i = s32[64,1]{1,0:T(8,128)} parameter(1)
%u = f32[64,512]{1,0:T(8,128)} parameter(2)
%f = f32[4096,512]{1,0:T(8,128)} fusion(%b, %i, %u), kind=kCustom, calls=%outer"""
    m = hlo.parse(module(entry, add, inner, outer))
    work = cost.instruction_work(m, m.computations["main"][-1])
    update, index = 64 * 512 * 4, 64 * 128 * 4  # the index's minor dimension of 1 is padded to 128
    assert work.hbm_bytes == 3 * update + index and work.rows == 64  # updates read, rows read and written


@pytest.mark.parametrize("width", [512, 256, 64])
def test_an_update_across_part_of_the_minor_tiles_costs_the_whole_buffer(width):
    """A dynamic-update-slice costs its update where it covers whole minor (lane) tiles, fused or not;
    narrower than its buffer by a width the tile does not divide, the whole buffer read and written."""
    fused = f"""%dus (b: bf16[4096,512], u: bf16[4096,{width}]) -> bf16[4096,512] {{
  %b = bf16[4096,512]{{1,0:T(8,128)(2,1)}} parameter(0)
  %u = bf16[4096,{width}]{{1,0:T(8,128)(2,1)}} parameter(1)
  %z = s32[] constant(0)
  ROOT %d = bf16[4096,512]{{1,0:T(8,128)(2,1)}} dynamic-update-slice(%b, %u, %z, %z)
}}"""
    args = f"""%b = bf16[4096,512]{{1,0:T(8,128)(2,1)}} parameter(0)
%u = bf16[4096,{width}]{{1,0:T(8,128)(2,1)}} parameter(1)
%z = s32[] constant(0)"""
    buffer, update = 4096 * 512 * 2, 4096 * max(width, 128) * 2
    want = 2 * buffer + update if width % 128 else 2 * update  # the update read and written, or all
    m = hlo.parse(module(args + "\n%f = bf16[4096,512]{1,0:T(8,128)(2,1)} fusion(%b, %u), kind=kLoop, calls=%dus",
                         fused))
    assert cost.instruction_work(m, m.computations["main"][-1]).hbm_bytes == want
    m = hlo.parse(module(args + "\n%d = bf16[4096,512]{1,0:T(8,128)(2,1)} dynamic-update-slice(%b, %u, %z, %z)"))
    assert cost.instruction_work(m, m.computations["main"][-1]).hbm_bytes == (2 * buffer if width % 128 else 2 * update)


RAGGED = """%lhs = bf16[2048,512]{1,0:T(8,128)(2,1)} parameter(0)
%rhs = bf16[8,512,256]{2,1,0:T(8,128)(2,1)} parameter(1)
%sizes = s32[8]{0:T(128)} parameter(2)
%out = bf16[2048,256]{1,0:T(8,128)(2,1)} custom-call(%sizes, %lhs, %rhs), custom_call_target="tpu_custom_call\""""
TGMM = """%lhs_t = bf16[512,2048]{1,0:T(8,128)(2,1)} parameter(0)
%dout = bf16[2048,256]{1,0:T(8,128)(2,1)} parameter(1)
%sizes = s32[8]{0:T(128)} parameter(2)
%drhs = f32[8,512,256]{2,1,0:T(8,128)} custom-call(%lhs_t, %dout, %sizes), custom_call_target="tpu_custom_call\""""


def test_grouped_matmul_kernels_count_their_flops_from_their_shapes():
    flops = 2 * 2048 * 512 * 256
    for text in (RAGGED, TGMM):
        m = hlo.parse(module(text))
        assert hlo.matmul_flops(m) == flops
        assert estimate(module(text))["compute_s"] == pytest.approx(flops * FLOP_S)
    f32 = module(RAGGED.replace("%lhs = bf16[2048,512]{1,0:T(8,128)(2,1)}", "%lhs = f32[2048,512]{1,0:T(8,128)}"))
    assert estimate(f32)["compute_s"] == pytest.approx(3 * flops * FLOP_S)  # three bf16 passes
    other = module(RAGGED.replace("bf16[8,512,256]", "bf16[8,512,128]"))  # a kernel of another shape: bytes only
    assert hlo.matmul_flops(hlo.parse(other)) == 0 and estimate(other)["memory_s"] > 0


def test_a_grouped_matmul_kernel_is_priced_at_the_rows_its_groups_cover():
    """`ragged` {static rows: rows computed}: a grouped-matmul kernel over a 2048-row buffer whose groups
    cover 512 rows (drop-free expert parallelism's receive buffer) costs a quarter of its matmul, the
    forward and the weights' gradient alike, declared FLOPs too; its bytes stay the buffer's; a kernel
    of other rows is priced as before."""
    flops = 2 * 2048 * 512 * 256
    declared = (', backend_config={"custom_call_config":{"body":"TUxJUg==","cost_estimate":{"bytes_accessed":"7",'
                f'"flops":"{flops}","transcendentals":"0"}}}}}}')
    for text in (RAGGED, TGMM, RAGGED + declared):
        full, priced = estimate(module(text)), cost.estimate(module(text), CEILINGS, EFF, ragged={2048: 512})
        assert priced["compute_s"] == pytest.approx(flops / 4 * FLOP_S) and full["compute_s"] == pytest.approx(flops * FLOP_S)
        m = hlo.parse(module(text))
        kernel = m.computations["main"][-1]
        assert cost.instruction_work(m, kernel, {2048: 512}).hbm_bytes == cost.instruction_work(m, kernel).hbm_bytes > 0
    assert cost.estimate(module(RAGGED), CEILINGS, EFF, ragged={4096: 512})["compute_s"] == pytest.approx(flops * FLOP_S)


def test_a_kernel_counts_the_flops_its_cost_estimate_declares():
    """A Pallas kernel of no grouped-matmul shape (core/ops/fused_attention.py's) counts the FLOPs its
    `pl.CostEstimate` declares in the custom call's backend config, as declared whatever its operands'
    dtypes (its float32 operands need not be matmul operands); a declared 0 falls back to the shapes."""
    flops = 123_456_789_012
    declared = (', backend_config={"custom_call_config":{"body":"TUxJUg==","cost_estimate":{"bytes_accessed":"7",'
                f'"flops":"{flops}","transcendentals":"9"}}}}}}')
    other = RAGGED.replace("bf16[8,512,256]", "bf16[8,512,128]")
    m = hlo.parse(module(other + declared))
    assert hlo.matmul_flops(m) == flops
    assert estimate(module(other + declared))["compute_s"] == pytest.approx(flops * FLOP_S)
    f32 = other.replace("%lhs = bf16[2048,512]{1,0:T(8,128)(2,1)}", "%lhs = f32[2048,512]{1,0:T(8,128)}")
    assert estimate(module(f32 + declared))["compute_s"] == pytest.approx(flops * FLOP_S)  # declared: as is
    zero = declared.replace(f'"flops":"{flops}"', '"flops":"0"')
    assert hlo.matmul_flops(hlo.parse(module(RAGGED + zero))) == 2 * 2048 * 512 * 256


def test_a_ragged_dots_masked_convolution_counts_one_group_in_g():
    conv = """%masked (a: bf16[2048,512], k: bf16[2048,256], mask: pred[8,2048]) -> f32[512,256] {
  %a = bf16[2048,512]{1,0:T(8,128)(2,1)} parameter(0)
  %k = bf16[2048,256]{1,0:T(8,128)(2,1)} parameter(1)
  %mask = pred[8,2048]{1,0:T(8,128)(4,1)} parameter(2)
  ROOT %c = f32[512,256]{1,0:T(8,128)} dot(%a, %k), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}"""
    entry = """%a = bf16[2048,512]{1,0:T(8,128)(2,1)} parameter(0)
%k = bf16[2048,256]{1,0:T(8,128)(2,1)} parameter(1)
%mask = pred[8,2048]{1,0:T(8,128)(4,1)} parameter(2)
%f = f32[512,256]{1,0:T(8,128)} fusion(%a, %k, %mask), kind=kOutput, calls=%masked, backend_config={"mask_aggregator_config":{"iteration_skipper_mode":"ITERATION_SKIPPER_MODE_GROUP_STARTS","mask_dim_to_iteration_index":["1","4"]}}"""
    m = hlo.parse(module(entry, conv))
    dense = hlo.matmul_flops_of(m, m.computations["masked"][-1])
    assert dense > 0 and hlo.matmul_flops(m) == pytest.approx(dense / 8)
    assert cost.instruction_work(m, m.computations["main"][-1]).flops == pytest.approx(dense / 8)


TORUS = cost.Ceilings(peak_flops=1e12, hbm_bandwidth=1e11, link_bandwidth=1e10, torus=((4, 2), (4, 2), (2, 1)))
SUM = """%sum (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %c = bf16[] add(%a, %b)
}"""
RING4 = "replica_groups=[8,4]<=[32]"  # 8 groups of 4 devices
RING16 = "replica_groups=[2,16]<=[32]"


def test_a_group_takes_the_links_of_the_torus_axes_it_spans():
    assert [TORUS.links(n) for n in (1, 2, 4, 8, 16, 32)] == [1, 2, 2, 4, 4, 5]
    assert CEILINGS.links(64) == 1  # a switch: one port per device, whatever the group


@pytest.mark.parametrize("kind, text, want", [
    ("all-gather over 4", f"%y = bf16[4096,1024]{{1,0}} all-gather(%x), dimensions={{0}}, {RING4}", 3 / 4 / 2),
    ("all-gather over 16", f"%y = bf16[4096,1024]{{1,0}} all-gather(%x), dimensions={{0}}, {RING16}", 15 / 16 / 4),
    ("all-reduce over 4", f"%y = bf16[4096,1024]{{1,0}} all-reduce(%x), {RING4}, to_apply=%sum", 2 * 3 / 4 / 2),
    ("reduce-scatter over 4: its operand's bytes", f"%y = bf16[1024,1024]{{1,0}} reduce-scatter(%x), dimensions={{0}}, "
     f"{RING4}, to_apply=%sum", 3 / 4 / 2),
    ("permute to one peer", "%y = bf16[4096,1024]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}", 1.0),
])
def test_a_collective_moves_a_rings_bytes_over_its_links(kind, text, want):
    x = "%x = bf16[4096,1024]{1,0} parameter(0)" if "all-gather" not in kind else "%x = bf16[1024,1024]{1,0} parameter(0)"
    e = cost.estimate(module(f"{x}\n{text}", SUM), TORUS, EFF)
    assert e["collective_s"] == pytest.approx(4096 * 1024 * 2 * want / 1e10), kind


def _permute(name: str, direction: str) -> str:
    pairs = "{{0,1},{1,0}}" if direction == "+" else "{{1,0},{0,1}}"
    return (f"%{name} = (bf16[4096,1024]{{1,0}}, bf16[4096,1024]{{1,0}}, u32[], u32[]) collective-permute-start(%x), "
            f"source_target_pairs={pairs}")


PERMUTE_S = 4096 * 1024 * 2 / 1e10  # one link


def test_an_asynchronous_collective_overlaps_until_its_first_user():
    """A -done costs nothing by itself: the first instruction that reads its value waits for what is
    left, so the independent work scheduled between the done and that user hides it too."""
    use = "%u = bf16[4096,1024]{1,0} negate(%pd)"
    use_s = 2 * 4096 * 1024 * 2 * BYTES_S
    args = f"%x = bf16[4096,1024]{{1,0}} parameter(0)\n{DOT_ARGS}"
    text = "\n".join([args, _permute("p", "+"), "%pd = bf16[4096,1024]{1,0} collective-permute-done(%p)", DOT_CALL, use])
    e = cost.estimate(module(text, DOT), TORUS, EFF)
    dot_s = DOT_FLOPS * FLOP_S + 1e-6
    assert e["collective_s"] == pytest.approx(PERMUTE_S - dot_s)  # a start or done costs no op of its own
    assert e["step_s"] == pytest.approx(PERMUTE_S + use_s + 1e-6)
    unused = "\n".join([args, _permute("p", "+"), "%pd = bf16[4096,1024]{1,0} collective-permute-done(%p)", DOT_CALL])
    assert cost.estimate(module(unused, DOT), TORUS, EFF)["collective_s"] == pytest.approx(PERMUTE_S - dot_s)


def test_collectives_in_flight_move_at_once_each_on_its_links():
    args = "%x = bf16[4096,1024]{1,0} parameter(0)"
    both = "\n".join([args, _permute("p", "+"), _permute("q", "-"),
                      "%pd = bf16[4096,1024]{1,0} collective-permute-done(%p)",
                      "%qd = bf16[4096,1024]{1,0} collective-permute-done(%q)",
                      "%s = bf16[4096,1024]{1,0} add(%pd, %qd)"])
    e = cost.estimate(module(both), TORUS, EFF)
    assert e["collective_s"] == pytest.approx(PERMUTE_S)  # not twice: the two run side by side


def test_a_fused_asynchronous_collective_overlaps_its_first_user():
    """XLA:TPU's asynchronous collective fusion writes the collective synchronously, with the name of
    the async pair it replaces: it runs beside what follows, its first user included."""
    gather = (f"%g = bf16[4096,1024]{{1,0}} all-gather(%x), dimensions={{0}}, {RING4}, "
              'frontend_attributes={async_collective_name="all-gather-start.1"}')
    consumer = "%zero = bf16[] constant(0)\n%u = bf16[1024]{0} reduce(%g, %zero), dimensions={0}, to_apply=%sum"
    use_s = (4096 + 1) * 1024 * 2 * BYTES_S
    gather_s = 4096 * 1024 * 2 * 3 / 4 / 2 / 1e10
    text = "\n".join(["%x = bf16[1024,1024]{1,0} parameter(0)", gather, consumer])
    e = cost.estimate(module(text, SUM), TORUS, EFF)
    assert gather_s > use_s and e["step_s"] == pytest.approx(gather_s)
    plain = cost.estimate(module(text.replace(gather[gather.index(", frontend"):], ""), SUM), TORUS, EFF)
    assert plain["step_s"] == pytest.approx(gather_s + use_s + 1e-6)  # synchronous: one after the other


def test_a_fusion_around_a_collective_costs_it():
    """XLA:TPU writes a reduce-scatter as a fusion of an all-reduce and the slice of it a device keeps."""
    body = f"""%rs (p: bf16[4096,1024]) -> bf16[1024,1024] {{
  %p = bf16[4096,1024]{{1,0}} parameter(0)
  %r = bf16[4096,1024]{{1,0}} all-reduce(%p), {RING4}, to_apply=%sum
  ROOT %s = bf16[1024,1024]{{1,0}} slice(%r), slice={{[0:1024], [0:1024]}}
}}"""
    text = "%x = bf16[4096,1024]{1,0} parameter(0)\n%f = bf16[1024,1024]{1,0} fusion(%x), kind=kCustom, calls=%rs"
    e = cost.estimate(module(text, SUM, body), TORUS, EFF)
    assert e["collective_s"] == pytest.approx(4096 * 1024 * 2 * 2 * 3 / 4 / 2 / 1e10)


def test_a_multi_output_fusion_updating_in_place_counts_its_update():
    """A scan step's fusion returns its stacked output updated in place beside the value it passes on:
    the update and the other output are written, the stack is not read."""
    body = """%step (b: bf16[64,1024,1024], x: bf16[1024,1024], i: s32[]) -> (bf16[64,1024,1024], bf16[1024,1024]) {
  %b = bf16[64,1024,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
  %x = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %i = s32[] parameter(2)
  %n = bf16[1024,1024]{1,0:T(8,128)(2,1)} negate(%x)
  %r = bf16[1,1024,1024]{2,1,0:T(8,128)(2,1)} bitcast(%n)
  %z = s32[] constant(0)
  %d = bf16[64,1024,1024]{2,1,0:T(8,128)(2,1)} dynamic-update-slice(%b, %r, %i, %z, %z)
  ROOT %t = (bf16[64,1024,1024]{2,1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}) tuple(%d, %n)
}"""
    entry = """%b = bf16[64,1024,1024]{2,1,0:T(8,128)(2,1)} parameter(0)
%x = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
%i = s32[] parameter(2)
%f = (bf16[64,1024,1024]{2,1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}) fusion(%b, %x, %i), kind=kLoop, calls=%step"""
    m = hlo.parse(module(entry, body))
    one = 1024 * 1024 * 2
    assert cost.instruction_work(m, m.computations["main"][-1]).hbm_bytes == 3 * one + 4  # x and i read; update, n written


def test_a_kernels_matmul_runs_at_its_own_efficiency():
    flops = 2 * 2048 * 512 * 256
    eff = cost.Efficiency(mxu=0.5, mxu_kernel=0.25, hbm=0.5, vmem=0.25, row_s=1e-8, op_s=1e-6)
    e = cost.estimate(module(RAGGED), CEILINGS, eff)
    assert e["compute_s"] == pytest.approx(flops / (1e12 * 0.25))
    assert cost.estimate(module(DOT_ARGS + "\n" + DOT_CALL, DOT), CEILINGS, eff)["compute_s"] == pytest.approx(
        DOT_FLOPS / (1e12 * 0.5))


def test_the_plan_reports_the_estimate_and_its_parts():
    from core.plan.report import step_estimate
    from core.plan.targets import parse_target

    text = module(DOT_ARGS + "\n" + DOT_CALL, DOT)
    out = step_estimate(parse_target("v5e-1"), text, tokens=4096)
    parts = out["step_estimate"]
    names = ("compute_s", "memory_s", "gather_s", "overhead_s", "dma_wait_s", "collective_s")
    assert out["estimated_step_s"] == pytest.approx(sum(parts[k] for k in names))
    assert out["estimated_tokens_per_s"] == pytest.approx(4096 / out["estimated_step_s"])
    assert parts["compute_s"] == pytest.approx(DOT_FLOPS / (parts["peak_flops"] * cost.V5E.mxu))
    assert step_estimate(parse_target("cpu:2"), text, tokens=4096)["estimated_step_s"] is None


@pytest.mark.parametrize("name, torus", [
    ("v5p-128", ((4, 2), (4, 2), (4, 2))),    # a whole cube: each axis a ring
    ("v5p-64", ((2, 1), (4, 1), (4, 1))),     # less than a cube: lines
    ("v5e-256", ((16, 2), (16, 2))),          # a whole v5e pod: rings
    ("v5e-8", ((2, 1), (4, 1))),
    ("v5e-1", ()),
    ("h200x8", ()),                           # NVLink: a switch
])
def test_a_targets_torus(name, torus):
    from core.plan.targets import ceilings, parse_target

    assert parse_target(name).torus == torus
    assert ceilings(parse_target(name)).torus == torus


def test_drop_free_expert_parallelism_prices_its_grouped_matmuls_at_the_balanced_rows():
    """`ragged_rows` on expert 8 x fsdp 2 (16 token shards), 1 x 128 tokens a device, k 2 of 16 experts:
    n = 128 tokens a device, drop-free buffers of P n min(k, E/P) = 8 * 128 * 2 rows priced at n k = 256;
    with a capacity factor, on ragged's tiled sibling, or without an expert axis: none (priced as built)."""
    from jax.sharding import AbstractMesh

    from core.plan.report import ragged_rows
    from tests.conftest import tiny_config

    mesh = AbstractMesh((1, 2, 1, 8), ("data", "fsdp", "tensor", "expert"))
    cfg = tiny_config("sparse", "num_experts=16", "num_experts_per_tok=2", "moe_impl=gmm", "max_target_length=128",
                      "per_device_batch_size=1")
    rows = ragged_rows(cfg, mesh, global_batch=16)
    assert (rows["static_rows"], rows["padded_rows"], rows["priced_rows"]) == (2048, 2048, 256)
    assert ragged_rows(cfg.replace(moe_gmm_tiles=(512,) * 6 + (768, 512, 512)), mesh, 16)["padded_rows"] == 2304
    assert ragged_rows(cfg.replace(moe_capacity_factor=1.0), mesh, 16) is None
    assert ragged_rows(cfg.replace(moe_impl="tiled"), mesh, 16) is None
    assert ragged_rows(cfg, AbstractMesh((1, 16, 1, 1), ("data", "fsdp", "tensor", "expert")), 16) is None


def test_a_group_across_gpu_hosts_moves_at_the_networks_rate():
    """Four devices on two hosts (0, 0, 1, 1): an all-gather within each host crosses NVLink's switch; one
    whose groups pair devices of two hosts goes through each device's NIC, at the network's rate."""
    gpus = cost.Ceilings(peak_flops=1e12, hbm_bandwidth=1e11, link_bandwidth=1e10, network_bandwidth=1e9,
                         hosts=(0, 0, 1, 1))
    x = "%x = bf16[1024,1024]{1,0} parameter(0)"
    within = f"%y = bf16[2048,1024]{{1,0}} all-gather(%x), dimensions={{0}}, replica_groups={{{{0,1}},{{2,3}}}}"
    across = f"%y = bf16[2048,1024]{{1,0}} all-gather(%x), dimensions={{0}}, replica_groups={{{{0,2}},{{1,3}}}}"
    half = 2048 * 1024 * 2 / 2  # each device receives its peer's half
    assert cost.estimate(module(f"{x}\n{within}"), gpus, EFF)["collective_s"] == pytest.approx(half / 1e10)
    assert cost.estimate(module(f"{x}\n{across}"), gpus, EFF)["collective_s"] == pytest.approx(half / 1e9)
    permute = "%y = bf16[1024,1024]{1,0} collective-permute(%x), source_target_pairs={{0,2},{2,0}}"
    assert cost.estimate(module(f"{x}\n{permute}"), gpus, EFF)["collective_s"] == pytest.approx(half / 1e9)  # its whole array
    # an all-to-all over the four: each device's quarter bound for its host's other device crosses NVLink,
    # beside the two quarters bound for the other host, which cross the network
    a2a = "%y = bf16[1024,1024]{1,0} all-to-all(%x), dimensions={0}, replica_groups={{0,1,2,3}}"
    assert cost.estimate(module(f"{x}\n{a2a}"), gpus, EFF)["collective_s"] == pytest.approx(half / 2 / 1e9)
    # without hosts (a TPU slice, or a plan that names none) every group stays on the links
    assert cost.estimate(module(f"{x}\n{across}"), CEILINGS, EFF)["collective_s"] == pytest.approx(half / 1e10)


def test_a_gpu_target_prices_hosts_and_rows_as_a_gpu():
    """h200x16: two hosts of 8, each GPU's NIC at 400 Gb/s; a gathered row costs one 32-byte DRAM sector
    at the HBM rate, where a TPU's costs row_s; a TPU target keeps no hosts (one slice's ICI)."""
    from core.plan.targets import ceilings, efficiency, parse_target

    h200 = parse_target("h200x16")
    c = ceilings(h200, tuple(i // 8 for i in range(16)))
    assert (c.network_bandwidth, c.hosts[7], c.hosts[8]) == (5.0e10, 0, 1)
    assert efficiency(h200).row_s == pytest.approx(32 / (h200.chip.hbm_bandwidth * cost.V5E.hbm))
    assert efficiency(h200).mxu == cost.V5E.mxu
    v5p = parse_target("v5p-128")
    assert efficiency(v5p) == cost.V5E
    assert ceilings(v5p, tuple(range(64))).hosts == ()
