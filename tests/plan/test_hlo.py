"""core/plan/hlo.py: how often each computation runs, matmul FLOPs and bytes accessed, on HLO text.

Against XLA: a scan of matmuls, where XLA's cost analysis counts the loop body once and the
reader counts it as often as it runs; and hand-written HLO for the rules (trip counts from
known_trip_count or the loop condition, call sites summed, convolutions, slices, in-place updates
and scatters).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

HLO = textwrap.dedent("""\
    HloModule m

    %fused_dot (param_0: f32[8,16], param_1: f32[16,4]) -> f32[8,4] {
      %param_0 = f32[8,16]{1,0} parameter(0)
      %param_1 = f32[16,4]{1,0} parameter(1)
      ROOT %dot.1 = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    }

    %fused_slice (param_0.1: f32[100,8,16], param_1.1: s32[]) -> f32[1,8,16] {
      %param_0.1 = f32[100,8,16]{2,1,0} parameter(0)
      %param_1.1 = s32[] parameter(1)
      %zero = s32[] constant(0)
      ROOT %ds = f32[1,8,16]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %zero, %zero), dynamic_slice_sizes={1,8,16}
    }

    %fused_update (param_0.2: f32[100,8,4], param_1.2: f32[1,8,4], param_2.2: s32[]) -> f32[100,8,4] {
      %param_0.2 = f32[100,8,4]{2,1,0} parameter(0)
      %param_1.2 = f32[1,8,4]{2,1,0} parameter(1)
      %param_2.2 = s32[] parameter(2)
      %zero.1 = s32[] constant(0)
      ROOT %dus = f32[100,8,4]{2,1,0} dynamic-update-slice(%param_0.2, %param_1.2, %param_2.2, %zero.1, %zero.1)
    }

    %add_f (x: f32[], y: f32[]) -> f32[] {
      %x = f32[] parameter(0)
      %y = f32[] parameter(1)
      ROOT %sum = f32[] add(%x, %y)
    }

    %fused_scatter (param_0.3: f32[100,8,4], param_1.3: s32[2,1], param_2.3: f32[2,8,4]) -> f32[100,8,4] {
      %param_0.3 = f32[100,8,4]{2,1,0} parameter(0)
      %param_1.3 = s32[2,1]{1,0} parameter(1)
      %param_2.3 = f32[2,8,4]{2,1,0} parameter(2)
      ROOT %sc.1 = f32[100,8,4]{2,1,0} scatter(%param_0.3, %param_1.3, %param_2.3), update_window_dims={1,2}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add_f
    }

    %branch_t (bt: f32[8,16]) -> f32[8,16] {
      %bt = f32[8,16]{1,0} parameter(0)
      ROOT %neg.t = f32[8,16]{1,0} negate(%bt)
    }

    %branch_f (bf: f32[8,16]) -> f32[8,16] {
      %bf = f32[8,16]{1,0} parameter(0)
      ROOT %copy.f = f32[8,16]{1,0} copy(%bf)
    }

    %cond.1 (p.1: (s32[], f32[8,16])) -> pred[] {
      %p.1 = (s32[], f32[8,16]{1,0}) parameter(0)
      %i.1 = s32[] get-tuple-element(%p.1), index=0
      %n.1 = s32[] constant(7)
      ROOT %lt.1 = pred[] compare(%i.1, %n.1), direction=LT
    }

    %body.1 (p.2: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
      %p.2 = (s32[], f32[8,16]{1,0}) parameter(0)
      %x.2 = f32[8,16]{1,0} get-tuple-element(%p.2), index=1
      %w.2 = f32[16,4]{1,0} constant({...})
      %f.2 = f32[8,4]{1,0} fusion(%x.2, %w.2), kind=kOutput, calls=%fused_dot
      %pr.2 = pred[] constant(true)
      %cd.2 = f32[8,16]{1,0} conditional(%pr.2, %x.2, %x.2), true_computation=%branch_t, false_computation=%branch_f
      ROOT %t.2 = (s32[], f32[8,16]{1,0}) tuple(%i.2, %x.2)
    }

    %body.2 (p.3: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
      %p.3 = (s32[], f32[8,16]{1,0}) parameter(0)
      %x.3 = f32[8,16]{1,0} get-tuple-element(%p.3), index=1
      %w.3 = f32[16,4]{1,0} constant({...})
      %f.3 = f32[8,4]{1,0} fusion(%x.3, %w.3), kind=kOutput, calls=%fused_dot
      ROOT %t.3 = (s32[], f32[8,16]{1,0}) tuple(%i.3, %x.3)
    }

    ENTRY %main (a: f32[8,16], big: f32[100,8,16], acc: f32[100,8,4], up: f32[1,8,4], k: s32[], idx: s32[2,1], ups: f32[2,8,4]) -> f32[8,4] {
      %a = f32[8,16]{1,0} parameter(0)
      %big = f32[100,8,16]{2,1,0} parameter(1)
      %acc = f32[100,8,4]{2,1,0} parameter(2)
      %up = f32[1,8,4]{2,1,0} parameter(3)
      %k = s32[] parameter(4)
      %idx = s32[2,1]{1,0} parameter(5)
      %ups = f32[2,8,4]{2,1,0} parameter(6)
      %w1 = (s32[], f32[8,16]{1,0}) while(%a), condition=%cond.1, body=%body.1
      %w2 = (s32[], f32[8,16]{1,0}) while(%a), condition=%cond.9, body=%body.2, backend_config={"known_trip_count":{"n":"3"}}
      %once = f32[8,4]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused_dot
      %s = f32[1,8,16]{2,1,0} fusion(%big, %k), kind=kLoop, calls=%fused_slice
      %u = f32[100,8,4]{2,1,0} fusion(%acc, %up, %k), kind=kLoop, calls=%fused_update
      %sf = f32[100,8,4]{2,1,0} fusion(%acc, %idx, %ups), kind=kLoop, calls=%fused_scatter
      %sc = f32[100,8,4]{2,1,0} scatter(%acc, %idx, %ups), update_window_dims={1,2}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add_f
      %c = f32[4,8]{1,0} convolution(%a, %a), window={size=3 lhs_dilate=3}, dim_labels=bf_oi->bf
      ROOT %e = f32[8,4]{1,0} add(%once, %once)
    }
    """)


def test_runs_trip_counts_and_call_sites():
    from core.plan.hlo import parse, runs

    times = runs(parse(HLO))
    assert times["body.1"] == 7 and times["body.2"] == 3 and times["main"] == 1  # condition's bound; known_trip_count
    assert times["fused_dot"] == 7 + 3 + 1  # summed over its three call sites
    assert times["branch_t"] == times["branch_f"] == 7  # both branches of a predicate's conditional, at every run


def test_matmul_flops_and_bytes_by_hand():
    from core.plan.hlo import bytes_accessed, instruction_bytes, matmul_flops, parse, runs

    module = parse(HLO)
    dot = 2 * 8 * 4 * 16
    conv = 2 * 4 * 8 * 16 * 1  # input features (16) x the one tap of a size-3 window over a 3-dilated input
    assert matmul_flops(module) == dot * 11 + conv
    assert matmul_flops(module, runs(module, loops=False)) == dot * 3 + conv
    main = {i.name: i for i in module.computations["main"]}
    assert instruction_bytes(module, main["s"]) == 2 * 8 * 16 * 4 + 4     # the slice read and written, and the index
    assert instruction_bytes(module, main["u"]) == 2 * 8 * 4 * 4 + 4      # the update in place, not the buffer
    # a scatter-add in place, fused or not: indices and updates read, the updated rows read and written
    # (not the [100, 8, 4] buffer, as HloCostAnalysis would count it)
    assert instruction_bytes(module, main["sf"]) == instruction_bytes(module, main["sc"]) == 2 * 4 + 3 * (2 * 8 * 4 * 4)
    assert instruction_bytes(module, main["once"]) == (8 * 4 + 2 * 8 * 16) * 4
    assert bytes_accessed(module) > 0


def test_a_scan_of_matmuls_against_xla():
    """XLA's cost analysis counts the loop body once; the reader counts it ten times, the same bytes per run."""
    import jax
    import jax.numpy as jnp

    from core.plan.hlo import bytes_accessed, matmul_flops, parse, runs

    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=10)[0]

    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    compiled = jax.jit(f).lower(x, w).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    module = parse(compiled.as_text())
    once = runs(module, loops=False)
    assert matmul_flops(module) == 10 * 2 * 64 * 128 * 128
    assert matmul_flops(module, once) == 2 * 64 * 128 * 128 <= cost["flops"] < 1.1 * 2 * 64 * 128 * 128
    assert bytes_accessed(module, once) == pytest.approx(cost["bytes accessed"], rel=0.1)
    per_run = (64 * 128 + 128 * 128 + 64 * 128) * 4  # the body reads the carry and w, writes the carry
    assert 10 * per_run <= bytes_accessed(module) <= 10 * bytes_accessed(module, once)


def test_convolution_taps_on_padding_and_dilation_holes_count_nothing():
    """XLA:TPU's einsums as convolutions: a batched matmul (a window of 24 over an input dilated by
    24, stride 23: one tap per output) and an outer product (a window of 4 over one element padded
    by 3 on each side: one real tap per output, not 4), against their einsums' FLOPs."""
    from core.plan.hlo import matmul_flops, parse

    module = parse(textwrap.dedent("""\
    ENTRY %main (a: f32[24,128,64], w: f32[24,64,32], x: f32[8,16,1], y: f32[4,4,16]) -> f32[8,4,4] {
      %a = f32[24,128,64]{2,1,0} parameter(0)
      %w = f32[24,64,32]{2,1,0} parameter(1)
      %x = f32[8,16,1]{2,1,0} parameter(2)
      %y = f32[4,4,16]{2,1,0} parameter(3)
      %bmm = f32[24,128,32]{2,1,0} convolution(%a, %w), window={size=24 stride=23 lhs_dilate=24}, dim_labels=0bf_0io->0bf
      ROOT %outer = f32[8,4,4]{2,1,0} convolution(%x, %y), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_o0i->bf0
    }
    """))
    assert matmul_flops(module) == 2 * 24 * 128 * 64 * 32 + 2 * 8 * 4 * 4 * 16


def test_outputs_meeting_a_tap_equal_the_enumeration():
    """The closed form against counting (output, tap) pairs one by one, on seeded random windows."""
    from core.plan.hlo import outputs_meeting

    rng = np.random.default_rng(0)
    for _ in range(2000):
        n_in, n_out, stride, dilate = (int(v) for v in rng.integers(1, 9, size=4))
        offset = int(rng.integers(-12, 13))
        last = (n_in - 1) * dilate
        want = sum(0 <= o * stride + offset <= last and (o * stride + offset) % dilate == 0 for o in range(n_out))
        assert outputs_meeting(n_in, n_out, stride, offset, dilate) == want, (n_in, n_out, stride, offset, dilate)
