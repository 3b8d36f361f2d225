"""Training: the step, the run around it, and what makes a run safe and quick to start.

Modules: step (losses, optimizer, trainable mask, jit, build), run (the Trainer: resume,
init-from, metrics), precompile (ahead-of-time compile beside the build), compile_cache, guard
(one writer, finite state, write failures), handoff (stage hand-off via --init-from), tensorboard.
May import: core.checkpoint and below.
"""
