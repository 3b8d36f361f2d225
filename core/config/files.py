"""Config files: the installed configs/ directory, its model files, base defaults and stage presets.

DESIGN.md, "Layout": `configs/base.yml` declares every key with its default and, under `stages:`,
the preset each stage command applies; the other files there are model files. Every file is read
with `yaml.safe_load`, and a file that cannot be read, is not UTF-8, is not valid YAML or is not a
mapping raises `ConfigError` in one line naming the file and the fix. core/config/schema.py merges these
layers into a Config.
"""

from __future__ import annotations

import difflib
import importlib.resources
from pathlib import Path
from typing import Any

import yaml

from core.config.stages import STAGE_COMMANDS
from core.errors import ConfigError

STAGES = tuple(STAGE_COMMANDS)  # the stage commands, each with a preset under base.yml's `stages:`


def configs_dir() -> Path:
    """The installed configs/ directory (package data `dsv4_configs`)."""
    return Path(str(importlib.resources.files("dsv4_configs")))


def model_names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yml") if p.stem != "base")


def read_yaml(path: Path, what: str) -> dict[str, Any]:
    """The mapping in YAML file `path` ({} for an empty file); `what` names it in errors."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read ({e.strerror}): check the path.") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}): give a YAML file.") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {_yaml_problem(e)}; fix the syntax there.") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r} must be a mapping of KEY: VALUE lines, got {type(data).__name__}.")
    return data


def _yaml_problem(e: Exception) -> str:
    """PyYAML's multi-line error as one phrase: 'line L, column C: problem (context at line L', column C')'."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return " ".join(str(e).split()) or type(e).__name__
    where = lambda m: f"line {m.line + 1}, column {m.column + 1}"  # noqa: E731  (marks are 0-based)
    text = f"{where(mark)}: {problem}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark is not None and (context_mark.line, context_mark.column) != (mark.line, mark.column):
        text += f" ({context} started at {where(context_mark)})"
    elif context:
        text += f" ({context})"
    return text


def model_file(model: str) -> Path:
    """The YAML file of `model`: a name in configs/ or a path; unknown names get a did-you-mean."""
    if model in model_names():
        return configs_dir() / f"{model}.yml"
    path = Path(model).expanduser()
    if path.suffix in (".yml", ".yaml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"model file {model!r} does not exist: give a YAML path or one of {', '.join(model_names())}.")
        return path
    hint = difflib.get_close_matches(model, model_names(), n=1)
    fix = f"did you mean {hint[0]!r}?" if hint else f"choose one of {', '.join(model_names())} or a YAML path."
    raise ConfigError(f"unknown model {model!r}: {fix}")


def split_stages(data: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A config file's keys and its `stages:` section (stage -> overrides): base.yml's presets of
    `dsv4 <stage>`, or a model file's own entries for its stages (e.g. the mesh its sparse stage
    needs), which `load_config` applies after base.yml's preset of that stage."""
    data = dict(data)
    stages = data.pop("stages", None) or {}
    if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
        raise ConfigError(f"{where}: `stages:` must map a stage name to KEY: VALUE lines.")
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ConfigError(f"{where}: unknown stage {unknown[0]!r} under `stages:`: use one of {', '.join(STAGES)}.")
    return data, {name: dict(v) for name, v in stages.items()}


def base_config() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """base.yml: (every key with its default, the stage presets)."""
    return split_stages(read_yaml(configs_dir() / "base.yml", "base config"), "configs/base.yml")


def base_defaults() -> dict[str, Any]:
    return base_config()[0]


def stage_presets(stage: str, presets: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The overrides `dsv4 <stage>` applies (base.yml's `stages:` section, or `presets` read from it)."""
    presets = base_config()[1] if presets is None else presets
    if stage not in presets:
        raise ConfigError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)}.")
    return dict(presets[stage])
