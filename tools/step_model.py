"""The plan's step-time model (core/plan/cost.py) beside a TPU profile of the same program.

    python tools/step_model.py DIR [DIR ...] [--fit | --fit-on DIR [DIR ...]]

Each DIR holds what `tools/chip_step.py --out` writes per variant: `hlo.txt[.gz]`, the compiled
step's optimised HLO, and `trace.xplane.pb[.gz]`, a jax.profiler trace of a few steps on one TPU.
In the trace (plane "/device:TPU:0"), each "XLA Ops" event is named by its instruction's text, the
op being the token after '%', and a while loop's event encloses its body's, so an op's time is its
exclusive time; the "Steps" line gives the steps. Prints, per run, the measured step, the estimate
and its parts, and the measured and estimated seconds per step by kind of instruction (fusion kind
or opcode). `--fit` refits the model's efficiencies (mxu, mxu_kernel, hbm, vmem, row_s; op_s stays) by least
squares over every instruction's measured time, over all the runs given (`--fit-on`: over those
runs only), and prints every run's estimate with them (needs scipy). The model and its calibration: docs/step-time-model.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.plan import cost, hlo  # noqa: E402
from core.plan.targets import TPU_CHIPS  # noqa: E402


def _read(directory: Path, name: str) -> bytes:
    plain = directory / name
    return plain.read_bytes() if plain.exists() else gzip.decompress((directory / f"{name}.gz").read_bytes())


def measured(directory: Path) -> tuple[float, dict[str, float]]:
    """(seconds per step, {op: exclusive seconds per step}) from the directory's trace."""
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.NamedTemporaryFile(suffix=".xplane.pb") as f:
        f.write(_read(directory, "trace.xplane.pb"))
        f.flush()
        plane = next(p for p in ProfileData.from_file(f.name).planes if p.name == "/device:TPU:0")
    lines = {line.name: line for line in plane.lines}
    steps = [e.duration_ns for e in lines["Steps"].events]
    events = sorted(([e.start_ns, e.start_ns + e.duration_ns, re.match(r"%?([\w.\-]+)", e.name).group(1),
                      e.duration_ns] for e in lines["XLA Ops"].events), key=lambda e: (e[0], -e[1]))
    stack, ops = [], collections.Counter()
    for event in events:
        while stack and stack[-1][1] <= event[0]:
            stack.pop()
        if stack:
            stack[-1][3] -= event[1] - event[0]  # the enclosing loop's own time excludes its body's
        stack.append(event)
    for _, _, op, exclusive in events:
        ops[op] += exclusive / len(steps) / 1e9
    return sum(steps) / len(steps) / 1e9, dict(ops)


def instructions(text: str, ceilings: cost.Ceilings) -> list[tuple[str, str, int, cost.Work]]:
    """(name, kind, runs per step, work) of each instruction outside fusions that does work."""
    module = hlo.parse(text)
    times = hlo.runs(module)
    out = []
    for comp, insts in module.computations.items():
        for inst in insts:
            if comp in module.fused or inst.opcode.endswith(("-start", "-done")) or inst.opcode in ("while", "call"):
                continue
            if (work := cost.instruction_work(module, inst)) is not None:
                kind = re.search(r"kind=(\w+)", inst.attrs).group(1) if inst.opcode == "fusion" else inst.opcode
                out.append((inst.name, kind, times.get(comp, 1), work))
    return out


def report(name: str, text: str, step: float, ops: dict[str, float], ceilings: cost.Ceilings,
           eff: cost.Efficiency) -> None:
    e = cost.estimate(text, ceilings, eff)
    print(f"{name}: measured {step:.4f} s, estimated {e['step_s']:.4f} s ({e['step_s'] / step - 1:+.1%}); "
          + ", ".join(f"{k} {v:.4f}" for k, v in e.items() if k != "step_s"))
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for op, kind, runs, work in instructions(text, ceilings):
        kinds[kind][0] += ops.get(op, 0.0)
        kinds[kind][1] += cost._op(work, ceilings, eff).step_s * runs
    kinds["copy waits (-done)"] = [sum(t for op, t in ops.items() if re.match(r"(copy|slice)-done", op)), e["dma_wait_s"]]
    for kind, (meas, est) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        if max(meas, est) >= 1e-3 * step:
            print(f"  {kind:24s} measured {meas:9.4f} s  estimated {est:9.4f} s")


def fit(runs: list[tuple[str, float, dict[str, float]]], ceilings: cost.Ceilings, eff: cost.Efficiency) -> cost.Efficiency:
    """Efficiencies minimising the squared error of every instruction's time per step (each run's
    errors relative to its step), op_s kept."""
    import numpy as np
    from scipy.optimize import minimize

    data = []
    for text, step, ops in runs:
        rows = instructions(text, ceilings)
        work = np.array([[w.flops * (not w.kernel), w.hbm_bytes, w.vmem_bytes, w.rows, w.flops * w.kernel]
                         for _, _, _, w in rows], float)
        data.append((work, np.array([r for _, _, r, _ in rows], float), np.array([ops.get(n, 0.0) for n, *_ in rows]), step))

    def loss(p):
        mxu, hbm, vmem, row_ns, kernel = p
        if min(p) <= 0 or mxu > 1 or hbm > 1 or kernel > 1:
            return 1e9
        total = 0.0
        for work, runs_, meas, step in data:
            t = np.maximum.reduce([work[:, 0] / (ceilings.peak_flops * mxu) + work[:, 4] / (ceilings.peak_flops * kernel),
                                   (work[:, 1] + vmem * work[:, 2]) / (ceilings.hbm_bandwidth * hbm), work[:, 3] * row_ns * 1e-9])
            total += np.sum(((t + eff.op_s) * runs_ - meas) ** 2) / step ** 2
        return total

    p = minimize(loss, [eff.mxu, eff.hbm, eff.vmem, eff.row_s * 1e9, eff.mxu_kernel], method="Nelder-Mead",
                 options={"maxiter": 8000, "xatol": 1e-6, "fatol": 1e-14}).x
    return dataclasses.replace(eff, mxu=float(p[0]), hbm=float(p[1]), vmem=float(p[2]), row_s=float(p[3]) * 1e-9,
                               mxu_kernel=float(p[4]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--chip", default="v5e", choices=sorted(TPU_CHIPS), help="the chip the traces ran on")
    parser.add_argument("--fit", action="store_true", help="refit the efficiencies on these runs")
    parser.add_argument("--fit-on", nargs="+", type=Path, default=[], help="refit on these runs only (among DIRs)")
    args = parser.parse_args()
    chip = TPU_CHIPS[args.chip][2]
    ceilings = cost.Ceilings(chip.peak_flops, chip.hbm_bandwidth, chip.link_bandwidth)  # one chip: no links
    runs = [(str(d), _read(d, "hlo.txt").decode(), *measured(d)) for d in args.dirs]
    eff = cost.V5E
    if args.fit or args.fit_on:
        chosen = [str(d) for d in args.fit_on] or [name for name, *_ in runs]
        eff = fit([(text, step, ops) for name, text, step, ops in runs if name in chosen], ceilings, eff)
        print("fitted:", dataclasses.asdict(eff))
    for name, text, step, ops in runs:
        report(name, text, step, ops, ceilings, eff)


if __name__ == "__main__":
    main()
