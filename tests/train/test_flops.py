"""core/train/flops.py: the analytic model FLOPs against an independent count of the same step.

Two checks that together pin every term. (1) The attended area: `causal_area`'s closed forms equal
the sums of the very masks the model uses (core/ops/chunked_attention.py) over a document's positions. (2) The
matmuls: `step_matmuls`, given the dense reference's full [T, T] / [T, W] area, equals per
component the dot_generals and ragged dots of the training step's own jaxpr, dead code eliminated
(core/bench/train.py's `jaxpr_flops`: forward and backward, remat off, attention=masked, the direct
indexer and LM losses, moe_impl=ragged; and the warm-up's own chunked path, remat on, its window
banded, its loss fed the attention's teacher), for every row of the stage table, up to the named
differences of the implementation (`_implementation_extras`): the loss's teacher builds its queries
and its logits a second time (the attention's q and q·k), the MoE's load statistics are
contractions that are not the model's, and with `hc_mixes_backward: closed` the mHC mixing
projections' input gradient runs as products of slices added (core/model/block.py `hc_mixes`), not as
a dot_general. A dropped or wrong term, a wrong pass count, a wrong attribution or dead work counted
(the warm-up's last experts) fails (2).
"""

from __future__ import annotations

import pytest

import numpy as np

from core.bench.train import component_flops, sweep_config
from core.config.schema import load_config
from core.config.stages import stage_of
from core.ops.chunked_attention import band_run, num_chunks
from core.ops.masked_attention import compressed_visibility, sliding_window_mask
from core.spec.platform import resolve_config
from core.train.flops import Area, COMPONENTS, causal_area, live_parts, model_flops_per_step, step_matmuls
from tests.conftest import resolved

# Every layer kind (hash-routed CSA, HCA, SWA), the dense reference paths, no remat.
TINY = ["base_num_decoder_layers=3", "compress_ratios=[4,128,0]", "first_num_hash_layers=1", "vocab_size=256",
        "hc_sinkhorn_iters=2", "remat_policy=none", "attention=masked", "lm_loss_chunk_size=0", "csa_query_chunk_size=0",
        "moe_impl=ragged"]
SEQ, ROWS = 512, 2


@pytest.mark.parametrize("seq, window, topk, ratios", [
    (384, 32, 16, [0, 4, 128]),   # the window and the top-k fill up well before T
    (36, 64, 3, [0, 4]),          # a window longer than the sequence
    (256, 128, 64, [4, 128]),     # the top-k binds only at the last query
    (768, 16, 2, [128, 4]),       # HCA sees more blocks than the top-k, which is CSA's alone
])
@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_causal_area_is_the_sum_of_the_masks(seq, window, topk, ratios, stage):
    cfg = load_config("deepseek4-tiny", [f"max_target_length={seq}", f"sliding_window_size={window}",
                                         f"indexer_topk={topk}", f"compress_ratios={ratios}",
                                         f"base_num_decoder_layers={len(ratios)}", "first_num_hash_layers=0"],
                      stage=stage)
    positions = np.arange(seq)[None]
    segments = np.ones_like(positions)
    window_keys = int(np.sum(sliding_window_mask(positions, segments, window)))
    for layer, ratio in enumerate(ratios):
        area = causal_area(cfg, layer)
        assert area.window == window_keys, (area, window_keys)
        if not ratio:
            assert area[1:] == (0, 0), area
            continue
        per_query = np.sum(compressed_visibility(positions, segments, ratio), axis=-1)
        visible, selected = int(per_query.sum()), int(np.minimum(per_query, topk).sum())
        topk_stage = stage == "sparse" and ratio == 4
        assert area == Area(window_keys, selected if topk_stage else visible, visible), (ratio, area, visible, selected)


def _full_area(cfg, layer: int) -> Area:
    """The masked reference's area: every query against every raw key and every block."""
    t, ratio = cfg.max_target_length, cfg.compress_ratios[layer]
    blocks = t * (t // ratio) if ratio else 0
    return Area(t * t, blocks, blocks)


def _chunked_area(cfg, layer: int) -> Area:
    """The chunked attention's area (core/ops/chunked_attention.py): each query meets its chunk's
    window band (2u keys per run of u queries, or the chunk's C + S - 1) and every block."""
    t, ratio, window = cfg.max_target_length, cfg.compress_ratios[layer], cfg.sliding_window_size
    c, n = num_chunks(t, cfg.attention_query_chunk_size)
    run = band_run(c, window) if n > 1 else 0
    blocks = t * (t // ratio) if ratio else 0
    return Area(t * (2 * run if run else c + (window - 1 if n > 1 else 0)), blocks, blocks)


def _teacher_fed(cfg) -> bool:
    """The dense loss runs in the chunked attention's scan and reads its teacher off the attention's
    logits (core/model/attention.py `_teacher_tap`): no second teacher."""
    stage = stage_of(cfg)
    return (cfg.attention == "chunked" and not stage.csa_topk and stage.indexer_loss != "off"
            and cfg.indexer_gradient == "local" and cfg.csa_query_chunk_size == 0
            and cfg.max_target_length % min(cfg.attention_query_chunk_size, cfg.max_target_length) == 0)


def _implementation_extras(cfg, rows: int) -> dict[str, float]:
    """The live step's contractions that are not the model's matmuls, or not where it counts them:
    - in each CSA layer with the indexer loss, the loss's teacher builds the queries a second time
      (c_q W_qb, detached: forward only) where the attention's own are read, and computes its logits
      Q·K over the [T, W] blocks (and, joint, Q·kv over the [T, T] window) again under "indexer":
      the attention's q·k, which the model counts once, under "attention" (where the attention's
      output is dead, the layer's "teacher" part, the loss's are the only ones: moved, not added);
    - the MoE's load statistics: one-hot choice counts (the one-hot summed over the k slots first)
      in every live layer where the router biases move (`trains_rest`: the warm-up restores its
      frozen biases, so their loads are dead), and in learned-routing layers whose router is read
      the load-balance loss's counts and mean router probability, with its gradient where the
      router trains;
    - less the mHC mixing projections' input-gradient pass where the stream gets a gradient and
      `hc_mixes_backward` is `closed` (an elementwise pass then).
    """
    stage, n = stage_of(cfg), rows * cfg.max_target_length
    hd, t = cfg.num_heads * cfg.head_dim, cfg.max_target_length
    extras = dict.fromkeys(COMPONENTS, 0.0)
    for layer, (ratio, live) in enumerate(zip(cfg.compress_ratios, live_parts(cfg))):
        if live == "none":
            continue
        if ratio == 4 and stage.indexer_loss != "off" and not _teacher_fed(cfg):
            logits = 2 * rows * t * (t // 4) * hd + (2 * rows * t * t * hd if cfg.indexer_teacher == "joint" else 0)
            extras["indexer"] += logits
            if live == "teacher":
                extras["attention"] -= logits
            else:
                extras["attention"] += 2 * n * cfg.q_lora_rank * hd
        if live == "teacher":
            continue
        extras["MoE"] += 2 * n * cfg.num_experts if stage.trains_rest else 0
        if layer >= cfg.first_num_hash_layers:
            extras["MoE"] += 2 * n * cfg.num_experts * (1 + (2 if stage.trains_rest else 1))
    if stage.trains_rest and resolve_config(cfg, "cpu").hc_mixes_backward == "closed":
        c, m = cfg.mhc_expansion_rate, cfg.emb
        extras["mHC"] -= 2 * cfg.num_layers * 2 * n * c * m * (2 + c) * c  # attention's and the MoE's
        extras["mHC"] -= 2 * n * c * m * c if stage.lm_loss else 0  # the head collapse's
    return extras


@pytest.mark.parametrize("stage, overrides", [
    ("pretrain", []),
    ("warmup", []),  # the last layer's experts are dead: its router alone is read (the load-balance loss)
    ("warmup", ["indexer_teacher=joint"]),
    ("warmup", ["first_num_hash_layers=3"]),  # no router read: the CSA layer's attention up to the teacher, no more
    ("sparse", []),
    ("sparse", ["indexer_loss_scaling_factor=0"]),  # the no-indexer-loss row: the indexer selects, learns nothing
    ("pretrain", ["hc_mixes_backward=closed"]),  # a TPU's mixes backward
    # the warm-up's default path: chunked attention (its window banded), the loss in its scan fed the
    # attention's teacher, remat (no gradient crosses a layer: nothing runs again)
    ("warmup", ["attention=chunked", "attention_query_chunk_size=128", "remat_policy=full"]),
])
def test_step_matmuls_equal_the_steps_own_live_jaxpr(stage, overrides):
    cfg = sweep_config(stage, SEQ, ROWS, [*TINY, *overrides])
    counted = component_flops(*resolved(cfg), compile=False)["components"]
    expected = _implementation_extras(cfg, ROWS)
    for mm in step_matmuls(cfg, ROWS, area=_chunked_area if cfg.attention == "chunked" else _full_area):
        assert mm.component in COMPONENTS and mm.flops > 0 and 1 <= mm.passes <= 3, mm
        if mm.name != "expert combine":  # moe_impl=ragged scales the hidden by it: no contraction
            expected[mm.component] += mm.step_flops
    for name in counted:
        want = expected.get(name, 0.0)  # the optimizer and "other" do no matmul
        assert counted[name]["matmul_flops"] == want, (stage_of(cfg).name, name, counted[name]["matmul_flops"], want)


def test_the_warm_up_counts_no_dead_layer():
    """$W's layout (docs/planning.md#on-a-chip): the last layer, CSA, is read up to its router (the
    load-balance loss); with every layer hash-routed, the last CSA layer up to its teacher, and the
    layers after it not at all."""
    w = ["base_num_decoder_layers=4", "compress_ratios=[0,4,128,4]", "first_num_hash_layers=1"]
    warmup = load_config("deepseek4-tiny", w, stage="warmup")
    assert live_parts(warmup) == ("all", "all", "all", "router")
    names = [mm.name for mm in step_matmuls(warmup) if mm.component == "MoE"]
    assert names.count("router") == 4 and names.count("routed experts") == names.count("shared experts") == 3
    hashed = load_config("deepseek4-tiny", [*w[:2], "first_num_hash_layers=4", "compress_ratios=[4,0,4,0]"],
                         stage="warmup")
    assert live_parts(hashed) == ("all", "all", "teacher", "none")
    assert live_parts(load_config("deepseek4-tiny", w, stage="sparse")) == ("all",) * 4


def test_model_flops_add_up_and_scale_with_the_rows():
    cfg = sweep_config("sparse", SEQ, ROWS, TINY)
    one, four = model_flops_per_step(cfg, 1), model_flops_per_step(cfg, 4)
    assert one["tokens"] == SEQ and four["tokens"] == 4 * SEQ
    assert one["total"] == sum(one[c] for c in COMPONENTS) and four["total"] == pytest.approx(4 * one["total"], rel=1e-12)
    assert model_flops_per_step(cfg) == model_flops_per_step(cfg, cfg.per_device_batch_size)


def test_the_warm_up_counts_the_frozen_model_once_and_the_indexer_three_times():
    cfg = sweep_config("warmup", SEQ, ROWS, TINY)
    passes = {mm.name: mm.passes for mm in step_matmuls(cfg, ROWS)}
    assert {passes[n] for n in ("wq_a", "window logits", "block logits", "routed experts", "mHC pre")} == {1}
    assert passes["indexer wq_b"] == passes["indexer compressor wkv"] == 2  # detached inputs: weight gradients only
    assert passes["indexer scores"] == passes["indexer head sum"] == 3 and "teacher logits" not in passes
    assert "head" not in passes  # the warm-up bypasses the head
