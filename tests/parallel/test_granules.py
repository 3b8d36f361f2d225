"""The granule of a TPU topology is its slice, also for compile-only devices (DESIGN.md, "Scale")."""

from __future__ import annotations

import pytest

from core.parallel.mesh import make_mesh
from tests.conftest import tiny_config


def _topology(slices: int):
    pytest.importorskip("libtpu", reason="the tpu extra is not installed (pip install 'dsv4[tpu]')")
    from jax.experimental.topologies import get_topology_desc

    return get_topology_desc(topology_name="v5:2x2x2", platform="tpu", chip_config_name="megacore",
                             chips_per_host_bounds=(2, 2, 1), num_slices=slices).devices


def test_a_compile_only_slice_is_one_granule_whatever_hosts_it_spans():
    cfg = tiny_config(None, "ici_data_parallelism=1", "ici_fsdp_parallelism=-1")
    devices = _topology(1)
    assert len({d.process_index for d in devices}) > 1  # the slice spans several hosts
    assert dict(make_mesh(cfg, devices).shape) == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}


def test_two_slices_are_two_granules():
    cfg = tiny_config(None, "ici_data_parallelism=1", "ici_fsdp_parallelism=-1")
    assert dict(make_mesh(cfg, _topology(2)).shape) == {"data": 2, "fsdp": 8, "tensor": 1, "expert": 1}
