"""`dsv4 eval-indexer` end to end on a small checkpoint: JSON schema, invariants, the human
table, --plot, and the error cases."""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
from typer.testing import CliRunner

from dsv4cli.main import app
from tests.eval.test_evaluate import EVAL_KEYS, K_KEYS, ROW_KEYS
from tests.checkpoint.test_inspect import warmup_run

runner = CliRunner()
KS = "2,4,8"
CONTEXT_KEYS = {"checkpoint", "step", "stage", "model_name", "batch_size", "max_target_length", "data"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return warmup_run(tmp_path_factory)


@pytest.fixture(scope="module")
def report(run_dir):
    result = runner.invoke(app, ["eval-indexer", str(run_dir), "--batches", "2", "--topk", KS, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _entries(report):
    for row in report["layers"] + [report["overall"]]:
        for entry in row["by_k"]:
            yield row, entry


def test_json_schema(report):
    assert set(report) == EVAL_KEYS and set(report["checkpoint"]) == CONTEXT_KEYS
    assert report["ks"] == [2, 4, 8] and report["indexer_topk"] == 4 and report["batches"] == 2
    assert [layer["layer"] for layer in report["layers"]] == [1, 3]
    assert report["checkpoint"]["step"] == 1 and report["checkpoint"]["stage"] == "warmup"
    for row, entry in _entries(report):
        assert set(row) - {"layer"} == ROW_KEYS and set(entry) == K_KEYS


def test_metric_invariants(report):
    assert 0 < report["tokens"] <= report["rows"] == 2 * 2 * 128
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


def test_table(run_dir):
    result = runner.invoke(app, ["eval-indexer", str(run_dir / "checkpoints"), "--step", "0", "--batches", "1",
                                 "--topk", KS])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for needle in ("k = 2", "k = 8", "overall", "recall@k", "oracle", "recent", "random", "lm_loss", "step 0"):
        assert needle in out, needle


def test_plot_without_matplotlib_is_one_line(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = runner.invoke(app, ["eval-indexer", str(run_dir), "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 2 and "pip install matplotlib" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plot(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "recall.png"
    result = runner.invoke(app, ["eval-indexer", str(run_dir), "--batches", "1", "--topk", KS, "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,needle", [
    (["{tmp}/missing"], "does not exist"),
    (["{tmp}"], "not a dsv4 run"),
    (["{run}", "--step", "5"], "no checkpoint for step 5"),
    (["{run}", "--topk", "2,x"], "--topk value 'x'"),
    (["{run}", "--topk", "33"], "out of range"),
    (["{run}", "no_such_key=3"], "no_such_key"),
    (["{run}", "base_emb_dim=32"], "shape"),
    (["{run}", "--data", "{tmp}/none.jsonl"], "none.jsonl"),
])
def test_errors_are_one_line(run_dir, tmp_path, args, needle):
    args = [a.format(tmp=tmp_path, run=run_dir) for a in args]
    result = runner.invoke(app, ["eval-indexer", *args, "--batches", "1"])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_corrupted_arrays_are_one_line(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    data_files = [f for f in (copy / "checkpoints" / "1" / "model").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data_files
    for f in data_files:
        f.write_bytes(f.read_bytes()[:7])
    result = runner.invoke(app, ["eval-indexer", str(copy), "--batches", "1"])
    assert result.exit_code == 2 and "corrupted" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
