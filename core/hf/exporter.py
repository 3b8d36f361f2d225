"""`dsv4 export-hf`: a dsv4 checkpoint -> DeepSeek-V4 safetensors (DESIGN.md, "Real checkpoints").

Writes config.json (official spelling, core.hf.config_json.to_hf_config: no MTP) and safetensors
shards + model.safetensors.index.json in the official or the transformers layout (core.hf.names).
Weights in --dtype (default: the run's weight_dtype); float32 for mHC, ape, sinks and router biases
whatever --dtype (transformers keeps those modules in float32); int64 tid2eid.
Weights the run holds in the released format (frozen_weights=released, core/model/quant.py): in
the official layout their codes and e8m0 scales are written back unchanged, bit for bit, under the
official names (`<module>.weight` F8_E4M3 or packed-FP4 I8, `<module>.scale` F8_E8M0), and
config.json carries the official quantization_config (and expert_dtype "fp4" for FP4 experts); in
the transformers layout they are dequantised (exact in float32) and written like any weight.
Shards hold whole tensors, filled in layer order up to `max_shard_bytes`: a first pass over names
and shapes plans them, the second writes each tensor into its planned file as it is converted
(core.hf.safetensors_io.StreamedFile); everything is written in a temporary sibling directory renamed
to OUT at the end. Host memory: the restored model plus about one tensor (its converted copy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from core.hf import names
from core.hf import safetensors_io as st
from core.errors import CheckpointError, ConfigError

DTYPES = ("bfloat16", "float32")
_RELEASED_DTYPES = {st.DTYPES[code] for code in ("F8_E4M3", "F8_E8M0", "I8")}


@dataclasses.dataclass
class ExportSummary:
    """What `export_checkpoint` wrote."""

    run: str
    step: int
    output: str
    layout: str
    dtype: str
    tensors: int
    shards: int
    bytes: int
    released: int = 0       # tensors written as the run holds them, FP8 / FP4 codes and their scales


def _layer_params(model, cfg) -> Iterator[tuple[int | None, dict[str, np.ndarray]]]:
    """(layer or None for the root, {logical path: host array}) in checkpoint order: embed, layers, head."""
    from flax import nnx

    from core.tree import flatten

    where, _, _ = names.state_slots(cfg)
    state = flatten(nnx.to_pure_dict(nnx.state(model)))
    by_layer: dict[int | None, dict[str, np.ndarray]] = {}
    for path, (key, j) in where.items():
        m = re.match(r"layers\.(\d+)\.", path)
        value = np.asarray(state[key])
        by_layer.setdefault(int(m.group(1)) if m else None, {})[path] = value if j is None else value[j]
    root = by_layer.pop(None)
    yield None, {"embed": root.pop("embed")}
    for layer in range(cfg.num_layers):
        yield layer, by_layer[layer]
    yield None, root


def _export_dtype(path: str, value: np.ndarray, dtype: str) -> np.dtype:
    import ml_dtypes

    if np.issubdtype(value.dtype, np.integer):
        return np.dtype(np.int64)
    if names.FLOAT32_PARAMS.search(path):
        return np.dtype(np.float32)
    return np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)


_HELD = (".codes", ".scales")


def _dequantized(path: str, codes: np.ndarray, scales: np.ndarray, dims: dict, dtype: np.dtype) -> np.ndarray:
    """One layer's held weight in dsv4's layout and the export `dtype` (exact: FP8 / FP4 values times
    a power of two are bfloat16 numbers), official [(E,) O, I] codes -> ours; float32 one matrix at a time."""
    rule, _ = names.rule_of(path)
    deq = st.dequant_fp4 if codes.dtype == np.int8 else st.dequant_fp8
    if not rule.per_expert("official"):
        return rule.conv_official.to_ours(deq(codes, scales), dims).astype(dtype)
    out = None
    for e, (c, s) in enumerate(zip(codes, scales)):
        one = rule.conv_official.to_ours(deq(c, s), dims)
        out = np.empty((len(codes), *one.shape), dtype) if out is None else out
        out[e] = one
    return out


def _tensors(model, cfg, layout: str, dtype: str) -> Iterator[tuple[int, str, np.ndarray, np.dtype]]:
    """(step of `_layer_params`, HF name, HF-layout view or array, export dtype) in file order.

    A held weight (`<path>.codes`, `<path>.scales`) is its official tensors unchanged in the
    official layout, its dequantisation otherwise (module docstring)."""
    dims = names.dims_of(cfg)
    for k, (_, params) in enumerate(_layer_params(model, cfg)):
        plain = {}
        for path, value in params.items():
            if not path.endswith(_HELD):
                plain[path] = value
            elif path.endswith(".codes"):
                base = path.removesuffix(".codes")
                scales = params[f"{base}.scales"]
                if layout == "official":
                    # nothing pending in `plain` spans two paths in the official layout: flush it first
                    yield from _converted(k, plain, dims, layout, dtype)
                    plain = {}
                    yield from ((k, name, v, v.dtype) for name, v in names.held_to_official(base, value, scales))
                else:
                    out = _export_dtype(base, np.empty(0, np.float32), dtype)
                    plain[base] = _dequantized(base, value, scales, dims, out)
        yield from _converted(k, plain, dims, layout, dtype)


def _converted(k: int, params: dict, dims: dict, layout: str, dtype: str):
    for name, value in names.dsv4_to_hf(params, dims, layout):
        yield k, name, value, _export_dtype(_logical_of(name, layout), value, dtype)


def _plan(model, cfg, layout: str, dtype: str, limit: int) -> list[list[tuple[str, np.dtype, tuple]]]:
    """Shards of whole tensors [(name, dtype, shape)], in file order, each at most `limit` bytes
    (or one tensor): a pass over the names and shapes, holding no tensor."""
    shards, size = [[]], 0
    for _, name, value, out in _tensors(model, cfg, layout, dtype):
        n = value.size * out.itemsize
        if shards[-1] and size + n > limit:
            shards, size = shards + [[]], 0
        shards[-1].append((name, out, tuple(value.shape)))
        size += n
    return shards


def export_checkpoint(run: str | Path, output: str | Path, *, step: int | None = None, layout: str = "official",
                      dtype: str | None = None, max_shard_bytes: int = 4 * 2**30,
                      on_progress: Callable[[dict], None] | None = None) -> ExportSummary:
    """Write a dsv4 checkpoint as DeepSeek-V4 safetensors (module docstring).

    Args:
      run: run directory, checkpoints/ directory or step directory.
      output: directory to create (must not exist, or be empty).
      layout: "official" | "transformers".
      dtype: "bfloat16" | "float32" | None (the run's weight_dtype).
      on_progress: called with {"layer", "layers", "bytes"} after each layer.
    """
    from core.checkpoint import store as ckpt
    from core.hf.config_json import to_hf_config

    if layout not in names.LAYOUTS:
        raise ConfigError(f"--layout {layout!r} is not supported: use one of {', '.join(names.LAYOUTS)}.")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}.")
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(f"output {str(output)!r} exists and is not empty: choose a new OUT or remove it.")
    model, cfg, meta = ckpt.restore_model(run, step)
    dtype = dtype or cfg.weight_dtype
    released = _released_formats(model) if layout == "official" else set()
    plan = _plan(model, cfg, layout, dtype, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weight_map, total, shard, writer, last, kept = {}, 0, -1, None, 0, 0
        for k, name, value, out in _tensors(model, cfg, layout, dtype):
            if writer is None or writer.next == len(plan[shard]):
                if writer is not None:
                    writer.close()
                shard += 1
                writer = st.StreamedFile(tmp / files[shard], plan[shard], metadata={"format": "pt"})
            writer.write(name, value.astype(out, copy=False))
            weight_map[name], total = files[shard], total + value.size * out.itemsize
            kept += out in _RELEASED_DTYPES
            if on_progress and k != last:
                on_progress({"layer": last, "layers": cfg.num_layers + 2, "bytes": total})
                last = k
        writer.close()
        if on_progress:
            on_progress({"layer": last, "layers": cfg.num_layers + 2, "bytes": total})
        st.write_index(tmp / "model.safetensors.index.json", weight_map, total)
        (tmp / "config.json").write_text(json.dumps(to_hf_config(cfg, dtype, released=released), indent=2) + "\n")
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportSummary(str(run), meta["step"], str(output), layout, dtype, len(weight_map), len(files), total, kept)


def _released_formats(model) -> set[str]:
    """"fp8" / "fp4": the formats of the weights `model` holds released (core/model/quant.py)."""
    from flax import nnx

    from core.model.quant import HeldWeight

    return {node.fmt for _, node in nnx.iter_graph(model) if isinstance(node, HeldWeight)}


def _logical_of(name: str, layout: str) -> str:
    """A dsv4 path of an exported tensor (for its dtype rule)."""
    m = names.match(name, layout)
    return names.logical_path(m.rules[0], m.layer)
