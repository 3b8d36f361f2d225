"""One layer's attention on this machine's accelerator: core/ops/fused_attention.py's Pallas kernels
against the query-chunked path (core/ops/chunked_attention.py), forward and forward + backward.

    python3 tools/fused_attention_bench.py                      # on a TPU (v5e: B=1, T=4096, H=64, D=512)
    python3 tools/fused_attention_bench.py --block-q 8 16 32 --chunk 512 --repeats 10
    python3 tools/fused_attention_bench.py --small              # tiny shapes, interpret mode, any machine
    python3 tools/fused_attention_bench.py --aot                # compile only, for a v5e chip, no TPU needed

Two layers, bf16 operands, window S = 128: CSA (ratio 4, W = T / 4 entries, allowed = visible & a
random top-k of the visible entries per query, as a mask) and HCA (ratio 128, allowed =
visible), one document filling the row. For each, the forward alone and the value and gradient of
sum(o * cotangent) wrt q, kv, ckv and the sink are jitted, run once, then timed `--repeats` times
(median, block_until_ready). Prints one line per variant, and for each fused variant the largest
difference of o and of each gradient from the chunked path's. Writes no files.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-q", type=int, nargs="+", default=[8, 16, 32], help="fused: query tokens per step")
    parser.add_argument("--chunk", type=int, default=512, help="chunked: query positions per scan step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--topk", type=int, default=512, help="CSA: selected entries per query")
    parser.add_argument("--small", action="store_true", help="tiny shapes, Pallas interpret mode, 1 repetition")
    parser.add_argument("--aot", action="store_true", help="only compile the fused kernels for a v5e chip "
                        "(JAX on the CPU, libtpu's compiler) and print their compiled memory")
    return parser.parse_args()


def _inputs(shape, ratio: int, topk: int, seed: int = 0):
    """q, kv, ckv, sink, cotangent, packing, allowed and the selection (None in HCA) of one layer."""
    import jax
    import jax.numpy as jnp

    from core.ops.masked_attention import compressed_visibility
    from core.ops.topk import topk_mask

    b, t, h, d = shape
    ks = jax.random.split(jax.random.key(seed), 6)
    q = (jax.random.normal(ks[0], (b, t, h, d)) * d ** -0.5).astype(jnp.bfloat16)
    kv = jax.random.normal(ks[1], (b, t, d)).astype(jnp.bfloat16)
    ckv = jax.random.normal(ks[2], (b, t // ratio, d)).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[3], (h,), jnp.float32)
    cot = jax.random.normal(ks[4], (b, t, h, d), jnp.float32)
    packing = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), jnp.ones((b, t), jnp.int32))
    visible = compressed_visibility(*packing, ratio)
    selection = None
    if ratio == 4:
        selection = topk_mask(jax.random.uniform(ks[5], visible.shape), visible, topk)
    allowed = visible if selection is None else visible & selection
    return q, kv, ckv, sink, cot, packing, allowed, selection


def _timed(fn, args, repeats: int):
    import jax

    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def _diff(a, b) -> str:
    import jax.numpy as jnp

    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return f"{float(jnp.max(jnp.abs(a - b))):.2e} (/ {float(jnp.max(jnp.abs(b))):.2e})"


def _loss_fns(attend, cot):
    import jax
    import jax.numpy as jnp

    fwd = jax.jit(attend)
    grad = jax.jit(jax.value_and_grad(lambda q, kv, ckv, sink: jnp.sum(attend(q, kv, ckv, sink).astype(jnp.float32) * cot),
                                      argnums=(0, 1, 2, 3)))
    return fwd, grad


def _aot(args, shape, window):
    """Compile the fused forward and value-and-grad for one v5e chip; print their memory."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from core.ops.fused_attention import fused_attention

    topo = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chip_config_name="default",
                                        chips_per_host_bounds=(1, 1, 1), num_slices=1)
    sharding = SingleDeviceSharding(topo.devices[0])
    spec = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=sharding)
    b, t, h, d = shape
    for name, ratio in (("csa", 4), ("hca", 128)):
        w = t // ratio
        for bq in args.block_q:
            def attend(q, kv, ckv, sink, pos, seg, allowed, bq=bq):
                return fused_attention(q, kv, sink, pos, seg, window, ckv, allowed, block_q=bq)

            def grad(q, kv, ckv, sink, pos, seg, allowed, cot, bq=bq):
                loss = lambda *x: jnp.sum(attend(*x, pos, seg, allowed).astype(jnp.float32) * cot)
                return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, kv, ckv, sink)

            ins = [spec((b, t, h, d), jnp.bfloat16), spec((b, t, d), jnp.bfloat16), spec((b, w, d), jnp.bfloat16),
                   spec((h,), jnp.float32), spec((b, t), jnp.int32), spec((b, t), jnp.int32), spec((b, t, w), jnp.bool_)]
            for kind, fn, extra in (("fwd", attend, []), ("fwd+bwd", grad, [spec((b, t, h, d), jnp.float32)])):
                mem = jax.jit(fn).lower(*ins, *extra).compile().memory_analysis()
                print(f"{name} W={w} fused block_q={bq} {kind}: compiled for v5e, temp "
                      f"{mem.temp_size_in_bytes / 2**20:.1f} MiB, arguments {mem.argument_size_in_bytes / 2**20:.1f} MiB, "
                      f"outputs {mem.output_size_in_bytes / 2**20:.1f} MiB", flush=True)


def main() -> None:
    args = _args()
    if args.aot:  # before JAX starts: the CPU as platform, libtpu only as the compiler
        os.environ.update(JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax
    import jax.numpy as jnp

    from core.ops.chunked_attention import Keys, RowQueries, chunked_attention
    from core.ops.fused_attention import fused_attention

    shape, window, chunk, topk = (1, 4096, 64, 512), 128, args.chunk, args.topk
    if args.small:
        shape, window, chunk, topk, args.repeats = (1, 512, 8, 128), 16, 128, 16, 1
        args.block_q = [b for b in args.block_q if b <= 16] or [8]
    if args.aot:
        return _aot(args, shape, window)
    print(f"device {jax.devices()[0].device_kind}; B, T, H, D = {shape}, window {window}, bf16, "
          f"median of {args.repeats}", flush=True)
    for name, ratio in (("csa", 4), ("hca", 128)):
        q, kv, ckv, sink, cot, packing, allowed, selection = _inputs(shape, ratio, topk)
        label = f"{name} W={ckv.shape[1]}" + (f" top-{topk}" if selection is not None else "")

        def chunked(q, kv, ckv, sink, ratio=ratio, packing=packing, selection=selection):
            keys = Keys(raw_bsd=kv, sink_h=sink, window=window, compressed_bwd=ckv, ratio=ratio)
            return chunked_attention(RowQueries.given(q), keys, *packing, selection, chunk=chunk)

        ins = (q, kv, ckv, sink)
        fwd, grad = _loss_fns(chunked, cot)
        o_ref, t_fwd = _timed(fwd, ins, args.repeats)
        (_, g_ref), t_grad = _timed(grad, ins, args.repeats)
        print(f"{label} chunked chunk={chunk}: fwd {t_fwd * 1e3:.2f} ms, fwd+bwd {t_grad * 1e3:.2f} ms", flush=True)
        for bq in args.block_q:
            def fused(q, kv, ckv, sink, bq=bq, packing=packing, allowed=allowed):
                return fused_attention(q, kv, sink, *packing, window, ckv, allowed, block_q=bq, interpret=args.small)

            fwd, grad = _loss_fns(fused, cot)
            o, t_fwd = _timed(fwd, ins, args.repeats)
            (_, g), t_grad = _timed(grad, ins, args.repeats)
            names = ("o", "dq", "dkv", "dckv", "dsink")
            diffs = ", ".join(f"{n} {_diff(a, b)}" for n, a, b in zip(names, (o, *g), (o_ref, *g_ref)))
            print(f"{label} fused block_q={bq}: fwd {t_fwd * 1e3:.2f} ms, fwd+bwd {t_grad * 1e3:.2f} ms; "
                  f"max |fused - chunked| (/ max |chunked|): {diffs}", flush=True)


if __name__ == "__main__":
    main()
