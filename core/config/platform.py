"""Per-platform choices: the keys whose value `auto` is decided by the platform a step runs on.

A config is read before JAX knows its devices, so a key that is fastest one way on a CPU and
another on a TPU says `auto`, and `resolve(cfg, platform)` turns every `auto` into the platform's
choice once the mesh is known, before anything is built or traced: the training run's preflight,
the planner (for its target's platform), the benchmarks and the evaluation. An explicit value
always wins. Why each choice: docs/benchmarks.md#why-the-defaults.

Nothing below `resolve` ever sees `auto`: the model's specs refuse it (`require_resolved`).
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"
PLATFORMS = ("cpu", "gpu", "tpu")

# key -> platform -> the value `auto` becomes there
PLATFORM_CHOICES: dict[str, dict[str, Any]] = {
    # tiles of plain einsums on XLA:CPU (which lowers ragged_dot densely); a grouped matmul elsewhere
    "moe_impl": {"cpu": "tiled", "gpu": "ragged", "tpu": "ragged"},
}


def platform_name(platform: str) -> str:
    """A JAX device platform ("cpu", "gpu", "cuda", "rocm", "tpu") as one of PLATFORMS."""
    return "gpu" if platform in ("cuda", "rocm") else platform


def resolve(cfg, platform: str):
    """`cfg` with every `auto` key set to `platform`'s choice (the same Config when none is `auto`).

    Args:
      cfg: a Config (core.config.schema).
      platform: the platform of the mesh the step runs on (`core.parallel.mesh.mesh_platform`),
        or of the planner's target.
    """
    platform = platform_name(platform)
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}: one of {', '.join(PLATFORMS)}")
    changes = {key: choices[platform] for key, choices in PLATFORM_CHOICES.items() if getattr(cfg, key) == AUTO}
    return cfg.replace(**changes) if changes else cfg


def require_resolved(value: Any, key: str) -> None:
    """Refuse an `auto` that reached the model: the caller skipped `resolve`."""
    if value == AUTO:
        raise ValueError(f"{key}=auto reached the model unresolved: call core.config.platform.resolve(cfg, "
                         "platform) once the mesh is known, before building")
