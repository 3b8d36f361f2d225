"""Which component of the model a frame of a call stack belongs to: the attribution that `bench --train`'s
FLOP count, its profile and the planner's largest temporaries share.

A frame is (source file, qualified function name). Its owner is found by one rule, on (module,
function): `OWNERS["module:name"]`, for the outermost name of the frame's qualified function name
(`Indexer` of `Indexer.inputs`, `compress` of `compress.<locals>.body`), where the module holds
another component's code; else `OWNERS["module"]`. Modules are package paths under core/
(`model/attention`, `loss/indexer_kl`). An equation or an HLO op belongs to the innermost frame of
its call stack whose owner is a component; `HELPER` frames (shared building blocks such as
`model/layers`' norms and RoPE, the masks) pass their work to whoever called them, and `GLUE` frames
(the decoder's wiring, the step, the data) own no work of their own and also pass to the next frame
up. Every core module has an entry (tests/bench/test_bench.py checks it, and that every
"module:name" names a function or class there), so a new module cannot land in "other" silently.
A trace recorded before issue 60 merged modules names their old files: `RENAMED` says where that
code lives now, and the same rule reads it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

COMPONENTS = ("attention", "compressor", "indexer", "MoE", "mHC", "head", "optimizer", "other")
HELPER, GLUE = "helper", "glue"  # frames that pass to the next one up (module docstring)

# the visibility and selection masks, which the attention, the indexer's top-k, its loss and the evaluation all
# build: helpers (the rules per set of rows in core/ops/chunked_attention.py, the dense masks in masked_attention.py)
_MASKS = ("block_segment_ids", "block_last_positions", "block_first_positions", "visible_rows", "window_rows",
          "block_keys")
_DENSE_MASKS = ("csa_visible", "compressed_visibility", "sliding_window_mask", "selection_mask", "selected")
_GLUE = (
    "errors", "process", "model/transformer", "model/params", "train/flops", "spec/platform", "spec/resolve",
    "parallel/chips", "parallel/peers", "parallel/collective_order", "parallel/xla_flags",
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
)
# "module" or "module:name" -> component, HELPER or GLUE
OWNERS = {
    "model/attention": "attention", "ops/chunked_attention": "attention", "ops/fused_attention": "attention",
    **{f"model/layers:{name}": "indexer"  # the lightning indexer's parameters and projections
       for name in ("Indexer", "IndexerSpec", "indexer_queries", "local_gradient_loss", "local_gradient_surrogate")},
    **{f"ops/chunked_attention:{name}": HELPER for name in _MASKS},
    "ops/masked_attention": "attention", **{f"ops/masked_attention:{name}": HELPER for name in _DENSE_MASKS},
    "ops/topk": "indexer", "loss/indexer_kl": "indexer", "loss/indexer_kl_direct": "indexer", "model/indexer_init": "indexer",
    "model/layers": HELPER, "model/layers:compress": "compressor", "model/layers:Compressor": "compressor",
    "model/moe": "MoE", "ops/grouped_matmul": "MoE", "ops/expert_parallel": "MoE", "ops/batched_experts": "MoE",
    "model/block": "mHC",  # the block wires the sublayers (their frames are inner); its own maths is the mHC
    "loss/lm": "head",
    "train/optimizer": "optimizer", "train/step_guard": "optimizer",  # the guard tests the update it keeps or drops
    **{m: HELPER for m in ("model/init_draws", "model/quant", "ops/quant", "parallel/sharding", "parallel/mesh",
                           "ops/placement", "tree")},
    **{m: GLUE for m in _GLUE},
}
MODULES = {m for m in OWNERS if ":" not in m}  # the core modules of today
HELPERS = {m for m in MODULES if OWNERS[m] == HELPER}
# modules merged into others since a trace was recorded (issue 60's moves) -> the module their code lives in now
RENAMED = {"model/compressor": "model/layers", "model/indexer": "model/layers", "ops/moe_dispatch": "model/moe",
           "loss/indexer_kl_rows": "loss/indexer_kl", "loss/indexer_kl_streamed": "loss/indexer_kl",
           "model/mhc": "model/block", "ops/rope": "model/layers", "ops/masks": "ops/chunked_attention",
           "ops/order": "ops/placement"}
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


def owner(module: str, function_name: str | None = None) -> str | None:
    """The component, HELPER or GLUE of a frame of `module` (a path under core/, or one `RENAMED`) running
    `function_name` (qualified: `Indexer.inputs`); None for a module no entry names."""
    module = RENAMED.get(module, module)
    outer = (function_name or "").split(".", 1)[0]
    return OWNERS.get(f"{module}:{outer}") or OWNERS.get(module)


def component_of_files(file_names: Sequence[str], function_names: Sequence[str] | None = None) -> str:
    """Component of a call stack given as source file names (and their frames' qualified function names),
    innermost first.

    optax's frames are the optimizer; the first core frame whose owner is a component decides; helper and
    glue frames pass to the next frame up; a stack with no owner is "other".
    """
    for i, name in enumerate(file_names):
        if "/optax/" in name:
            return "optimizer"
        module = core_module(name)
        if module is None:
            continue
        found = owner(module, function_names[i] if function_names else None)
        if found in (HELPER, GLUE):
            continue
        return found or "other"
    return "other"
