"""Run directories and checkpoints: Orbax steps, the run's plain files, host trees, inspection.

Modules: store (Orbax steps, restore, compatibility checks), run_files (config.yml,
metrics.jsonl, the output-directory check), host_tree (saving host NumPy trees in bounded memory),
inspect (what a checkpoint holds, from metadata alone).
May import: core.data and below.
"""
