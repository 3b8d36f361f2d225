"""Training: the step, the run around it in phases, and what makes a run safe and quick to start.

Modules: step (the step's maths: losses, schedule, trainable mask, router biases), optimizer
(AdamW with its moments' dtypes), program (the compiled step's one home: `StepProgram`, abstract
inputs, jit, memo, ahead-of-time compile; shared with plan and bench), remat (`remat_policy=auto`:
the first step that fits a chip), run (the Trainer: its phases in order,
the loop, checkpoints), preflight (every check that needs no array), materialise (build, restore,
init-from), outputs (checkpointer, config.yml, metrics.jsonl, TensorBoard), memory (the step's
memory against a device's), indexer_init (the teacher's indexer initialisation), compile_cache,
run_lock (one writer per run directory), step_guard (no non-finite step applied), stop (Ctrl-C,
SIGTERM and write errors agreed across processes), resume_checks (what a resume may change),
write_errors (write failures as one error), handoff (stage hand-off via --init-from), tensorboard,
flops (the model FLOPs of a training step, from the config: MFU's numerator).
May import: core.checkpoint and below.
"""
