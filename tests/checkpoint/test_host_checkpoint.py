"""core.checkpoint.host_tree: the import's model save writes the host buffers in place, in bounded
chunks, into the ordinary run layout.

Host memory is measured with tracemalloc, which sees every NumPy allocation (NumPy registers its
buffers with it) and every Python object, so the figures are deterministic: the whole import of a
checkpoint whose output is tens of MB peaks at the output plus less than its largest tensor, where
Orbax's default save would add a full copy (shown beside it). TensorStore's own chunk buffers
(C++, bounded by CHUNK_BYTES) are outside this measure: docs/benchmarks.md measures them with RSS.
"""

from __future__ import annotations

import json
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from core.checkpoint import store as ckpt
from core import tree as trees
from core.checkpoint import host_tree as host_checkpoint
from core.hf.importer import import_checkpoint
from tests.hf_checkpoints import SMALL, write_official


def _tree(rng):
    return {"embed": rng.standard_normal((300, 70)).astype(ml_dtypes.bfloat16),
            "layers": {"0": {"w": rng.standard_normal((3, 40, 50)).astype(np.float32),
                             "tid2eid": rng.integers(0, 8, (64, 2)).astype(np.int32)}},
            "scale": np.asarray(rng.standard_normal(()), np.float32)}


def _save(run, tree, host_model):
    saver = ckpt.RunCheckpointer(run, max_to_keep=1, async_save=False, host_model=host_model)
    saver.save(0, model=tree, optimizer={"imported": np.zeros((), np.int32)}, data={"imported": True},
               metadata={"stage": "import", "step": 0})
    saver.close()


def _layout(run):
    step = run / "checkpoints" / "0"
    meta = json.loads((step / "model" / "_METADATA").read_text())["tree_metadata"]
    handlers = json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    return sorted(p.name for p in step.iterdir()), sorted(p.name for p in (step / "model").iterdir()), meta, handlers


def test_host_save_is_the_standard_layout_bitwise(tmp_path, monkeypatch):
    """Chunked into many pieces, the host save restores bitwise and has the standard save's items,
    files and tree metadata; `restore_model_state` / `read_tree` read it as any run."""
    monkeypatch.setattr(host_checkpoint, "CHUNK_BYTES", 4096)  # every leaf above spans several chunks
    tree = _tree(np.random.default_rng(0))
    _save(tmp_path / "host", tree, host_model=True)
    _save(tmp_path / "standard", tree, host_model=False)
    assert _layout(tmp_path / "host") == _layout(tmp_path / "standard")
    assert ckpt.read_tree(tmp_path / "host") == ckpt.read_tree(tmp_path / "standard")
    import jax

    target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), tree)
    out, step = ckpt.restore_model_state(tmp_path / "host", target)
    assert step == 0
    for k, v in trees.flatten(tree).items():
        got = np.asarray(trees.flatten(out)[k])
        assert got.dtype == v.dtype and got.tobytes() == v.tobytes(), k


def test_host_save_must_be_synchronous(tmp_path):
    with pytest.raises(ValueError, match="synchronous"):
        ckpt.RunCheckpointer(tmp_path, max_to_keep=1, async_save=True, host_model=True)


WIDE = {**SMALL, "vocab_size": 65536}  # 37 MB of float32 parameters; the largest tensor the 17 MB embedding


def _traced(fn, *args, **kwargs):
    """(fn's result, peak bytes tracemalloc saw above the start while it ran)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn(*args, **kwargs)
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _traced_import(src, run):
    return _traced(import_checkpoint, str(src), run, dtype="float32")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    src = tmp_path_factory.mktemp("wide") / "DeepSeek-V4-Wide"
    write_official(src, WIDE, seed=5, keep_values=False)
    return src


@pytest.fixture(scope="module")
def wide_imports(wide, tmp_path_factory):
    """{"default": peak of an import through Orbax's default save, "run", "summary", "peak": the
    import's own}; the default one runs first, so that the measured import runs warm."""
    out = tmp_path_factory.mktemp("wide-runs")
    default = ckpt.RunCheckpointer.__init__
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ckpt.RunCheckpointer, "__init__", lambda self, *a, host_model=False, **k: default(self, *a, **k))
        _, peak_default = _traced_import(wide, out / "run-default")
    summary, peak = _traced_import(wide, out / "run")
    return {"default": peak_default, "run": out / "run", "summary": summary, "peak": peak}


def test_import_peak_is_the_output_plus_less_than_one_tensor(wide_imports):
    """Peak NumPy + Python allocations of the whole import <= output + largest tensor. The same
    import through Orbax's default save peaks above that (it copies every leaf)."""
    output = wide_imports["summary"].params * 4
    largest = WIDE["vocab_size"] * WIDE["hidden_size"] * 4
    assert output > 2 * largest
    assert wide_imports["peak"] <= output + largest, (wide_imports["peak"], output, largest)
    assert wide_imports["default"] > output + largest, (wide_imports["default"], output, largest)


def test_export_peak_is_about_one_tensor(wide_imports, tmp_path):
    """export-hf converts and writes tensor by tensor: its NumPy + Python allocations peak at a few
    converted tensors (the restored model itself is jax arrays, outside this measure), not a shard."""
    from core.hf.exporter import export_checkpoint

    run = wide_imports["run"]
    summary, peak = _traced(export_checkpoint, run, tmp_path / "out", dtype="float32")
    largest = WIDE["vocab_size"] * WIDE["hidden_size"] * 4
    assert summary.shards == 1 and summary.bytes > 2 * largest
    assert peak <= 2 * largest, (peak, largest, summary.bytes)
