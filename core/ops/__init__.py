"""Pure, jit-safe maths that both the model and the losses use: functions of arrays and static ints.

Modules: chunked_attention (visibility from positions and segment ids; banded window, gathered top-k,
chunked visible blocks), masked_attention (the dense masks and the attention over them: the reference),
fused_attention (the same
attention as Pallas TPU kernels, forward and backward), topk (indexer scores,
top-k block selection), grouped_matmul (the
megablox kernels with per-pass tiles, slot permutations), batched_experts (the experts as batched
matmuls over rows padded to a capacity per expert), expert_parallel (tokens sent to their
experts' devices and back), quant (the released FP8/FP4 formats), placement (the mesh axes the batch and the experts split over,
an activation pinned to the batch split on the trace's mesh, the platform a trace is for, and the data
dependencies that fix the order of collectives on XLA:CPU).
May import: core.errors, core.tree (never core.config: ops take static ints and specs). No parameters, no nnx modules.
"""
