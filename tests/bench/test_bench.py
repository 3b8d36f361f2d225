"""core.bench.loss and `dsv4 bench` (issue 7): memory scaling of the streamed loss, the CLI's JSON."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.bench import loss as bench
from dsv4cli.main import app

ROOT = Path(__file__).resolve().parents[2]

SMALL = bench.LossShape("test", "none", batch=1, heads=4, head_dim=16, indexer_heads=4, indexer_head_dim=16, topk=8)


def test_streamed_memory_grows_linearly_in_t():
    """XLA's temp size of the compiled fwd+bwd step: streamed ~2x per doubling, direct ~4x."""
    def temp(variant, seq):
        return bench.compile_step(SMALL, seq, variant, head_chunk=2, query_chunk=32)[2].temp_size_in_bytes

    streamed = [temp("streamed", seq) for seq in (256, 512)]
    direct = [temp("direct", seq) for seq in (256, 512)]
    assert streamed[1] / streamed[0] < 2.5, streamed
    assert direct[1] / direct[0] > 3.5, direct  # the test can tell quadratic from linear
    assert streamed[1] < direct[1] / 10, (streamed, direct)


def test_step_flops_by_hand():
    # B=1, T=8, W=2, H*D=64, HI*DI=64, HI=4: 2 * 16 * (64 + 3 * 64 + 2 * 4)
    assert bench.step_flops(SMALL, 8) == 2 * 16 * (64 + 192 + 8)


def test_cli_bench_tiny_json_has_every_field():
    result = CliRunner().invoke(app, ["bench", "--shape", "tiny", "--seq", "64", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {f.name for f in dataclasses.fields(bench.LossBenchResult)}
    assert out["shape"]["name"] == "tiny" and out["matmul_gflops"] > 0 and out["budget_bytes"] > 0
    (row,) = out["seqs"]
    assert set(row) == {f.name for f in dataclasses.fields(bench.SeqResult)}
    assert row["seq"] == 64 and row["fits"] and row["flops"] == bench.step_flops(bench.loss_shape("tiny"), 64)
    assert [v["variant"] for v in row["variants"]] == list(bench.VARIANTS)
    for v in row["variants"]:
        assert set(v) == {f.name for f in dataclasses.fields(bench.VariantResult)}
        no_grad_diff = {"grad_abs_diff"} if v["variant"] == "teacher+kl" else set()
        assert v["ran"] and all(value is not None for k, value in v.items() if k not in no_grad_diff), v
        assert v["compile_s"] > 0 and v["step_s"] > 0 and v["temp_bytes"] >= 0 and v["gflops"] > 0
        assert v["loss_abs_diff"] <= 1e-5 * v["loss"] and (v["grad_abs_diff"] or 0) <= 1e-5, v
    assert row["variants"][3]["query_chunk"] == 16 and row["variants"][3]["head_chunk"] == 1


def test_cli_rejects_chunks_that_do_not_divide():
    result = CliRunner().invoke(app, ["bench", "--shape", "tiny", "--seq", "64", "--chunk", "3"])
    assert result.exit_code == 2 and "--chunk 3" in result.output


# Two sliding-window layers, a 512-token vocabulary, 32-token rows: the training step compiles in seconds.
TRAIN_TINY = ["compress_ratios=[0,0]", "base_num_decoder_layers=2", "first_num_hash_layers=0", "vocab_size=512",
              "hc_sinkhorn_iters=2", "lm_loss_chunk_size=24", "indexer_topk=4"]


def test_cli_train_sweep_json():
    """One shape through the CLI: its own subprocess, every figure present and positive. The shape is
    `timed_profile`'s (its subprocess then reads this one's step from the compilation cache)."""
    result = CliRunner().invoke(app, ["bench", "--train", "--seq", "32", "--batch", "2", "--stage", "sparse",
                                      "--train-steps", "1", "--json", *TRAIN_TINY])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    (row,) = out["rows"]
    assert (row["stage"], row["seq"], row["batch"]) == ("sparse", 32, 2), row
    for key in ("compile_s", "first_step_s", "step_time_s", "tokens_per_s", "temp_bytes", "peak_rss_bytes",
                "model_flops", "tflops_per_device", "mfu", "peak_flops"):
        assert row[key] > 0, (key, row)
    assert row["tokens_per_step"] == 2 * 32 and row["last"]["lm_loss"] > 0
    assert row["peak_source"] == "CPU: measured f32 matmul ceiling" and row["devices"] == 1, row
    assert row["mfu"] == pytest.approx(row["model_flops"] / row["step_time_s"] / row["peak_flops"], rel=1e-12)
    assert row["tflops_per_device"] == pytest.approx(row["model_flops"] / row["step_time_s"] / 1e12, rel=1e-12)
    from rich.console import Console

    from dsv4cli.bench_train import render_sweep

    console = Console(record=True, width=250)
    render_sweep(console, out)
    text = console.export_text()
    assert "TFLOP/s/dev" in text and f"{row['mfu']:.1%}" in text and "CPU: measured f32 matmul ceiling" in text, text


@pytest.fixture(scope="module")
def timed_profile():
    """`dsv4 bench --train --profile` at 2 x 32 (FLOPs, one timed and one traced step), as JSON."""
    result = CliRunner().invoke(app, ["bench", "--train", "--profile", "--seq", "32", "--batch", "2",
                                      "--train-steps", "1", "--json", *TRAIN_TINY])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_profile_counts_the_head_exactly(timed_profile):
    """FLOPs per component from the step's jaxpr: the chunked head's matmuls are 3 x 2NMV
    (logits, d hidden, d head, all in the forward scan) plus 2NM (each token's target logit, from h
    and its target's head column) over N tokens padded to whole chunks, and the components add up
    to the total."""
    from rich.console import Console

    from dsv4cli.bench_train import render_profile

    out = timed_profile
    assert (out["stage"], out["seq"], out["batch"]) == ("sparse", 32, 2)
    n, m, v = 72, 64, 512  # 2 x 32 = 64 tokens in chunks of 24: 3 chunks
    comps = out["components"]
    assert comps["head"]["matmul_flops"] == 3 * 2 * n * m * v + 2 * n * m, comps["head"]
    assert comps["optimizer"]["matmul_flops"] == 0 and comps["optimizer"]["other_flops"] > 0
    for name in ("attention", "MoE", "mHC"):
        assert comps[name]["matmul_flops"] > 0, (name, comps[name])
    assert comps["indexer"]["matmul_flops"] == comps["compressor"]["matmul_flops"] == 0  # no CSA/HCA layer
    total = sum(c["matmul_flops"] + c["other_flops"] for c in comps.values())
    assert total == out["total_flops"] and out["temp_bytes"] > 0
    console = Console(record=True, width=200)
    render_profile(console, out)
    text = console.export_text()
    assert all(name in text for name in comps) and "MFLOP/token" in text, text


@pytest.mark.parametrize("args, needle", [
    (["--stage", "nosuch"], "--stage"), (["--seq", "0"], "--seq"), (["--batch", "x"], "--batch"),
    (["--profile", "--seq", "32,64"], "one shape"), (["indexer_topk=oops"], "indexer_topk"),
])
def test_cli_train_rejects_bad_input(args, needle):
    result = CliRunner().invoke(app, ["bench", "--train", *args])
    assert result.exit_code == 2 and needle in result.output, result.output


def test_cli_loss_bench_rejects_overrides():
    result = CliRunner().invoke(app, ["bench", "--shape", "tiny", "remat_policy=none"])
    assert result.exit_code == 2 and "--train" in result.output


@pytest.mark.parametrize("name", ["flash", "tiny"])
def test_loss_shapes_come_from_the_model_configs(name):
    shape = bench.loss_shape(name)
    if name == "flash":
        assert (shape.heads, shape.head_dim, shape.indexer_heads, shape.indexer_head_dim, shape.topk) == (64, 512, 64, 128, 512)
        assert shape.default_head_chunk == 8
    assert shape.heads % shape.default_head_chunk == 0


def test_profile_times_every_component_from_a_trace(timed_profile):
    """The measured time per component (jax.profiler trace of the compiled step): the components cover
    the traced ops exactly, every component that runs gets time and those the model lacks get none."""
    from rich.console import Console

    from core.bench.train import COMPONENTS
    from dsv4cli.bench_train import render_profile

    out = timed_profile
    assert out["measured"]["tokens_per_step"] == 64 and out["matmul_gflops"] > 0
    timed = out["measured"]["time"]
    assert list(timed["components"]) == list(COMPONENTS) and timed["steps"] == 1
    assert sum(timed["components"].values()) == pytest.approx(timed["op_s"], rel=1e-9)
    for name in ("attention", "MoE", "mHC", "head", "optimizer"):
        assert timed["components"][name] > 0, (name, timed)
    assert timed["components"]["indexer"] == timed["components"]["compressor"] == 0  # no CSA/HCA layer
    assert timed["platform"] == "cpu" and timed["traced_step_s"] == timed["wall_step_s"] > 0  # no Steps line
    assert 0 <= timed["unattributed_s"] <= min(timed["components"]["other"], timed["no_frame_s"]), timed
    assert sum(timed["by_how"].values()) == pytest.approx(timed["op_s"], rel=1e-9)
    assert all(row[1] in COMPONENTS and row[2] > 0 for row in timed["top_ops"]), timed["top_ops"]
    model, mfu = out["model_flops"], out["mfu"]
    assert model["tokens"] == 64 and 0 < model["total"] < out["total_flops"], model  # no remat, no implementation recompute
    assert 0 < mfu["model"] < mfu["compiled"] and mfu["peak_source"] == "CPU: measured f32 matmul ceiling", mfu
    console = Console(record=True, width=250)
    render_profile(console, out)
    text = console.export_text()
    assert "time share" in text and "model GFLOP" in text and "MFU: model" in text, text


def test_hlo_stack_frames_name_the_component():
    """Every instruction of a compiled fwd+bwd of mHC's Sinkhorn and MoE's SwiGLU maps to one of the two."""
    import jax
    import jax.numpy as jnp

    from core.bench import hlo_owners
    from core.bench import trace as bench_time
    from core.model import block as mhc
    from core.model import moe

    def f(x):
        return jnp.sum(mhc.sinkhorn(x, 3, 1e-6)) + jnp.sum(moe.swiglu_hidden(x, 2.0 * x, 1.5))

    hlo = jax.jit(jax.grad(f)).lower(jnp.ones((4, 3, 3))).compile().as_text()
    owners = {component for component, _ in bench_time.hlo_components(hlo).values()}
    assert {"mHC", "MoE"} <= owners <= {"mHC", "MoE", "other"}, owners
    assert hlo_owners.parse(hlo).name.startswith("jit_")


def test_every_core_module_has_a_component_or_is_named_glue():
    """A new core module lands in OWNERS (a component, HELPER or GLUE) on purpose, never in "other" by omission;
    every "module:name" entry names a function or class of its module; RENAMED's old modules are gone into
    today's; the rule reads (module, function)."""
    import importlib

    from core.bench import components

    core = components.CORE
    modules = {components.core_module(str(p)) for p in core.rglob("*.py") if p.name != "__init__.py"}
    missing, stale = sorted(modules - components.MODULES), sorted(components.MODULES - modules)
    assert not missing and not stale, f"unlisted {missing}, gone {stale}"
    named = [key.split(":") for key in components.OWNERS if ":" in key]
    assert all(hasattr(importlib.import_module("core." + m.replace("/", ".")), name) for m, name in named), named
    assert not set(components.RENAMED) & modules and set(components.RENAMED.values()) <= modules
    of = components.component_of_files
    layers, attention, masks, topk = (str(core / f) for f in ("model/layers.py", "model/attention.py",
                                                               "ops/chunked_attention.py", "ops/topk.py"))
    assert of([str(core / "loss" / "indexer_kl.py")]) == "indexer"
    assert of([str(core / "ops" / "rope.py"), attention]) == "attention"  # a module since merged, as recorded
    assert of([layers, attention], ["compress.<locals>.pool", "Attention.__call__"]) == "compressor"
    assert of([layers, attention], ["apply_rope", "Attention.__call__"]) == "attention"
    assert of([layers], ["Indexer.inputs"]) == "indexer"
    assert of([layers, attention], ["local_gradient_loss", "Attention._index"]) == "indexer"
    assert of([str(core / "model" / "indexer.py")], ["Indexer.inputs"]) == "indexer"  # its module before the merge
    assert of([masks, topk], ["visible_rows", "select_topk_chunked.<locals>.body"]) == "indexer"
    assert of([masks, attention], ["chunked_attention.<locals>.body", "Attention.__call__"]) == "attention"


@pytest.mark.parametrize("impl", ["ragged", "gmm"])
def test_grouped_matmuls_count_each_row_once(impl):
    """The MoE's grouped matmuls in the jaxpr count: lax.ragged_dot's forward, input and weight gradients, and
    the megablox kernels by their own cost estimates (interpret mode here): 3 x 2·S·K·N, as the model's.
    (The megablox forward's equation carries no core frame, only its jit's: it lands in "other".)"""
    import jax
    import jax.numpy as jnp

    from core.bench.train import jaxpr_flops
    from core.model import moe

    s, e, k, n = 64, 4, 128, 256
    matmul = moe.ragged(jnp.float32) if impl == "ragged" else moe.megablox_gmm(jnp.float32, moe.auto_gmm_tiling(k, n), "cpu")
    sizes = jnp.full((e,), s // e, jnp.int32)
    loss = lambda lhs, rhs: jnp.sum(matmul(lhs, rhs, sizes))  # noqa: E731
    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(jnp.ones((s, k)), jnp.ones((e, k, n)))
    counted = sum(c["matmul_flops"] for c in jaxpr_flops(closed).values())
    assert counted == 3 * 2 * s * k * n, counted


def test_the_bench_parent_never_opens_a_device():
    """`run_train_sweep` and a timed `profile_step` leave every device to their children (one process at
    a time may hold a TPU): checking the inputs initialises no JAX backend in the parent."""
    code = (
        "import jax._src.xla_bridge as xb\n"
        "from core.bench import train\n"
        "train._run_point = lambda *a, **k: {'error': 'not run'}\n"
        "assert train.profile_step('sparse', 128, 1, overrides=['base_num_decoder_layers=2', "
        "'compress_ratios=[4,128]', 'first_num_hash_layers=1']) == {'error': 'not run'}\n"
        "train.run_train_sweep(['warmup'], [128], [1])\n"
        "print('backends', xb.backends_are_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip().endswith("backends False"), out.stderr[-2000:]
