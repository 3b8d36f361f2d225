"""The TPU compiler's scheduler options for collectives (DESIGN.md "Scale"; "Planning").

MaxText's v5p recipes (benchmarks/maxtext_v5p_model_configs.py, whose flag sets live in
benchmarks/xla_flags_library.py) compile their DeepSeek and Mixtral programs with libtpu's
asynchronous collective fusion for all-gathers (`CF_FOR_ALL_GATHER`), its data-parallel all-reduce
optimisation (`DATA_PARALLEL_OVERLAP`) and, in the host-offload recipes, the all-gathers of the
backward pipelined ahead of their layer (`xla_tpu_enable_ag_backward_pipelining`). The training step
takes them as compile options on a TPU (core/train/program.py `step_compiler_options`), so the run's
compile and `dsv4 plan`'s (the same jitted step) schedule the collectives alike. libtpu refuses an
option it does not know, so a compile that succeeds has read every one. Left out: the recipes'
scoped-VMEM limits (the Pallas kernels' tiles were chosen under libtpu's default, docs/tpu.md).
"""

from __future__ import annotations

# name -> value, as MaxText's flag strings spell them (without the leading --)
TPU_COLLECTIVE_OPTIONS: dict[str, str] = {
    # CF_FOR_ALL_GATHER: all-gathers as asynchronous fusions overlapping the compute before their use
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
    # DATA_PARALLEL_OVERLAP: the gradients' all-reduces overlapped with the backward
    "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
    "xla_tpu_data_parallel_opt_different_sized_ops": "true",
    # the backward's all-gathers pipelined (HOST_OFFLOAD_FLAGS' scheduler option)
    "xla_tpu_enable_ag_backward_pipelining": "true",
}


def collective_options(platform: str) -> dict[str, str]:
    """The compile options of a step for `platform` ("cpu", "gpu", "tpu"): TPU_COLLECTIVE_OPTIONS on a TPU."""
    return dict(TPU_COLLECTIVE_OPTIONS) if platform == "tpu" else {}
