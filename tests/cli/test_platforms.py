"""Installed accelerator extras stay quiet on a machine without their devices (issue 22)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "from dsv4cli import main; main.pin_cpu_without_accelerators(); import jax; print(jax.default_backend())"


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_jax_starts_on_the_cpu_without_a_word_when_no_accelerator_exists():
    import glob

    from dsv4cli.main import ACCELERATOR_DEVICES

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = _probe(env)
    assert out.returncode == 0, out.stderr
    if not any(glob.glob(p) for p in ACCELERATOR_DEVICES):
        assert out.stdout.strip() == "cpu" and out.stderr == "", out.stderr


def test_a_platform_the_user_chose_is_kept():
    out = _probe({**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr
