"""core/checkpoint/inspect.py and `dsv4 inspect-ckpt`: checkpoint summaries from metadata only, and errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.checkpoint import inspect as ins
from core.model import params
from core.checkpoint.run_files import read_metrics
from core.errors import CheckpointError
from core.spec.resolve import resolve
from dsv4cli.main import app

runner = CliRunner()
# deepseek4-tiny shrunk (as tests/conftest.py's TINY_OVERRIDES): SWA (hash-routed), CSA, HCA, CSA.
OVERRIDES = ["compress_ratios=[0,4,128,4]", "base_num_decoder_layers=4", "first_num_hash_layers=1",
             "vocab_size=512", "max_target_length=128", "per_device_batch_size=2", "indexer_topk=4"]
STEPS = (0, 1)


def warmup_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory written by `dsv4 warmup --steps 2` with a checkpoint at each step.

    Built once per test session under pytest's base temporary directory (test modules may be
    imported under two names, so the cache is a directory, not a Python object); pytest removes
    old base directories itself.
    """
    run = tmp_path_factory.getbasetemp() / "dsv4-warmup"
    done = run / "done"
    if not done.exists():
        shutil.rmtree(run, ignore_errors=True)
        result = runner.invoke(app, ["warmup", "--steps", str(len(STEPS)), "--output", str(run / "run"),
                                     *OVERRIDES, "checkpoint_period=1"])
        assert result.exit_code == 0, result.output
        done.write_text(result.output)  # the training header, for test_one_parameter_count
    return run / "run"


def abstract_expectations(run: Path) -> dict:
    """What the checkpoint must report, from the run's config alone (nnx.eval_shape: no arrays)."""
    from flax import nnx

    from core.checkpoint import store as ckpt
    from core import tree
    from core.model.transformer import Transformer
    from core.train.optimizer import make_optimizer
    from core.spec.resolve import optimizer_spec

    cfg = ckpt.config_of(run)
    model = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    optimizer = nnx.eval_shape(lambda m: nnx.Optimizer(m, make_optimizer(optimizer_spec(cfg)), wrt=nnx.Param), model)
    params = {p: math.prod(x.shape) for p, x in tree.flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}
    indexer = {p: "indexer" in p.split("/") for p in params}  # the warm-up mask '.*indexer.*'
    biases = sum(math.prod(x.shape) for x in tree.flatten(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))).values())
    return {
        "model": {p: (tuple(x.shape), str(x.dtype)) for p, x in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()},
        "parameters": sum(params.values()) + biases,  # the official inventory: nnx.Params + router biases
        "router_bias": biases,
        "trainable": sum(n for p, n in params.items() if indexer[p]),
        "optimizer_state": sum(math.prod(x.shape) for x in tree.flatten(nnx.to_pure_dict(nnx.state(optimizer))).values()),
        "params": params,
        "labels": indexer,
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = warmup_run(tmp_path_factory)
    return run, abstract_expectations(run)


def test_summary_matches_the_model_it_was_written_from(run_dir):
    run, want = run_dir
    s = ins.summarize_checkpoint(run)
    assert s.step == STEPS[-1] and s.steps == list(STEPS) and s.stage == "warmup"
    logged = {row["step"]: row for row in read_metrics(run)}
    assert s.model_name == "deepseek4-tiny" and s.metrics == logged[1]
    assert s.metrics["lm_loss"] == 0.0 and s.metrics["indexer_loss"] > 0
    assert s.indexer["indexer_topk"] == 4 and s.indexer["csa_layers"] == [1, 3]
    assert s.indexer["trainable_parameters_mask"] == [".*indexer.*"]
    assert {l.path: (l.shape, l.dtype) for l in s.leaves} == want["model"]
    t = s.totals()
    assert t["parameters"] == want["parameters"] and t["trainable"] == want["trainable"] > 0
    assert t["frozen"] == want["parameters"] - want["router_bias"] - want["trainable"]
    assert t["router_bias"] == want["router_bias"]
    assert t["optimizer_state"] == want["optimizer_state"]
    assert want["router_bias"] > 0 and t["hash_table"] == 512 * 4  # layer 0's token -> experts table
    assert {l.path for l in s.leaves if l.kind == "param"} == set(want["params"])
    assert {l.path: l.trainable for l in s.leaves if l.kind == "param"} == want["labels"]
    assert t["disk_bytes"] > 0 and t["parameter_bytes"] == 4 * t["parameters"]
    assert t["optimizer_bytes"] == 4 * t["optimizer_state"]  # float32 moments, int32 counts


def test_step_and_path_forms_agree(run_dir):
    run, _ = run_dir
    a = ins.summarize_checkpoint(run, step=0).to_dict()
    b = ins.summarize_checkpoint(run / "checkpoints", step=0).to_dict()
    c = ins.summarize_checkpoint(run / "checkpoints" / "0").to_dict()
    assert a == b == c and a["step"] == 0 and a["metrics"] == read_metrics(run)[0]


def test_no_array_is_read(run_dir, monkeypatch):
    """Every Orbax restore the summary makes asks for JSON items only, never model/optimizer."""
    import orbax.checkpoint as ocp

    requested = []
    restore = ocp.CheckpointManager.restore

    def spy(self, step, *a, args=None, **kw):
        requested.extend(args.keys() if args is not None else ["<everything>"])
        return restore(self, step, *a, args=args, **kw)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", spy)
    ins.summarize_checkpoint(run_dir[0])
    assert requested and set(requested) <= {"metadata", "data"}, requested


def test_mask_rule_is_the_trainers():
    """inspect-ckpt's rule on saved '/'-joined paths = the step's on the jax key paths of a
    parameter tree (DictKey, SequenceKey) and on nnx's (str, int) paths."""
    import jax

    from core import tree
    from core.train.step import path_matcher

    params_tree = {"layers": [{"attn": {"wq_b": 0}}, {"attn": {"indexer": {"wq_b": 0}, "wq_b": 0}}],
                   "scanned": {"blocks": [{"attn": {"indexer": {"compressor": {"ape": 0}}}}]}, "embed": 0}
    keyed = jax.tree_util.tree_leaves_with_path(params_tree)
    paths = [tree.join(k) for k, _ in keyed]
    assert "layers/1/attn/indexer/wq_b" in paths and "scanned/blocks/0/attn/indexer/compressor/ape" in paths
    nnx_paths = [tuple(int(n) if n.isdigit() else n for n in p.split("/")) for p in paths]
    for patterns in ([], [".*indexer.*"], ["embed", "layers/.*/wq_b"], ["indexer"]):
        ours, theirs = params.mask_matcher(patterns), path_matcher(patterns)
        want = [ours(p) for p in paths]
        assert want == [theirs(k) for k, _ in keyed] == [theirs(p) for p in nnx_paths], patterns


def test_fold_sums_every_leaf():
    leaves = [ins.Leaf("a/b/c", (2, 3), "float32", "param", True), ins.Leaf("a/b/d", (4,), "bfloat16", "param", False),
              ins.Leaf("a/e", (5,), "int32", "hash_table", False), ins.Leaf("f", (7,), "float32", "param", False)]
    assert [g["path"] for g in ins.fold(leaves, None)] == ["a/b/c", "a/b/d", "a/e", "f"]
    one = ins.fold(leaves, 1)
    assert [(g["path"], g["leaves"], g["count"], g["trainable"], g["shape"]) for g in one] == [
        ("a", 3, 15, 6, None), ("f", 1, 7, 0, [7])]
    assert one[0]["bytes"] == 6 * 4 + 4 * 2 + 5 * 4 and one[0]["dtypes"] == ["float32", "bfloat16", "int32"]
    assert one[0]["kind"] == "mixed" and one[1]["kind"] == "param"
    two = ins.fold(leaves, 2)
    assert [(g["path"], g["count"]) for g in two] == [("a/b", 10), ("a/e", 5), ("f", 7)]


def test_variable_kinds():
    assert params.variable_kind("layers/0/ffn/gate/tid2eid") == "hash_table"
    assert params.variable_kind("scanned/blocks/1/ffn/gate/bias") == "router_bias"
    assert params.variable_kind("layers/0/ffn/gate/weight") == "param"
    assert params.variable_kind("bias") == "param"


SUMMARY_KEYS = {"run_dir", "checkpoint", "step", "steps", "stage", "model_name", "version", "indexer", "metrics",
                "depth", "tree", "totals"}
TOTAL_KEYS = {"parameters", "trainable", "frozen", "parameter_bytes", "router_bias", "hash_table", "optimizer_state",
              "optimizer_bytes", "disk_bytes"}
GROUP_KEYS = {"path", "leaves", "count", "bytes", "trainable", "dtypes", "shape", "kind"}


def test_cli_json_schema_and_depth(run_dir):
    run, want = run_dir
    result = runner.invoke(app, ["inspect-ckpt", str(run), "--json", "--depth", "1"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert set(d) == SUMMARY_KEYS and set(d["totals"]) == TOTAL_KEYS
    assert all(set(g) == GROUP_KEYS for g in d["tree"])
    assert d["depth"] == 1 and "/" not in "".join(g["path"] for g in d["tree"])
    assert sum(g["count"] for g in d["tree"]) == sum(math.prod(s) for s, _ in want["model"].values())


def test_cli_table(run_dir):
    run, want = run_dir
    result = runner.invoke(app, ["inspect-ckpt", str(run), "--step", "0", "--depth", "2"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "steps present: 0, 1" in out and "stage warmup" in out and "indexer_topk=4" in out
    assert re.search(rf"^  trainable +{want['trainable']:,}  ", out, re.M), out
    assert "layers/1 " in out and "layers/1/attn" not in out  # folded at depth 2


def test_one_parameter_count(run_dir):
    """inspect-ckpt's table and --json, the training header and param_counts: one total (issue 14)."""
    from core.checkpoint.store import config_of
    from core.model.transformer import param_counts

    run, want = run_dir
    total = param_counts(resolve(config_of(run), "cpu").model)["total"]
    assert total == want["parameters"]  # nnx.Params + router biases, the official inventory
    d = json.loads(runner.invoke(app, ["inspect-ckpt", str(run), "--json"]).stdout)["totals"]
    assert d["parameters"] == total == d["trainable"] + d["frozen"] + d["router_bias"]
    table = runner.invoke(app, ["inspect-ckpt", str(run)]).stdout
    assert f"parameters {total:,} (" in table
    sub = {m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"^  (\w+(?: \w+)?) +([\d,]+)  ", table, re.M)}
    assert sub == {"trainable": d["trainable"], "frozen": d["frozen"], "router bias": want["router_bias"],
                   "hash table": d["hash_table"]}, table
    header = (run.parent / "done").read_text()
    assert f"params {total:,} (" in header and f"{want['trainable']:,} trainable" in header


def _corrupt(run: Path, tmp_path: Path, how: str) -> Path:
    copy = tmp_path / how
    shutil.copytree(run, copy)
    step = copy / "checkpoints" / "1"
    if how == "truncated-metadata":
        (step / "metadata" / "metadata").write_text('{"config": ')
    elif how == "no-tree-metadata":
        (step / "model" / "_METADATA").unlink()
    elif how == "missing-item":
        shutil.rmtree(step / "optimizer")
    elif how == "foreign-metadata":
        (step / "metadata" / "metadata").write_text('{"hello": 1}')
    return copy


@pytest.mark.parametrize("how", ["truncated-metadata", "no-tree-metadata", "missing-item", "foreign-metadata"])
def test_corrupted_checkpoints_are_one_line_errors(run_dir, tmp_path, how):
    path = _corrupt(run_dir[0], tmp_path, how)
    with pytest.raises(CheckpointError, match="corrupted"):
        ins.summarize_checkpoint(path)
    result = runner.invoke(app, ["inspect-ckpt", str(path)])
    assert result.exit_code == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("args,needle", [
    (["{tmp}/missing"], "does not exist"),
    (["{tmp}"], "not a dsv4 run"),
    (["{run}", "--step", "7"], "no checkpoint for step 7"),
])
def test_path_errors(run_dir, tmp_path, args, needle):
    args = [a.format(tmp=tmp_path, run=run_dir[0]) for a in args]
    result = runner.invoke(app, ["inspect-ckpt", *args])
    assert result.exit_code == 2 and needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
