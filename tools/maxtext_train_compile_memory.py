"""MaxText's `train_compile` with its per-device memory: arguments + temporaries, also when refused.

MaxText's train_compile prints `compiled.memory_analysis()` when the compile succeeds; when the
TPU compiler refuses the program for memory it may print only the temporaries ("the total memory
required for HLO temporaries (X) exceeds available HBM (Y)"). This wrapper runs train_compile's own
`main` unchanged, except that before compiling it prints the per-device bytes of the step's
arguments from the shapes and shardings of train_compile's own inputs (the state and the batch),
by dtype, and the largest of them. Then it compiles as train_compile does.

Run with MaxText's venv (tools/setup_maxtext.sh) plus its TPU compiler (`uv pip install
jax==0.10.2 jaxlib==0.10.2 libtpu==0.0.42.1`, MaxText's tpu-requirements pins), in MAXTEXT_SRC:

    DECOUPLE_GCLOUD=TRUE $MAXTEXT_VENV/bin/python DSV4_CHECKOUT/tools/maxtext_train_compile_memory.py \\
      src/maxtext/configs/base.yml model_name=deepseek4-284b compile_topology=v5p-128 \\
      compile_topology_num_slices=1 ici_fsdp_parallelism=64 per_device_batch_size=1 max_target_length=4096 \\
      opt_type=adamw attention=flash use_tokamax_splash=True run_name=x base_output_directory=OUT \\
      enable_checkpointing=False dataset_type=synthetic

The figures beside dsv4's: docs/planning.md#beside-maxtext.
"""

import sys

import jax
import numpy as np
from absl import app
from maxtext.trainers.pre_train import train_compile


def _itemsize(dtype) -> int:
    return getattr(dtype, "itemsize", 8)  # a PRNG key's dtype has none: count its key data as 8 bytes


def argument_bytes(args, shardings) -> list[tuple[int, tuple, str, str]]:
    """(bytes per device, shape, dtype, partition spec) of every leaf of `args` under `shardings`
    (a prefix tree of them; None: replicated)."""
    rows = []
    is_leaf = lambda x: x is None or isinstance(x, jax.sharding.Sharding)  # noqa: E731

    def walk(sharding, arg):
        if not is_leaf(sharding):
            jax.tree.map(walk, sharding, arg, is_leaf=is_leaf)
            return
        for leaf in jax.tree.leaves(arg):
            shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
            rows.append((int(np.prod(shape)) * _itemsize(leaf.dtype), tuple(leaf.shape), str(leaf.dtype),
                         str(getattr(sharding, "spec", None))))

    walk(tuple(shardings), tuple(args))
    return rows


_compile = train_compile.jit_and_compile


def _report_then_compile(func, func_input_args, func_input_kwargs, mesh, in_shardings, *rest):
    rows = argument_bytes(func_input_args, in_shardings)
    total = sum(r[0] for r in rows)
    by_dtype: dict[str, int] = {}
    for b, _, dtype, _ in rows:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + b
    print(f"arguments per device (shapes and shardings): {total / 2**30:.2f} GiB; by dtype: "
          + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(by_dtype.items(), key=lambda kv: -kv[1])))
    for b, shape, dtype, spec in sorted(rows, reverse=True)[:8]:
        print(f"  {b / 2**30:8.3f} GiB  {dtype}{list(shape)}  {spec}")
    sys.stdout.flush()
    return _compile(func, func_input_args, func_input_kwargs, mesh, in_shardings, *rest)


if __name__ == "__main__":
    train_compile.jit_and_compile = _report_then_compile
    app.run(train_compile.main)
