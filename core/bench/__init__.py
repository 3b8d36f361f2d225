"""Measurements: the indexer loss's speed and memory, the train step's speed, FLOPs and profile.

Modules: loss (`dsv4 bench`), train (`dsv4 bench --train`: shapes, FLOPs per component), trace
(a step's measured time per component from a jax.profiler trace, CPU or TPU), hlo_owners (which
component owns each instruction of the compiled step's HLO text), components (source file ->
component, shared by all of them).
May import: core.train and below; not core.eval, core.hf or core.plan.
"""
