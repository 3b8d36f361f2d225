"""Compiled temp memory of one attention layer's train step: tests/attention_memory.py as a tool.

What it measures: XLA's compiled memory analysis (temp bytes; arguments and outputs excluded) of
jax.grad over (parameters, x) of sum(layer(x)) + its indexer loss, for layer 2 of the model's plan
(a CSA layer in deepseek4-284b's), batch 1, at the stage the overrides describe (the indexer loss
on when indexer_loss_scaling_factor > 0; top-k selection). Compiled ahead of time from abstract
state: nothing is allocated or run, so the figure is deterministic and needs no idle machine.
docs/benchmarks.md#attention-layer-memory has the figures. The suite's memory tests use the same
function (tests/attention_memory.py), so this tool and they measure one thing.

Prerequisites: the project installed (`pip install -e .`) and run from a clone (the function
lives in tests/); a few GiB of RAM for the compile at T = 32768.

Usage (from the repository root):

    python tools/attention_memory.py deepseek4-284b 32768 float32
    python tools/attention_memory.py deepseek4-284b 4096 float32 attention=masked
    python tools/attention_memory.py deepseek4-284b 32768 float32 \\
        indexer_loss_scaling_factor=0.1 csa_query_chunk_size=256 csa_qk_head_chunk_size=8
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]) or len(sys.argv) < 4:
        sys.exit(__doc__)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.attention_memory import main

    main(sys.argv[1:])
