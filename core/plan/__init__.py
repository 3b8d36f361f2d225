"""Planning (`dsv4 plan`, DESIGN.md "Planning"): the training step (or, `--stage eval`, the
evaluation's programs) compiled ahead of time for a target.

Modules: targets (TPU topologies by MaxText's names, NVIDIA GPUs from XLA's GpuTargetConfigProto
specs in specs/, fake CPU devices; the extra each needs), compile (the child process that builds
the compile-only devices and compiles the step; its parent side), hlo (the compiled HLO read with
loops counted: matmul FLOPs, bytes accessed, collectives per mesh axis), cost (the step-time model
per executed instruction, calibrated on a TPU v5e chip), report (state bytes from
shapes and shardings, the compiler's memory, largest temporaries, FLOP figures, step-time estimate, verdict),
search (`--search`: meshes and batches enumerated, pruned on exact state bytes, compiled and ranked,
cached per candidate).
May import: core.train and everything below (core.bench for the component attribution, core.eval
for the evaluation's programs); nothing imports it.
"""
