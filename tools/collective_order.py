"""Collectives that XLA:CPU may start out of program order, read from a compiled step's HLO dump.

Prints the (loop, collective) pairs of `core.parallel.collective_order.at_risk_pairs`: a collective
that follows a loop holding collectives without reading the loop's output, which XLA:CPU may start
before the loop's own collectives (docs/scaling.md#collective-order-on-the-cpu). A step with none
is safe from it.

Usage (from the repository root), on a dump of the 8-device sparse step:

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dump_to=DUMP" JAX_PLATFORMS=cpu \\
      dsv4 sparse --steps 1 base_num_decoder_layers=4 ... ici_fsdp_parallelism=4 ici_tensor_parallelism=2
    python tools/collective_order.py DUMP/module_*.jit_step.cpu_after_optimizations.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.parallel.collective_order import at_risk_pairs  # noqa: E402


def main(path: str) -> None:
    with open(path) as f:
        n_loops, n_coll, pairs = at_risk_pairs(f.read())
    print(f"loops holding collectives {n_loops}, collectives {n_coll}, at-risk pairs {len(pairs)}, "
          f"collectives at risk {len({c for _, c in pairs})}")
    for loop, coll in pairs:
        print(f"  {loop} -> {coll}")


if __name__ == "__main__":
    main(sys.argv[1])
