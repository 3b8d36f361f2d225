"""`dsv4 eval-indexer` on a run that holds its frozen weights released (import-hf --keep-quantized):
it evaluates without a conversion step, on the held FP8/FP4 codes dequantised inside the layers, and
its figures equal those of the plain import of the same source (the float32 dequantisation)."""

from __future__ import annotations

import json

import pytest

from tests.cli import dsv4_ok
from tests.hf_checkpoints import SMALL, write_official

# SMALL cut to a hash-routed SWA layer and a CSA layer with a k below the blocks of 128-token rows
TWO_LAYERS = dict(SMALL, num_hidden_layers=2, compress_ratios=[0, 4], num_hash_layers=1, index_topk=8)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-released")
    write_official(root / "src", TWO_LAYERS, seed=3)
    out = {}
    for name, flags in (("kept", ("--keep-quantized",)), ("plain", ())):
        dsv4_ok("import-hf", str(root / "src"), "--output", str(root / name), *flags)
        result = dsv4_ok("eval-indexer", str(root / name), "--rows", "2", "--length", "128", "--topk", "2,8", "--json",
                         "dataset_type=synthetic")
        out[name] = json.loads(result.stdout)
    return out


def test_a_kept_import_evaluates_as_its_dequantisation(reports):
    kept, plain = reports["kept"], reports["plain"]
    assert kept["checkpoint"]["frozen_weights"] == "released" and plain["checkpoint"]["frozen_weights"] == "param_dtype"
    assert kept["rows"] == plain["rows"] == 2 * 128 and [e["layer"] for e in kept["layers"]] == [1]
    for name in ("dense", "topk"):
        assert kept["lm_loss"][name] == pytest.approx(plain["lm_loss"][name], rel=1e-6)
    for got, want in zip(kept["overall"]["by_k"], plain["overall"]["by_k"], strict=True):
        assert got["informative_rows"] == want["informative_rows"] > 0
        for subset in ("all", "informative"):
            for metric, value in want[subset].items():
                assert got[subset][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (got["k"], subset, metric)
