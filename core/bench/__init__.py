"""Measurements: the indexer loss's speed and memory, the train step's speed, FLOPs and profile.

Modules: loss (`dsv4 bench`), train (`dsv4 bench --train`: shapes, FLOPs per component), trace
(profile attribution from a jax.profiler trace).
May import: core.train and below; not core.eval, core.hf or core.plan.
"""
