"""Training: the step, the run around it, and what makes a run safe and quick to start.

Modules: step (losses, optimizer, trainable mask, the jitted step, build), program (a stage's
step program: its abstract inputs and its jit, shared with plan and bench), run (the Trainer: resume,
init-from, metrics), precompile (ahead-of-time compile beside the build), compile_cache, run_lock
(one writer per run directory), step_guard (no non-finite step applied), resume_checks (what a
resume may change), write_errors (write failures as one error), handoff (stage hand-off via
--init-from), tensorboard.
May import: core.checkpoint and below.
"""
