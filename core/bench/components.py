"""Which component of the model a source file belongs to: the attribution that `bench --train`'s
FLOP count, its profile and the planner's largest temporaries share.

Components are keyed on package paths under core/ (`model/attention`, `loss/indexer_kl`):
an equation or an HLO op belongs to the innermost frame of its call stack that is an owned core
module. Helper modules (shared building blocks such as `model/layers`) are skipped, so their work is
attributed to whoever called them; glue modules (the decoder's wiring, the step, the data) own no
work of their own and also pass to the next frame up. Every core module is in exactly one of the
three tables (tests/bench/test_bench.py checks it), so a new module cannot land in "other" silently.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

COMPONENTS = ("attention", "compressor", "indexer", "MoE", "mHC", "head", "optimizer", "other")

# core module (path under core/, no suffix) -> component
OWNERS = {
    "model/attention": "attention", "ops/chunked_attention": "attention", "ops/fused_attention": "attention",
    "ops/topk": "indexer", "loss/indexer_kl": "indexer",
    "model/moe": "MoE", "ops/grouped_matmul": "MoE", "ops/expert_parallel": "MoE",
    "model/block": "mHC",  # the block wires the sublayers (their frames are inner); its own maths is the mHC
    "loss/lm": "head",
    "model/indexer_init": "indexer",
    "train/optimizer": "optimizer", "train/step_guard": "optimizer",  # the guard tests the update it keeps or drops
}
# shared building blocks: their work belongs to the caller
HELPERS = {"model/layers", "model/init_draws", "model/quant", "ops/quant", "parallel/sharding", "parallel/mesh", "ops/placement", "tree"}
# wiring and drivers: no arithmetic of their own beyond what they call (their frames pass up too)
GLUE = {
    "errors", "process", "model/transformer", "model/params", "train/flops", "spec/platform", "spec/resolve", "parallel/chips", "parallel/peers", "parallel/collective_order", "parallel/xla_flags",
    "config/schema", "config/files", "config/values", "config/validate", "config/stages", "config/key_table",
    "data/batches", "data/sources", "data/identity", "data/prefetch",
    "checkpoint/store", "checkpoint/run_files", "checkpoint/host_tree", "checkpoint/inspect",
    "train/step", "train/program", "train/remat", "train/run", "train/preflight", "train/materialise", "train/outputs",
    "train/memory", "train/compile_cache", "train/run_lock",
    "train/resume_checks", "train/write_errors", "train/handoff", "train/tensorboard", "train/stop",
    "train/indexer_init",
    "eval/metrics", "eval/evaluate", "eval/report", "eval/rows",
    "hf/names", "hf/config_json", "hf/safetensors_io", "hf/importer", "hf/exporter",
    "bench/loss", "bench/train", "bench/trace", "bench/hlo_owners", "bench/components",
    "plan/targets", "plan/compile", "plan/report", "plan/hlo", "plan/search", "plan/cost",
}
# modules merged into others since a trace was recorded (issue 60's file moves): what their frames meant then, so
# that a trace recorded before the move (tests/bench/test_trace.py's) reads as it did; no module of today is here
MOVED_OWNERS = {"model/compressor": "compressor", "model/indexer": "indexer", "ops/moe_dispatch": "MoE",
                "loss/indexer_kl_rows": "indexer", "loss/indexer_kl_streamed": "indexer",
                "model/mhc": "mHC"}
MOVED_HELPERS = {"ops/rope", "ops/masks", "ops/order"}
# functions that own a component inside a module whose other work is another's (issue 60 merged the indexer into
# model/attention and the compressor into model/layers): module -> (component, exact names, class prefixes), matched
# on a frame's qualified function name
FUNCTION_OWNERS = {
    "model/attention": ("indexer", {"indexer_queries", "local_gradient_loss", "local_gradient_surrogate"}, ("Indexer.",)),
    "model/layers": ("compressor", {"compress"}, ("Compressor.",)),
}
CORE = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=4096)
def core_module(file_name: str) -> str | None:
    """'model/attention' for .../core/model/attention.py; None outside core/ (cached: a jaxpr names the
    same few files on thousands of frames)."""
    path = Path(file_name)
    try:
        rel = path.resolve().relative_to(CORE) if path.is_absolute() else None
    except ValueError:
        rel = None
    if rel is None:
        return None
    return rel.with_suffix("").as_posix().removesuffix("/__init__")


def _function_owner(module: str, function_name: str | None) -> str | None:
    owner = FUNCTION_OWNERS.get(module)
    if owner is None or not function_name:
        return None
    component, names, prefixes = owner
    return component if function_name in names or function_name.startswith(prefixes) else None


def component_of_files(file_names: Sequence[str], function_names: Sequence[str] | None = None) -> str:
    """Component of a call stack given as source file names, innermost first.

    optax's frames are the optimizer; the first core frame that is an owner decides; helper and glue
    frames pass to the next frame up; a stack with no owner is "other".
    """
    for i, name in enumerate(file_names):
        if "/optax/" in name:
            return "optimizer"
        module = core_module(name)
        owned = _function_owner(module, function_names[i] if function_names else None) if module else None
        if owned:
            return owned
        if module is None or module in HELPERS or module in GLUE or module in MOVED_HELPERS:
            continue
        return OWNERS.get(module) or MOVED_OWNERS.get(module, "other")
    return "other"
