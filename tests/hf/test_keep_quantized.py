"""`dsv4 import-hf --keep-quantized`, a warm-up on the weights it keeps, and `export-hf` of them (issue 23, item 2).

* The synthetic official checkpoint (tests/hf_checkpoints.py: FP8 linear weights, FP4 experts,
  stacked scan segments) imports through the CLI with its frozen FP8 / FP4 tensors stored as they
  are: each `<path>/codes` and `<path>/scales` slice is the file's bytes; the config says
  frozen_weights: released; the indexer's wq_b (trained by the warm-up) is dequantised as without the
  flag, and the whole model dequantises to exactly the plain import.
* `dsv4 warmup --steps 5 --init-from` the kept run equals, bitwise, the same warm-up from the plain
  import (float32): every step's losses and gradient norm, and the indexer after the last step;
  the held codes come out of the warm-up unchanged (nothing re-quantised them).
* `export-hf --layout official` writes every held tensor back with the source's name, dtype and
  bytes, and the source's quantization_config; `--layout transformers` dequantises, bitwise as the
  plain import's export; the official export imports back with --keep-quantized to the same leaves.
* `inspect-ckpt` names the held leaves' formats and bytes.
* Bad input is one line, exit 2: sparse --init-from a kept run, a transformers-layout source, a
  source whose experts are not FP4.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from core import tree
from core.checkpoint import store as ckpt
from core.hf import safetensors_io as st
from core.hf.importer import read_source
from dsv4cli.main import app
from tests.cli import dsv4_ok
from tests.hf_checkpoints import SMALL, write_official

pytestmark = pytest.mark.slow  # two imports and two warm-ups through the CLI, each compiled: the file starts early
runner = CliRunner()
# The source: tests/hf_checkpoints.py's SMALL at four layers, the hash-routed SWA layer and three CSA layers
# (a stacked scan segment): every held kind (FP8 projections, FP4 experts), the indexer and the scan.
KEPT = dict(SMALL, num_hidden_layers=4, compress_ratios=[0, 4, 4, 4], num_hash_layers=1)
# 128-token rows, one row, k below the 32 blocks of a row
WARMUP = ("--steps", "5", "dataset_type=synthetic", "max_target_length=128", "per_device_batch_size=1",
          "indexer_topk=8", "enable_tensorboard=false")
# official weight -> (dsv4 logical path of the held parameter, routed expert or None), written from the notes
_HELD = re.compile(r"layers\.(\d+)\.(attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]"
                   r"|ffn\.experts\.(\d+)\.(w[123]))\.weight")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """(work dir, source dir, {name: (shard, header entry)} of the source)."""
    work = tmp_path_factory.mktemp("keepq")
    write_official(work / "src", KEPT, seed=5)
    return work, work / "src", read_source(work / "src")[1]


@pytest.fixture(scope="module")
def runs(work):
    """The kept and the plain import of the same source, through the CLI."""
    root, src, _ = work
    kept = dsv4_ok("import-hf", str(src), "--output", str(root / "kept"), "--keep-quantized")
    dsv4_ok("import-hf", str(src), "--output", str(root / "plain"))
    return root / "kept", root / "plain", kept.stdout


def _state(run) -> dict[str, np.ndarray]:
    from flax import nnx

    return {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(ckpt.restore_model(run)[0]))).items()}


def _held_slot(name: str, where: dict) -> tuple[str, tuple] | None:
    """(flat state key without /codes, index (stack, expert)) of an official weight the run holds, or None."""
    m = _HELD.fullmatch(name)
    if m is None:
        return None
    layer, path, expert, w = m.groups()
    path = f"layers.{layer}.ffn.experts.{w}" if expert is not None else f"layers.{layer}.{path}"
    key, j = where[f"{path}.codes"]
    return key.removesuffix("/codes"), tuple(i for i in (j, None if expert is None else int(expert)) if i is not None)


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def test_keep_quantized_stores_the_files_codes_and_scales_bit_for_bit(work, runs):
    from core.config.schema import load_config
    from core.hf.names import state_slots

    _, _, table = work
    kept, plain, out = runs
    assert "kept as released: FP8 " in out and "frozen_weights: released" in out, out
    config = yaml.safe_load((kept / "config.yml").read_text())
    assert config["frozen_weights"] == "released" and config["trainable_parameters_mask"] == [".*indexer.*"]
    where = state_slots(load_config(str(kept / "config.yml")))[0]
    state, checked = _state(kept), 0
    for name, (shard, info) in table.items():
        if name.startswith("mtp.") or info.dtype not in ("F8_E4M3", "I8"):
            continue
        slot = _held_slot(name, where)
        if ".indexer." in name:  # the warm-up trains it: a float parameter, as without the flag
            assert slot is None and not any(".indexer." in k for k in where if k.endswith(".codes"))
            continue
        key, index = slot
        scale = table[name.removesuffix(".weight") + ".scale"]
        for part, (f, i) in (("codes", (shard, info)), ("scales", scale)):
            got = state[f"{key}/{part}"][index]
            want = st.read_tensor(f, i)
            assert got.dtype == want.dtype and got.shape == want.shape, (name, part, got.dtype, got.shape)
            assert np.array_equal(_bytes(got), _bytes(want)), (name, part)
        checked += 1
    # every FP8 / FP4 tensor of the file but the indexer's is held: one (codes, scales) pair each
    assert checked == sum(1 for n, (_, i) in table.items()
                          if i.dtype in ("F8_E4M3", "I8") and not n.startswith("mtp.") and ".indexer." not in n)
    held = {k for k in state if k.endswith(("/codes", "/scales"))}
    assert len(held) == 2 * len({k.rsplit("/", 1)[0] for k in held})
    # dequantised, the kept run is the plain import, bitwise
    from core.model import quant

    model = ckpt.restore_model(kept)[0]
    assert quant.dequantize_held(model)
    from flax import nnx

    deq = {k: np.asarray(v) for k, v in tree.flatten(nnx.to_pure_dict(nnx.state(model))).items()}
    flat = _state(plain)
    assert deq.keys() == flat.keys()
    for k in flat:
        assert deq[k].dtype == flat[k].dtype and np.array_equal(deq[k], flat[k]), (k, np.abs(deq[k] - flat[k]).max())


@pytest.fixture(scope="module")
def warmed(work, runs):
    """The 5-step warm-ups from the kept and from the plain import, through the CLI, their steps
    compiled with XLA:CPU's own fusions as `dsv4` compiles them (tests/conftest.py PRODUCT_FUSION)."""
    from core.train import program
    from tests.conftest import PRODUCT_FUSION

    root = work[0]
    out = {}
    options = program.step_compiler_options
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(program, "step_compiler_options", lambda *a, **k: {**options(*a, **k), **PRODUCT_FUSION})
        results = {name: dsv4_ok("warmup", "--model", str(run / "config.yml"), "--init-from", str(run),
                                 "--output", str(root / f"warm-{name}"), *WARMUP)
                   for name, run in zip(("kept", "plain"), runs[:2])}
    for name, result in results.items():
        assert "indexer_init=teacher skipped" in result.output, result.output  # the release's indexer is kept
        out[name] = root / f"warm-{name}"
    return out


def test_warmup_on_kept_weights_equals_the_float32_import_bitwise(runs, warmed):
    metrics = {k: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
               for k, run in warmed.items()}
    assert len(metrics["kept"]) == 5
    for a, b in zip(metrics["kept"], metrics["plain"]):
        for key in ("total_loss", "indexer_loss", "moe_lb_loss", "grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert metrics["kept"][-1]["indexer_loss"] != metrics["kept"][0]["indexer_loss"]  # the indexer moved
    kept, plain, imported = _state(warmed["kept"]), _state(warmed["plain"]), _state(runs[0])
    indexer = [k for k in plain if "/indexer/" in k]
    assert indexer and all(k in kept for k in indexer)
    for k in indexer:
        assert np.array_equal(kept[k], plain[k]), (k, np.abs(kept[k] - plain[k]).max())
    assert any(not np.array_equal(plain[k], _state(runs[1])[k]) for k in indexer)  # trained
    held = [k for k in imported if k.endswith(("/codes", "/scales"))]
    assert held and all(np.array_equal(_bytes(kept[k]), _bytes(imported[k])) for k in held)  # never re-quantised


def test_export_official_writes_the_held_tensors_back_bit_for_bit(work, runs):
    root, src, table = work
    kept, plain, _ = runs
    out = root / "export-official"
    result = dsv4_ok("export-hf", str(kept), str(out), "--layout", "official")
    assert "as held (FP8/FP4 codes and e8m0 scales)" in result.stdout, result.stdout
    exported = read_source(out)[1]
    source_config, config = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert config["quantization_config"] == source_config["quantization_config"] and config["expert_dtype"] == "fp4"
    quantised = [n for n, (_, i) in table.items()
                 if i.dtype in ("F8_E4M3", "I8", "F8_E8M0") and not n.startswith("mtp.")]
    for name in quantised:
        if ".indexer." in name:  # a float parameter of the kept run: its exact dequantisation, no scale
            assert name not in exported if name.endswith(".scale") else exported[name][1].dtype == "F32", name
            continue
        (f, i), (g, e) = table[name], exported[name]
        assert (e.dtype, e.shape) == (i.dtype, i.shape), (name, e.dtype, e.shape)
        assert np.array_equal(_bytes(st.read_tensor(f, i)), _bytes(st.read_tensor(g, e))), name
    wq_b = next(n for n in quantised if n.endswith("indexer.wq_b.weight"))
    (f, i), s = table[wq_b], table[wq_b.removesuffix(".weight") + ".scale"]
    np.testing.assert_array_equal(st.read_tensor(*exported[wq_b]),
                                  st.dequant_fp8(st.read_tensor(f, i), st.read_tensor(*s)))
    # back in with --keep-quantized: the same leaves, byte for byte
    dsv4_ok("import-hf", str(out), "--output", str(root / "again"), "--keep-quantized")
    a, b = _state(kept), _state(root / "again")
    assert a.keys() == b.keys() and all(np.array_equal(_bytes(a[k]), _bytes(b[k])) for k in a)
    # the transformers layout dequantises: exactly the plain import's export
    for run, name in ((kept, "tf-kept"), (plain, "tf-plain")):
        dsv4_ok("export-hf", str(run), str(root / name), "--layout", "transformers")
    tk, tp = read_source(root / "tf-kept")[1], read_source(root / "tf-plain")[1]
    assert tk.keys() == tp.keys()
    assert json.loads((root / "tf-kept" / "config.json").read_text()).get("quantization_config") is None
    for name in tk:
        assert tk[name][1].dtype == tp[name][1].dtype, name
        assert np.array_equal(_bytes(st.read_tensor(*tk[name])), _bytes(st.read_tensor(*tp[name]))), name


def test_inspect_names_the_held_formats_and_bytes(runs):
    kept, plain, _ = runs
    out = dsv4_ok("inspect-ckpt", str(kept)).stdout
    row = lambda path: next(l for l in out.splitlines() if l.split() and l.split()[0] == path)  # noqa: E731
    assert re.search(r"float8_e4m3fn +2,048 +2\.0 KiB +held FP8 e4m3", row("layers/0/attn/wq_a/codes")), out
    assert re.search(r"float8_e8m0fnu +1 +1 B +e8m0 scales", row("layers/0/attn/wq_a/scales")), out
    assert re.search(r"int8 +8,192 +8\.0 KiB +held FP4 e2m1, 2 per byte", row("layers/0/ffn/experts/w1/codes")), out
    assert re.search(r"held released in \d+ leaves \(FP8 e4m3 / FP4 e2m1 codes \+ e8m0 scales, [\d.]+ KiB\)", out), out
    totals = [json.loads(dsv4_ok("inspect-ckpt", str(r), "--json").stdout)["totals"] for r in (kept, plain)]
    assert totals[0]["parameters"] == totals[1]["parameters"]
    assert totals[0]["trainable"] + totals[0]["frozen"] == totals[1]["trainable"] + totals[1]["frozen"]
    assert totals[0]["parameter_bytes"] < totals[1]["parameter_bytes"]


def _one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    for needle in needles:
        assert re.search(needle, lines[0]), (needle, lines[0])


def test_bad_inputs_are_one_line_exit_2(work, runs, tmp_path):
    root = work[0]
    kept = runs[0]
    result = runner.invoke(app, ["sparse", "--model", str(kept / "config.yml"), "--init-from", str(kept),
                                 "--output", str(tmp_path / "sparse"), *WARMUP])
    _one_line_error(result, "dsv4 sparse trains layers/", "released FP8/FP4 format", "without --keep-quantized")
    assert not (tmp_path / "sparse" / "checkpoints").exists()
    # a transformers-layout source has no codes to keep
    dsv4_ok("export-hf", str(runs[1]), str(tmp_path / "tf"), "--layout", "transformers")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "tf"), "-o", str(tmp_path / "x"), "--keep-quantized"])
    _one_line_error(result, "transformers layout", "without --keep-quantized")
    # experts in FP8 (convert.py --expert-dtype fp8): dsv4 holds them as FP4 only
    write_official(tmp_path / "fp8experts", KEPT, seed=1, experts="fp8")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "fp8experts"), "-o", str(tmp_path / "y"),
                                 "--keep-quantized"])
    _one_line_error(result, r"^error: tensor layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight is F8_E4M3", "FP4 e2m1",
                    "import without it")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert runner.invoke(app, ["import-hf", str(tmp_path / "fp8experts"), "-o", str(tmp_path / "z")]).exit_code == 0
