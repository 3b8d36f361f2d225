"""`dsv4 plan --stage eval`: the evaluation's programs (core.eval.evaluate.lowered_eval, the ones
`dsv4 eval-indexer` jits) compiled for a target with the training plan's report and JSON fields:
on cpu:1 (its temporaries equal the same programs compiled in-process; no optimizer state; its batch
is --batch-rows rows, not the training batch), on the compile-only v5p-8 through libtpu, and its
bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import resolved
from tests.plan import invoke_plan
from tests.plan.test_plan_accelerators import SMALL

# a training step's model FLOPs and MFU (core/train/flops.py): the evaluation's programs have no such count
TRAINING_ONLY = {"model_flops_per_step", "model_mfu", "model_tflops_per_device"}

EVAL_SMALL = (*(o for o in SMALL if not o.startswith("per_device_batch_size=")), "indexer_topk=4")
ROWS = 3  # rows per step: neither SMALL's training batch nor the config's


@pytest.fixture(scope="module")
def cpu1():
    result = invoke_plan("--stage", "eval", "--target", "cpu:1", *EVAL_SMALL, "--batch-rows", str(ROWS), "--top", "3",
                         "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cpu1_reports_the_eval_programs_with_the_plan_fields(cpu1):
    from core.plan.compile import compile_plan, load
    from core.plan.targets import parse_target

    train = compile_plan(resolved(load("deepseek4-tiny", "warmup", SMALL))[0], parse_target("cpu:1"), top=0,
                         analytic=False)
    assert set(train) - {"flops_rule", *TRAINING_ONLY} <= set(cpu1)  # the training plan's fields, and more
    assert train["global_batch"] != ROWS == cpu1["global_batch"] == cpu1["per_device_batch_size"]
    assert cpu1["per_device"]["batch_bytes"] == ROWS * 4 * (5 * cpu1["max_target_length"] + 1)  # EVAL_KEYS, int32
    assert cpu1["stage"] == "eval" and set(cpu1["eval_programs"]) == {"dense", "topk"}
    assert cpu1["eval_program"] == max(cpu1["eval_programs"], key=cpu1["eval_programs"].get)
    d = cpu1["per_device"]
    assert d["optimizer_bytes"] == 0 and d["temp_bytes"] == cpu1["eval_programs"][cpu1["eval_program"]] > 0
    assert d["parameter_bytes"] == train["per_device"]["parameter_bytes"] and cpu1["fits"]
    assert cpu1["top_temporaries"]


def test_cpu1_temporaries_are_the_in_process_programs(cpu1):
    from core.eval.evaluate import lowered_eval
    from core.eval.rows import EvalSet
    from core.plan.compile import load

    cfg = load("deepseek4-tiny", "eval", EVAL_SMALL)
    specs, mesh = resolved(cfg)
    lowered, _ = lowered_eval(specs, (cfg.indexer_topk,), mesh, EvalSet(batch_rows=ROWS))
    temps = {part: program.compile().memory_analysis().temp_size_in_bytes for part, program in lowered.items()}
    assert temps == cpu1["eval_programs"]


def test_eval_search_unknown_stage_and_batch_misuse_are_one_line_exit_2():
    for args, needle in ((("--stage", "eval", "--search"), "--search plans training steps"),
                         (("--stage", "evaluate"), "eval"),
                         (("--stage", "eval", "per_device_batch_size=2"), "give --batch-rows N"),
                         (("--stage", "eval", "--batch-rows", "0"), "--batch-rows 0 must be at least 1"),
                         (("--stage", "warmup", "--batch-rows", "2"), "--batch-rows sizes --stage eval")):
        result = invoke_plan(*args, "--target", "cpu:1", *EVAL_SMALL)
        assert result.exit_code == 2 and needle in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "dsv4[tpu]"')
def test_v5p8_compiles_the_eval_programs_with_libtpu():
    from core.plan.compile import plan
    from core.plan.targets import GIB

    result = plan("deepseek4-tiny", "eval", "v5p-8", EVAL_SMALL, top=3, analytic=False)
    assert result["platform"] == "tpu" and result["devices"] == 4 and result["stage"] == "eval"
    d = result["per_device"]
    assert result["fits"] and d["usable_bytes"] == int(95.74 * GIB) and d["optimizer_bytes"] == 0
    assert all(t > 0 for t in result["eval_programs"].values()) and d["code_bytes"] > 0
