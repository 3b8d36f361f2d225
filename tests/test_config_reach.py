"""tools/config_reach.py's hook: it finds the modules whose functions receive a Config, through every call, and
tells them apart from those that receive a record holding one."""

from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "config_reach.py"


@dataclasses.dataclass
class _Holder:
    cfg: object


def _takes(holder, *, scale: int = 1):
    return holder, scale


def test_finds_the_receivers_of_a_config_through_every_call():
    from core.config.schema import Config, load_config
    from core.train import flops, preflight

    cfg = load_config("deepseek4-tiny", [], stage="sparse")

    def call():
        flops.model_flops_per_step(cfg, 2)  # flops.py, and config/stages.py beneath it
        preflight.topk_warning(cfg)
        flops.COMPONENTS.index("head")  # no Config passed: nothing

    receivers = runpy.run_path(str(TOOL))["receivers"]
    found = receivers(call, Config)
    assert {"core/train/flops.py", "core/config/stages.py", "core/train/preflight.py"} <= set(found["receives"])
    assert {"model_flops_per_step", "layer_matmuls"} <= found["receives"]["core/train/flops.py"], found
    assert not found["holds"], found["holds"]

    held = receivers(lambda: (_takes(_Holder(cfg), scale=2), _takes(_Holder(None))), Config, roots=("tests/",))
    assert held == {"receives": {}, "holds": {"tests/test_config_reach.py": {"_takes"}}}, held
