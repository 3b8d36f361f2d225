"""core/spec/platform.py: `auto` keys become the platform's choice; an explicit value wins; the model's specs
refuse an unresolved `auto`."""

import pytest

from core.config.schema import load_config
from core.config.validate import validate
from core.model import attention, moe
from core.spec.platform import PLATFORM_CHOICES, resolve_config
from core.spec.resolve import model_spec


@pytest.mark.parametrize("platform, expected", [("cpu", "cpu"), ("tpu", "tpu"), ("cuda", "gpu"), ("gpu", "gpu")])
def test_auto_keys_take_the_platforms_choice(platform, expected):
    cfg = load_config("deepseek4-tiny", ["remat_policy=auto"])  # its YAML picks minimal
    assert all(getattr(cfg, key) == auto for key, (auto, _) in PLATFORM_CHOICES.items())
    resolved = resolve_config(cfg, platform)
    for key, (_, choice) in PLATFORM_CHOICES.items():
        want = choice(cfg, expected, None) if callable(choice) else choice[expected]
        assert getattr(resolved, key) == want != getattr(cfg, key), key
    assert resolve_config(resolved, platform) is resolved  # nothing left to resolve
    for stage in (None, "pretrain", "warmup", "sparse"):  # every choice passes the config's rules
        validate(resolve_config(load_config("deepseek4-tiny", stage=stage), platform), stage)


@pytest.mark.parametrize("length, topk, platform, expected", [
    (4096, 512, "tpu", "mask"), (8192, 512, "tpu", "gather"), (4096, 512, "cpu", "gather"), (4096, 512, "gpu", "mask"),
    (8192, 512, "gpu", "gather"), (4096, 256, "tpu", "gather"), (4096, 256, "gpu", "gather")])
def test_topk_attention_is_a_mask_on_a_tpu_or_gpu_while_the_blocks_are_at_most_twice_k(length, topk, platform, expected):
    cfg = load_config("deepseek4-tiny", [f"max_target_length={length}", f"indexer_topk={topk}"])
    assert resolve_config(cfg, platform).csa_topk_attention == expected


@pytest.mark.parametrize("model, stage, platform, projections, chunk", [
    ("deepseek4-284b", "sparse", "tpu", "whole", 128), ("deepseek4-284b", "pretrain", "tpu", "whole", 128),
    ("deepseek4-284b", "warmup", "tpu", "chunked", 128), ("deepseek4-284b", "sparse", "cpu", "chunked", 128),
    ("deepseek4-284b", "sparse", "gpu", "whole", 512), ("deepseek4-284b", "warmup", "gpu", "whole", 128),
    ("deepseek4-284b", "pretrain", "gpu", "whole", 512),
    # deepseek4-tiny's W_qb gradient (8 KiB) stays on the chip: per chunk, in chunks of 512 where it trains
    ("deepseek4-tiny", "sparse", "tpu", "chunked", 512), ("deepseek4-tiny", "pretrain", "tpu", "chunked", 512),
    ("deepseek4-tiny", "warmup", "tpu", "chunked", 128), ("deepseek4-tiny", "sparse", "cpu", "chunked", 128)])
def test_attention_projections_run_whole_on_a_tpu_where_large_ones_train(model, stage, platform, projections, chunk):
    resolved = resolve_config(load_config(model, ["max_target_length=4096"], stage=stage), platform)
    assert (resolved.attention_projections, resolved.attention_query_chunk_size) == (projections, chunk)


def test_the_mixes_backward_is_closed_on_a_tpu_and_a_gpu():
    cfg = load_config("deepseek4-tiny", [])
    assert [resolve_config(cfg, p).hc_mixes_backward for p in ("cpu", "gpu", "tpu")] == ["autodiff", "closed", "closed"]


@pytest.mark.parametrize("model, given, chunk", [("deepseek4-tiny", "whole", 128), ("deepseek4-284b", "chunked", 512)])
def test_the_chunk_follows_explicit_projections(model, given, chunk):
    cfg = load_config(model, ["max_target_length=4096", f"attention_projections={given}"], stage="sparse")
    assert resolve_config(cfg, "tpu").attention_query_chunk_size == chunk


def test_an_explicit_value_wins_on_every_platform():
    cfg = load_config("deepseek4-tiny", ["moe_impl=dense", "attention_query_chunk_size=64", "lm_loss_chunk_size=0"])
    for platform in ("cpu", "gpu", "tpu"):
        resolved = resolve_config(cfg, platform)
        assert (resolved.moe_impl, resolved.attention_query_chunk_size, resolved.lm_loss_chunk_size) == ("dense", 64, 0)


def test_unknown_platform_and_unresolved_auto_are_refused():
    with pytest.raises(ValueError, match="platform"):
        resolve_config(load_config("deepseek4-tiny"), "quantum")
    with pytest.raises(ValueError, match="MoE impl must be one of dense, tiled, ragged, gmm, batched, got 'auto'"):
        moe.MoESpec(emb=8, mlp=4, num_experts=4, k=2, shared=0, hash_routed=False, vocab_size=10, impl="auto")
    with pytest.raises(ValueError, match="attention='auto': the layer takes one of chunked, fused, masked"):
        model_spec(load_config("deepseek4-tiny"))  # a config no entry point resolved builds no model
    with pytest.raises(ValueError, match="attention_projections='auto'"):
        attention.AttentionImpl(projections="auto")


@pytest.mark.parametrize("platform, impl", [("tpu", "gmm"), ("gpu", "tiled"), ("cpu", "tiled")])
def test_moe_is_a_grouped_matmul_on_a_tpu_whose_experts_are_whole_or_expert_parallel(platform, impl):
    """gmm on a TPU mesh that splits the experts over no device (data parallelism only, or one chip) or
    over `expert` (each device's local experts); tiled where fsdp or tensor alone split them, from the
    mesh or, without one, the keys."""
    tiny, flash = load_config("deepseek4-tiny"), load_config("deepseek4-284b", ["ici_expert_parallelism=1"])
    one = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    assert resolve_config(tiny, platform).moe_impl == impl
    assert resolve_config(tiny, platform, {**one, "data": 8}).moe_impl == impl
    assert resolve_config(flash, platform, one).moe_impl == impl  # one chip
    assert resolve_config(flash, platform).moe_impl == "tiled"  # fsdp fills the devices: split unless the mesh says not
    for axes in ({"fsdp": 64}, {"tensor": 2}):
        assert resolve_config(flash, platform, {**one, **axes}).moe_impl == "tiled"
    for axes in ({"expert": 4}, {"expert": 64}, {"fsdp": 2, "expert": 32}):
        assert resolve_config(flash, platform, {**one, **axes}).moe_impl == impl
    assert resolve_config(load_config("deepseek4-tiny", ["ici_expert_parallelism=4"]), platform).moe_impl == impl


def test_moe_is_batched_on_a_gpu_under_expert_parallelism_with_a_capacity():
    """On a GPU whose experts split over `expert` with a capacity factor (the model file's sparse stage on
    h200x64: expert 64, capacity 1), batched matmuls over each local expert's rows; drop-free, or with the
    experts whole on every device, the tiled einsums (batched would pad each expert to the worst case)."""
    one = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    sparse = load_config("deepseek4-284b", ["max_target_length=4096"], stage="sparse")
    assert sparse.moe_capacity_factor == 1.0
    assert resolve_config(sparse, "gpu", {**one, "expert": 64}).moe_impl == "batched"
    assert resolve_config(sparse, "gpu").moe_impl == "batched"  # the keys fill expert
    # expert_outer splits the experts too (h200x64's expert_outer 8 x expert 8), alone as well
    assert resolve_config(sparse, "gpu", {**one, "expert_outer": 8, "expert": 8}).moe_impl == "batched"
    assert resolve_config(sparse, "gpu", {**one, "expert_outer": 8}).moe_impl == "batched"
    assert resolve_config(sparse, "tpu", {**one, "expert_outer": 8}).moe_impl == "gmm"
    assert resolve_config(sparse, "gpu", one).moe_impl == "tiled"  # one GPU: nothing exchanged
    drop_free = load_config("deepseek4-284b", ["max_target_length=4096", "moe_capacity_factor=0"], stage="sparse")
    assert resolve_config(drop_free, "gpu", {**one, "expert": 64}).moe_impl == "tiled"
    assert resolve_config(sparse, "tpu", {**one, "expert": 64}).moe_impl == "gmm"


def test_attention_is_fused_where_a_tpu_trains_it_and_its_shapes_fit_the_kernels():
    """fused on a TPU in the stages that train the attention (pre-training, sparse), with head_dim a
    multiple of 128, 16 heads per device and CSA's top-k as a mask; chunked otherwise."""
    one_chip = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    flash = lambda stage, *keys: load_config("deepseek4-284b", ["max_target_length=4096", *keys], stage=stage)  # noqa: E731
    for stage in ("sparse", "pretrain"):
        assert resolve_config(flash(stage), "tpu", one_chip).attention == "fused"
        assert resolve_config(flash(stage), "tpu", {**one_chip, "fsdp": 64}).attention == "fused"
        assert resolve_config(flash(stage), "tpu", {**one_chip, "tensor": 4}).attention == "fused"  # 16 heads each
        assert resolve_config(flash(stage), "tpu").attention == "fused"  # no tensor split in the keys
    assert resolve_config(flash("warmup"), "tpu", one_chip).attention == "chunked"  # forward only
    for platform in ("cpu", "gpu"):
        assert resolve_config(flash("sparse"), platform, one_chip).attention == "chunked"
    assert resolve_config(flash("sparse"), "tpu", {**one_chip, "tensor": 8}).attention == "chunked"  # 8 heads each
    assert resolve_config(flash("sparse", "max_target_length=8192"), "tpu", one_chip).attention == "chunked"  # top-k gathered
    heads_unknown = flash("sparse", "ici_fsdp_parallelism=1", "ici_expert_parallelism=1", "ici_tensor_parallelism=-1")
    assert resolve_config(heads_unknown, "tpu").attention == "chunked"  # the tensor split fills the devices
    assert resolve_config(flash("sparse", "head_dim=192"), "tpu", one_chip).attention == "chunked"
    assert resolve_config(flash("sparse", "attention=chunked"), "tpu", one_chip).attention == "chunked"  # explicit wins
    assert resolve_config(load_config("deepseek4-tiny", stage="sparse"), "tpu", one_chip).attention == "chunked"
