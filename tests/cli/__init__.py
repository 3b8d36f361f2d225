"""Tests of the command line (dsv4cli); `dsv4_ok` runs one command in-process, for tests elsewhere too."""


def dsv4_ok(*args: str):
    """`dsv4 ARGS` through typer's CliRunner, in this process; asserts exit 0 (the output in the message)."""
    from typer.testing import CliRunner

    from dsv4cli.main import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result
