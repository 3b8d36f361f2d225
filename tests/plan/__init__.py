"""Tests of `dsv4 plan` (core/plan); `invoke_plan` runs the command in-process."""


def invoke_plan(*args: str):
    """`dsv4 plan ARGS` through typer's CliRunner (the command alone, as a one-command app)."""
    import typer
    from typer.testing import CliRunner

    from dsv4cli import plan as plan_cmd

    app = typer.Typer(add_completion=False)
    app.command()(plan_cmd.command)
    return CliRunner().invoke(app, list(args))
