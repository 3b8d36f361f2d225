"""The fused attention kernels (core.ops.fused_attention) vs `softmax_attention` with dense masks.

Pallas' interpret mode on the CPU, float32: the value and the gradients of q, kv, ckv and the sink
against autodiff of the dense formula, on packed rows with padding tokens, T not a multiple of the
key block, CSA-like (a random selection among visible entries), HCA-like and SWA layers, and a
window wider than 128. Every case has at least three query blocks and two key blocks. The inputs
follow DESIGN.md, positions counting up by one inside a document: the kernel relies on it (a
query's window keys are among its S - 1 predecessors, so within two key blocks). With libtpu
installed, the kernels also compile for a v5e chip (compile-only, no TPU).
"""

from __future__ import annotations

import functools
import importlib.util
import pytest
from tests.model.test_attention import packed
from tests.ops.test_sparse_attention import check_layer_equals_masked

import jax
import jax.numpy as jnp
import numpy as np

from core.ops.masked_attention import compressed_visibility, sliding_window_mask, softmax_attention
from core.ops.fused_attention import fused_attention, key_block

D = 128
# (name, row document lengths, T, H, window S, ratio (0: SWA), block_q)
CASES = [
    ("csa top-k, packed with padding", [[70, 60], [160]], 160, 4, 24, 4, 16),
    ("hca-like ratio 128", [[256], [130, 90]], 256, 8, 32, 128, 16),
    ("swa, T not a multiple of the key block", [[150, 40], [190]], 200, 4, 17, 0, 16),
    ("window over 128: key blocks of 256", [[300], [40, 250]], 300, 4, 130, 4, 32),
    ("entries in three chunks of 128, skipped past each step's reach", [[544], [300, 200]], 544, 4, 24, 2, 32),
]
IDS = [c[0] for c in CASES]


def _inputs(case, seed=0):
    """pos, seg, q, kv, ckv, sink, allowed, cotangent; `allowed` is the visible entries, thinned at
    random (a top-k-like selection) and never any entry w = 3 mod 7 (for the zero gradient)."""
    _, rows, t, h, _, ratio, _ = case
    rng = np.random.default_rng(seed)
    pos, seg = (jnp.asarray(a, jnp.int32) for a in packed(rows, t))
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, kv, sink, cot = arr(2, t, h, D) * D ** -0.5 * 4, arr(2, t, D), arr(h), arr(2, t, h, D)
    ckv, allowed = None, None
    if ratio:
        w = t // ratio
        ckv = arr(2, w, D)
        keep = rng.random((2, t, w)) < (0.5 if ratio == 4 else 1.0)
        allowed = compressed_visibility(pos, seg, ratio) & jnp.asarray(keep) & (jnp.arange(w) % 7 != 3)
    return pos, seg, q, kv, ckv, sink, allowed, cot


def _results(case):
    return _results_of(case[0])


def _value_and_grads(attend, q, kv, ckv, sink, cot):
    """(o, (dq, dkv, dckv, dsink)) of `attend` at (q, kv, ckv, sink) for the cotangent `cot`: one jitted
    program (eagerly, each operation around the kernels would compile on its own)."""
    def run(q, kv, ckv, sink, cot):
        o, vjp = jax.vjp(attend, q, kv, ckv, sink)
        return o, vjp(cot)

    return jax.jit(run)(q, kv, ckv, sink, cot)


@functools.cache  # by name: each case runs once for the tests below
def _results_of(name):
    """(fused, reference), each (o, (dq, dkv, dckv, dsink)), and the inputs."""
    case = CASES[IDS.index(name)]
    _, _, _, _, window, _, block_q = case
    pos, seg, q, kv, ckv, sink, allowed, cot = _inputs(case)
    win = sliding_window_mask(pos, seg, window)
    fused = lambda q, kv, ckv, sink: fused_attention(q, kv, sink, pos, seg, window, ckv, allowed, block_q=block_q,
                                                     interpret=True)
    dense = lambda q, kv, ckv, sink: softmax_attention(q, kv, win, sink, ckv, allowed)
    out = [_value_and_grads(attend, q, kv, ckv, sink, cot) for attend in (fused, dense)]
    return out, (pos, seg, q, kv, ckv, sink, allowed, cot)


def _close(a, b, name):
    err, scale = float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b)))
    assert err <= 1e-5 * max(scale, 1.0), f"{name}: max |fused - dense| {err:.2e} (max |dense| {scale:.2e})"


def test_cases_span_three_query_blocks_and_two_key_blocks():
    for _, _, t, _, window, _, block_q in CASES:
        kb = key_block(block_q, window)
        assert -(-t // block_q) >= 3 and -(-t // kb) >= 2 and kb >= window


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_value_and_gradients_match_softmax_attention(case):
    ((o, grads), (o_ref, grads_ref)), _ = _results(case)
    _close(o, o_ref, "o")
    for name, g, g_ref in zip(("dq", "dkv", "dckv", "dsink"), grads, grads_ref):
        if g_ref is not None:
            _close(g, g_ref, name)


def test_value_and_gradients_match_the_float64_reference(x64):
    """The CSA case against `softmax_attention` in float64: the kernels compute in float32, so to
    float32 rounding of the exact values."""
    case = CASES[0]
    _, _, _, _, window, _, block_q = case
    pos, seg, q, kv, ckv, sink, allowed, cot = _inputs(case)
    f64 = [x.astype(jnp.float64) for x in (q, kv, ckv, sink)]
    fused = lambda q, kv, ckv, sink: fused_attention(q, kv, sink, pos, seg, window, ckv, allowed,  # noqa: E731
                                                     block_q=block_q, interpret=True)
    exact = lambda q, kv, ckv, sink: softmax_attention(q, kv, sliding_window_mask(pos, seg, window), sink,  # noqa: E731
                                                       ckv, allowed)
    o, grads = _value_and_grads(fused, q, kv, ckv, sink, cot)
    o_ref, grads_ref = _value_and_grads(exact, *f64, cot.astype(jnp.float64))
    assert o_ref.dtype == jnp.float64
    _close(o, o_ref, "o")
    for name, g, g_ref in zip(("dq", "dkv", "dckv", "dsink"), grads, grads_ref):
        _close(g, g_ref, name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rows_with_nothing_allowed_give_zero(case):
    """Padding tokens see nothing (not even the sink's value): o and dq are exactly 0 there."""
    ((o, (dq, *_)), _), (pos, seg, *_) = _results(case)
    pad = seg == 0
    assert bool(jnp.any(pad))
    assert float(jnp.max(jnp.abs(jnp.where(pad[..., None, None], o, 0.0)))) == 0.0
    assert float(jnp.max(jnp.abs(jnp.where(pad[..., None, None], dq, 0.0)))) == 0.0


@pytest.mark.parametrize("case", [c for c in CASES if c[5]], ids=[c[0] for c in CASES if c[5]])
def test_entries_never_allowed_get_exactly_zero_gradient(case):
    ((_, (_, _, dckv, _)), _), (*_, allowed, _) = _results(case)
    never_bw = ~jnp.any(allowed, axis=1)
    assert bool(jnp.any(never_bw)) and bool(jnp.any(~never_bw))
    assert float(jnp.max(jnp.abs(jnp.where(never_bw[..., None], dckv, 0.0)))) == 0.0


def test_each_step_reads_the_entries_up_to_its_reach_only():
    """A step's reach is 1 + the last chunk of 128 entries any of its rows may attend; the kernels
    never read a chunk past it: NaN entries there leave every value and gradient finite."""
    from core.ops.fused_attention import entry_reach

    case = CASES[IDS.index("entries in three chunks of 128, skipped past each step's reach")]
    _, _, t, _, window, ratio, block_q = case
    pos, seg, q, kv, ckv, sink, allowed, cot = _inputs(case)
    visible = compressed_visibility(pos, seg, ratio)
    wp = 3 * 128
    padded = jnp.pad(visible, ((0, 0), (0, t % block_q), (0, wp - visible.shape[-1])))
    reach = np.asarray(entry_reach(padded, block_q)).reshape(2, -1)
    last = np.arange(1, t // block_q + 1) * block_q // ratio  # entries complete by each step's last token
    assert reach[0].tolist() == [min(3, -(-n // 128)) for n in last]
    assert reach.min() < 3 and reach.max() == 3
    ckv = ckv.at[:, 256:].set(jnp.nan)  # chunk 2, attended by no row below
    allowed = allowed & (jnp.arange(ckv.shape[1]) < 256)
    fused = lambda q, kv, ckv, sink: fused_attention(q, kv, sink, pos, seg, window, ckv, allowed,  # noqa: E731
                                                     block_q=block_q, interpret=True)
    o, (dq, dkv, dckv, dsink) = _value_and_grads(fused, q, kv, ckv, sink, cot)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in (o, dq, dkv, dsink, dckv)), "a skipped chunk was read"


def test_shapes_a_tpu_cannot_compile_are_one_config_error():
    from core.errors import ConfigError
    from core.ops.fused_attention import check_kernel_shapes

    check_kernel_shapes(64, 512)  # V4-Flash's
    for heads, head_dim in ((4, 32), (64, 192), (8, 512)):
        with pytest.raises(ConfigError, match=rf"head_dim={head_dim}, {heads} heads per device\): use attention=chunked"):
            check_kernel_shapes(heads, head_dim)


def test_bad_arguments_raise():
    pos, seg, q, kv, ckv, sink, allowed, _ = _inputs(CASES[0])
    with pytest.raises(ValueError, match="block_q"):
        fused_attention(q, kv, sink, pos, seg, 24, ckv, allowed, block_q=12, interpret=True)
    with pytest.raises(ValueError, match="together"):
        fused_attention(q, kv, sink, pos, seg, 24, ckv, None, interpret=True)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "dsv4[tpu]"')
def test_forward_and_backward_compile_for_a_v5e_chip():
    """Mosaic's layout and VMEM checks, compile-only (bf16, H = 16, W = 64)."""
    from jax.experimental.topologies import get_topology_desc
    from jax.sharding import SingleDeviceSharding

    topo = get_topology_desc(topology_name="v5e:1x1", platform="tpu", chip_config_name="default",
                             chips_per_host_bounds=(1, 1, 1), num_slices=1)
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(topo.devices[0]))
    b, t, h, w = 1, 256, 16, 64

    def loss(q, kv, ckv, sink, pos, seg, allowed):
        o = fused_attention(q, kv, sink, pos, seg, 128, ckv, allowed, block_q=16)
        return jnp.sum(o.astype(jnp.float32))

    ins = (spec((b, t, h, D), jnp.bfloat16), spec((b, t, D), jnp.bfloat16), spec((b, w, D), jnp.bfloat16),
           spec((h,), jnp.float32), spec((b, t), jnp.int32), spec((b, t), jnp.int32), spec((b, t, w), jnp.bool_))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*ins).compile()
    assert compiled.memory_analysis().output_size_in_bytes > 0


LAYER_CASES = [  # (ratio, dense, indexer_loss, extra spec fields): the layer with `attention: fused`
    (4, False, True, dict(loss_scale=0.1, topk_attention="mask")),       # the sparse stage's CSA
    (4, True, True, dict(loss_scale=0.1)),                               # dense CSA (pre-training, warm-up)
    (4, False, False, dict(topk_attention="gather", projections="whole")),  # a gathered selection, as its mask
]  # HCA and SWA layers take the dense case's and the kernel cases' paths


@pytest.mark.parametrize("ratio,dense,loss,kw", LAYER_CASES)
def test_layer_fused_equals_masked(ratio, dense, loss, kw):
    """The whole layer, `attention: fused` (interpret mode) against the masked reference: output,
    indexer loss, the input's and every parameter's gradient, to float32 rounding."""
    check_layer_equals_masked("fused", ratio, dense, loss, kw, seed=3 + ratio)


SHARDED = """
import json, jax, jax.numpy as jnp, numpy as np
from core.ops.chunked_attention import Keys, RowQueries
from core.ops.fused_attention import fused_layer_attention
from core.parallel.mesh import MESH_AXES
from tests.model.test_attention import packed
rng = np.random.default_rng(0)
arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
t, h, d, w = 64, 4, 16, 16
pos, seg = (jnp.asarray(a, jnp.int32) for a in packed([[40, 20], [64]], t))
q, kv, ckv, sink, cot = arr(2, t, h, d) / 4, arr(2, t, d), arr(2, w, d), arr(h), arr(2, t, h, d)

def loss(q, kv, ckv, sink):
    o = fused_layer_attention(RowQueries.given(q), Keys(kv, sink, 8, ckv, 4), pos, seg, block_q=8)
    return jnp.sum(o * cot)

one = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, kv, ckv, sink)
mesh = jax.make_mesh((2, 1, 2, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)  # as the run's
with jax.set_mesh(mesh):
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    hlo = step.lower(q, kv, ckv, sink).as_text()
    many = step(q, kv, ckv, sink)
diff = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many))]
print(json.dumps({"diff": diff, "scale": [float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(one)],
                  "manual": "shard_map" in hlo or "manual" in hlo}))
"""


def test_on_a_mesh_each_device_runs_its_own_rows_and_heads():
    """`fused_layer_attention` on 4 fake CPU devices (data 2 x tensor 2: rows and heads split, inside
    `jax.shard_map`) equals one device in value and gradients (a subprocess: this one has one device)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {os.environ.get('XLA_FLAGS', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("JAX_ENABLE_X64", None)
    proc = subprocess.run([sys.executable, "-c", SHARDED], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["manual"], "the kernels should run inside shard_map"
    for diff, scale in zip(out["diff"], out["scale"]):
        assert diff <= 1e-5 * max(scale, 1.0), out
