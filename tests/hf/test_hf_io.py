"""`dsv4 import-hf` / `dsv4 export-hf` (core.hf.importer, core.hf.exporter, core.hf.config_json).

* A synthetic official-layout checkpoint (tests/hf_checkpoints.py: SWA, CSA, HCA layers, hash and
  learned routing, a scanned segment, FP8 / FP4 exactly as on disk, two shards + index, MTP
  tensors) imports to exactly the float32 dequantisation computed in the test, renamed to the
  transformers layout by this file's own table (the notes' section 3) and loaded through the map
  the HF parity test proves.
* The committed HF fixture, written as transformers-layout safetensors, imports and matches HF's
  logits.
* export -> import is bitwise; the export's names / shapes / dtypes are the official inventory; the
  exported values of a model with non-square tensors equal the layout rule (the notes: torch
  [out, in] against our [in, out]) written out in this file, in both layouts.
* Every bad input is one line, exit 2, and leaves nothing behind.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from safetensors.numpy import load_file
from typer.testing import CliRunner

from core.checkpoint import store as ckpt
from core import tree
from core.hf import safetensors_io as st
from core.config.schema import load_config
from core.errors import CheckpointError, ConfigError
from core.hf.config_json import from_hf_config
from core.hf.exporter import export_checkpoint
from core.hf.importer import import_checkpoint
from core.hf.names import dims_of, hf_to_dsv4, set_params
from core.model.transformer import Transformer
from core.spec.resolve import resolve
from dsv4cli.main import app
from tests.hf_checkpoints import NARROW, SMALL, official_inventory, write_official

FIXTURES = Path(__file__).parents[1] / "fixtures"
LOGIT_TOL = 1e-4


# ----------------------------------------------------------------------------- an independent rename


_LEAF = [  # official -> transformers, applied in order to the part after `layers.{i}.` (notes section 3)
    (r"^attn_norm\.", "input_layernorm."), (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
    (r"^attn\.indexer\.compressor\.", "self_attn.compressor.indexer."),
    (r"^attn\.indexer\.weights_proj", "self_attn.compressor.indexer.scorer.weights_proj"),
    (r"^attn\.indexer\.wq_b", "self_attn.compressor.indexer.q_b_proj"), (r"^attn\.", "self_attn."),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"), (r"compressor(\.indexer)?\.norm\.", r"compressor\1.kv_norm."),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"), (r"^ffn\.", "mlp."),
    (r"shared_experts\.w1\.", "shared_experts.gate_proj."), (r"shared_experts\.w3\.", "shared_experts.up_proj."),
    (r"shared_experts\.w2\.", "shared_experts.down_proj."),
]
_ROOT = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
         "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def official_to_transformers(values: dict[str, np.ndarray], c: dict) -> dict[str, np.ndarray]:
    """Rename official tensors to transformers' and fuse the experts (gate rows first)."""
    out = {}
    for name, v in values.items():
        if name.startswith("mtp."):
            continue
        if name in _ROOT:
            out[_ROOT[name]] = v
            continue
        i, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
        if ".experts." in rest and "shared" not in rest:
            continue
        for pattern, repl in _LEAF:
            rest = re.sub(pattern, repl, rest)
        out[f"model.layers.{i}.{rest}"] = v
    for i in range(c["num_hidden_layers"]):
        e = range(c["n_routed_experts"])
        w = {k: [values[f"layers.{i}.ffn.experts.{x}.{k}.weight"] for x in e] for k in ("w1", "w2", "w3")}
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack([np.concatenate([a, b]) for a, b in zip(w["w1"], w["w3"])])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(w["w2"])
    return out


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hfio")


@pytest.fixture(scope="module")
def official(work):
    """(source dir, {official name: float64 dequantised value})."""
    src = work / "DeepSeek-V4-Small"
    return src, write_official(src, SMALL, seed=3)


@pytest.fixture(scope="module")
def imported(work, official):
    """(run dir, summary) of the float32 import of the synthetic official checkpoint."""
    run = work / "runs" / "base"
    return run, import_checkpoint(str(official[0]), run)


def _state(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}


@nnx.jit
def _forward(model, tokens):
    """Eval-mode logits of one row (jitted: models of one structure share the compilation)."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return model(tokens, positions, jnp.ones_like(tokens), mode="eval")[0]


# ----------------------------------------------------------------------------- the official layout


def test_official_import_equals_float32_dequantisation(official, imported):
    """Every parameter (stacked scanned segments included) equals the test's own dequantisation."""
    _, values = official
    run, summary = imported
    model, cfg, meta = ckpt.restore_model(run)
    assert meta["stage"] == "import" and cfg.weight_dtype == "float32" and summary.dtype == "float32"
    assert cfg.layer_kinds == ("swa", "csa", "hca", "csa", "hca", "csa") and cfg.first_num_hash_layers == 2
    assert any(reps > 1 for _, _, reps in model.segments), "the plan must include a scanned segment"
    inv = official_inventory(SMALL, mtp=True)
    assert summary.mtp_skipped == sum(2 if kind in ("fp8", "fp4") else 1 for n, (_, kind) in inv.items() if n.startswith("mtp."))
    assert summary.fp8 == sum(k == "fp8" for n, (_, k) in inv.items() if not n.startswith("mtp."))
    assert summary.fp4 == sum(k == "fp4" for n, (_, k) in inv.items() if not n.startswith("mtp."))

    expected = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    f32 = {k: v if v.dtype.kind == "i" else v.astype(np.float32) for k, v in values.items()}
    set_params(expected, hf_to_dsv4(official_to_transformers(f32, SMALL), dims_of(cfg)))
    ours, theirs = _state(model), _state(expected)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and np.array_equal(ours[key], theirs[key]), \
            f"{key}: max diff {np.abs(ours[key].astype(np.float64) - theirs[key]).max():.3e}"


def test_flash_config_json_imports_to_the_284b_config():
    """The released DeepSeek-V4-Flash config.json -> exactly configs/deepseek4-284b.yml's model keys."""
    hf = json.loads((FIXTURES / "deepseek_v4_flash_config.json").read_text())
    cfg = from_hf_config(hf, model_name="deepseek4-284b")
    flash = load_config("deepseek4-284b")
    keys = yaml.safe_load((Path(__file__).parents[2] / "configs" / "deepseek4-284b.yml").read_text())
    keys.pop("stages")  # the layouts of its stages, applied only under a stage
    # the file's layout and precision (dtype, *_dtype, ici_*/dcn_*) are run choices, not the model's
    run = {k for k in keys if k == "dtype" or k.endswith("_dtype") or k.startswith(("ici_", "dcn_"))}
    keys = {k: v for k, v in keys.items() if k not in run}
    assert {k: getattr(cfg, k) for k in keys} == {k: getattr(flash, k) for k in keys}
    assert cfg.replace(**{k: getattr(flash, k) for k in run}) == flash


def test_init_from_eval_and_inspect_accept_the_import(imported):
    """What `--init-from` does (shape check + restore into a model of the run's config.yml)."""
    run, _ = imported
    cfg = load_config(str(run / "config.yml"))
    abstract = nnx.eval_shape(lambda: Transformer(resolve(cfg, "cpu").model, rngs=nnx.Rngs(0)))
    target = nnx.to_pure_dict(nnx.state(abstract))
    values, step = ckpt.restore_model_state(run, target)
    assert step == 0 and tree.shapes(values) == tree.shapes(target)
    result = CliRunner().invoke(app, ["inspect-ckpt", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["stage"] == "import"


def test_hub_id_goes_through_snapshot_download(official, work, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: calls.append((repo, kw)) or str(official[0]))
    summary = import_checkpoint("someone/DeepSeek-V4-Small", work / "runs" / "hub")
    assert calls[0][0] == "someone/DeepSeek-V4-Small" and "*.safetensors" in calls[0][1]["allow_patterns"]
    assert summary.model_name == "DeepSeek-V4-Small" and summary.tensors > 0
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="cannot be fetched"):  # HF_HUB_OFFLINE=1 (conftest), not cached
        import_checkpoint("someone/not-there", work / "runs" / "hub2")


# ----------------------------------------------------------------------------- the HF fixture


def test_hf_fixture_as_transformers_safetensors_matches_hf_logits(work):
    with np.load(FIXTURES / "hf_deepseek_v4.npz") as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays.pop("config_json")))
    params = {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
    src = work / "hf-fixture"
    src.mkdir()
    names = sorted(params)
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        st.write_file(src / file, {n: params[n] for n in part})
        weight_map.update({n: file for n in part})
    st.write_index(src / "model.safetensors.index.json", weight_map, sum(v.nbytes for v in params.values()))
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **meta["hf_kwargs"]}))
    summary = import_checkpoint(str(src), work / "runs" / "hf")
    assert summary.layout == "transformers" and summary.dtype == "float32"
    model, cfg, _ = ckpt.restore_model(work / "runs" / "hf")
    for key, value in meta["dsv4_overrides"].items():
        if key not in ("dtype", "max_target_length", "per_device_batch_size"):
            assert getattr(cfg, key) == (tuple(value) if isinstance(value, list) else value), key
    logits = _forward(model, jnp.asarray(arrays["tokens"], jnp.int32))
    diff = np.abs(np.asarray(logits, np.float64) - arrays["logits"]).max()
    assert diff < LOGIT_TOL, f"max |dsv4 - HF| logits = {diff:.3e}"


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("layout", ["official", "transformers"])
def test_export_then_import_is_bitwise(imported, work, layout):
    run, _ = imported
    out = work / f"export-{layout}"
    summary = export_checkpoint(run, out, layout=layout)
    assert summary.layout == layout and summary.dtype == "float32"
    again = import_checkpoint(str(out), work / "runs" / f"again-{layout}")
    assert again.layout == layout and again.fp8 == again.fp4 == 0
    a, b = _state(ckpt.restore_model(run)[0]), _state(ckpt.restore_model(work / "runs" / f"again-{layout}")[0])
    assert a.keys() == b.keys()
    assert [k for k in a if a[k].dtype != b[k].dtype or not np.array_equal(a[k], b[k])] == []
    assert load_config(str(run / "config.yml")).replace(model_name="x") == \
        load_config(str(work / "runs" / f"again-{layout}" / "config.yml")).replace(model_name="x")


def test_export_inventory_is_the_official_one(imported, work):
    """Names and shapes = the official inventory (no MTP); dtypes: weights in --dtype, F32 / I64 kept."""
    run, _ = imported
    out = work / "export-bf16"
    assert export_checkpoint(run, out, dtype="bfloat16", max_shard_bytes=2**19).shards > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    header = {}
    for shard in sorted(set(index["weight_map"].values())):
        header.update(st.read_header(out / shard))
    assert set(index["weight_map"]) == set(header)
    inv = official_inventory(SMALL)
    assert {n: i.shape for n, i in header.items()} == {n: s for n, (s, _) in inv.items()}
    want = {"fp8": "BF16", "fp4": "BF16", "bf16": "BF16", "f32": "F32", "i64": "I64"}
    assert {n: i.dtype for n, i in header.items()} == {n: want[k] for n, (_, k) in inv.items()}
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in header.values())
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"


def _exported(out: Path) -> dict[str, np.ndarray]:
    """Every tensor of an export, read with the safetensors library (not core.hf)."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(out / shard)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def _expected_export(ours: dict[str, np.ndarray], c: dict, layout: str) -> dict[str, np.ndarray]:
    """Exported values of a few tensors of each kind, from our [in, out] parameters by the notes'
    layout rule (torch Linear [out, in]; section 1's inventory, section 3's transformers names)."""
    h, g, e, n = c["num_attention_heads"], c["o_groups"], c["n_routed_experts"], c["hc_mult"]
    w1, w2, w3 = (ours[f"layers/1/ffn/experts/{w}"] for w in ("w1", "w2", "w3"))
    wq_b = ours["layers/1/attn/wq_b"]                         # [q_lora, H, D]
    wo_a = ours["layers/2/attn/wo_a"]                         # [G, H/G * D, R]
    fn = ours["layers/0/hc_attn/fn"]                          # [n, M, J]
    values = {  # official name: value
        "embed.weight": ours["embed"],                        # [V, M] both sides
        "head.weight": ours["head"].T,                        # ours [M, V]
        "layers.1.attn.wq_a.weight": ours["layers/1/attn/wq_a"].T,
        "layers.1.attn.wq_b.weight": np.concatenate([wq_b[:, i, :].T for i in range(h)]),   # row i * D + d
        "layers.2.attn.wo_a.weight": np.concatenate([wo_a[k].T for k in range(g)]),         # row k * R + r
        "layers.2.attn.compressor.wkv.weight": ours["layers/2/attn/compressor/wkv"].T,
        "layers.0.hc_attn_fn": np.concatenate([fn[i].T for i in range(n)], axis=1),        # column i * M + m
        "layers.1.ffn.gate.weight": ours["layers/1/ffn/gate/weight"].T,
        "layers.1.ffn.shared_experts.w2.weight": ours["layers/1/ffn/shared_experts/w2"].T,
    }
    if layout == "official":
        for x in range(e):
            for w, value in (("w1", w1), ("w2", w2), ("w3", w3)):
                values[f"layers.1.ffn.experts.{x}.{w}.weight"] = value[x].T
        return values
    renamed = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
               "layers.1.attn.wq_a.weight": "model.layers.1.self_attn.q_a_proj.weight",
               "layers.1.attn.wq_b.weight": "model.layers.1.self_attn.q_b_proj.weight",
               "layers.2.attn.wo_a.weight": "model.layers.2.self_attn.o_a_proj.weight",
               "layers.2.attn.compressor.wkv.weight": "model.layers.2.self_attn.compressor.kv_proj.weight",
               "layers.0.hc_attn_fn": "model.layers.0.attn_hc.fn",
               "layers.1.ffn.gate.weight": "model.layers.1.mlp.gate.weight",
               "layers.1.ffn.shared_experts.w2.weight": "model.layers.1.mlp.shared_experts.down_proj.weight"}
    values = {renamed[k]: v for k, v in values.items()}
    values["model.layers.1.mlp.experts.gate_up_proj"] = np.stack([np.concatenate([w1[x].T, w3[x].T]) for x in range(e)])
    values["model.layers.1.mlp.experts.down_proj"] = np.stack([w2[x].T for x in range(e)])
    return values


@pytest.fixture(scope="module")
def narrow(work):
    """(run dir, {our path: value}) of the float32 import of a NARROW official checkpoint."""
    src, run = work / "narrow-src", work / "runs" / "narrow"
    write_official(src, NARROW, seed=5, mtp=False)
    import_checkpoint(str(src), run)
    return run, _state(ckpt.restore_model(run)[0])


@pytest.mark.parametrize("layout", ["official", "transformers"])
def test_exported_values_follow_the_layout_rule(narrow, work, layout):
    """The bytes of an export (float32) equal the expected arrays computed here from our parameters."""
    run, ours = narrow
    out = work / f"export-narrow-{layout}"
    export_checkpoint(run, out, layout=layout, dtype="float32")
    got = _exported(out)
    for name, want in _expected_export(ours, NARROW, layout).items():
        want = np.ascontiguousarray(want, np.float32)
        assert want.ndim < 2 or want.shape[-1] != want.shape[-2], f"{name} {want.shape}: square hides a transpose"
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, (name, got[name].shape, want.shape)
        assert got[name].tobytes() == want.tobytes(), \
            f"{name}: max diff {np.abs(got[name].astype(np.float64) - want).max():.3e}"


def test_bfloat16_import_export_import_is_bitwise(official, work):
    run, run2, out = work / "runs" / "bf16", work / "runs" / "bf16-again", work / "export-bf16-run"
    assert import_checkpoint(str(official[0]), run, dtype="bfloat16").dtype == "bfloat16"
    export_checkpoint(run, out, layout="transformers")
    import_checkpoint(str(out), run2)  # default: the exported torch_dtype does not matter, the values are bf16
    a, b = _state(ckpt.restore_model(run)[0]), _state(ckpt.restore_model(run2)[0])
    assert [k for k in a if not np.array_equal(a[k].astype(np.float32), b[k].astype(np.float32))] == []
    assert {str(v.dtype) for k, v in a.items() if v.dtype.kind != "i"} >= {"bfloat16"}
    # the warm-up takes the bfloat16 import as it is: the indexer it trains is a float32 master, the rest bfloat16
    for stage in ("warmup", "sparse"):
        load_config(str(run / "config.yml"), stage=stage)
    floats = {k: str(v.dtype) for k, v in a.items() if v.dtype.kind != "i"}
    assert {d for k, d in floats.items() if "indexer" in k} == {"float32"}, floats
    held = [k for k in floats if "indexer" not in k and not k.endswith("gate/bias")]  # the bias is no Param
    assert held and {k for k in held if floats[k] != "bfloat16"} == set()
    kept = import_checkpoint(str(official[0]), work / "runs" / "bf16-kept", dtype="bfloat16", keep_quantized=True)
    assert kept.dtype == "bfloat16" and kept.kept_fp8 + kept.kept_fp4 > 0


# ----------------------------------------------------------------------------- bad input


def _copy(official, work, name) -> Path:
    dst = work / "bad" / name
    shutil.copytree(official[0], dst)
    return dst


def _edit_config(src: Path, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))


def _bad_cases(official, work):
    src = _copy(official, work, "missing")
    (src / "model-00002-of-00002.safetensors").unlink()
    yield src, "shard model-00002-of-00002.safetensors named by model.safetensors.index.json is missing"
    src = _copy(official, work, "shape")
    _edit_config(src, q_lora_rank=16)
    yield src, r"tensor layers\.0\.attn\.(q_norm\.weight has shape \[32\]|wq_a\.weight has shape \[32, 64\]), but config.json implies \[16"
    src = _copy(official, work, "truncated")
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    yield src, "model-00002-of-00002.safetensors' is truncated"
    src = _copy(official, work, "dtype")
    st.write_file(src / "extra.safetensors", {"w": np.ones((2, 2), "float8_e5m2")})
    (src / "model.safetensors.index.json").unlink()
    yield src, "tensor w in extra.safetensors has dtype F8_E5M2"
    src = _copy(official, work, "unknown")
    st.write_file(src / "extra.safetensors", {"layers.0.attn.wq_c.weight": np.ones((2, 2), np.float32)})
    (src / "model.safetensors.index.json").unlink()
    yield src, "tensor layers.0.attn.wq_c.weight matches no DeepSeek-V4 parameter"
    src = _copy(official, work, "field")
    _edit_config(src, dspark_target_layer_ids=[1, 2])
    yield src, "config.json field dspark_target_layer_ids=.* is unknown to dsv4"
    src = _copy(official, work, "maths")
    _edit_config(src, scoring_func="softmax")
    yield src, "config.json field scoring_func='softmax' is not supported"


def test_bad_inputs_are_one_line_exit_2_and_leave_nothing(official, work):
    runner = CliRunner()
    for src, message in _bad_cases(official, work):
        out = work / "bad-out" / src.name
        result = runner.invoke(app, ["import-hf", str(src), "--output", str(out)])
        assert result.exit_code == 2, (src.name, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and re.search(message, errors[0]), (src.name, result.output)
        assert "Traceback" not in result.output
        assert not out.exists() and not list((work / "bad-out").glob(".*")), f"{src.name}: something was left behind"


def test_non_empty_output_is_refused(official, imported, work):
    run, _ = imported
    for argv in (["import-hf", str(official[0]), "--output", str(run)], ["export-hf", str(run), str(run)]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2 and "exists and is not empty" in result.output, result.output
    with pytest.raises(ConfigError, match="--layout 'hf' is not supported"):
        export_checkpoint(run, work / "never", layout="hf")


# ----------------------------------------------------------------------------- what transformers writes


def test_transformers_saved_config_equals_the_official_spelling():
    """tests/fixtures/transformers_saved_config.json: transformers 5.24's save_pretrained of an export of
    the SMALL model (layer_types, mlp_layer_types, nested rope_parameters, partial_rotary_factor...)."""
    saved = json.loads((FIXTURES / "transformers_saved_config.json").read_text())
    official = {"model_type": "deepseek_v4", **SMALL}
    assert from_hf_config(saved, model_name="m") == from_hf_config(official, model_name="m")


def test_transformers_saved_norm_names_are_read(imported, work):
    """save_pretrained writes `kv_norm` as `norm` (self_attn, compressor, indexer): the same parameters."""
    run, _ = imported
    out, renamed = work / "export-tf-norm", work / "export-tf-renamed"
    export_checkpoint(run, out, layout="transformers")
    renamed.mkdir()
    for f in out.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, renamed / f.name)
            continue
        header = st.read_header(f)
        st.write_file(renamed / f.name, {n.replace("kv_norm.", "norm."): np.array(st.read_tensor(f, i)) for n, i in header.items()})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n.replace("kv_norm.", "norm."): s for n, s in index["weight_map"].items()}
    (renamed / "model.safetensors.index.json").write_text(json.dumps(index))
    import_checkpoint(str(renamed), work / "runs" / "tf-renamed")
    a, b = _state(ckpt.restore_model(run)[0]), _state(ckpt.restore_model(work / "runs" / "tf-renamed")[0])
    assert [k for k in a if not np.array_equal(a[k], b[k])] == []


def test_cli_json_summaries(official, imported, work):
    run, _ = imported
    result = CliRunner().invoke(app, ["export-hf", str(run), str(work / "cli-export"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tensors"] == len(official_inventory(SMALL))
    result = CliRunner().invoke(app, ["import-hf", str(work / "cli-export"), "-o", str(work / "runs" / "cli"),
                                      "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.output[result.output.index("{"):])
    assert s["dtype"] == "bfloat16" and s["dtype_reason"] == "--dtype" and s["mtp_skipped"] == 0


def test_null_or_unsupported_fields_name_themselves():
    base = {"model_type": "deepseek_v4", **SMALL}
    for change, field in ((dict(q_lora_rank=None), "q_lora_rank"), (dict(tie_word_embeddings=True), "tie_word_embeddings"),
                          (dict(rope_scaling={"type": "linear", "factor": 2}), "rope_scaling.rope_type"),
                          (dict(rope_scaling={**SMALL["rope_scaling"], "mscale": 0.7}), "rope_scaling.mscale")):
        with pytest.raises(ConfigError, match=f"config.json field {re.escape(field)}="):
            from_hf_config({**base, **change}, model_name="m")
