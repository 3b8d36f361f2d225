"""Indexer evaluation against the dense teacher: per-layer metrics and their pooling over batches.

Modules: metrics (pure per-layer maths), evaluate (the driver: batches, layers, derived figures).
May import: core.train and below; not core.hf, core.bench or core.plan.
"""
