"""`dsv4 plan --search`: enumeration, the exact-bytes prune, the cache, the ranking, bad input.

One real state pass and one real compile (cpu:2, a two-layer deepseek4-tiny at T = 32) serve the
prune, cache and CLI tests; the ranking and failure tests use a stand-in compile that returns
plans with chosen figures, so they start no process.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from tests.plan import invoke_plan

SMALL = ("compress_ratios=[0,4]", "base_num_decoder_layers=2", "first_num_hash_layers=1", "vocab_size=256",
         "max_target_length=32", "sliding_window_size=8", "indexer_topk=4")
# cpu:2 with tensor, expert and the batch held: two candidates, data 2 (state replicated) and fsdp 2
PINNED = (*SMALL, "ici_tensor_parallelism=1", "ici_expert_parallelism=1", "per_device_batch_size=1")


def _cfg(*overrides: str):
    from core.plan.compile import load

    return load("deepseek4-tiny", "sparse", [*SMALL, *overrides])


# ----------------------------------------------------------------------------- enumeration


def _brute_force(cfg, devices: int, slices: int, batches) -> set:
    """Every (ici, dcn, batch) by trying all 4-tuples of sizes: the reference for `candidates`."""
    sizes = range(1, devices + 1)
    out = set()
    for ici in itertools.product(sizes, repeat=4):
        for dcn in itertools.product(range(1, slices + 1), repeat=4):
            if math.prod(ici) * math.prod(dcn) != devices or math.prod(dcn) != slices:
                continue
            mesh = [i * d for i, d in zip(ici, dcn)]
            for b in batches:
                if cfg.num_heads % mesh[2] == 0 and cfg.num_experts % mesh[3] == 0 and b * devices % (mesh[0] * mesh[1] * mesh[3]) == 0:
                    out.add((ici, dcn, b))
    return out


@pytest.mark.parametrize("slices", [1, 2])
def test_enumeration_is_every_valid_mesh_and_batch_once(slices):
    from core.plan.search import candidates
    from core.plan.targets import parse_target

    cfg = _cfg("num_experts=4")  # 4 heads, 4 experts on 8 devices: tensor 8 and expert 8 are out
    target = dataclasses.replace(parse_target("cpu:8"), slices=slices)
    cands = candidates(cfg, target, max_batch=6)
    assert all(c.ici[3] == c.dcn[3] == 1 for c in cands), "expert_outer split off a GPU's hosts"
    got = [(c.ici[:3] + c.ici[4:], c.dcn[:3] + c.dcn[4:], c.per_device_batch_size) for c in cands]
    assert len(got) == len(set(got)), "duplicates"
    assert set(got) == _brute_force(cfg, 8, slices, (1, 2, 4))
    for c in cands:
        assert math.prod(c.mesh.values()) == 8 and math.prod(c.dcn) == slices
        assert cfg.num_heads % c.mesh["tensor"] == 0 and cfg.num_experts % c.mesh["expert"] == 0
    assert {c.mesh["tensor"] for c in cands} == {1, 2, 4} and {c.mesh["expert"] for c in cands} == {1, 2, 4}
    assert {c.per_device_batch_size for c in cands} == {1, 2, 4}


def test_gpu_hosts_are_the_granules():
    """A GPU target's compile-only devices carry their host's process index, so `make_mesh` splits
    h200x16 into 2 granules of 8: every candidate's ici_* multiply to 8 and its dcn_* to 2, and each
    passes the mesh check the compile child makes (before: ici over all 16, which the child refused)."""
    from core.config.schema import load_config
    from core.parallel.mesh import plan_mesh
    from core.plan.search import candidates
    from core.plan.targets import parse_target

    assert [parse_target(t).granules for t in ("h100x4", "h200x8", "h200x16", "b200x64", "v5p-128", "cpu:8")] == \
        [1, 1, 2, 8, 1, 1]
    cfg = load_config("deepseek4-tiny", [], stage="sparse")
    target = parse_target("h200x16")
    cands = candidates(cfg, target, max_batch=1)
    assert cands and {(math.prod(c.ici), math.prod(c.dcn)) for c in cands} == {(8, 2)}
    for c in cands:
        plan_mesh(cfg.replace(**c.fields()), target.devices, target.granules)


def test_gpu_hosts_enumerate_expert_outer():
    """On a GPU target of several hosts the dcn_* also split over expert_outer (the experts across the
    hosts, the other weights replicated there): every (ici over 4 axes, dcn over 5) whose experts divide
    expert_outer x expert, each once, each a mesh the compile child accepts with expert_outer named
    where above 1; on one host none (h200x8: dcn is 1)."""
    from core.config.schema import load_config
    from core.parallel.mesh import CONFIG_AXES, plan_mesh
    from core.plan.search import candidates
    from core.plan.targets import parse_target

    cfg = load_config("deepseek4-tiny", [], stage="sparse")
    target = parse_target("h200x16")
    cands = candidates(cfg, target, max_batch=1)
    got = {(c.ici, c.dcn) for c in cands}
    assert len(got) == len(cands), "duplicates"
    want = set()
    for ici in itertools.product([1, 2, 4, 8], repeat=4):
        for dcn in itertools.product([1, 2], repeat=5):
            if math.prod(ici) != 8 or math.prod(dcn) != 2:
                continue
            ici5 = (*ici[:3], 1, ici[3])
            mesh = dict(zip(CONFIG_AXES, (i * d for i, d in zip(ici5, dcn))))
            experts = mesh["expert_outer"] * mesh["expert"]
            if cfg.num_heads % mesh["tensor"] == 0 and cfg.num_experts % experts == 0 and \
                    16 % (mesh["data"] * mesh["fsdp"] * experts) == 0:
                want.add((ici5, dcn))
    assert got == want
    outer = [c for c in cands if c.dcn[3] == 2]
    assert outer and all(c.mesh["expert_outer"] == 2 and c.fields()["dcn_expert_outer_parallelism"] == 2 for c in outer)
    assert all("expert_outer" not in c.mesh for c in cands if c.dcn[3] == 1)
    for c in outer:
        ici, dcn = plan_mesh(cfg.replace(**c.fields()), target.devices, target.granules)
        assert (tuple(ici.values()), tuple(dcn.values())) == (c.ici, c.dcn)
    assert all(c.dcn[3] == 1 for c in candidates(cfg, parse_target("h200x8"), max_batch=1))


def test_overrides_fix_axes_and_the_batch():
    from core.plan.search import candidates, factorizations, pinned
    from core.plan.targets import parse_target

    overrides = ("ici_tensor_parallelism=2", "ici_data_parallelism=-1", "per_device_batch_size=2")
    cfg = _cfg(*overrides)
    pins = pinned(cfg, [*SMALL, *overrides])
    assert pins == {"ici_tensor_parallelism": 2, "per_device_batch_size": 2}  # -1 means: search it
    cands = candidates(cfg, parse_target("cpu:8"), pins=pins)
    assert cands and all(c.ici[2] == 2 and c.per_device_batch_size == 2 for c in cands)
    assert len(cands) == len(factorizations(4, 3))  # the other three axes share 8 / 2
    assert len(factorizations(64, 4)) == 84  # v5p-128's 64 chips over four axes


# ----------------------------------------------------------------------------- prune and cache (real processes)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """Three searches over PINNED on cpu:2 with one cache: (1) usable 0: all pruned; (2) usable between
    the two states: data 2 pruned, fsdp 2 compiled; (3) the same again. Compiles and children counted."""
    from core.plan import compile as plan_compile
    from core.plan import report
    from core.plan.search import search

    cache = tmp_path_factory.mktemp("plan-cache")
    calls = {"plan": 0, "child": 0}
    real_plan, real_child = plan_compile.plan, plan_compile.run_child
    usable = {"bytes": 0}

    def counting_plan(*args, **kwargs):
        calls["plan"] += 1
        return real_plan(*args, **kwargs)

    def counting_child(*args, **kwargs):
        calls["child"] += 1
        return real_child(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_compile, "plan", counting_plan)
        mp.setattr(plan_compile, "run_child", counting_child)
        mp.setattr(report, "usable_memory", lambda target, limit=None: (usable["bytes"], "test"))
        runs = []

        def run():
            before = dict(calls)
            result = search("deepseek4-tiny", "sparse", "cpu:2", PINNED, cache_dir=cache, top=5)
            runs.append((result, {k: calls[k] - before[k] for k in calls}))

        run()
        states = sorted(r["state_bytes"] for r in runs[0][0]["candidates"])
        usable["bytes"] = (states[0] + states[1]) // 2
        run()
        run()
        yield runs, cache


def test_state_alone_over_the_usable_memory_is_pruned_without_a_compile(searched):
    runs, _ = searched
    (first, n1), (second, n2) = runs[0], runs[1]
    assert n1 == {"plan": 0, "child": 1}, n1  # one state pass, no compile
    assert first["counts"]["pruned"] == 2 and first["best"] is None
    assert n2 == {"plan": 1, "child": 1}, n2  # the states came from the cache; only fsdp 2 compiled
    by_mesh = {next((a for a, n in r["mesh"].items() if n > 1)): r for r in second["candidates"]}
    assert by_mesh["data"]["status"] == "pruned" and "alone need" in by_mesh["data"]["reason"]
    assert by_mesh["data"]["state_bytes"] > by_mesh["fsdp"]["state_bytes"]  # replicated vs sharded over 2
    fsdp = by_mesh["fsdp"]
    assert fsdp["status"] == "fits" and second["best"] is fsdp and second["candidates"][0] is fsdp
    d = fsdp["plan"]["per_device"]  # the prune's bytes are the compiled plan's own, exactly
    assert fsdp["state_bytes"] == d["parameter_bytes"] + d["optimizer_bytes"] + d["batch_bytes"], (fsdp["state"], d)
    assert fsdp["state"] == {k: d[k] for k in fsdp["state"]}


def test_a_rerun_compiles_nothing(searched):
    runs, cache = searched
    (second, _), (third, n3) = runs[1], runs[2]
    assert n3 == {"plan": 0, "child": 0}, n3
    assert third["counts"]["cached"] == 1 and third["counts"]["compiled"] == 0
    assert [(r["label"], r["status"], r["total_bytes"]) for r in third["candidates"]] == \
           [(r["label"], r["status"], r["total_bytes"]) for r in second["candidates"]]
    assert len(list(cache.glob("*.json"))) == 2


def test_cli_search_prints_the_table_and_names_the_best(searched, monkeypatch):
    from core.plan import compile as plan_compile

    _, cache = searched
    monkeypatch.setattr(plan_compile, "run_child", lambda *a, **k: pytest.fail("the cache should answer"))
    result = invoke_plan("--target", "cpu:2", "--search", "--cache", str(cache), *PINNED)
    assert result.exit_code == 0, result.output
    assert "best: fsdp 2, batch 1" in result.output and "pruned 1" in result.output, result.output
    listed = invoke_plan("--target", "cpu:2", "--search", "--cache", str(cache), "--json", *PINNED)
    rows = json.loads(listed.stdout)
    assert listed.exit_code == 0 and [r["status"] for r in rows] == ["fits", "pruned"]
    assert rows[0]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 1} and rows[0]["plan"]["fits"]


@pytest.mark.slow
def test_the_search_compiles_an_expert_split_like_any_mesh(tmp_path):
    """cpu:2 with data, fsdp, tensor and the batch held: the one candidate left is expert 2 (the experts
    split over the devices, the tokens sent to them), state-counted and compiled through the search like
    any mesh: it fits and is the best, its pruning state exactly the compiled plan's. That the enumeration
    proposes expert splits beside the other axes: test_enumeration_is_every_valid_mesh_and_batch_once."""
    from core.plan.search import search

    r = search("deepseek4-tiny", "sparse", "cpu:2", [*SMALL, "ici_data_parallelism=1", "ici_fsdp_parallelism=1",
                                                      "ici_tensor_parallelism=1", "per_device_batch_size=1"],
               cache_dir=tmp_path, top=0)
    (only,) = r["candidates"]
    assert only["label"] == "expert 2, batch 1" and only["status"] == "fits" and r["best"] is only, only
    d = only["plan"]["per_device"]
    assert only["plan"]["mesh"]["expert"] == 2 and only["state_bytes"] == d["parameter_bytes"] + d["optimizer_bytes"] + d["batch_bytes"]


# ----------------------------------------------------------------------------- ranking and failures (stand-in compile)


def _stand_in(monkeypatch, fits, rate, fail=None):
    """search with a compile that returns a plan whose verdict and tokens/s are `fits(mesh, b)` and
    `rate(mesh, b)` (or raises `fail(mesh, b)`), and a state pass of 1 KiB per candidate; returns the calls."""
    from core.plan import compile as plan_compile
    from core.plan import search as plan_search

    calls = []

    def plan(model, stage, target, overrides, **kwargs):
        values = dict(o.split("=") for o in overrides if "parallelism" in o or o.startswith("per_device"))
        mesh = {a: int(values[f"ici_{a}_parallelism"]) for a in ("data", "fsdp", "tensor", "expert")}
        b = int(values["per_device_batch_size"])
        calls.append((tuple(mesh.values()), b))
        error = fail(mesh, b) if fail else None
        if error is not None:
            raise error
        ok = fits(mesh, b)
        return {"fits": ok, "per_device": {"total_bytes": 1 << 20, "usable_bytes": 2 << 20},
                "headroom_bytes": (1 if ok else -1) << 20, "estimated_tokens_per_s": rate(mesh, b),
                "estimated_step_s": 1.0, "flops_per_step": 1.0, "top_temporaries": [], "max_target_length": 32}

    state = {"parameter_bytes": 512, "optimizer_bytes": 256, "batch_bytes": 256}
    monkeypatch.setattr(plan_compile, "plan", plan)
    monkeypatch.setattr(plan_search, "state_figures", lambda *a, **k: [dict(state) for _ in a[5]])
    return calls


def test_the_best_is_the_first_row_and_larger_batches_of_a_mesh_that_does_not_fit_are_skipped(monkeypatch, tmp_path):
    from core.plan.search import search

    # fits up to batch 2 except on data 4; tokens/s grow with fsdp and with the batch
    calls = _stand_in(monkeypatch, fits=lambda m, b: b <= 2 and m["data"] < 4, rate=lambda m, b: 100 * m["fsdp"] + b)
    r = search("deepseek4-tiny", "sparse", "cpu:4", [*SMALL, "ici_tensor_parallelism=1", "ici_expert_parallelism=1"],
               cache_dir=tmp_path, max_batch=8)
    fits = [c for c in r["candidates"] if c["status"] == "fits"]
    assert r["best"] is r["candidates"][0] is fits[0]
    assert (fits[0]["mesh"]["fsdp"], fits[0]["per_device_batch_size"]) == (4, 2)
    rates = [c["estimated_tokens_per_s"] for c in fits]
    assert rates == sorted(rates, reverse=True) and len(fits) == 4  # fsdp 4 and data 2 x fsdp 2, batches 1 and 2
    # each mesh compiles batches 1, 2, 4 (or only 1 for data 4) and stops at its first that does not fit
    assert sorted(calls) == sorted([((1, 4, 1, 1), b) for b in (1, 2, 4)] + [((2, 2, 1, 1), b) for b in (1, 2, 4)]
                                   + [((4, 1, 1, 1), 1)])
    skipped = [c for c in r["candidates"] if c["status"] == "pruned"]
    assert len(skipped) == 1 + 1 + 3 and all("on this mesh does not fit" in c["reason"] for c in skipped)
    assert r["counts"] == {"fits": 4, "does not fit": 3, "pruned": 5, "failed": 0, "candidates": 12, "compiled": 7,
                           "cached": 0}


def test_failures_are_counted_and_timeouts_retried(monkeypatch, tmp_path):
    from core.errors import ConfigError
    from core.plan.compile import CompileTimeout
    from core.plan.search import search

    def fail(m, b):
        return CompileTimeout("ran past 1 s") if m["data"] == 2 else ConfigError("boom") if m["fsdp"] == 2 else None

    calls = _stand_in(monkeypatch, fits=lambda m, b: True, rate=lambda m, b: 1.0, fail=fail)
    args = ("deepseek4-tiny", "sparse", "cpu:2", [*SMALL, "ici_tensor_parallelism=1", "ici_expert_parallelism=1",
                                                  "per_device_batch_size=1"])
    r = search(*args, cache_dir=tmp_path)
    assert r["counts"]["failed"] == 2 and r["best"] is None
    assert {c["reason"] for c in r["candidates"]} == {"ran past 1 s", "boom"}
    calls.clear()
    search(*args, cache_dir=tmp_path)
    assert calls == [((2, 1, 1, 1), 1)]  # the compile error is cached, the timeout is tried again


def test_nothing_fits_exits_1(monkeypatch, tmp_path):
    _stand_in(monkeypatch, fits=lambda m, b: False, rate=lambda m, b: None)
    result = invoke_plan("--target", "cpu:2", "--search", "--cache", str(tmp_path), *PINNED)
    assert result.exit_code == 1 and "nothing fits" in result.output, result.output


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, needle", [
    (("--target", "cpu:0"), "--target"),
    (("--target", "cpu:4", "ici_tensor_parallelism=3"), "ici_tensor_parallelism=3"),
    (("--target", "cpu:4", "--max-batch", "0"), "--max-batch"),
    (("--target", "cpu:4", "--compile-timeout", "0"), "--compile-timeout"),
    (("--target", "cpu:4", "--cache", "FILE"), "--cache"),
])
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    result = invoke_plan("--search", *[str(file) if a == "FILE" else a for a in args], *SMALL)
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert needle in lines[0], lines[0]
