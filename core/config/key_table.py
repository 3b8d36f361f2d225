"""The key table of docs/configuration.md, rendered from configs/base.yml's own comments.

base.yml is the one place a key, its default and its meaning are written; the docs page shows them
as Markdown tables, one per `# ---- section` of the file, and one per stage preset under `stages:`.
tests/test_docs.py checks that the page holds exactly what `render` makes of today's base.yml, and
`python tools/config_table.py` rewrites the page's table after an edit of base.yml.
"""

from __future__ import annotations

import re

BEGIN = "<!-- key table: generated from configs/base.yml by tools/config_table.py; do not edit by hand -->"
END = "<!-- end of the key table -->"

_SECTION = re.compile(r"^# -+ (?P<name>.+)$")
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[a-z_][a-z0-9_]*):(?P<value>[^#]*?)\s*(?:#\s*(?P<comment>.*))?$")


def _cell(text: str) -> str:
    """A table cell: Markdown's column separator escaped."""
    return text.replace("|", "\\|")


def _value(raw: str) -> str:
    return f"`{raw}`" if raw else ""


def parse(text: str) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], dict[str, list[tuple[str, str, str]]]]:
    """base.yml's text as (section, [(key, default, comment)]) in file order, and the stage presets
    as stage -> [(key, value, comment)]. A value is the YAML text as written."""
    sections: list[tuple[str, list[tuple[str, str, str]]]] = []
    stages: dict[str, list[tuple[str, str, str]]] = {}
    stage = None
    for line in text.splitlines():
        if m := _SECTION.match(line):
            sections.append((m["name"].strip(), []))
            continue
        m = _KEY.match(line)
        if not m:
            continue
        key, value, comment = m["key"], m["value"].strip(), (m["comment"] or "").strip()
        depth = len(m["indent"])
        if depth == 0 and key == "stages":
            stage = ""
        elif depth == 0:
            stage = None
            if not sections:  # keys above the first section header
                sections.append(("keys", []))
            sections[-1][1].append((key, value, comment))
        elif stage is not None and not value:
            stage = key
            stages[stage] = []
        elif stage:
            stages[stage].append((key, value, comment))
    return sections, stages


def render(text: str) -> str:
    """The Markdown of the key table for base.yml's `text`, between the BEGIN and END markers."""
    sections, stages = parse(text)
    out = [BEGIN, ""]
    for name, rows in sections:
        if not rows:
            continue
        out += [f"### {name[0].upper()}{name[1:]}", "", "| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{key}` | {_cell(_value(value))} | {_cell(comment)} |" for key, value, comment in rows]
        out.append("")
    for stage, rows in stages.items():
        out += [f"### Stage preset: `dsv4 {stage}`", "", "| key | value | why |", "|---|---|---|"]
        out += [f"| `{key}` | {_cell(_value(value))} | {_cell(comment)} |" for key, value, comment in rows]
        out.append("")
    out.append(END)
    return "\n".join(out)


def replace_block(page: str, table: str) -> str:
    """`page` with its text from BEGIN to END replaced by `table`."""
    start, stop = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + table + page[stop:]
