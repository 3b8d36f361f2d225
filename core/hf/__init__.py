"""Checkpoint interchange with DeepSeek-V4's official and transformers layouts.

Modules: names (the one name/layout map), config_json (config.json <-> Config), safetensors_io
(bytes, FP8/FP4), importer (`dsv4 import-hf`), exporter (`dsv4 export-hf`).
May import: core.train and below; not core.eval, core.bench or core.plan.
"""
