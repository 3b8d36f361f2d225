"""Device meshes and shardings: where arrays live, on one host or many.

Modules: mesh (the (data, fsdp, tensor, expert) mesh, granules, multi-host start-up), sharding
(logical-axis rules, sharded state and batches), peers (a lost process: watch and goodbye),
collective_order (the collectives XLA:CPU may start out of order, read from a compiled program's HLO),
chips (each chip's peak FLOP/s, by the planner's names and JAX's device kinds; MFU), xla_flags (the
TPU compiler's collective scheduler options of a step).
May import: core.spec and below.
"""
