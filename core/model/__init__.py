"""The DeepSeek-V4 decoder as nnx modules: parameters, initialisation, and the wiring of core.ops.

Modules: layers (param, RMSNorm), init_draws (shared truncated-normal draws), compressor, indexer,
attention, moe, mhc, transformer (the decoder, `abstract`), params (the parameter inventory).
May import: core.loss, core.ops, core.config and below.
"""
