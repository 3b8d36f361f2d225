"""The routed experts' computation alone, each implementation timed on this machine's accelerator.

    python tools/moe_kernels.py --tokens 4096 --emb 4096 --mlp 2048 --experts 8 --k 6 \
        tiled ragged "gmm:512,1024,1024" "gmm:512,1024,1024/512,1024,1024/512,1024,1024"

One process; for each implementation the forward alone and the forward with the gradient of x and
the three expert weights (a fixed random cotangent) are jitted, run once, then timed `--repeats`
times (median). Random routing, bf16 operands, float32 accumulation, as the model's MoE runs them.
Prints one JSON line per implementation with the medians and the TFLOP/s of the slots' matmuls
(2 * 3 * N k M F forward, three times that with the gradients). Implementations:

- `tiled`: core/model/moe.py's `tiled_experts` (the CPU's default);
- `ragged`: core/model/moe.py's `grouped_experts` over lax.ragged_dot (moe_impl=ragged);
- `gmm:TILES`: the same over the megablox kernels (moe_impl=gmm); TILES is one (tm,tk,tn) for all
  passes or fwd/dlhs/drhs, three tuples separated by '/'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("impls", nargs="+")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--emb", type=int, default=4096)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (no TPU)")
    args = parser.parse_args()

    import functools

    import jax
    import jax.numpy as jnp

    from core.model.moe import auto_tile, grouped_experts, megablox_gmm, ragged, swiglu_hidden, tiled_experts
    from core.ops.grouped_matmul import GmmTiling

    n, m, f, e, k = args.tokens, args.emb, args.mlp, args.experts, args.k
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (1, n, m), jnp.bfloat16)
    logits = jax.random.normal(keys[1], (1, n, e))
    idx = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.lax.top_k(logits, k)[0], axis=-1)
    w1 = (jax.random.normal(keys[2], (e, m, f)) * m ** -0.5).astype(jnp.bfloat16)
    w3 = (jax.random.normal(keys[3], (e, m, f)) * m ** -0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[4], (e, f, m)) * f ** -0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[5], (1, n, m), jnp.float32)
    platform = "cpu" if args.interpret else jax.default_backend()

    def impl_fn(name):
        if name == "tiled":
            return lambda *a: tiled_experts(*a, tile=auto_tile(n, e, k), hidden=functools.partial(swiglu_hidden, limit=10.0))
        if name == "ragged":
            return lambda *a: grouped_experts(*a, 10.0, ragged(jnp.bfloat16))
        if name.startswith("gmm:"):
            tiles = [tuple(int(v) for v in part.split(",")) for part in name[4:].split("/")]
            tiling = GmmTiling(*(tiles * 3 if len(tiles) == 1 else tiles))
            return lambda *a: grouped_experts(*a, 10.0, megablox_gmm(jnp.bfloat16, tiling, platform))
        raise SystemExit(f"unknown implementation {name!r}")

    slot_flops = 2.0 * 3 * n * k * m * f
    for name in args.impls:
        fn = impl_fn(name)
        fwd = jax.jit(lambda x, w1, w2, w3: fn(x, idx, weights, w1, w2, w3))
        grad = jax.jit(jax.grad(lambda x, w1, w2, w3: jnp.sum(fn(x, idx, weights, w1, w2, w3) * cot),
                                argnums=(0, 1, 2, 3)))
        row = {"impl": name, "tokens": n, "emb": m, "mlp": f, "experts": e, "k": k}
        try:
            for label, prog, flops in (("fwd", fwd, slot_flops), ("fwd_bwd", grad, 3 * slot_flops)):
                jax.block_until_ready(prog(x, w1, w2, w3))
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(prog(x, w1, w2, w3))
                    times.append(time.perf_counter() - start)
                row[f"{label}_ms"] = 1e3 * statistics.median(times)
                row[f"{label}_tflops"] = flops / statistics.median(times) / 1e12
        except Exception as exc:  # noqa: BLE001 - report, go on with the next
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
