"""`dsv4 eval-indexer` end to end on a small checkpoint: JSON schema, invariants, the human
table and its progress lines, --plot, the evaluation's own rows, and the error cases."""

from __future__ import annotations

import json
import math
import shutil
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from dsv4cli.main import app
from tests.eval.test_evaluate import EVAL_KEYS, K_KEYS, ROW_KEYS
from tests.checkpoint.test_inspect import warmup_run

runner = CliRunner()
KS = "2,4,8"
CONTEXT_KEYS = {"checkpoint", "step", "stage", "model_name", "batch_size", "max_target_length", "data", "eval_rows",
                "frozen_weights"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return warmup_run(tmp_path_factory)


@pytest.fixture(scope="module")
def report(run_dir):
    """Three rows, two per step: the second batch holds one row and one padding row."""
    result = runner.invoke(app, ["eval-indexer", str(run_dir), "--rows", "3", "--batch-rows", "2", "--topk", KS, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _entries(report):
    for row in report["layers"] + [report["overall"]]:
        for entry in row["by_k"]:
            yield row, entry


def test_json_schema(report):
    assert set(report) == EVAL_KEYS and set(report["checkpoint"]) == CONTEXT_KEYS
    assert report["ks"] == [2, 4, 8] and report["indexer_topk"] == 4 and report["batches"] == 2
    assert report["checkpoint"]["eval_rows"] == 3 and report["checkpoint"]["batch_size"] == 2
    assert [layer["layer"] for layer in report["layers"]] == [1, 3]
    assert report["checkpoint"]["step"] == 1 and report["checkpoint"]["stage"] == "warmup"
    for row, entry in _entries(report):
        assert set(row) - {"layer"} == ROW_KEYS and set(entry) == K_KEYS


def test_metric_invariants(report):
    assert 0 < report["tokens"] <= report["rows"] == 3 * 128
    lm = report["lm_loss"]
    assert math.isfinite(lm["dense"]) and math.isfinite(lm["topk"]) and lm["gap"] == pytest.approx(lm["topk"] - lm["dense"])
    for row, entry in _entries(report):
        assert 0 < entry["informative_rows"] <= row["valid_rows"]
        assert entry["informative_share"] == pytest.approx(entry["informative_rows"] / row["valid_rows"])
        for subset in ("all", "informative"):
            m = entry[subset]
            assert m["kl"] >= 0
            for name in ("recall", "overlap", "recall_recent", "recall_random"):
                assert 0 <= m[name] <= 1
                if name != "overlap":  # the teacher's own top-k holds the most mass of any k blocks
                    assert m[name] <= m["recall_oracle"] + 1e-6, (name, m)
    shares = [e["informative_share"] for e in report["overall"]["by_k"]]
    assert shares == sorted(shares, reverse=True)  # more rows are trivial as k grows


def test_the_rows_do_not_depend_on_the_batching(run_dir, report):
    """The same three rows one per step (no padding row) give the same figures: the rows, the random
    baseline's draws and the sums do not depend on how many rows a step holds."""
    result = runner.invoke(app, ["eval-indexer", str(run_dir), "--rows", "3", "--batch-rows", "1", "--topk", KS, "--json"])
    assert result.exit_code == 0, result.output
    other = json.loads(result.stdout)
    assert other["batches"] == 3 and other["rows"] == report["rows"] and other["tokens"] == report["tokens"]
    for (row, got), (_, want) in zip(_entries(other), _entries(report), strict=True):
        assert got["informative_rows"] == want["informative_rows"]
        for subset in ("all", "informative"):
            # the indexer's own top-k may flip on a near tie (its scores after two warm-up steps from
            # zero weights are nearly equal): at most one row's worth of its selection figures
            flip = 1.0 / (row["valid_rows"] if subset == "all" else got["informative_rows"])
            for name, value in want[subset].items():
                if name == "gain":
                    continue  # a ratio of the figures compared here
                tol = flip if name in ("recall", "overlap") else 1e-6
                assert got[subset][name] == pytest.approx(value, rel=1e-5, abs=tol), (subset, name)
    for name in ("dense", "topk"):
        assert other["lm_loss"][name] == pytest.approx(report["lm_loss"][name], rel=1e-6)


def test_the_rows_do_not_depend_on_the_training_batch(run_dir):
    """The evaluation set comes from its own keys: the same rows whatever per_device_batch_size the run
    trained with, for the embedded text and for synthetic data."""
    from core.checkpoint import store as ckpt
    from core.eval.rows import EvalSet, eval_config, row_batches

    cfg = ckpt.config_of(run_dir)
    for data in ((), ("dataset_type=synthetic",)):
        rows = []
        for train_batch, batch in ((1, 1), (4, 2), (2, 3)):
            run_cfg = cfg.replace(per_device_batch_size=train_batch, **dict(o.split("=") for o in data))
            got = list(row_batches(eval_config(run_cfg, EvalSet(rows=3, length=256)), 3, batch))
            rows.append(np.concatenate([b["tokens"][:real] for b, _, real in got]))
        assert rows[0].shape == (3, 256) and all(np.array_equal(r, rows[0]) for r in rows[1:]), data


def test_table(run_dir):
    result = runner.invoke(app, ["eval-indexer", str(run_dir / "checkpoints"), "--step", "0", "--rows", "1",
                                 "--topk", KS])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for needle in ("k = 2", "k = 8", "overall", "recall@k", "oracle", "recent", "random", "lm_loss", "step 0",
                   "1 rows x 128 tokens"):
        assert needle in out, needle
    # not a terminal: one progress line per batch, over CSA layers x batches, with its ETA
    progress = [line for line in result.stderr.splitlines() if "CSA layers x batches" in line]
    assert len(progress) == 1 and "[2/2 CSA layers x batches" in progress[0] and "ETA" in progress[0], result.stderr


def test_plot_without_matplotlib_is_one_line(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = runner.invoke(app, ["eval-indexer", str(run_dir), "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 2 and "pip install matplotlib" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plot(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "recall.png"
    result = runner.invoke(app, ["eval-indexer", str(run_dir), "--rows", "1", "--topk", KS, "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,needle", [
    (["{tmp}/missing"], "does not exist"),
    (["{tmp}"], "not a dsv4 run"),
    (["{run}", "--step", "5"], "no checkpoint for step 5"),
    (["{run}", "--topk", "2,x"], "--topk value 'x'"),
    (["{run}", "--topk", "33"], "out of range"),
    (["{run}", "--length", "512", "--topk", "129"], "out of range"),
    (["{run}", "--length", "512", "max_position_embeddings=256"], "longer than the model's max_position_embeddings"),
    (["{run}", "--length", "200"], "multiple of compress ratio"),
    (["{run}", "use_indexer=false", "indexer_loss_scaling_factor=0"], "no lightning indexer"),
    (["{run}", "--rows", "0"], "--rows 0"),
    (["{run}", "--batch-rows", "-8"], "--batch-rows -8"),
    (["{run}", "--length", "0"], "--length 0"),
    (["{run}", "no_such_key=3"], "no_such_key"),
    (["{run}", "base_emb_dim=32"], "shape"),
    (["{run}", "--data", "{tmp}/none.jsonl"], "none.jsonl"),
])
def test_errors_are_one_line(run_dir, tmp_path, args, needle):
    args = [a.format(tmp=tmp_path, run=run_dir) for a in args]
    result = runner.invoke(app, ["eval-indexer", "--rows", "1", *args])  # a later --rows wins
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_corrupted_arrays_are_one_line(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    data_files = [f for f in (copy / "checkpoints" / "1" / "model").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data_files
    for f in data_files:
        f.write_bytes(f.read_bytes()[:7])
    result = runner.invoke(app, ["eval-indexer", str(copy), "--rows", "1"])
    assert result.exit_code == 2 and "corrupted" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
