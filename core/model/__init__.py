"""The DeepSeek-V4 decoder as nnx modules: parameters, initialisation, and the wiring of core.ops.

Modules: layers (param, RMSNorm, RoPE, the KV compressor, the lightning indexer's parameters), init_draws
(shared truncated-normal draws), indexer_init (the teacher's indexer projection), attention (with its
lightning indexer's selection and loss), moe, block (one decoder layer and its mHC), transformer (the decoder and
its `ModelSpec`, `abstract`), params (the parameter inventory), quant (frozen weights held in the
released FP8/FP4 format). Every module takes specs (core/spec builds them from a resolved config).
May import: core.loss, core.ops and below; never core.config.
"""
