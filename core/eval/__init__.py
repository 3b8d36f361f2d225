"""Indexer evaluation against the dense teacher: per-layer metrics streamed inside the model, their
pooling over batches, and the evaluation's own rows.

Modules: metrics (pure per-block maths and the per-layer stream), report (pooling, derived ratios,
the result), rows (the evaluation set), evaluate (the step, the driver, a checkpoint's evaluation).
May import: core.train and below; not core.hf, core.bench or core.plan.
"""
