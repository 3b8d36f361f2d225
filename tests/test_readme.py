"""The README's set-up block, the front door: its first command installs dsv4 and runs the main job,
as written; its second installs the test extras and runs the suite, as .ci/run runs it.

The first command's run is checked through the CLI, as typed, up to the end of its preflight
(core/train/preflight.py: config, run directory, mesh, data, the model's shapes, fit, masks), the
last phase that can refuse the command's input; the phases after it train the suite's shrunken
model in tests/train/.
"""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    """The commands of the README's set-up block, comments dropped."""
    section = (ROOT / "README.md").read_text().split("\n## Set-up\n", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_setup_installs_then_runs_the_main_job_then_the_suite():
    first, second = _setup_commands()
    assert [part.strip() for part in first.split("&&")] == ["pip install -e .", "dsv4 pretrain --steps 300"], first
    assert second == 'pip install -e ".[dev]" && pytest', second
    assert second in (ROOT / ".ci" / "run").read_text(), ".ci/run must run the README's test command"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dsv4"] == "dsv4cli.main:main"  # the plain install provides the command


class _Preflown(Exception):
    def __init__(self, plan):
        super().__init__("preflight passed")
        self.plan = plan


def test_the_first_command_runs_as_written_through_preflight(tmp_path, monkeypatch):
    from core.train import run
    from dsv4cli.main import app

    argv = shlex.split(_setup_commands()[0].split("&&")[1])
    assert argv[0] == "dsv4"

    def preflight_then_stop(*args, **kwargs):
        raise _Preflown(preflight(*args, **kwargs))

    preflight = run.preflight
    monkeypatch.setattr(run, "preflight", preflight_then_stop)
    monkeypatch.chdir(tmp_path)  # the command's default run directory, runs/pretrain, lands here
    result = CliRunner().invoke(app, argv[1:])
    assert isinstance(result.exception, _Preflown), result.output
    plan = result.exception.plan
    assert (plan.run.model_name, plan.run.steps, plan.resolved.cfg.dense_pretraining) == ("deepseek4-tiny", 300, True)
    assert plan.source is None and plan.data.fingerprint["source"].startswith("embedded"), plan.data.fingerprint
