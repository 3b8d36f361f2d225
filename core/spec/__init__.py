"""A config resolved for a platform, as the frozen specs the model and the step are built from.

Modules: platform (the `auto` keys' per-platform choices: `resolve_config`), resolve (`resolve(cfg,
platform, mesh)` -> `Resolved`: the resolved Config, the model's `ModelSpec` with one `BlockSpec`
per layer (attention, indexer, MoE, mHC) and the step's `StepSpec`; the stage-table row is data in
both; `data_spec(cfg)`: the batches' `DataSpec`). A run, the planner, a benchmark and the evaluation call `resolve` where they start; the model
and the maths below it take specs, never a Config.
May import: core.model, core.config and below.
"""
