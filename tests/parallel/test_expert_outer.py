"""The `expert_outer` mesh axis (core/parallel/mesh.py): the routed experts and the batch split over it as
over `expert`, every other weight replicated across it; on 8 fake CPU devices the MoE on expert_outer 2 x
expert 4 (and with fsdp 2) equals one device in value and every gradient, and its parameters are laid
out as the rules say.

This pytest process has already started JAX with one device, so the mesh cases run in one subprocess
with eight (tests.conftest.device_worker; this file is its __main__). The one-device MoE, the models and
the inputs are tests/model/test_expert_parallel.py's; the exchange runs in its XLA:CPU form there too.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
# name -> ({axis: size}, moe_impl): the batched experts (a GPU's) and the tiles, each with the learned routing
CASES = {"outer2_expert4/batched": ({"expert_outer": 2, "expert": 4}, "batched"),
         "outer2_expert4/tiled": ({"expert_outer": 2, "expert": 4}, "tiled"),
         "fsdp2_outer2_expert2/tiled": ({"fsdp": 2, "expert_outer": 2, "expert": 2}, "tiled")}


@pytest.fixture(scope="module")
def worker():
    from tests.conftest import device_worker  # here: the worker runs this file as __main__, without conftest

    return device_worker(HERE, devices=8, timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_expert_outer_equals_one_device_value_and_gradient(worker, case):
    """Loss, output and gradients (x, router, experts, shared expert) equal the one-device MoE to float32
    rounding; the tokens are exchanged; nothing dropped."""
    got = worker[case]
    assert got["all_to_all"], f"{case}: the step should exchange tokens with all-to-all"
    assert got["dropped"] == 0.0
    for what, (diff, scale) in got["diffs"].items():
        assert diff <= 1e-5 * max(1.0, scale), f"{case} {what}: max |diff| = {diff:.3e} (scale {scale:.2e})"
    assert got["diffs"]["d gate/weight"][1] > 1e-3, "the router weight should get a gradient"


def test_experts_split_over_both_axes_every_other_weight_within_expert(worker):
    """On expert_outer 2 x expert 4: each device holds 8 / 8 experts; the router is sharded over `expert`
    (4 ways) and replicated across `expert_outer`; the batch's 8 rows split 8 ways."""
    specs = worker["specs"]
    assert specs["experts/w1"][0][0] == ["expert_outer", "expert"] and specs["experts/w1"][1] == [1, 16, 12]
    assert specs["gate/weight"] == [["expert", None], [4, 8]]
    assert "expert_outer" in specs["batch"][0][0] and specs["batch"][1] == 1
    assert worker["mesh_axes"] == ["data", "fsdp", "tensor", "expert_outer", "expert"]
    assert worker["mesh_axes_without"] == ["data", "fsdp", "tensor", "expert"], "a size-1 expert_outer stays out"


def test_a_gathered_weights_free_cotangent_reaches_its_shard_without_a_whole_all_reduce(worker):
    """core.ops.placement.gathered_free_cotangent (gather_weight's form on a GPU): the loss and the weight's
    gradient equal one device's, and the compiled gradient holds no all-reduce of the whole weight
    gradient, which the constrained gather_weight's does (its sum over every device before the slice)."""
    got = worker["free_cotangent"]
    for what, (diff, scale) in got["diffs"].items():
        assert diff <= 1e-5 * max(1.0, scale), f"{what}: max |diff| = {diff:.3e} (scale {scale:.2e})"
    assert got["whole_all_reduces"]["constrained"] > 0, "the constrained gather should all-reduce the whole gradient"
    assert got["whole_all_reduces"]["free"] == 0, "the free cotangent should reach the shard without one"


def _mesh(sizes):
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from core.parallel.mesh import mesh_axes

    names = mesh_axes(sizes)
    return Mesh(np.array(jax.devices()).reshape([sizes.get(a, 1) for a in names]), names,
                axis_types=(AxisType.Auto,) * len(names))


def _case(sizes, impl):
    import jax
    from flax import nnx

    from core.parallel import sharding
    from tests.model.test_expert_parallel import _diff, _inputs, _jitted_step, _models, _one_device

    x, tokens, valid, cot = _inputs()
    (v0, (y0, _)), (g0, gx0) = _one_device("learned")
    mesh = _mesh(sizes)
    model = sharding.shard_state(_models("learned", impl=impl), mesh)
    xs = jax.device_put(x, sharding.batch_sharding(mesh))
    step = _jitted_step(tokens, valid, cot)
    with jax.set_mesh(mesh):
        hlo = step.lower(model, xs).as_text()
        (v1, (y1, aux1)), (g1, gx1) = step(model, xs)
    diffs = {"loss": _diff(v1, v0), "y": _diff(y1, y0), "d x": _diff(gx1, gx0)}
    flat0, flat1 = dict(nnx.to_flat_state(g0)), dict(nnx.to_flat_state(g1))
    for path, v in flat0.items():
        diffs["d " + "/".join(map(str, path))] = _diff(flat1[path].get_value(), v.get_value())
    return {"diffs": diffs, "dropped": float(aux1["dropped"]), "all_to_all": "all_to_all" in hlo or "all-to-all" in hlo}


def _specs():
    import jax
    from flax import nnx

    from core.parallel import sharding
    from tests.model.test_expert_parallel import _models

    mesh = _mesh({"expert_outer": 2, "expert": 4})
    model = sharding.shard_state(_models("learned"), mesh)
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model)):
        name = "/".join(map(str, path))
        if name in ("experts/w1", "gate/weight"):
            a = v.get_value()
            out[name] = [[list(e) if isinstance(e, tuple) else e for e in a.sharding.spec],
                         list(a.sharding.shard_shape(a.shape))]
    b = sharding.batch_sharding(mesh)
    out["batch"] = [[list(e) if isinstance(e, tuple) else e for e in b.spec], b.shard_shape((8,))[0]]
    return out, list(mesh.axis_names), list(_mesh({"expert": 8}).axis_names)


def _elements(dims: str) -> int:
    return math.prod(int(n) for n in dims.split(","))


def _group_size(line: str) -> int:
    """Devices in each replica group of a collective written as replica_groups=mesh['axis_0'=a, ...] {'axis_i', ...}."""
    mesh, axes = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line).groups()
    sizes = dict(re.findall(r"'(axis_\d+)'=(\d+)", mesh))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(axis_\d+)'", axes))


def _free_cotangent():
    """A projection through a gathered weight w [R, H, D] (R over `expert`, as W_qb's q_lora) of batch-split
    rows, on expert_outer 2 x expert 4: gather_weight's constrained and free-cotangent forms against one
    device, and the all-reduces of w's whole gradient shape in each compiled gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from core.ops import placement
    from tests.model.test_expert_parallel import _diff

    r, h, d = 16, 4, 8
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(8, 32, r)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(r, h, d)), jnp.float32)

    def loss(gather):
        return lambda w, x: jnp.sum(jnp.tanh(jnp.einsum("btr,rhd->bthd", x, gather(w, heads_axis=1))))

    v0, g0 = jax.value_and_grad(loss(lambda w, heads_axis: w))(w, x)
    mesh = _mesh({"expert_outer": 2, "expert": 4})
    ws = jax.device_put(w, NamedSharding(mesh, PartitionSpec("expert")))
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("expert_outer", "expert"))))
    out, diffs = {}, {}
    for name, gather in (("constrained", placement.gather_weight), ("free", placement.gathered_free_cotangent)):
        step = jax.jit(jax.value_and_grad(loss(gather)), out_shardings=(None, ws.sharding))
        with jax.set_mesh(mesh):
            text = step.lower(ws, xs).compile().as_text()
            v1, g1 = step(ws, xs)
        diffs[f"{name} loss"], diffs[f"{name} d w"] = _diff(v1, v0), _diff(g1, g0)
        out[name] = sum(1 for line in text.splitlines() if "all-reduce(" in line and _group_size(line) == 8
                        and any(_elements(shape) == r * h * d for shape in re.findall(r"f32\[([\d,]+)\]", line.split("all-reduce(")[0])))
    return {"diffs": diffs, "whole_all_reduces": out}


if __name__ == "__main__":
    results = {name: _case(sizes, impl) for name, (sizes, impl) in CASES.items()}
    results["specs"], results["mesh_axes"], results["mesh_axes_without"] = _specs()
    results["free_cotangent"] = _free_cotangent()
    print(json.dumps(results))
