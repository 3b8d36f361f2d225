"""Rewrite the key table of docs/configuration.md from configs/base.yml's comments.

    python tools/config_table.py          # after editing base.yml; tests/test_docs.py checks the page
"""

from pathlib import Path

from core.config.key_table import render, replace_block

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    page = ROOT / "docs" / "configuration.md"
    page.write_text(replace_block(page.read_text(), render((ROOT / "configs" / "base.yml").read_text())))
    print(f"wrote the key table of {page.relative_to(ROOT)}")
