"""The DeepSeek-V4 decoder as nnx modules: parameters, initialisation, and the wiring of core.ops.

Modules: layers (param, RMSNorm), init_draws (shared truncated-normal draws), compressor, indexer,
indexer_init (the teacher's indexer projection), attention, moe, mhc, transformer (the decoder,
`abstract`), params (the parameter inventory), flops (the model FLOPs of a training step, from the
config: MFU's numerator), quant (frozen weights held in the released FP8/FP4 format).
May import: core.loss, core.ops, core.config and below.
"""
