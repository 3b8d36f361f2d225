"""The planner's deterministic figure for expert parallelism (issue 24): deepseek4-tiny's sparse step
(TINY_OVERRIDES, two layers) on `cpu:8` with `ici_expert_parallelism=8` (every other ici axis 1), compiled
by `dsv4 plan`'s own machinery.

From XLA's buffer assignment with component attribution (core/plan/report.py `top_temporaries`):
- the MoE's largest temporary is at most N k M 4 bytes (N tokens per device, k experts per token, M model
  width, float32), a bound that does not grow with the expert devices P: the exchange runs in rounds whose
  drop-free blocks hold about N rows of M (core/ops/expert_parallel.py), where one worst-case exchange held
  P N min(k, E/P) rows (4 N k M 4 bytes here);
- no temporary among the plan's top ones (its default 10) is shaped like [experts or tiles, M, F]: no
  per-tile or gathered copy of the expert weights is among the largest buffers.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import TINY_OVERRIDES

TOP = 10  # `dsv4 plan`'s default --top
ALL = 10_000  # every temporary: the MoE's largest ranks past the 100th among the step's (attention's are larger)
# a hash-routed SWA layer and a learned-routing CSA layer: both MoE routings, half the compile of five layers
TWO_LAYERS = ("compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=1")

pytestmark = pytest.mark.slow  # one cpu:8 compile of the sparse step in a child process


def test_expert_parallel_moe_temporaries_are_bounded_by_the_slots():
    from core.config.schema import load_config
    from core.plan.compile import plan

    overrides = [*TINY_OVERRIDES, *TWO_LAYERS, "ici_data_parallelism=1", "ici_expert_parallelism=8"]
    r = plan("deepseek4-tiny", "sparse", "cpu:8", overrides, top=ALL, analytic=False)
    assert r["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8}, r["mesh"]
    cfg = load_config("deepseek4-tiny", overrides, stage="sparse")
    k, m, f = cfg.num_experts_per_tok, cfg.emb, cfg.moe_mlp_dim
    n = cfg.per_device_batch_size * cfg.max_target_length            # the batch splits over all 8 devices
    slots_bytes = n * k * m * 4

    temps = r["top_temporaries"]
    moe = [t for t in temps if t["component"] == "MoE"]
    assert moe, "the MoE's temporaries should be attributed to it (core.bench.trace.hlo_components)"
    largest = max(moe, key=lambda t: t["bytes"])
    assert largest["bytes"] <= slots_bytes, (
        f"the MoE's largest temporary {largest['shape']} ({largest['bytes']} B, {largest['op_name'][:120]}) is more "
        f"than N k M 4 = {slots_bytes} B (N={n}, k={k}, M={m})")

    weights = re.compile(rf"^\w+\[(\d+,)+({m},{f}|{f},{m})\]$")  # [..., M, F] or [..., F, M] with a leading count
    copies = [t for t in temps[:TOP] if weights.match(t["shape"])]
    assert not copies, f"expert-weight-shaped buffers among the top {TOP} temporaries: {copies}"
