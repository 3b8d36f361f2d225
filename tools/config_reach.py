"""The modules whose functions receive the run's `Config`, counted at run time over a tiny run's `Trainer.__init__`.

    python tools/config_reach.py [--stage pretrain] [--json] [KEY=VALUE ...]

Issue 60's measure in its own words: "counting each module a function that receives it lives in, through every
call". Builds deepseek4-tiny cut to two layers (SWA then CSA, 64 tokens, the embedded text) and runs
`core.train.run.Trainer.__init__` on it in a temporary run directory under `sys.setprofile` (and
`threading.setprofile`, for the step compiled ahead on its own thread). Every call into a module of this
checkout (core/, dsv4cli/) whose arguments (*args and **kwargs included) include a `core.config.schema.Config`
(any: the one asked or the one resolved from it) counts that module: `receives`. A call whose arguments hold a Config one attribute
down (a record that carries it, such as a field of a dataclass or an entry of a tuple) counts apart:
`holds`. Values computed from the Config (specs, the mesh, data) are not followed: that is
`farm-studio walk`'s wider measure, which counts every room a value derived from `cfg` enters.
Prints each module with the functions that received the Config, and the two counts.

Developer tool: run it before and after a change that moves the Config's reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=1", "max_target_length=64",
        "enable_tensorboard=false", "steps=1"]


def _held(value, kind) -> bool:
    """Whether `value` holds a `kind` one attribute down: a dataclass's field, an object's attribute, an entry
    of a tuple, list or dict's values."""
    if isinstance(value, (tuple, list)):
        parts = value
    elif isinstance(value, dict):
        parts = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    else:
        parts = getattr(value, "__dict__", {}).values() if not isinstance(value, type) else ()
    return any(isinstance(p, kind) for p in parts)


def receivers(call, kind, roots=("core/", "dsv4cli/")) -> dict[str, dict[str, set[str]]]:
    """Run `call()` under a profile hook: {"receives" | "holds": {module path: {function names}}} of every call
    into a file under `roots` (relative to this checkout) whose arguments are a `kind`, or hold one
    (`_held`). Arguments: the frame's parameters (positional, keyword-only, *args, **kwargs) at entry."""
    found: dict[str, dict[str, set[str]]] = {"receives": defaultdict(set), "holds": defaultdict(set)}
    prefixes = tuple(str(ROOT / r) for r in roots)

    def hook(frame, event, _):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(prefixes):
            return
        code, local = frame.f_code, frame.f_locals
        n = code.co_argcount + code.co_kwonlyargcount
        values = [local.get(name) for name in code.co_varnames[:n]]
        if code.co_flags & inspect.CO_VARARGS:
            values += list(local.get(code.co_varnames[n], ()))
            n += 1
        if code.co_flags & inspect.CO_VARKEYWORDS:
            values += list(local.get(code.co_varnames[n], {}).values())
        module = str(Path(path).relative_to(ROOT))
        if any(isinstance(v, kind) for v in values):
            found["receives"][module].add(code.co_qualname)
        elif any(_held(v, kind) for v in values):
            found["holds"][module].add(code.co_qualname)

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {k: dict(v) for k, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides (after the tiny layout's)")
    parser.add_argument("--stage", default="pretrain", choices=("pretrain", "warmup", "sparse"))
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    from core.config.schema import Config, load_config
    from core.train.run import Trainer

    cfg = load_config("deepseek4-tiny", [*TINY, *args.overrides], stage=args.stage)
    with tempfile.TemporaryDirectory() as tmp:
        made: list = []
        found = receivers(lambda: made.append(Trainer(cfg, stage=args.stage, run_dir=Path(tmp) / "run")), Config)
        made[0].outputs.close(None)
        made[0].lock.release()
    receives, holds = found["receives"], {m: f for m, f in found["holds"].items() if m not in found["receives"]}
    if args.json:
        print(json.dumps({"receives": {m: sorted(f) for m, f in sorted(receives.items())},
                          "holds": {m: sorted(f) for m, f in sorted(holds.items())},
                          "counts": {"receives": len(receives), "receives_or_holds": len(receives) + len(holds)}}))
        return
    for title, table in (("receive the Config", receives), ("receive a record holding it", holds)):
        print(f"{len(table)} modules {title}:")
        for module, functions in sorted(table.items()):
            print(f"  {module}: {', '.join(sorted(functions))}")
    print(f"{len(receives)} modules receive the Config; {len(receives) + len(holds)} receive it or a record holding it")


if __name__ == "__main__":
    main()
