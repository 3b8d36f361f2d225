"""The dsv4 CLI shell: fast help, version, and one-line errors with exit code 2."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dsv4cli import __version__
from dsv4cli.main import app

runner = CliRunner()
COMMANDS = ["warmup", "sparse", "eval-indexer", "inspect-ckpt", "bench"]


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_help_has_an_example(name):
    result = runner.invoke(app, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_help_does_not_import_jax():
    """`dsv4 --help` stays instant: the command modules import jax lazily."""
    code = "import sys; from dsv4cli.main import app; print(sorted(m for m in ('jax', 'flax', 'orbax', 'datasets', 'optax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("args,key", [
    (["warmup", "indexer_topk=99999", "indexer_loss_scaling_factor=0.1"], "indexer_topk"),
    (["warmup", "no_such_key=1"], "no_such_key"),
    (["sparse", "o_groups=3"], "o_groups"),
    (["warmup", "--model", "deepseek4-nope"], "deepseek4-nope"),
])
def test_config_errors_are_one_line_exit_2(args, key):
    out = subprocess.run([sys.executable, "-m", "dsv4cli.main", *args], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, out.stderr
    assert key in lines[0] and "Traceback" not in out.stderr


@pytest.mark.parametrize("option", ["--config", "--model"])
def test_malformed_yaml_is_one_line_with_line_and_column(tmp_path, option):
    """PyYAML's multi-line context becomes one line: file, line, column, problem (issue 14)."""
    bad = tmp_path / "bad.yml"
    bad.write_text("steps: 3\nlearning_rate: [1e-3\nindexer_topk: 8\n")
    out = subprocess.run([sys.executable, "-m", "dsv4cli.main", "warmup", option, str(bad),
                          "--output", str(tmp_path / "run")], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(bad) in lines[0] and "line 3, column 13: expected ',' or ']'" in lines[0], lines[0]
    assert "flow sequence started at line 2, column 16" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_model_that_cannot_fit_stops_before_building(tmp_path):
    """V4-Flash's f32 state on one CPU device: one line naming the need, the mesh and `dsv4 plan`,
    exit 2, nothing allocated and nothing written (core/train/preflight.py, check_fits)."""
    out = subprocess.run([sys.executable, "-m", "dsv4cli.main", "warmup", "--model", "deepseek4-284b",
                          "max_target_length=4096"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "GiB per device" in lines[0] and "dsv4 plan --model deepseek4-284b --stage warmup" in lines[0]
    assert not any(tmp_path.rglob("*.json*")), sorted(tmp_path.rglob("*"))
