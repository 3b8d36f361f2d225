"""The YAML configuration files, installed as package data (`dsv4_configs`) so that they are
found after any install, from any working directory. See core/config/schema.py."""
