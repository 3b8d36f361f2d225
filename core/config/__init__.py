"""Configuration: the frozen `Config` dataclass, the YAML files it is read from, value parsing, validation.

Modules: schema (Config, load_config, dump/loads), stages (the stage table), files (configs/ directory, model files, stage
presets), values (KEY=VALUE parsing, type coercion), validate (every rule),
key_table (docs/configuration.md's key table from base.yml's comments).
May import: core.errors only. The packages above core.model read their settings from here; the model
and the maths below it take the specs core/spec builds.
"""
