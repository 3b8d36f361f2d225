"""core.checkpoint.store: Orbax round trips, retention, locating checkpoints, metadata-only reads, and
the guarantees around incomplete or corrupted steps. A toy nnx module keeps these fast; the
training tests (test_train.py) cover the real model."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from core.checkpoint import store as ckpt
from core.errors import CheckpointError


class Bias(nnx.Variable):
    pass


class Toy(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.indexer = nnx.Linear(3, width, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(2)])
        self.bias = Bias(jnp.arange(width, dtype=jnp.float32))


def _toy(width=4, seed=0):
    model = Toy(width, nnx.Rngs(seed))
    labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, _: "train" if "indexer" in jax.tree_util.keystr(p) else "frozen", params)
    tx = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)  # non-trivial moments and count
    return model, optimizer


def _save(run_dir, steps=(0,), max_to_keep=3, async_save=True, width=4):
    model, optimizer = _toy(width)
    saver = ckpt.RunCheckpointer(run_dir, max_to_keep=max_to_keep, async_save=async_save)
    for s in steps:
        saver.save(s, model=nnx.to_pure_dict(nnx.state(model)), optimizer=nnx.to_pure_dict(nnx.state(optimizer)),
                   data={"epoch": 0, "document": s}, metadata={"stage": "warmup", "step": s})
    saver.close()
    return model, optimizer


def test_round_trip_keeps_values_and_optimizer_types(tmp_path):
    model, optimizer = _save(tmp_path / "run", steps=(0, 4))
    abstract_m, abstract_o = nnx.eval_shape(lambda: _toy()[0]), nnx.eval_shape(lambda: _toy()[1])
    saver = ckpt.RunCheckpointer(tmp_path / "run", max_to_keep=3, async_save=False)
    assert saver.latest_step() == 4
    checkpoint = ckpt.read_checkpoint(tmp_path / "run", items=("model", "optimizer"))
    assert checkpoint.step == 4 and checkpoint.data == {"epoch": 0, "document": 4} and checkpoint.metadata["step"] == 4
    out = ckpt.restore(checkpoint, model=nnx.to_pure_dict(nnx.state(abstract_m)),
                       optimizer=nnx.to_pure_dict(nnx.state(abstract_o)))
    state = nnx.state(abstract_o)
    nnx.replace_by_pure_dict(state, out["optimizer"])
    assert jax.tree.structure(state) == jax.tree.structure(nnx.state(optimizer))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(optimizer))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(out["model"]), jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))):
        np.testing.assert_array_equal(a, b)
    # frozen parameters hold no optimizer state at all
    assert all("indexer" in p or p.endswith(("count", "step")) for p in ckpt.read_tree(tmp_path / "run", item="optimizer"))


def test_retention_and_metadata_only_tree(tmp_path):
    _save(tmp_path / "run", steps=(1, 2, 3, 4), max_to_keep=2)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3", "4"]
    tree = ckpt.read_tree(tmp_path / "run")
    assert tree["layers/1/kernel"] == ((4, 4), "float32") and tree["bias"] == ((4,), "float32")
    assert ckpt.read_metadata(tmp_path / "run", 3) == {"stage": "warmup", "step": 3}
    assert ckpt.read_checkpoint(tmp_path / "run", items=()).data == {"epoch": 0, "document": 4}


def test_resolve_accepts_run_checkpoints_and_step_dirs(tmp_path):
    _save(tmp_path / "run", steps=(2, 5))
    run, cdir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert ckpt.resolve_checkpoint(run) == (run, cdir, 5)
    assert ckpt.resolve_checkpoint(cdir) == (run, cdir, 5)
    assert ckpt.resolve_checkpoint(cdir / "2") == (run, cdir, 2)
    assert ckpt.resolve_checkpoint(run, step=2) == (run, cdir, 2)


@pytest.mark.parametrize("case,needle", [
    ("missing", "does not exist"),
    ("foreign", "not a dsv4 run"),
    ("empty", "no finished checkpoint"),
    ("step", "no checkpoint for step 7"),
    ("incomplete", "incomplete or corrupted"),
])
def test_resolve_errors(tmp_path, case, needle):
    run = tmp_path / "run"
    if case in ("step", "incomplete"):
        _save(run, steps=(1,))
    if case == "incomplete":
        shutil.rmtree(run / "checkpoints" / "1" / "model")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    path = {"missing": tmp_path / "nope", "foreign": tmp_path / "foreign", "empty": tmp_path / "empty"}.get(case, run)
    with pytest.raises(CheckpointError, match=needle) as e:
        ckpt.resolve_checkpoint(path, step=7 if case == "step" else None)
    assert "\n" not in str(e.value)


def test_corrupted_arrays_are_a_checkpoint_error(tmp_path):
    _save(tmp_path / "run", steps=(1,))
    model_dir = tmp_path / "run" / "checkpoints" / "1" / "model"
    for p in model_dir.rglob("*"):
        if p.is_file() and "metadata" not in p.name.lower():
            p.write_bytes(b"garbage")
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: _toy()[0])))
    with pytest.raises(CheckpointError, match="cannot be read|unreadable"):
        ckpt.restore_model_state(tmp_path / "run", abstract)


def test_shape_mismatch_names_the_parameter(tmp_path):
    _save(tmp_path / "run", steps=(1,), width=4)
    wider = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: _toy(width=6)[0])))
    with pytest.raises(CheckpointError, match="'bias' of shape \\(4,\\), but this model's is \\(6,\\)"):
        ckpt.restore_model_state(tmp_path / "run", wider)


def test_a_failed_restore_ends_its_reads_before_returning(tmp_path, monkeypatch):
    """A restore that fails on a truncated data file leaves no read in flight: none completes later,
    on Orbax's closed event loop, as an unraisable "Event loop is closed"."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    model = {f"w{i}": np.full((16, 16), i, np.float32) for i in range(32)}
    saver = ckpt.RunCheckpointer(tmp_path / "run", max_to_keep=1, async_save=False)
    saver.save(0, model=model, optimizer={"count": np.zeros((), np.int32)}, data={}, metadata={"step": 0})
    saver.close()
    files = sorted(p for p in (tmp_path / "run" / "checkpoints" / "0" / "model").rglob("*")
                   if p.is_file() and p.parent.name == "d")
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in model.items()}
    failures = 0
    for _ in range(3):
        for f in files:
            good = f.read_bytes()
            f.write_bytes(good[:7])
            try:
                ckpt.restore_model_state(tmp_path / "run", target)
            except CheckpointError as e:
                assert "cannot be read" in str(e) or "unreadable" in str(e), e
                failures += 1
            f.write_bytes(good)
    time.sleep(0.5)  # TensorStore would complete a read left in flight within this
    gc.collect()
    assert failures and unraisable == [], f"{failures} failed restores, {len(unraisable)} unraisable: {unraisable[:1]}"


def test_unfinished_step_is_never_latest(tmp_path):
    """Orbax finalises a step by renaming its tmp directory: a leftover one is not a checkpoint."""
    _save(tmp_path / "run", steps=(1,))
    cdir = tmp_path / "run" / "checkpoints"
    shutil.copytree(cdir / "1", cdir / "9.orbax-checkpoint-tmp-1234")
    assert ckpt.resolve_checkpoint(tmp_path / "run")[2] == 1
    assert ckpt.RunCheckpointer(tmp_path / "run", max_to_keep=2, async_save=False).latest_step() == 1


def test_killed_async_save_leaves_a_readable_latest(tmp_path):
    """A process killed right after starting an async save: whatever is latest restores."""
    script = textwrap.dedent(f"""
        import os, jax.numpy as jnp
        from core.checkpoint import store as ckpt
        saver = ckpt.RunCheckpointer({str(tmp_path / 'run')!r}, max_to_keep=3, async_save=True)
        small = {{"w": jnp.ones((4,))}}
        saver.save(1, model=small, optimizer=small, data={{}}, metadata={{"step": 1}})
        saver.wait()
        big = {{"w": jnp.ones((4,))}}
        big.update({{f"x{{i}}": jnp.full((1 << 20,), i, jnp.float32) for i in range(16)}})
        saver.save(2, model=big, optimizer=small, data={{}}, metadata={{"step": 2}})
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    _, _, step = ckpt.resolve_checkpoint(tmp_path / "run")
    assert step in (1, 2)
    target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    if step == 2:
        target.update({f"x{i}": jax.ShapeDtypeStruct((1 << 20,), jnp.float32) for i in range(16)})
    values, _ = ckpt.restore_model_state(tmp_path / "run", target)
    np.testing.assert_array_equal(values["w"], np.ones(4))
