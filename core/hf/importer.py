"""`dsv4 import-hf`: a DeepSeek-V4 checkpoint (official FP8/FP4 or transformers layout) -> a dsv4 run.

DESIGN.md, "Real checkpoints". The source is a directory with config.json and *.safetensors
(optionally model.safetensors.index.json), or a hub id fetched with huggingface_hub. Steps:
  1. headers only: every shard's tensor table (core.hf.safetensors_io), the layout and which optional
     parameter groups exist (indexer, router biases) -> the Config (core.hf.config_json);
  2. one host buffer per dsv4 parameter, in the output dtype, shaped like the model's state
     (scanned segments of core.model.transformer.layer_plan stacked on their leading axis);
  3. shard by shard, tensor by tensor: map the name (core.hf.names), dequantise FP8 / FP4 to
     float32, convert the layout, write the slice into its buffer (a kept weight: its codes and
     scales as they are, below);
  4. every parameter complete -> config.yml + checkpoints/0 through core.checkpoint.store, the buffers
     written in place in bounded chunks (core.checkpoint.host_tree), in a temporary directory renamed
     to the output at the end.
Peak host memory: the output parameters plus about one float32 copy of the largest tensor (the
save adds a bounded number of `core.checkpoint.host_tree.CHUNK_BYTES` chunks, not a copy;
docs/checkpoints.md#import-and-export-at-flash-width).
Output dtype: --dtype, else bfloat16 above 1e9 parameters and float32 below; it is the run's
frozen_weight_dtype. With bfloat16 (which also rounds the float32 tensors: mHC, ape, sinks) the run's
config.yml names the warm-up's trainable_parameters_mask: the frozen weights are held in bfloat16 and
the indexer, which the warm-up trains, in float32 (weight_dtype, the master copy AdamW updates;
docs/precision.md). A later stage that trains more restores those weights into its own float32 masters.

`keep_quantized` (--keep-quantized, official layout only): the FP8 / FP4 weights that the warm-up
freezes and dsv4 holds released (core/model/quant.py RELEASED: all of them but the indexer's wq_b,
which the warm-up trains) are stored as the release stores them, codes and e8m0 scales bit for bit,
at `<param path>/codes` and `<param path>/scales`. The run's config.yml then says
`frozen_weights: released` with the warm-up's trainable_parameters_mask, so the model it describes
holds exactly those leaves (and `dsv4 warmup --init-from` loads them with no re-quantisation); a
stage that would train them is refused (core.model.quant.restore_target). A transformers-layout
source is refused: it holds no FP8 / FP4 codes to keep (a frozen_weights=released run quantises a
float checkpoint when it loads it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from core.hf import names
from core.hf import safetensors_io as st
from core.errors import CheckpointError, ConfigError
from core.model.params import count_parameters

INDEX_FILE = "model.safetensors.index.json"
BF16_ABOVE = 1_000_000_000
STAGE = "import"
_SCALE = re.compile(r"(.+)\.(scale|weight_scale_inv)$")


@dataclasses.dataclass
class ImportSummary:
    """What `import_checkpoint` did (the CLI renders it)."""

    source: str
    output: str
    layout: str
    model_name: str
    params: int
    dtype: str
    dtype_reason: str
    tensors: int = 0
    fp8: int = 0               # FP8 tensors dequantised
    fp4: int = 0               # FP4 tensors dequantised
    kept_fp8: int = 0          # FP8 tensors stored as they are (--keep-quantized), scales not counted
    kept_fp4: int = 0
    kept_bytes: int = 0        # their codes and scales
    keep_quantized: bool = False
    mtp_skipped: int = 0
    source_bytes: int = 0
    use_indexer: bool = True
    routed_bias: bool = True


# ----------------------------------------------------------------------------- the source


def resolve_source(src: str) -> Path:
    """A local directory, or a hub id downloaded (config + safetensors only) with huggingface_hub."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{src!r} is a file: give the checkpoint directory (config.json + *.safetensors).")
        return path
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", src):
        raise CheckpointError(f"{src!r} is neither a directory nor a hub id like deepseek-ai/DeepSeek-V4-Flash.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(src, allow_patterns=["config.json", "*.safetensors", INDEX_FILE]))
    except Exception as e:  # offline, unknown repo, gated, network: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"hub checkpoint {src!r} cannot be fetched ({first}): check the id, "
                              "your network / HF_TOKEN, or download it and give the directory.") from None


def read_source(root: Path) -> tuple[dict, dict[str, tuple[Path, st.TensorInfo]]]:
    """(config.json, {tensor name: (shard, header entry)}) from headers only.

    Raises:
      CheckpointError: no config.json, no shards, a shard the index names is missing, a tensor
        the index names is absent from its shard, or any unreadable / truncated shard.
    """
    try:
        config = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(root)!r} has no config.json: give a DeepSeek-V4 checkpoint directory.") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{str(root / 'config.json')!r} cannot be read ({e}): fix or re-download it.") from None
    index = root / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{str(index)!r} is not a safetensors index (no weight_map): fix or remove it.") from None
    shards = sorted({root / f for f in weight_map.values()}) if weight_map else sorted(root.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{str(root)!r} holds no *.safetensors shard: give a DeepSeek-V4 checkpoint directory.")
    for shard in shards:
        if not shard.exists():
            raise CheckpointError(f"shard {shard.name} named by {INDEX_FILE} is missing from {str(root)!r}: "
                                  "download it again.")
    table = {}
    for shard in shards:
        for name, info in st.read_header(shard).items():
            if name in table:
                raise CheckpointError(f"tensor {name} appears in both {table[name][0].name} and {shard.name}: "
                                      "the checkpoint is inconsistent.")
            table[name] = (shard, info)
    for name, shard in (weight_map or {}).items():
        if table.get(name, (None,))[0] != root / shard:
            raise CheckpointError(f"tensor {name} is listed in {INDEX_FILE} under {shard} but that shard does not "
                                  "hold it: the download is incomplete or mixed.")
    return config, table


# ----------------------------------------------------------------------------- targets


def _has(table, pattern: str) -> bool:
    return any(re.search(pattern, n) for n in table)


def build_config(config: dict, table: dict, *, model_name: str, dtype: str | None, keep_quantized: bool = False):
    """(Config, layout, dtype reason) from config.json and the tensor names.

    With `keep_quantized`: frozen_weights=released and the warm-up's trainable_parameters_mask
    (module docstring). Raises ConfigError for a transformers-layout source.
    """
    from core.config.files import stage_presets
    from core.hf.config_json import from_hf_config
    from core.model.transformer import param_counts
    from core.spec.resolve import parameter_spec

    layout = names.detect_layout(table)
    if keep_quantized and layout != "official":
        raise ConfigError("--keep-quantized keeps the official layout's FP8/FP4 codes, but this checkpoint is in the "
                          "transformers layout (unquantised): import it without --keep-quantized (a run with "
                          "frozen_weights=released quantises its frozen weights when it loads it).")
    groups = dict(use_indexer=_has(table, r"\.indexer\."),
                  routed_bias=_has(table, r"\.gate\.(bias|e_score_correction_bias)$"))
    cfg = from_hf_config(config, model_name=model_name, **groups)
    if dtype is None:
        total = param_counts(parameter_spec(cfg))["total"]
        dtype = "bfloat16" if total > BF16_ABOVE else "float32"
        reason = f"the default {'above' if total > BF16_ABOVE else 'at or below'} 1e9 parameters"
    else:
        reason = "--dtype"
    warmup = stage_presets("warmup")["trainable_parameters_mask"]
    held = dict(frozen_weights="released", trainable_parameters_mask=warmup) if keep_quantized else {}
    if dtype == "bfloat16":  # what the warm-up freezes in bfloat16; what it trains gets its float32 master copy
        held.setdefault("trainable_parameters_mask", warmup)
    return cfg.replace(weight_dtype="float32", frozen_weight_dtype=dtype, **held), layout, reason


# ----------------------------------------------------------------------------- reading one tensor


def _scale_of(name: str, info: st.TensorInfo, table: dict) -> tuple[Path, st.TensorInfo]:
    """(shard, header entry) of an FP8 / FP4 weight's block scales."""
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    scale = next((table[k] for k in (f"{base}.scale", f"{base}.weight_scale_inv") if k in table), None)
    if scale is None:
        raise CheckpointError(f"tensor {name} is {info.dtype} but has no {base}.scale: an FP8/FP4 weight needs its "
                              "block scales; the checkpoint is incomplete.")
    return scale


def _value(name: str, shard: Path, info: st.TensorInfo, table: dict, summary: ImportSummary) -> np.ndarray:
    """The tensor in float32 (dequantised) or its own float / int dtype (a memory map)."""
    raw = st.read_tensor(shard, info)
    if info.dtype not in ("F8_E4M3", "I8"):
        return raw
    s = st.read_tensor(*_scale_of(name, info, table))
    if info.dtype == "F8_E4M3":
        summary.fp8 += 1
        return st.dequant_fp8(raw, s)
    summary.fp4 += 1
    return st.dequant_fp4(raw, s)


def _logical_shape(name: str, info: st.TensorInfo) -> tuple:
    return (info.shape[0], info.shape[1] * 2) if info.dtype == "I8" and not name.endswith("tid2eid") else info.shape


def _is_consumed_scale(name: str, table: dict) -> bool:
    m = _SCALE.fullmatch(name)
    weight = table.get(f"{m.group(1)}.weight") if m else None
    return weight is not None and weight[1].dtype in ("F8_E4M3", "I8")


def _slot(name: str, m: names.Match, leaf, j: int | None) -> tuple[tuple, tuple]:
    """(the shape one tensor fills in `leaf`, its index there: stacked slice j, then the expert)."""
    want = tuple(leaf.shape[1:] if j is not None else leaf.shape)
    if m.expert is not None:
        if not 0 <= m.expert < want[0]:
            raise CheckpointError(f"tensor {name} is for expert {m.expert}, but config.json has {want[0]} experts.")
        want = want[1:]
    return want, tuple(i for i in (j, m.expert) if i is not None)


def _claim(name: str, path: str, key: str, index: tuple, filled: set) -> None:
    if (key, index) in filled:
        raise CheckpointError(f"tensor {name} fills {path} a second time: the checkpoint holds it twice.")


def _write_slice(buffers: dict, key: str, leaf, index: tuple, value, filled: set) -> None:
    if key not in buffers:
        buffers[key] = np.empty(leaf.shape, leaf.dtype)
    buffers[key][index] = value
    filled.add((key, index))


def _place(name, load, shape, m, layout, dims, where, leaves, buffers, filled, num_layers) -> None:
    """Write one HF tensor's dsv4 slices into their buffers (shape-checked against the model first;
    `load()` then gives the tensor's values)."""
    value = None
    if m.layer is not None and m.layer >= num_layers:
        raise CheckpointError(f"tensor {name} is for layer {m.layer}, but config.json has {num_layers} layers: "
                              "the checkpoint and its config.json disagree.")
    for rule in m.rules:
        path = names.logical_path(rule, m.layer)
        if path not in where:
            raise CheckpointError(f"tensor {name} has no place in the model config.json describes (no {path}): "
                                  "check compress_ratios / num_hash_layers against the tensors.")
        key, j = where[path]
        leaf = leaves[key]
        want, index = _slot(name, m, leaf, j)
        hf_want = names.hf_shape(rule, layout, want, dims)
        if tuple(shape) != hf_want:
            raise CheckpointError(f"tensor {name} has shape {list(shape)}, but config.json implies {list(hf_want)}: "
                                  "the checkpoint and its config.json disagree.")
        _claim(name, path, key, index, filled)
        value = load() if value is None else value
        ours = names.rule_to_ours(rule, layout, value, dims)
        if np.issubdtype(leaf.dtype, np.integer):
            if not np.issubdtype(ours.dtype, np.integer) or ours.size and (ours.min() < 0 or ours.max() >= dims["experts"]):
                raise CheckpointError(f"tensor {name} must hold expert ids in [0, {dims['experts']}), "
                                      f"got dtype {ours.dtype}: the hash table is corrupted.")
        elif np.issubdtype(ours.dtype, np.integer) or ours.dtype == np.bool_:
            raise CheckpointError(f"tensor {name} has integer dtype {ours.dtype} where a float weight belongs.")
        _write_slice(buffers, key, leaf, index, ours, filled)


_HELD_CODES = {"int8": ("I8", "FP4 e2m1 (two per int8)"), "float8_e4m3fn": ("F8_E4M3", "FP8 e4m3")}


def _held_slots(m: names.Match, where: dict) -> dict[str, tuple[str, int | None]] | None:
    """{"codes", "scales": (state key, stacked index)} when the model holds this tensor's parameter released."""
    path = names.logical_path(m.rules[0], m.layer) if len(m.rules) == 1 else None
    if path is None or f"{path}.codes" not in where:
        return None
    return {part: where[f"{path}.{part}"] for part in ("codes", "scales")}


def _check_keepable(table: dict, layout: str, where: dict, leaves: dict) -> None:
    """--keep-quantized, from the headers before any tensor is read: every tensor whose parameter the
    model holds released is stored as dsv4 holds it (FP8 e4m3 or packed FP4 codes, e8m0 scales)."""
    for name, (_, info) in table.items():
        m = None if names.MTP.match(name) or _is_consumed_scale(name, table) else names.match(name, layout)
        slots = _held_slots(m, where) if m is not None else None
        if slots is None:
            continue
        code, what = _HELD_CODES[np.dtype(leaves[slots["codes"][0]].dtype).name]
        if info.dtype != code:
            path = names.logical_path(m.rules[0], m.layer)
            raise CheckpointError(f"tensor {name} is {info.dtype}, but dsv4 holds {path} released as {what} codes "
                                  f"({code}): --keep-quantized keeps the release's own codes; import without it.")
        scale = _scale_of(name, info, table)[1]
        if scale.dtype != "F8_E8M0":
            raise CheckpointError(f"tensor {scale.name} is {scale.dtype}, but dsv4 holds e8m0 block scales (F8_E8M0): "
                                  "--keep-quantized keeps the release's own scales; import without it.")


def _place_held(name: str, source: tuple[Path, st.TensorInfo], m: names.Match, slots: dict, leaves: dict,
                buffers: dict, filled: set, table: dict) -> int:
    """Store one FP8 / FP4 weight and its scales as they are (--keep-quantized; dtypes checked by
    `_check_keepable`): the official codes and e8m0 scales, bit for bit, into the held leaves'
    buffers. Returns the bytes stored."""
    path = names.logical_path(m.rules[0], m.layer)
    scale = _scale_of(name, source[1], table)
    stored = 0
    for part, (shard, tinfo) in (("codes", source), ("scales", scale)):
        key, j = slots[part]
        leaf = leaves[key]
        want, index = _slot(name, m, leaf, j)
        if tuple(tinfo.shape) != want:
            raise CheckpointError(f"tensor {tinfo.name} has shape {list(tinfo.shape)}, but config.json implies "
                                  f"{list(want)}: the checkpoint and its config.json disagree.")
        _claim(tinfo.name, f"{path}/{part}", key, index, filled)
        _write_slice(buffers, key, leaf, index, st.read_tensor(shard, tinfo), filled)
        stored += tinfo.nbytes
    return stored


def _check_complete(where, leaves, filled, layout) -> None:
    """Every dsv4 parameter (every stacked slice, every expert) was written exactly once."""
    for path, (key, j) in where.items():
        part = path.rsplit(".", 1)[-1] if path.endswith((".codes", ".scales")) else None
        rule, layer = names.rule_of(path.removesuffix(f".{part}") if part else path)
        experts = range(leaves[key].shape[0 if j is None else 1]) if rule.per_expert(layout) else [None]
        for e in experts:
            index = tuple(i for i in (j, e) if i is not None)
            if (key, index) not in filled:
                prefix = "" if layer is None else f"{names.PREFIX[layout]}{layer}."
                hf = prefix + rule.name(layout).replace("{e}", str(e))
                hf = names.scale_name(hf) if part == "scales" else hf
                raise CheckpointError(f"the checkpoint has no tensor {hf} (dsv4 {path}): it is incomplete or "
                                      "its config.json describes a different model.")


# ----------------------------------------------------------------------------- the command


def import_checkpoint(src: str, output: str | Path, *, dtype: str | None = None, keep_quantized: bool = False,
                      on_progress: Callable[[dict], None] | None = None) -> ImportSummary:
    """Convert a DeepSeek-V4 checkpoint into a dsv4 run directory (module docstring).

    Args:
      src: local directory or hub id.
      output: the run directory to create (must not exist, or be empty).
      dtype: "bfloat16" | "float32" | None (by parameter count).
      keep_quantized: store the frozen FP8 / FP4 weights as they are (module docstring).
      on_progress: called with {"shard", "shards", "name", "bytes", "total_bytes"} after each tensor.
    Raises:
      CheckpointError / ConfigError: one line naming the tensor, field or file; nothing is left behind.
    """
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(f"output {str(output)!r} exists and is not empty: choose a new --output or remove it.")
    root = resolve_source(src)
    config, table = read_source(root)
    model_name = re.sub(r"[^\w.-]", "-", Path(src.rstrip("/")).name or "imported")
    cfg, layout, reason = build_config(config, table, model_name=model_name, dtype=dtype,
                                       keep_quantized=keep_quantized)
    where, leaves, treedef = names.state_slots(cfg)
    dims = {**names.dims_of(cfg), "experts": cfg.num_experts}
    params = count_parameters({k: v.shape for k, v in leaves.items()})["parameters"]
    summary = ImportSummary(str(src), str(output), layout, cfg.model_name, params, cfg.frozen_weight_dtype, reason,
                            keep_quantized=keep_quantized, use_indexer=cfg.use_indexer, routed_bias=cfg.routed_bias)
    if keep_quantized:
        _check_keepable(table, layout, where, leaves)
    buffers: dict[str, np.ndarray] = {}
    filled: set = set()
    shards = sorted({shard for shard, _ in table.values()})
    total = sum(info.nbytes for _, info in table.values())
    done = 0
    for k, shard in enumerate(shards):
        for name, (where_shard, info) in table.items():
            if where_shard != shard:
                continue
            done += info.nbytes
            if names.MTP.match(name):
                summary.mtp_skipped += 1
            elif not _is_consumed_scale(name, table):
                m = names.match(name, layout)
                if m is None:
                    raise CheckpointError(f"tensor {name} matches no DeepSeek-V4 parameter of the {layout} layout: "
                                          "dsv4 cannot import it (is this a DeepSeek-V4 checkpoint?).")
                held = _held_slots(m, where) if keep_quantized else None
                if held is not None:
                    summary.kept_bytes += _place_held(name, (shard, info), m, held, leaves, buffers, filled, table)
                    summary.kept_fp4 += info.dtype == "I8"
                    summary.kept_fp8 += info.dtype != "I8"
                else:
                    load = lambda: _value(name, shard, info, table, summary)  # noqa: E731
                    _place(name, load, _logical_shape(name, info), m, layout, dims, where, leaves, buffers, filled,
                           cfg.num_layers)
                summary.tensors += 1
            if on_progress:
                on_progress({"shard": k + 1, "shards": len(shards), "name": name, "bytes": done, "total_bytes": total})
    _check_complete(where, leaves, filled, layout)
    summary.source_bytes = total
    _write_run(output, cfg, treedef, [buffers[k] for k in leaves], summary)
    return summary


def _write_run(output: Path, cfg, treedef, arrays, summary: ImportSummary) -> None:
    """config.yml + checkpoints/0 in a temporary sibling directory, renamed to `output` at the end."""
    import jax

    from core.checkpoint import store as ckpt
    from core.checkpoint import run_files
    from core.config.schema import dump
    from core.train.run import dsv4_version

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.import-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        run_files.write_config(tmp, dump(cfg))
        saver = ckpt.RunCheckpointer(tmp, max_to_keep=1, async_save=False, host_model=True)
        metadata = {"config": cfg.to_dict(), "stage": STAGE, "step": 0, "metrics": {}, "model_name": cfg.model_name,
                    "dsv4_version": dsv4_version(), "source": summary.source, "layout": summary.layout}
        # host_model: the buffers are written in place, in bounded chunks (core.checkpoint.host_tree);
        # Orbax's default save would hold two more copies. The optimizer item holds no state
        # (an import has none); Orbax refuses an empty item.
        saver.save(0, model=jax.tree_util.tree_unflatten(treedef, arrays),
                   optimizer={"imported": np.zeros((), np.int32)}, data={"imported": True}, metadata=metadata)
        saver.close()
        if output.exists():
            output.rmdir()  # empty (checked at the start)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
