"""core.config.schema: every model file loads, round-trips, and every rule raises ConfigError."""

import dataclasses
import os
import subprocess
import sys

import pytest
import yaml

from core.config import schema as C
from core.config import files as config_files
from core.config import stages
from core.config.stages import stage_of
from core.errors import ConfigError

MODELS = config_files.model_names()


def test_all_model_files_present():
    assert {"deepseek4-tiny", "deepseek4-284b", "deepseek4-1.6t"} <= set(MODELS)


@pytest.mark.parametrize("model", MODELS)
def test_every_model_file_loads_and_round_trips(model):
    cfg = C.load_config(model)
    assert cfg.model_name == model
    assert C.loads(C.dump(cfg)) == cfg
    assert len(cfg.compress_ratios) == cfg.num_layers


def test_base_declares_every_field_with_a_comment():
    text = (config_files.configs_dir() / "base.yml").read_text()
    data = yaml.safe_load(text)
    data.pop("stages")
    assert set(data) == set(C.FIELDS)
    for key in C.FIELDS:
        line = next(l for l in text.splitlines() if l.startswith(f"{key}:"))
        assert "#" in line, f"{key} has no comment in base.yml"


def test_model_shapes_match_the_issue():
    tiny = C.load_config("deepseek4-tiny")
    assert (tiny.emb, tiny.num_layers, tiny.num_heads, tiny.head_dim, tiny.indexer_topk) == (64, 43, 4, 32, 16)
    assert tiny.compress_ratios[:4] == (0, 0, 4, 128) and tiny.compress_ratios[-1] == 4
    flash = C.load_config("deepseek4-284b")
    assert (flash.emb, flash.num_heads, flash.head_dim, flash.qk_rope_head_dim) == (4096, 64, 512, 64)
    assert (flash.num_experts, flash.num_experts_per_tok, flash.routed_scaling_factor) == (256, 6, 1.5)
    assert flash.rope_type == "yarn" and flash.rope_factor == 16 and flash.original_max_position_embeddings == 65536
    pro = C.load_config("deepseek4-1.6t")
    assert pro.num_layers == 61 and pro.compress_ratios.count(128) == 31 and pro.compress_ratios.count(4) == 30
    assert pro.compress_ratios[:3] == (128, 128, 4) and pro.compress_ratios[-1] == 4


def test_precedence(tmp_path):
    extra = tmp_path / "extra.yml"
    extra.write_text("indexer_topk: 8\nlearning_rate: 0.5\n")
    cfg = C.load_config("deepseek4-tiny", ["learning_rate=0.25", "learning_rate=0.125"],
                        config_file=extra, stage="warmup", options={"steps": 7})
    assert cfg.indexer_topk == 8            # --config over the model file
    assert cfg.learning_rate == 0.125       # later override over earlier, over --config
    assert cfg.steps == 7                   # typed option wins
    assert cfg.indexer_loss_scaling_factor == 0.01 and cfg.trainable_parameters_mask == (".*indexer.*",)
    assert C.load_config("deepseek4-tiny", ["steps=3"], options={"steps": 9}).steps == 9
    assert C.load_config("deepseek4-tiny", ["steps=3"], options={"steps": None}).steps == 3


def test_model_file_stage_section_applies_after_the_preset(tmp_path):
    """A model file's `stages:` entry wins over base.yml's preset of that stage, and only there;
    overrides still win over it; an unknown stage under it is a one-line ConfigError."""
    path = tmp_path / "m.yml"
    path.write_text("vocab_size: 1024\nstages:\n  sparse:\n    learning_rate: 0.25\n"
                    "    dcn_fsdp_parallelism: -1\n    dcn_data_parallelism: 1\n")
    sparse = C.load_config(str(path), stage="sparse")
    assert sparse.learning_rate == 0.25 and sparse.dcn_fsdp_parallelism == -1 and sparse.vocab_size == 1024
    assert C.load_config(str(path), stage="warmup").learning_rate == C.load_config(stage="warmup").learning_rate
    assert C.load_config(str(path)).dcn_fsdp_parallelism == 1  # no stage: the section is not applied
    assert C.load_config(str(path), ["learning_rate=0.5"], stage="sparse").learning_rate == 0.5
    flash = C.load_config("deepseek4-284b", ["max_target_length=4096"], stage="sparse")
    # the experts over every GPU of every host (expert_outer across them): the tokens cross the hosts, not the weights
    assert (flash.dcn_data_parallelism, flash.dcn_fsdp_parallelism, flash.dcn_expert_outer_parallelism) == (1, 1, -1)
    warm = C.load_config("deepseek4-284b", ["max_target_length=4096"], stage="warmup")
    assert warm.dcn_data_parallelism == -1  # the frozen experts data-parallel across hosts
    for stage in (warm, flash):  # the experts stay on their devices, each receiving at most its tokens' slots
        assert (stage.ici_fsdp_parallelism, stage.ici_expert_parallelism, stage.moe_capacity_factor) == (1, -1, 1.0)
    path.write_text("stages:\n  sparce:\n    learning_rate: 0.25\n")
    with pytest.raises(ConfigError, match="unknown stage 'sparce'"):
        C.load_config(str(path), stage="sparse")


def test_stage_presets():
    warm = C.load_config(stage="warmup")
    assert stage_of(warm) is stages.WARMUP and not warm.indexer_sparse_training
    sparse = C.load_config(stage="sparse")
    assert sparse.indexer_sparse_training and sparse.indexer_loss_scaling_factor == 0.1
    assert sparse.trainable_parameters_mask == () and stage_of(sparse) is stages.SPARSE
    assert stage_of(C.load_config()) is stages.NO_INDEXER_LOSS  # default scale 0
    for command, rows in stages.STAGE_COMMANDS.items():  # each command's preset resolves to its first row
        assert stage_of(C.load_config(stage=command)) is rows[0], command
    # dsv4 sparse with the indexer's loss off is the table's no-indexer-loss row, not an error
    assert stage_of(C.load_config(stage="sparse", overrides=["indexer_loss_scaling_factor=0"])) is stages.NO_INDEXER_LOSS
    assert config_files.STAGES == tuple(stages.STAGE_COMMANDS)


@pytest.mark.parametrize("stage,overrides,message", [
    ("pretrain", ["dense_pretraining=false"], "dense_pretraining=false in dsv4 pretrain"),
    ("pretrain", ["indexer_loss_scaling_factor=0.1"], "dense_pretraining=true with indexer_loss_scaling_factor=0.1"),
    ("warmup", ["indexer_loss_scaling_factor=0"], "indexer_loss_scaling_factor=0 in a warm-up trains nothing"),
    ("warmup", ["indexer_loss_scaling_factor=0", "dense_pretraining=true"], "in a warm-up trains nothing"),
    ("warmup", ["indexer_sparse_training=true"], "indexer_sparse_training=true in dsv4 warmup"),
    ("sparse", ["indexer_sparse_training=false"], "indexer_sparse_training=false in dsv4 sparse"),
    ("sparse", ["indexer_loss_scaling_factor=0", "indexer_sparse_training=false", "dense_pretraining=true"],
     "dense_pretraining=true in dsv4 sparse"),
    (None, ["dense_pretraining=true", "indexer_sparse_training=true"], "pre-training leaves the indexer idle"),
])
def test_stage_commands_refuse_other_rows(stage, overrides, message):
    """A stage command's config must resolve to its row of the stage table (core/config/stages.py),
    and every config to some row; the message names the key, its value and the fix."""
    with pytest.raises(ConfigError, match=message) as e:
        C.load_config(stage=stage, overrides=overrides)
    assert len(str(e.value).splitlines()) == 1 and ("use dsv4" in str(e.value) or "give it" in str(e.value))


def test_seed_repro_command_parses():
    seed = ("model_name=deepseek4-tiny run_name=dsv4_warmup_100step steps=100 use_indexer=True "
            "indexer_loss_scaling_factor=0.01 indexer_sparse_training=False "
            "trainable_parameters_mask=['.*indexer.*'] dataset_type=hf hf_path='HuggingFaceFW/fineweb-edu' "
            "tokenizer_path=deepseek-ai/DeepSeek-V3.2 base_output_directory=/tmp/maxtext_output").split()
    cfg = C.load_config("deepseek4-284b", seed)
    assert cfg.model_name == "deepseek4-tiny" and cfg.emb == 64  # model_name selects the model file
    assert cfg.trainable_parameters_mask == (".*indexer.*",)
    assert cfg.hf_path == "HuggingFaceFW/fineweb-edu" and cfg.run_name == "dsv4_warmup_100step"
    # The shell strips the quotes: the mask still parses.
    assert C.load_config(overrides=["trainable_parameters_mask=[.*indexer.*]"]).trainable_parameters_mask == (".*indexer.*",)


def test_alias_for_head_chunk():
    assert C.load_config(overrides=["mla_qk_head_chunk_size=2"]).csa_qk_head_chunk_size == 2


def test_model_path_and_names(tmp_path):
    cfg = C.load_config("deepseek4-tiny", ["indexer_topk=8"])
    path = tmp_path / "resolved.yml"
    path.write_text(C.dump(cfg))
    assert C.load_config(str(path)) == dataclasses.replace(cfg, model_name=cfg.model_name)
    with pytest.raises(ConfigError, match="deepseek4-tiny"):
        C.load_config("deepseek4-tinny")
    with pytest.raises(ConfigError, match="does not exist"):
        C.load_config(str(tmp_path / "nope.yml"))


BAD = [
    (["no_such_key=1"], "no_such_key"),
    (["indexr_topk=3"], "did you mean 'indexer_topk'"),
    (["indexer_topk=abc"], "indexer_topk='abc' has the wrong type"),
    (["use_indexer=maybe"], "use_indexer"),
    (["compress_ratios=4"], "compress_ratios"),
    (["base_emb_dim=0"], "base_emb_dim=0 must be positive"),
    (["per_device_batch_size=-2"], "per_device_batch_size=-2 must be positive"),
    (["learning_rate=-1"], "learning_rate"),
    (["indexer_topk=99999", "indexer_loss_scaling_factor=0.1"], "indexer_topk=99999 exceeds max_target_length // 4"),
    (["csa_qk_head_chunk_size=3"], "csa_qk_head_chunk_size=3 must divide"),
    (["csa_query_chunk_size=100"], "csa_query_chunk_size=100 must divide max_target_length"),
    (["base_num_decoder_layers=5"], "compress_ratios has 43 entries"),
    (["compress_ratios=[0,4,8]", "base_num_decoder_layers=3"], "each ratio must be 0"),
    (["max_target_length=260"], "not a multiple of compress ratio"),
    (["o_groups=3"], "o_groups=3 does not divide"),
    (["num_experts_per_tok=17"], "num_experts_per_tok=17 exceeds num_experts"),
    (["moe_gmm_tiles=[512,1024]"], "moe_gmm_tiles=[512, 1024] must be nine positive ints"),
    (["trainable_parameters_mask=['(']"], "not a valid regex"),
    (["indexer_teacher=soft"], "indexer_teacher='soft'"),
    (["ici_data_parallelism=-1", "ici_fsdp_parallelism=-1"], "at most one"),
    (["ici_tensor_parallelism=0"], "ici_tensor_parallelism=0"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_invalid_values_raise_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[").replace("'", "'")):
        C.load_config("deepseek4-tiny", overrides)


def test_warmup_without_indexer_loss_is_refused():
    with pytest.raises(ConfigError, match="trains nothing"):
        C.load_config(stage="warmup", overrides=["indexer_loss_scaling_factor=0"])
    # The same value is fine outside the warm-up (plain LM training).
    assert C.load_config(overrides=["indexer_loss_scaling_factor=0"]).indexer_loss_scaling_factor == 0


def test_topk_rule_only_with_indexer_loss():
    assert C.load_config(overrides=["indexer_topk=99999"]).indexer_topk == 99999


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        C.load_config(overrides=["indexer_topk"])
    broken = tmp_path / "broken.yml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        C.load_config(config_file=broken)
    listy = tmp_path / "list.yml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        C.load_config(config_file=listy)


def test_config_is_frozen_and_replace_validates():
    cfg = C.load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]
    assert cfg.replace(steps=3).steps == 3
    with pytest.raises(ConfigError):
        cfg.replace(o_groups=3)
    with pytest.raises(ConfigError, match="did you mean 'indexer_topk'"):
        cfg.replace(indexr_topk=3)


def test_configs_found_from_any_directory(tmp_path):
    code = "from core.config.schema import load_config; print(load_config('deepseek4-284b').emb)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4096"
