"""The training step of several configs on this machine's accelerator, one after the other, with traces.

    python tools/chip_step.py --model deepseek4-284b --stage sparse --steps 6 --trace 2 --out DIR \
        "$S" "$S moe_impl=ragged"

For each variant (one argument of space-separated KEY=VALUE overrides; "-" for none) in turn, in this
process: build the training command's own model, optimizer and step (core/bench/train.py's
`compiled_shape`, the step `dsv4 STAGE` runs), run one untimed step, time `--steps` more, then run
`--trace` steps under jax.profiler. The variant's state is freed before the next one is built, so
each may use the whole accelerator. Prints one JSON line per variant as soon as it is timed (median
and minimum step, tokens/s, the model TFLOP per step and the model MFU at the median step
(core/train/flops.py over the device's peak, as the training log counts them), compile seconds,
XLA's temporaries, the last losses), so that a trace
cut short by a time limit loses no timing, then with `--trace` one more (`traced_step_s`, the traced
steps' mean); with `--out` it writes into
DIR/<n>/: `hlo.txt.gz` (the compiled step's optimised HLO) and `trace.xplane.pb.gz` (the profile),
the inputs of core/bench/trace.py and core/plan/hlo.py, for reading on any machine.

Variants are timed one after the other, not round-robin as tools/step_ab.py does: on a dedicated
accelerator the drift that interleaving guards against on a shared CPU is absent, and two full-width
states would not fit one chip together.
"""

from __future__ import annotations

import argparse
import gc
import glob
import gzip
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help='overrides per variant, e.g. "moe_impl=ragged"; "-" for none')
    parser.add_argument("--model", default="deepseek4-tiny")
    parser.add_argument("--stage", default="sparse", choices=("pretrain", "warmup", "sparse"))
    parser.add_argument("--steps", type=int, default=6, help="timed steps after the first")
    parser.add_argument("--trace", type=int, default=0, help="steps traced after the timed ones")
    parser.add_argument("--out", help="directory for each variant's HLO and trace")
    args = parser.parse_args()

    from core.process import tune_garbage_collector

    tune_garbage_collector()
    import jax

    from core.bench.train import compiled_shape
    from core.spec.resolve import resolve
    from core.config.schema import load_config
    from core.train.flops import model_flops_per_step
    from core.parallel.chips import peak_flops, utilization
    from core.parallel.mesh import make_mesh
    from core.train.remat import remat_that_fits

    for n, variant in enumerate(args.variants):
        overrides = [] if variant == "-" else variant.split()
        cfg = load_config(args.model, ["dataset_type=synthetic", "enable_tensorboard=false", *overrides], stage=args.stage)
        mesh, start = make_mesh(cfg), time.perf_counter()
        specs = remat_that_fits(cfg.remat_policy, resolve(cfg, jax.default_backend(), mesh.shape), mesh)
        cfg = specs.cfg
        chosen_s = time.perf_counter() - start  # with remat_policy=auto on a TPU: the compile without remat
        row = {"variant": variant, "stage": args.stage, "model": args.model, "remat_policy": cfg.remat_policy}
        try:
            run = compiled_shape(specs, mesh, 2 + args.steps + args.trace)
        except Exception as exc:  # noqa: BLE001 - report the variant's failure, go on with the next
            print(json.dumps({**row, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}), flush=True)
            continue
        step, state, batches = run["step"], run["state"], run["batches"]
        start = time.perf_counter()
        state, metrics = step(state, batches[0])
        jax.block_until_ready(metrics)
        row["first_step_s"] = time.perf_counter() - start
        times = []
        for batch in batches[1:1 + args.steps]:
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        flops = model_flops_per_step(cfg, run["batch_rows"])["total"]
        peak = peak_flops(jax.local_devices()[0], cfg.dtype)[0]
        row.update(step_s=median, min_step_s=min(times), tokens_per_s=run["tokens_per_step"] / median,
                   model_tflop=flops / 1e12, mfu=utilization(flops, median, run["devices"], peak)["mfu"],
                   compile_s=run["compile_s"] + chosen_s, temp_bytes=run["temp_bytes"],
                   last={k: float(v) for k, v in jax.device_get(metrics).items()})
        print(json.dumps(row), flush=True)
        if args.out:
            folder = Path(args.out) / str(n)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "variant.txt").write_text(variant + "\n")
            with gzip.open(folder / "hlo.txt.gz", "wt") as f:
                f.write(step.as_text())
            if args.trace:
                with tempfile.TemporaryDirectory(prefix="dsv4-trace-") as tmp:
                    jax.profiler.start_trace(tmp)
                    start = time.perf_counter()
                    for batch in batches[1 + args.steps:]:
                        state, metrics = step(state, batch)
                        jax.block_until_ready(metrics)
                    traced_s = (time.perf_counter() - start) / args.trace
                    jax.profiler.stop_trace()
                    for path in glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[:1]:
                        with open(path, "rb") as src, gzip.open(folder / "trace.xplane.pb.gz", "wb") as dst:
                            shutil.copyfileobj(src, dst)
                print(json.dumps({"variant": variant, "traced_step_s": traced_s}), flush=True)
        del run, step, state, batches, metrics
        gc.collect()
        jax.clear_caches()


if __name__ == "__main__":
    main()
