"""dsv4 command-line interface: one thin module per command (DESIGN.md, "Layout")."""

__version__ = "0.1.0"
