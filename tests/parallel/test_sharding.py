"""core.parallel.sharding: meshes from the config, logical-axis rules, sharded training, checkpoints, multi-host.

Training cases run in four concurrent subprocesses with fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`, `JAX_PLATFORMS=cpu`; this pytest process
has already started JAX with one device): a one-device reference, an eight-device worker, and the
two processes of a localhost `jax.distributed` run. They hand checkpoints to each other through
marker files. The entry point is this very file (`python tests/parallel/test_sharding.py CASE ...`), so
the worker code sits next to the assertions that read its JSON output.

Every training case goes through `core.train.run.Trainer` (the code `dsv4 warmup` / `dsv4 sparse`
run) on a one-layer CSA model, 8 rows x 64 tokens of synthetic data per step: the one-device run
uses per_device_batch_size=8, the eight-device meshes 1, so every run sees the same global batch.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config.schema import load_config
from core.errors import ConfigError
from core.spec.resolve import resolve

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
STAGES = ("warmup", "sparse")
STEPS = 3  # trained steps per run; runs are configured for STEPS + 1 so a resume has one to go
SMALL = (
    "compress_ratios=[4]", "base_num_decoder_layers=1", "first_num_hash_layers=0", "vocab_size=512",
    "max_target_length=64", "indexer_topk=4", "hc_sinkhorn_iters=2", "dataset_type=synthetic",
    f"steps={STEPS + 1}", f"checkpoint_period={STEPS}", "async_checkpointing=false",
    f"learning_rate_schedule_steps={STEPS + 1}",  # fixed: the longer Ctrl-C run below reuses the warm-up's step
)
# name -> (mesh overrides, per_device_batch_size): 8 rows per step everywhere.
MESHES = {
    "one": ([], 8),
    "data8": ([], 1),
    "fsdp4_tensor2": (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"], 1),
    "data2_expert4": (["ici_data_parallelism=2", "ici_expert_parallelism=4"], 1),
}
MULTI = (["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], 1)  # 2 processes x 4: data 2 (dcn) x fsdp 2 x tensor 2
# The stages each eight-device mesh trains. The warm-up differs from the sparse run in its dense CSA
# forward and in training the indexer alone (the rest frozen, without optimizer state); its MoE
# forward, expert exchange included, is the sparse run's. So the warm-up runs where parameters and
# their moments are sharded (fsdp 4 x tensor 2 here; data 2 x fsdp 2 x tensor 2 in the two-process
# run, which also reduces its gradients over data); data 2 x expert 4 runs the sparse stage, whose
# forward and backward hold everything else. data 8 (MESHES' default layout) trains nowhere: its batch
# split and gradient mean over eight shards are data 2 x expert 4's (every batch axis is a data axis
# to the gradient), its replicated parameters the replicated entries below.
MESH_STAGES = {"fsdp4_tensor2": STAGES, "data2_expert4": ("sparse",)}
# Hand-written from LOGICAL_AXIS_RULES: parameter path -> (PartitionSpec entries, local shard shape).
# Size-1 mesh axes are equivalent to None.
EXPECTED = {
    "fsdp4_tensor2": {
        "embed": (("tensor", "fsdp"), (256, 16)),                       # (vocab, embed)
        "layers/0/attn/wkv": (("fsdp", "tensor"), (16, 16)),            # (embed, kv)
        "layers/0/attn/wq_b": (("fsdp", "tensor", None), (4, 2, 32)),   # (q_lora, heads, kv): fsdp on q_lora
        "layers/0/ffn/experts/w1": ((None, "fsdp", "tensor"), (16, 16, 32)),  # (experts, embed, mlp)
        "layers/0/ffn/gate/bias": ((None,), (16,)),                     # the router bias, replicated
        "norm/weight": ((None,), (64,)),
    },
    "data2_expert4": {
        "embed": ((None, "expert"), (512, 16)),                         # embed over the expert devices too
        "layers/0/ffn/experts/w1": (("expert", None, None), (4, 64, 64)),
        "layers/0/ffn/experts/w2": (("expert", None, None), (4, 64, 64)),
    },
}
NO_MOMENTS = {"layers/0/ffn/gate/bias"}  # the router bias: moved by the load-balance rule, not by Adam
METRICS = ("total_loss", "lm_loss", "indexer_loss", "moe_lb_loss")
_CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "DSV4_DISTRIBUTED",
                 "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _cfg(name: str, stage: str | None = None, mesh=None):
    overrides, per_device = mesh or MESHES[name]
    return load_config("deepseek4-tiny", [*SMALL, *overrides, f"per_device_batch_size={per_device}"], stage=stage)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    from tests.conftest import FAST_COMPILE  # the suite's compiler flags; every run here uses them

    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS and k != "JAX_ENABLE_X64"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def _start(root: Path, name: str, args, devices: int) -> tuple[str, subprocess.Popen]:
    """Start worker `args` with `devices` fake CPU devices; its output goes to root/<name>.out|.err."""
    with open(root / f"{name}.out", "w") as out, open(root / f"{name}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, str(HERE), *map(str, args)], env=_env(devices), cwd=ROOT,
                                stdout=out, stderr=err, text=True)
    return name, proc


def _collect(root: Path, procs: list[tuple[str, subprocess.Popen]], timeout: float = 1200) -> dict[str, dict]:
    """Wait for every worker; the first failure (or the timeout) kills the rest and reports its log."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for _, p in procs):
            failed = [(n, p) for n, p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                name = failed[0][0] if failed else "a worker (timeout)"
                logs = "" if not failed else (root / f"{name}.err").read_text()[-6000:]
                raise AssertionError(f"{name} failed:\n{logs}")
            time.sleep(0.5)
        for name, p in procs:
            assert p.returncode == 0, f"{name} failed:\n{(root / f'{name}.err').read_text()[-6000:]}"
        return {name: json.loads((root / f"{name}.out").read_text().strip().splitlines()[-1]) for name, _ in procs}
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()


def _wait_for(path: Path, timeout: float = 1200) -> None:
    """Block until another worker created `path` (it creates it once the run there is complete)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.5)


def _assert_same(got: list[dict], want: list[dict], what: str) -> None:
    """Per-step metrics equal to 1e-5 relative (lm_loss is exactly 0 in the warm-up everywhere)."""
    assert len(got) == len(want), f"{what}: {len(got)} steps vs {len(want)}"
    for step, (g, w) in enumerate(zip(got, want)):
        for key in METRICS:
            err = abs(g[key] - w[key]) / max(abs(w[key]), 1e-30)
            assert err <= 1e-5 or g[key] == w[key], f"{what} step {step} {key}: {g[key]} vs one device {w[key]} (rel {err:.2e})"


# ----------------------------------------------------------------------------- in-process, no training


def test_plan_mesh_fills_the_minus_one_axis():
    from core.parallel.mesh import plan_mesh

    ones = {"data": 1, "fsdp": 1, "tensor": 1, "expert_outer": 1, "expert": 1}
    assert plan_mesh(_cfg("data8"), 8) == ({**ones, "data": 8}, ones)
    assert plan_mesh(_cfg("fsdp4_tensor2"), 8) == ({**ones, "fsdp": 4, "tensor": 2}, ones)
    ici, dcn = plan_mesh(_cfg("data8", mesh=(["ici_data_parallelism=1", "ici_fsdp_parallelism=-1"], 1)), 16, 2)
    assert ici == {**ones, "fsdp": 8} and dcn == {**ones, "data": 2}
    ici, dcn = plan_mesh(_cfg("data8", mesh=(["ici_tensor_parallelism=2", "dcn_data_parallelism=1",
                                              "dcn_fsdp_parallelism=-1"], 1)), 16, 4)
    assert ici == {**ones, "data": 2, "tensor": 2} and dcn == {**ones, "fsdp": 4}


@pytest.mark.parametrize("overrides, devices, granules, words", [
    (["ici_data_parallelism=2", "ici_fsdp_parallelism=2"], 8, 1, ["multiply to 4", "8 devices", "-1"]),
    (["ici_fsdp_parallelism=3"], 8, 1, ["ici_fsdp_parallelism=3", "does not divide the 8", "ici_data_parallelism=-1"]),
    (["dcn_fsdp_parallelism=2"], 8, 1, ["dcn_fsdp_parallelism=2", "dcn_data_parallelism=-1"]),
    (["ici_data_parallelism=16"], 16, 2, ["multiply to 16", "8 devices in each of the 2"]),
])
def test_plan_mesh_rejects_products_that_miss_the_device_count(overrides, devices, granules, words):
    from core.parallel.mesh import plan_mesh

    with pytest.raises(ConfigError) as e:
        plan_mesh(_cfg("data8", mesh=(overrides, 1)), devices, granules)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_logical_to_spec_resolves_rules_and_divisibility():
    """flax's resolution (first free mesh axis, unknown names replicated) + divisibility fallback."""
    from jax.sharding import PartitionSpec as P

    from core.parallel.sharding import logical_to_spec

    class FakeMesh:  # logical_to_spec reads only .shape
        shape = {"data": 2, "fsdp": 4, "tensor": 2, "expert": 1}

    mesh = FakeMesh()
    assert logical_to_spec(("embed", "mlp"), (64, 32), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("q_lora", "heads", "kv"), (16, 4, 32), mesh) == P("fsdp", "tensor", None)
    assert logical_to_spec(("embed", "q_lora"), (16, 16), mesh) == P("fsdp", None)  # fsdp once: embed's
    assert logical_to_spec(("embed", "vocab"), (6, 10), mesh) == P(None, "tensor")
    assert logical_to_spec(("experts", "embed", "mlp"), (16, 64, 3), mesh) == P("expert", "fsdp", None)
    assert logical_to_spec(("batch", None), (16, 3), mesh) == P(("data", "fsdp", "expert"), None)
    assert logical_to_spec(("batch",), (4,), mesh) == P("data")  # 4 rows: data 2 x fsdp 4 does not divide
    assert logical_to_spec(("unknown_axis", "norm"), (8, 8), mesh) == P(None, None)
    assert logical_to_spec(None, (3,), mesh) == P()
    with pytest.raises(ValueError, match="one name per dimension"):
        logical_to_spec(("embed",), (4, 4), mesh)


def test_the_ops_pin_activations_by_the_same_rules():
    """core.ops may not import core.parallel, so the placement names the batch's and the heads' mesh axes,
    and the rules take the batch's from there: the rules' own."""
    from core.ops.placement import BATCH_AXES, HEADS_AXIS
    from core.parallel.sharding import LOGICAL_AXIS_RULES

    assert dict(LOGICAL_AXIS_RULES)["batch"] == BATCH_AXES and dict(LOGICAL_AXIS_RULES)["heads"] == HEADS_AXIS


def test_every_logical_axis_of_the_model_has_a_rule():
    """A new axis name in the model must be placed deliberately, not silently replicated."""
    from flax import nnx

    from core.model.transformer import Transformer
    from core.parallel.sharding import LOGICAL_AXIS_RULES

    names = set()
    for cfg in (load_config("deepseek4-tiny"), _cfg("one", "sparse")):
        model = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
        for _, v in nnx.to_flat_state(nnx.state(model)):
            names |= {a for a in (v.get_metadata().get("out_sharding") or ()) if a is not None}
    assert names - {r for r, _ in LOGICAL_AXIS_RULES} == set()


@pytest.fixture
def no_cluster(monkeypatch):
    for key in _CLUSTER_VARS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_single_process_does_not_initialise_distributed(no_cluster):
    from core.parallel import mesh

    assert mesh.cluster_environment() is None
    assert mesh.initialize_distributed() is False
    assert mesh.is_main_process()


@pytest.mark.parametrize("kwargs, env, words", [
    ({"coordinator_address": "127.0.0.1:1234"}, {}, ["--num-processes", "--process-id"]),
    ({"num_processes": 2, "process_id": 0}, {}, ["--coordinator-address"]),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2}, {}, ["--process-id 2", "0..1"]),
    ({}, {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "two"}, ["JAX_NUM_PROCESSES"]),
])
def test_incomplete_multi_host_flags_are_config_errors(no_cluster, kwargs, env, words):
    from core.parallel import mesh

    for key, value in env.items():
        no_cluster.setenv(key, value)
    with pytest.raises(ConfigError) as e:
        mesh.initialize_distributed(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cluster_environment_detection(no_cluster):
    from core.parallel import mesh

    no_cluster.setenv("SLURM_JOB_ID", "7")
    no_cluster.setenv("SLURM_NTASKS", "1")
    assert mesh.cluster_environment() is None  # one SLURM task is a plain single process
    no_cluster.setenv("SLURM_NTASKS", "4")
    assert mesh.cluster_environment() == "slurm"
    no_cluster.delenv("SLURM_JOB_ID")
    no_cluster.setenv("DSV4_DISTRIBUTED", "1")
    assert mesh.cluster_environment() == "DSV4_DISTRIBUTED"


# ----------------------------------------------------------------------------- training on meshes


def _train(name: str, stage: str, run_dir: Path, mesh=None, steps: int | None = STEPS):
    """Run (or resume) `stage` on mesh `name`; returns (trainer, metric rows)."""
    from core.train.run import Trainer

    trainer = Trainer(_cfg(name, stage, mesh), stage=stage, run_dir=run_dir)
    run = trainer.run()
    rows = [next(run) for _ in range(steps)] if steps is not None else list(run)
    run.close()  # flushes and closes the checkpointer
    return trainer, [{k: r[k] for k in METRICS} for r in rows]


READY = "READY"  # created in a run directory (copy) once it is complete, for a waiting worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training run of this module, in four concurrent worker processes.

    one (1 device): the reference runs; hands a copy at step STEPS - 1 to `meshes`, continues its
    own runs one step (the uninterrupted reference for every resume), then resumes the checkpoints
    of `meshes` (8 -> 1) and of the two-process run (2 processes -> 1).
    meshes (8 devices): fsdp 4 x tensor 2, data 2 x expert 4 (MESH_STAGES); resumes one's run (1 -> 8).
    multi0, multi1 (4 devices each): one two-process run through jax.distributed on localhost.
    """
    root = tmp_path_factory.mktemp("sharding")
    port = _free_port()
    procs = [_start(root, "one", ["one", root], 1), _start(root, "meshes", ["meshes", root], 8)]
    procs += [_start(root, f"multi{pid}", ["multiprocess", pid, port, root], 4) for pid in range(2)]
    out = _collect(root, procs)
    print("worker CPU seconds:", {name: res["cpu_s"] for name, res in out.items()})  # shown with -s
    return {"one": out["one"]["losses"], "resumed": out["one"]["resumed"], "eight": out["meshes"],
            "multi": [out["multi0"], out["multi1"]], "multi_metrics_lines": out["one"]["multi_metrics_lines"]}


@pytest.mark.slow
def test_same_losses_on_every_mesh(runs):
    assert all(len(runs["one"][stage]) == STEPS for stage in STAGES)
    for name, stages in MESH_STAGES.items():
        assert tuple(runs["eight"][name]["losses"]) == stages
        for stage in stages:
            _assert_same(runs["eight"][name]["losses"][stage], runs["one"][stage], f"{name} {stage}")
    warm, sparse = runs["one"]["warmup"], runs["one"]["sparse"]
    assert all(r["lm_loss"] == 0.0 and r["indexer_loss"] > 0 for r in warm)
    assert all(r["lm_loss"] > 0 for r in sparse)


@pytest.mark.slow
def test_collectives_read_the_loops_they_follow(runs):
    """XLA:CPU may start a collective that follows a loop holding collectives before the loop's own
    unless it reads the loop's output (docs/scaling.md#collective-order-on-the-cpu): the ties of
    core/ops/placement.py leave no such pair in a small program that has some without them, nor in the
    trained steps on fsdp 4 x tensor 2."""
    assert runs["eight"]["order"]["False"] > 0, "the untied program should have at-risk pairs"
    assert runs["eight"]["order"]["True"] == 0, runs["eight"]["order"]
    assert runs["eight"]["fsdp4_tensor2"]["at_risk"] == {"warmup": 0, "sparse": 0}, runs["eight"]["fsdp4_tensor2"]


@pytest.mark.slow
def test_parameters_and_moments_are_sharded_as_the_rules_say(runs):
    for name, params in EXPECTED.items():
        got = runs["eight"][name]["params"]
        for path, (spec, shard) in params.items():
            assert got[path]["as_rules"], f"{name}: {path} has {got[path]['spec']}, the rules say {spec}"
            assert tuple(got[path]["shard"]) == shard, f"{name}: {path} local shard {got[path]['shard']}, expected {shard}"
            if path not in NO_MOMENTS:
                assert got[path]["moments"] == 2 and got[path]["moments_follow"], \
                    f"{name}: the Adam moments of {path} do not carry its sharding"


@pytest.mark.slow
def test_batches_are_split_over_data_fsdp_expert(runs):
    assert runs["eight"]["data2_expert4"]["batch_shard_rows"] == 1
    assert runs["eight"]["fsdp4_tensor2"]["batch_shard_rows"] == 2  # 4 fsdp shards; repeated over tensor
    assert runs["eight"]["fsdp4_tensor2"]["describe"] == "fsdp 4 x tensor 2 (8 cpu devices, 1 process)"


@pytest.mark.slow
def test_checkpoints_move_between_one_device_and_eight(runs):
    resumed = runs["resumed"]
    # 1 -> 8: the one-device run at step 2, resumed on fsdp 4 x tensor 2; 8 -> 1 the reverse.
    assert runs["eight"]["from_1"]["restored_as_rules"], "restored arrays do not carry the 8-device shardings"
    _assert_same(runs["eight"]["from_1"]["losses"], resumed["sparse"], "1 -> 8 resume")
    _assert_same(resumed["from_8"], resumed["sparse"], "8 -> 1 resume")
    _assert_same(runs["eight"]["fsdp4_tensor2"]["resumed"], resumed["sparse"], "8 -> 8 resume")


@pytest.mark.slow
def test_two_processes_match_one(runs):
    for pid, res in enumerate(runs["multi"]):
        assert (res["processes"], res["devices"], res["local_devices"]) == (2, 8, 4)
        assert res["describe"] == "data 2 x fsdp 2 x tensor 2 (8 cpu devices, 2 processes)"
        assert res["main"] == (pid == 0) and res["rows"] == [4 * pid, 4 * pid + 4]
        assert res["process_local_equal"], "process-local and global batch feeding disagree"
        _assert_same(res["losses"], runs["one"]["warmup"], f"process {pid}")
        _assert_same(res["sparse_losses"], runs["one"]["sparse"], f"process {pid} sparse")
    assert runs["multi_metrics_lines"] == STEPS, "only process 0 writes metrics"
    # only process 0 locks the run directory and writes its plain files and events (core/train/outputs.py)
    plain = {".lock", "config.yml", "metrics.jsonl", "tensorboard"}
    assert plain - {"tensorboard"} <= set(runs["multi"][0]["writes"]), runs["multi"][0]["writes"]
    assert not plain & set(runs["multi"][1]["writes"]), runs["multi"][1]["writes"]
    from core.train.stop import STOP_CHECK_EVERY

    for res in runs["multi"]:  # Ctrl-C on process 1 only: both stop after the first agreed step, saved
        assert res["stopped"] == {"steps": list(range(STOP_CHECK_EVERY)), "interrupted": True,
                                  "last_saved": STOP_CHECK_EVERY - 1}, res["stopped"]
    # The checkpoint both processes wrote (each its own shards) resumes on one device.
    _assert_same(runs["resumed"]["from_2_processes"], runs["resumed"]["warmup"], "2 processes -> 1 resume")


# ----------------------------------------------------------------------------- worker side


def _param_report(trainer, name: str) -> dict:
    """Sharding of the EXPECTED parameters of mesh `name` and of their Adam moments."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    model, optimizer = nnx.merge(trainer.graphdef, trainer.state)
    mesh = trainer.setup.mesh
    params = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    moments = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(optimizer))}
    report = {}
    for path, (spec, _) in EXPECTED.get(name, {}).items():
        x = params[path]
        follow = [m for k, m in moments.items() if k.endswith(("/mu/" + path, "/nu/" + path))]
        report[path] = {
            "spec": str(x.sharding.spec), "shard": list(x.addressable_shards[0].data.shape),
            "as_rules": x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim),
            "moments": len(follow), "moments_follow": all(m.sharding.is_equivalent_to(x.sharding, x.ndim) for m in follow),
        }
    return report


def _worker_one(root: str) -> dict:
    root = Path(root)
    losses, resumed = {}, {}
    for stage in STAGES:
        _, losses[stage] = _train("one", stage, root / "one" / stage)
    shutil.copytree(root / "one", root / "one_for_8")
    (root / "one_for_8" / READY).touch()
    for stage in STAGES:  # the uninterrupted reference for every resume below
        _, resumed[stage] = _train("one", stage, root / "one" / stage, steps=None)
    _wait_for(root / "eight_for_1" / READY)
    _, resumed["from_8"] = _train("one", "sparse", root / "eight_for_1" / "sparse", steps=None)
    _wait_for(root / "multi" / f"{READY}0")
    _wait_for(root / "multi" / f"{READY}1")
    lines = len((root / "multi" / "metrics.jsonl").read_text().splitlines())
    _, resumed["from_2_processes"] = _train("one", "warmup", root / "multi", steps=None)
    return {"losses": losses, "resumed": resumed, "multi_metrics_lines": lines}


def _worker_meshes(root: str) -> dict:
    import jax
    import numpy as np

    from core.parallel import mesh as mesh_lib
    from core.parallel import sharding
    from core.train.run import Trainer

    root, out = Path(root), {}
    for name, stages in MESH_STAGES.items():
        out[name] = {"losses": {}}
        for stage in stages:
            trainer, out[name]["losses"][stage] = _train(name, stage, root / name / stage)
            if name == "fsdp4_tensor2":
                out[name].setdefault("at_risk", {})[stage] = _at_risk(trainer)
        mesh = trainer.setup.mesh
        batch = sharding.shard_batch({"tokens": np.zeros((8, 4), np.int32)}, mesh)["tokens"]
        out[name].update(params=_param_report(trainer, name), describe=mesh_lib.describe_mesh(mesh),
                         batch_shard_rows=batch.addressable_shards[0].data.shape[0])
        if name == "fsdp4_tensor2":  # hand step STEPS - 1 to the one-device worker, then resume here
            shutil.copytree(root / name, root / "eight_for_1")
            (root / "eight_for_1" / READY).touch()
            _, out[name]["resumed"] = _train(name, "sparse", root / name / "sparse", steps=None)
    _wait_for(root / "one_for_8" / READY)
    trainer = Trainer(_cfg("fsdp4_tensor2", "sparse"), stage="sparse", run_dir=root / "one_for_8" / "sparse")
    assert trainer.start_step == STEPS, trainer.start_step
    want = jax.tree.leaves(sharding.state_shardings(trainer.state, trainer.setup.mesh))
    same = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(trainer.state), want))
    losses = [{k: r[k] for k in METRICS} for r in trainer.run()]
    out["from_1"] = {"losses": losses, "restored_as_rules": same}
    out["order"] = _order_report()
    return out


def _at_risk(trainer) -> int:
    """At-risk (loop, collective) pairs of the trainer's compiled step (core/parallel/collective_order.py)."""
    from core.parallel.collective_order import at_risk_pairs
    from core.train import program

    step = program.StepProgram.of(trainer.specs, trainer.graphdef, trainer.state, trainer.setup.mesh)
    compiled = step.compiled()  # the executable compiled ahead (compile_ahead)
    return len(at_risk_pairs(compiled.as_text())[2]) if compiled is not None else -1


def _order_report() -> dict:
    """At-risk pairs of a small program on fsdp 4 x tensor 2, without and with core/ops/placement.py's ties:
    three checkpointed layers (tied as run_segment ties a layer), each a scan whose steps hold partial
    sums over `tensor` beside a one-matmul MLP that does not read the scan (the MoE's routed and shared
    experts)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from core.ops.placement import after, backward_after_cotangent, cotangent_after_value, tied
    from core.parallel.collective_order import at_risk_pairs

    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))

    def program(tie: bool):
        # a fresh `layer` per program: jax.checkpoint reuses the trace of a function it has seen, so a
        # shared one traced untied would come back untied under `tied(True)`
        def layer(x, w_loop, w_in, w_out):
            y, _ = jax.lax.scan(lambda y, w: (y + jnp.tanh(x @ w) @ w.T, None), jnp.zeros_like(x), w_loop)
            out = y + jnp.tanh((after(x, y) if tie else x) @ w_in) @ w_out
            return cotangent_after_value(out) if tie else out

        def loss(params, x):
            for p in params:
                x = (backward_after_cotangent(jax.checkpoint(layer)) if tie else jax.checkpoint(layer))(x, *p)
            return jnp.sum(x ** 2)
        return jax.jit(jax.grad(loss))

    x = put(jnp.ones((16, 32)), "fsdp", None)
    params = [(put(jnp.ones((4, 32, 64)), None, "fsdp", "tensor"), put(jnp.ones((32, 64)), "fsdp", "tensor"),
               put(jnp.ones((64, 32)), "tensor", "fsdp"))] * 3
    def pairs(tie: bool) -> int:
        with tied(tie):  # as a step traced for this CPU mesh ties (core/train/program.py with_mesh)
            return len(at_risk_pairs(program(tie).lower(params, x).compile().as_text())[2])
    return {str(tie): pairs(tie) for tie in (False, True)}


def _ctrl_c_on_process_1(pid: int, run_dir: Path) -> dict:
    """An 8-step warm-up where process 1 alone gets Ctrl-C during step 0: both stop after the same step
    (the first agreement, core/train/stop.py), save it, and raise KeyboardInterrupt."""
    import signal

    from core.train.run import Trainer

    trainer = Trainer(_cfg("multi", "warmup", (MULTI[0] + ["steps=8"], 1)), stage="warmup", run_dir=run_dir)
    steps, interrupted = [], False
    try:
        for row in trainer.run():
            steps.append(row["step"])
            if pid == 1 and row["step"] == 0:
                os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        interrupted = True
    return {"steps": steps, "interrupted": interrupted, "last_saved": trainer.last_saved}


def _record_writes(root: Path) -> set[str]:
    """What this process opens for writing under `root` from now on (Python's "open" audit events:
    the plain files by name, anything under checkpoints/ or tensorboard/ as that directory)."""
    writes = set()

    def hook(event, args):
        if event != "open" or not isinstance(args[0], (str, Path)):
            return
        mode, flags = args[1], args[2]
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
        path = Path(os.path.abspath(args[0]))
        if writing and path.is_relative_to(root) and not path.name.startswith(READY):  # not the test's markers
            parts = path.relative_to(root).parts
            top = next((p for p in parts if p in ("checkpoints", "tensorboard")), parts[-1])
            writes.add(top)

    sys.addaudithook(hook)
    return writes


def _worker_multiprocess(pid: str, port: str, root: str) -> dict:
    from core.parallel import mesh as mesh_lib
    from core.parallel import sharding

    assert mesh_lib.initialize_distributed(f"127.0.0.1:{port}", 2, int(pid))
    writes = _record_writes(Path(root).resolve())
    import jax
    import numpy as np

    run_dir = Path(root) / "multi"
    trainer, losses = _train("multi", "warmup", run_dir, mesh=MULTI)
    (run_dir / f"{READY}{pid}").touch()
    # the sparse stage with a tensor axis: its step holds collectives inside loops (issue 38)
    _, sparse_losses = _train("multi", "sparse", Path(root) / "multi_sparse", mesh=MULTI)
    stopped = _ctrl_c_on_process_1(int(pid), Path(root) / "multi_stop")
    mesh = trainer.setup.mesh
    rows = sharding.local_batch_slice(mesh, 8)
    tokens = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    a = sharding.shard_batch({"t": tokens}, mesh)["t"]
    b = sharding.shard_batch({"t": tokens[rows]}, mesh, process_local=True)["t"]
    equal = all(np.array_equal(x.data, y.data) and x.index == y.index
                for x, y in zip(a.addressable_shards, b.addressable_shards))
    return {"losses": losses, "sparse_losses": sparse_losses, "stopped": stopped, "processes": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "main": mesh_lib.is_main_process(),
            "describe": mesh_lib.describe_mesh(mesh), "rows": [rows.start, rows.stop],
            "process_local_equal": equal, "writes": sorted(writes, key=str.lower)}


if __name__ == "__main__":
    import resource

    from core.process import tune_garbage_collector

    tune_garbage_collector()  # as in every dsv4 process
    case, *args = sys.argv[1:]
    result = globals()[f"_worker_{case}"](*args)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({**result, "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}))
