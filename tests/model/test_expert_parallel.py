"""core.ops.expert_parallel through core.model.moe: expert parallelism on 8 fake CPU devices equals one device.

This pytest process has already started JAX with one device, so the mesh cases run in one subprocess
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, this very file as its entry point, as
tests/parallel/test_sharding.py does) that prints one JSON object: per case, the max differences to
the one-device MoE (no mesh: the tiled path), the CPU form of the exchange against ragged_all_to_all's
definition, and a one-step training run's drop rate (metrics.jsonl) with its checkpoint's evaluation
on the same mesh. The module is traced under `jax.set_mesh(mesh)`, which makes the mesh visible to
`jax.sharding.get_abstract_mesh()`. XLA:CPU has no ragged-all-to-all: every case here runs the
exchange's all_to_all form (core/ops/expert_parallel.py `emulated_ragged_all_to_all`); the TPU program's
ragged exchange is compiled by tests/plan/test_expert_memory.py.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
# name -> (data, fsdp, tensor, expert)
MESHES = {"expert8": (1, 1, 1, 8), "fsdp2_expert4": (1, 2, 1, 4), "tensor2_expert4": (1, 1, 2, 4)}
# name -> (hash routed, k, table kind): learned top-k; every token to expert 3 alone (one device receives
# every slot, seven receive none; unnormalised weights, so the router still gets a gradient); expert 1
# for every token, never expert 0.
ROUTINGS = {"learned": (False, 3, None), "all_to_expert3": (True, 1, "three"), "expert1_always": (True, 3, "one")}
# every routing on expert 8; the learned one on the meshes that also split the weights (suite time); the
# tiled dispatch at the destination, and the grouped matmuls (ragged_dot; gmm's kernels in interpret mode)
CASES = [(m, r, "tiled") for m in MESHES for r in ROUTINGS if m == "expert8" or r == "learned"]
CASES += [("expert8", "all_to_expert3", "ragged"), ("fsdp2_expert4", "learned", "ragged"),
          ("tensor2_expert4", "learned", "gmm"), ("expert8", "all_to_expert3", "batched"),
          ("tensor2_expert4", "learned", "batched")]
B, T = 8, 16                     # 128 tokens: 16 per device on every mesh
DTYPES = ("float32", "float64")


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker():
    from tests.conftest import device_worker  # here: the worker runs this file as __main__, without conftest

    return device_worker(HERE, devices=8, timeout=1200)


@pytest.mark.parametrize("mesh, routing, impl", CASES)
def test_expert_parallel_equals_one_device_value_and_gradient(worker, mesh, routing, impl):
    """Loss, output and gradients (x, router, expert and shared weights) equal the one-device MoE to float32
    rounding; the step exchanges tokens with all-to-all; nothing is dropped."""
    case = worker[f"{mesh}/{routing}/{impl}"]
    assert case["all_to_all"], "the expert-parallel step should exchange tokens with all-to-all"
    assert case["dropped"] == 0.0
    for what, (diff, scale) in case["diffs"].items():
        assert diff <= 1e-5 * max(1.0, scale), f"{mesh}/{routing}/{impl} {what}: max |diff| = {diff:.3e} (scale {scale:.2e})"
    assert case["diffs"]["d gate/weight"][1] > 1e-3, "the router weight should get a gradient"
    if routing == "all_to_expert3":
        assert case["receivers"] == 1, "one device should receive every slot, the others none"


def test_grouped_matmul_moe_on_a_mesh_equals_one_device(worker):
    """moe_impl=ragged on data 2 x fsdp 2 x tensor 2 (on a TPU a Mosaic kernel, run per device inside
    shard_map, as gmm is): loss, output and every gradient equal the one-device MoE to float32 rounding."""
    for what, (diff, scale) in worker["token_parallel"]["ragged"].items():
        assert diff <= 1e-5 * max(1.0, scale), f"ragged {what}: max |diff| = {diff:.3e} (scale {scale:.2e})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_parallel_experts_equal_the_one_device_dispatch(worker, dtype):
    """`expert_parallel_experts` on fsdp 2 x expert 4 (two local experts: a token may send two slots to one
    device) equals the one-device tiled dispatch in value and in the gradients of x, the combine weights and
    the expert weights: to float32 rounding, and in float64 to float64 rounding (the one-device dispatch is
    tested against its float64 dense reference in tests/model/test_moe_dispatch.py)."""
    tol = 1e-5 if dtype == "float32" else 1e-12
    for what, (diff, scale) in worker["direct"][dtype].items():
        assert diff <= tol * max(1.0, scale), f"{dtype} {what}: max |diff| = {diff:.3e} (scale {scale:.2e})"


def test_the_cpu_exchange_is_ragged_all_to_all_by_its_definition(worker):
    """`emulated_ragged_all_to_all` on expert 8, random sizes and offsets (blocks placed with gaps and out of
    order, into an output of ones): equal to jax.lax.ragged_all_to_all's documented send loop, written in
    NumPy; rows no block writes keep the output's value."""
    case = worker["emulated"]
    assert case["rows_sent"] > 0 and case["untouched"] > 0, case
    assert case["diff"] == 0.0, case


def test_capacity_factor_drops_the_later_slots_and_reports_their_fraction(worker):
    """capacity_factor 1 on expert 8: each destination keeps its first ceil(n k) received slots, filled source
    by source, then by local expert, then in token order; the output equals the dense MoE without the others
    and aux['dropped'] is their fraction."""
    case = worker["capacity"]
    assert 0 < case["expected_dropped"] < 0.5, case
    assert abs(case["dropped"] - case["expected_dropped"]) < 1e-7, case
    diff, scale = case["diff"]
    assert diff <= 1e-5 * max(1.0, scale), f"output vs dense without the dropped slots: {diff:.3e}"


def test_batched_capacity_drops_each_local_experts_later_slots(worker):
    """moe_impl batched, capacity_factor 1 on fsdp 2 x expert 4 (two local experts a device): each local expert
    keeps its first ceil(n k / E_l) received slots, filled source by source, then in token order (the exchange's
    `per_expert`, each destination's kept slots sent first); the output and the expert weights' gradients equal
    the dense MoE's without the others, and aux['dropped'] is their fraction."""
    case = worker["capacity_batched"]
    assert 0 < case["expected_dropped"] < 0.5, case
    assert abs(case["dropped"] - case["expected_dropped"]) < 1e-7, case
    diff, scale = case["diff"]
    assert diff <= 1e-5 * max(1.0, scale), f"output vs dense without the dropped slots: {diff:.3e}"
    assert case["grad_diff"] <= 1e-5, f"expert weights' gradients vs dense without the dropped slots: {case['grad_diff']:.3e}"


def test_capacity_drop_rate_reaches_the_training_metrics(worker):
    """A training run on expert 8 with moe_capacity_factor 1 (two hash-routed layers: the routing is the
    tables' and the batch's, known in advance): metrics.jsonl's moe_dropped is the fraction of slots past
    each destination's ceil(f n k) rows (filled source by source, then by local expert), by hand, mean over
    layers; the same model drop-free drops 0."""
    case = worker["training"]
    assert 0.01 < case["expected_dropped"] < 0.5, case
    assert abs(case["row_dropped"] - case["expected_dropped"]) < 1e-6, case
    assert case["jsonl_dropped"] == case["row_dropped"], case
    assert case["forward_dropped_free"] == 0.0, case


def test_evaluation_runs_the_expert_parallel_moe_and_equals_data_parallel(worker):
    """`evaluate_checkpoint` on the expert-8 run traces the MoE's expert-parallel exchange (the training
    path), and its figures equal the same checkpoint's evaluation on data 8 (the tiled MoE) to rounding."""
    case = worker["eval"]
    assert case["expert_parallel_calls"] > 0, "eval on an expert mesh should take the expert-parallel MoE"
    assert case["data_parallel_calls"] == 0, case
    assert case["batch_size"] == 8, case
    for what, (diff, scale) in case["diffs"].items():
        assert diff <= 1e-5 * max(1.0, scale), f"eval {what}: max |diff| = {diff:.3e} (scale {scale:.2e})"


# ----------------------------------------------------------------------------- the 8-device worker


def _models(routing, impl="tiled", **kw):
    import jax.numpy as jnp
    import numpy as np

    from tests.model.test_moe import _moe

    hash_routed, k, table = ROUTINGS[routing]
    m = _moe(hash_routed, k=k, impl=impl, normalize=k > 1, **kw)
    if table is not None:
        rng = np.random.default_rng(k)
        rows = (np.full((50, 1), 3) if table == "three" else
                np.stack([np.concatenate([[1], rng.permutation(np.arange(2, 8))[:k - 1]]) for _ in range(50)]))
        m.gate.tid2eid[...] = jnp.asarray(rows, jnp.int32)
    return m


def _inputs():
    import jax.numpy as jnp
    import numpy as np

    from tests.model.test_moe import _normal

    x = _normal(11, (B, T, 16), jnp.float32, 3.0)
    tokens = jnp.asarray(np.random.default_rng(12).integers(0, 50, (B, T)), jnp.int32)
    valid = np.arange(T)[None, :] < np.array([[T - 3]] + [[T]] * (B - 1))
    return x, tokens, jnp.asarray(valid), _normal(13, (B, T, 16))


def _mesh(shape):
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    return Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor", "expert"),
                axis_types=(AxisType.Auto,) * 4)


def _jitted_step(tokens, valid, cot):
    """(model, x) -> ((loss, (y, aux)), (d params, d x)), jitted."""
    import jax.numpy as jnp
    from flax import nnx

    def loss(m, x):
        y, aux = m(x, tokens, valid)
        return jnp.sum(y * cot) + aux["lb_loss"], (y, aux)

    return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _step(model, x, tokens, valid, cot):
    """((loss, (y, aux)), (d params, d x)), jitted."""
    return _jitted_step(tokens, valid, cot)(model, x)


def _diff(a, b):
    """[max |a - b|, max |b|] in float64."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return [float(np.max(np.abs(a - b))), float(np.max(np.abs(b)))]


@functools.cache
def _one_device(routing):
    return _step(_models(routing), *_inputs())


def _token_parallel(impl):
    """The grouped-matmul MoE (moe_impl `impl`) on data 2 x fsdp 2 x tensor 2: each device's
    tokens in `jax.shard_map`, the hidden width split over tensor; against the one-device tiled MoE."""
    import jax
    from flax import nnx

    from core.parallel import sharding

    x, tokens, valid, cot = _inputs()
    (v0, (y0, _)), (g0, gx0) = _one_device("learned")
    mesh = _mesh((2, 2, 2, 1))
    model = sharding.shard_state(_models("learned", impl=impl), mesh)
    with jax.set_mesh(mesh):
        (v1, (y1, _)), (g1, gx1) = _step(model, jax.device_put(x, sharding.batch_sharding(mesh)), tokens, valid, cot)
    diffs = {"loss": _diff(v1, v0), "y": _diff(y1, y0), "d x": _diff(gx1, gx0)}
    flat1 = dict(nnx.to_flat_state(g1))
    for path, v in nnx.to_flat_state(g0):
        diffs["d " + "/".join(map(str, path))] = _diff(flat1[path].get_value(), v.get_value())
    return diffs


def _parity(mesh_name, routing, impl):
    import jax
    import numpy as np
    from flax import nnx

    from core.parallel import sharding

    x, tokens, valid, cot = _inputs()
    (v0, (y0, _)), (g0, gx0) = _one_device(routing)
    mesh = _mesh(MESHES[mesh_name])
    model = sharding.shard_state(_models(routing, impl=impl), mesh)
    xs = jax.device_put(x, sharding.batch_sharding(mesh))
    step = _jitted_step(tokens, valid, cot)
    with jax.set_mesh(mesh):  # the step lowered once: its text read, then compiled and run
        hlo = step.lower(model, xs).as_text()
        (v1, (y1, aux1)), (g1, gx1) = step(model, xs)

    diffs = {"loss": _diff(v1, v0), "y": _diff(y1, y0), "d x": _diff(gx1, gx0)}
    flat0, flat1 = dict(nnx.to_flat_state(g0)), dict(nnx.to_flat_state(g1))
    assert set(flat0) == set(flat1)
    for path, v in flat0.items():
        diffs["d " + "/".join(map(str, path))] = _diff(flat1[path].get_value(), v.get_value())
    e_local = 8 // MESHES[mesh_name][3]
    idx = np.asarray(_models(routing).gate.tid2eid[...])[np.asarray(tokens)] if ROUTINGS[routing][0] else None
    receivers = None if idx is None else len(np.unique(idx // e_local))
    return {"diffs": diffs, "dropped": float(aux1["dropped"]), "all_to_all": "all_to_all" in hlo or "all-to-all" in hlo,
            "receivers": receivers}


def _kept_slots(idx_pnk, experts: int, cap: int, per_expert: bool = False):
    """keep [P, n, k]: each destination's (each local expert's, `per_expert`) first `cap` received slots, source
    by source, local expert by local expert, token by token (the exchange's order); the rest dropped."""
    import numpy as np

    devices, n, k = idx_pnk.shape
    local = experts // devices
    keep = np.zeros(idx_pnk.shape, bool)
    for dest in range(devices):
        filled = np.zeros(experts, int)
        for src in range(devices):
            for e in range(dest * local, (dest + 1) * local):
                for token, j in zip(*np.nonzero(idx_pnk[src] == e)):
                    at = e if per_expert else dest
                    keep[src, token, j] = filled[at] < cap
                    filled[at] += 1
    return keep


def _capacity(mesh_name="expert8", impl="tiled"):
    """capacity 1 on `mesh_name` (no tensor split): the MoE against the dense MoE with the expected dropped
    slots' weights zeroed; `batched` keeps ceil(n k / E_l) slots per local expert, the others n k per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from core.model import moe
    from core.parallel import sharding

    from flax import nnx

    x, tokens, valid, cot = _inputs()
    model = _models("learned", impl=impl, capacity_factor=1.0)
    logits = jnp.einsum("btm,me->bte", x, model.gate.weight[...])
    idx, weights, _ = moe.route(logits, model.gate.bias[...], 3, scaling=model.spec.scaling, normalize=True)
    data, fsdp, _, ep = MESHES[mesh_name]
    idx, weights = np.asarray(idx).reshape(data * fsdp, ep, -1, 3), np.asarray(weights).reshape(data * fsdp, ep, -1, 3)
    per_expert = impl == "batched"
    cap = moe_capacity = idx.shape[2] * 3 // (8 // ep if per_expert else 1)                 # ceil(f n k (/ E_l)), f = 1
    keep = np.stack([_kept_slots(group, 8, cap, per_expert) for group in idx])              # per exchange group
    combine = np.einsum("gdnk,gdnke->gdne", weights * keep, np.eye(8)[idx]).reshape(B, T, 8)
    w = [model.experts.w1[...], model.experts.w2[...], model.experts.w3[...]]
    expected = moe.dense_experts(x, jnp.asarray(combine), *w, model.spec.swiglu_limit) + moe.swiglu_mlp(x, model.shared_experts, model.spec.swiglu_limit, model.dtype)
    # the routed experts' weight gradients: the kept slots' alone
    d_w = jax.grad(lambda *w: jnp.sum(moe.dense_experts(x, jnp.asarray(combine), *w, model.spec.swiglu_limit) * cot),
                   argnums=(0, 1, 2))(*w)
    mesh = _mesh(MESHES[mesh_name])
    model = sharding.shard_state(model, mesh)
    loss = lambda m, x: jnp.sum(m(x, tokens, valid)[0] * cot)  # noqa: E731
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, sharding.batch_sharding(mesh))
        y, aux = jax.jit(lambda x: model(x, tokens, valid))(xs)
        grads = nnx.jit(nnx.grad(loss))(model, xs)
    diff = float(np.max(np.abs(np.asarray(y) - np.asarray(expected))))
    grad_diff = max(_diff(getattr(grads.experts, name)[...], ref)[0] / max(1.0, _diff(0 * ref, ref)[1])
                    for name, ref in zip(("w1", "w2", "w3"), d_w))
    return {"dropped": float(aux["dropped"]), "expected_dropped": float(1 - keep.mean()), "cap": moe_capacity,
            "diff": [diff, float(np.max(np.abs(np.asarray(expected))))], "grad_diff": grad_diff}


def _direct(dtype: str = "float32"):
    """{what: diffs}: `expert_parallel_experts` on fsdp 2 x expert 4 against the one-device tiled dispatch,
    value and gradients, in `dtype` (float64: both paths in float64)."""
    import jax
    import jax.numpy as jnp

    if dtype != "float64":
        return _direct_in(jnp.float32)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        return _direct_in(jnp.float64)
    finally:
        jax.config.update("jax_enable_x64", previous)


def _direct_in(dtype):
    import jax
    import jax.numpy as jnp

    from core.model import moe
    from core.ops.expert_parallel import Exchange, expert_parallel_experts
    from core.model.moe import tiled_experts

    model = _models("learned")
    x, _, _, cot = _inputs()
    logits = jnp.einsum("btm,me->bte", x, model.gate.weight[...])
    idx, weights, _ = moe.route(logits, model.gate.bias[...], 3, scaling=model.spec.scaling, normalize=True)
    w = tuple(a.astype(dtype) for a in (model.experts.w1[...], model.experts.w2[...], model.experts.w3[...]))
    x, weights, cot = x.astype(dtype), weights.astype(dtype), cot.astype(dtype)
    hidden = functools.partial(moe.swiglu_hidden, limit=model.spec.swiglu_limit)
    names = ("y", "d x", "d weights", "d w1", "d w2", "d w3")

    def grads(experts):
        def loss(x, weights, *w):
            y = experts(x, idx, weights, *w)
            return jnp.sum(y * cot), y
        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(x, weights, *w)
        return (y, *g)

    ref = grads(lambda *a: tiled_experts(*a, tile=8, hidden=hidden))
    mesh = _mesh(MESHES["fsdp2_expert4"])
    local = functools.partial(tiled_experts, tile=8, empty_slots=True, hidden=hidden)
    with jax.set_mesh(mesh):
        got = grads(lambda *a: expert_parallel_experts(*a, Exchange(mesh, emulated=True), experts=local)[0])
    return {what: _diff(a, r) for what, a, r in zip(names, got, ref, strict=True)}


def _emulated():
    """emulated_ragged_all_to_all on expert 8 against ragged_all_to_all's send loop (its docstring) in NumPy."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from core.ops.expert_parallel import emulated_ragged_all_to_all

    devices, rows, out_rows, block = 8, 12, 40, 5
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, block + 1, (devices, devices))                 # [src, dst]
    in_off = np.stack([rng.integers(0, rows - sizes[s] + 1) for s in range(devices)])
    out_off = np.zeros_like(sizes)
    for dst in range(devices):                                             # sources' blocks out of order, with gaps
        at = 0
        for src in rng.permutation(devices):
            out_off[src, dst] = at
            at += sizes[src, dst] + rng.integers(0, 2)
    operand = rng.normal(size=(devices, rows, 3)).astype(np.float32)
    expected = np.ones((devices, out_rows, 3), np.float32)
    for src, dst in np.ndindex(devices, devices):
        n = sizes[src, dst]
        expected[dst, out_off[src, dst]:out_off[src, dst] + n] = operand[src, in_off[src, dst]:in_off[src, dst] + n]
    mesh = _mesh(MESHES["expert8"])

    def per_device(x, in_off, send, out_off, recv):
        return emulated_ragged_all_to_all(x[0], jnp.ones((out_rows, 3), x.dtype), in_off[0], send[0], out_off[0],
                                          recv[0], axis_name="expert", block=block)[None]

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=P("expert")))
    got = run(operand, *(jnp.asarray(a, jnp.int32) for a in (in_off, sizes, out_off, sizes.T)))
    written = sum(sizes[:, d].sum() for d in range(devices))
    return {"diff": float(np.max(np.abs(np.asarray(got) - expected))), "rows_sent": int(written),
            "untouched": int(devices * out_rows - written)}


# a 2-layer deepseek4-tiny (SWA, CSA), both layers hash-routed, one row per device on expert 8
RUN_OVERRIDES = ("compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=2", "vocab_size=512",
                 "max_target_length=64", "per_device_batch_size=1", "indexer_topk=4", "dataset_type=synthetic",
                 "jax_cache_dir=", "steps=1", "enable_tensorboard=false", "async_checkpointing=false", "compile_ahead=false",
                 "ici_data_parallelism=1", "ici_expert_parallelism=8")
CAPACITY = 1.0


def _expected_dropped(model, tokens_bt, k: int, experts: int, devices: int) -> float:
    """Per hash layer, the slots past each destination's first ceil(f n k) received ones (`_kept_slots`: source
    by source, local expert by local expert, token by token); their fraction of all B*T*k slots, mean over
    the layers."""
    import math

    import numpy as np

    n = tokens_bt.size // devices
    cap = math.ceil(CAPACITY * n * k)
    fractions = []
    for block in model.layers:
        idx_pnk = np.asarray(block.ffn.gate.tid2eid[...])[tokens_bt.reshape(devices, n)]
        fractions.append(1 - _kept_slots(idx_pnk, experts, cap).mean())
    return float(np.mean(fractions))


def _forward_dropped(cfg, run_dir, batch):
    """aux["moe_dropped"] of a train-mode forward of the run's checkpoint on `cfg`'s mesh."""
    import jax
    from flax import nnx

    from core.checkpoint.store import restore_model
    from core.parallel.mesh import make_mesh
    from core.parallel.sharding import shard_batch
    from core.spec.resolve import resolve
    from core.train.program import with_mesh

    mesh = make_mesh(cfg)
    model, _, _ = restore_model(Path(run_dir) / "checkpoints", 0, resolve(cfg, "cpu", mesh.shape).model, mesh=mesh)
    graphdef, state = nnx.split(model)
    b = shard_batch({k: batch[k] for k in ("tokens", "positions", "segment_ids")}, mesh)
    forward = with_mesh(mesh, lambda s, t, p, g: nnx.merge(graphdef, s).hidden(t, p, g, mode="train")[1]["moe_dropped"])
    return float(jax.jit(forward)(state, b["tokens"], b["positions"], b["segment_ids"]))


def _training_and_eval():
    """A 1-step expert-8 warm-up run with capacity CAPACITY: its drop rate; then eval of its checkpoint on
    expert 8 (drop-free) against data 8, counting the traces of the expert-parallel MoE."""
    import numpy as np
    from flax import nnx

    from core.checkpoint import run_files
    from core.data.batches import train_batches
    from core.spec.resolve import data_spec
    from core.eval.evaluate import evaluate_checkpoint
    from core.eval.rows import EvalSet
    from core.model import moe
    from core.train.run import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config("warmup", *RUN_OVERRIDES, f"moe_capacity_factor={CAPACITY}")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        trainer = Trainer(cfg, stage="warmup", run_dir=run_dir)
        [row] = list(trainer.run())
        batch = next(train_batches(data_spec(cfg), trainer.setup.batch_size))                  # the step's batch
        model, _ = nnx.merge(trainer.graphdef, trainer.state)
        expected = _expected_dropped(model, batch["tokens"], cfg.num_experts_per_tok, cfg.num_experts, 8)
        training = {"row_dropped": row["moe_dropped"], "expected_dropped": expected,
                    "jsonl_dropped": run_files.read_metrics(run_dir)[0]["moe_dropped"],
                    "forward_dropped_free": _forward_dropped(cfg.replace(moe_capacity_factor=0.0), run_dir, batch)}

        calls = [0]
        exchange = moe.expert_parallel_experts

        def counted(*args, **kw):
            calls[0] += 1
            return exchange(*args, **kw)

        moe.expert_parallel_experts = counted
        evals = {}
        try:
            for name, extra in (("expert", ()), ("data", ("ici_expert_parallelism=1", "ici_data_parallelism=8"))):
                before = calls[0]
                evals[name] = evaluate_checkpoint(run_dir, overrides=["moe_capacity_factor=0", *extra],
                                                  eval_set=EvalSet(rows=8),
                                                  ks="2,4").to_dict()
                evals[name + "_calls"] = calls[0] - before
        finally:
            moe.expert_parallel_experts = exchange

    ep, dp = evals["expert"], evals["data"]
    diffs = {f"lm_loss {k}": _diff(ep["lm_loss"][k], dp["lm_loss"][k]) for k in ("dense", "topk")}
    for got, ref in zip(ep["overall"]["by_k"], dp["overall"]["by_k"], strict=True):
        for subset in ("all", "informative"):
            for metric, value in ref[subset].items():
                if value is not None:
                    diffs[f"k={ref['k']} {subset} {metric}"] = _diff(got[subset][metric], value)
    return training, {"expert_parallel_calls": evals["expert_calls"], "data_parallel_calls": evals["data_calls"],
                      "batch_size": ep["checkpoint"]["batch_size"], "diffs": diffs}


if __name__ == "__main__":
    from core.process import tune_garbage_collector

    tune_garbage_collector()  # as in every dsv4 process
    results = {f"{m}/{r}/{i}": _parity(m, r, i) for m, r, i in CASES}
    results["token_parallel"] = {"ragged": _token_parallel("ragged")}  # gmm: the same wrapper (test_moe checks gmm)
    results["capacity"] = _capacity()
    results["capacity_batched"] = _capacity("fsdp2_expert4", "batched")
    results["direct"] = {dtype: _direct(dtype) for dtype in DTYPES}
    results["emulated"] = _emulated()
    results["training"], results["eval"] = _training_and_eval()
    print(json.dumps(results))
