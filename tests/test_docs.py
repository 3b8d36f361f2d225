"""The docs stay references and the code's comments explain the code (issue 33).

- No figure that goes stale (a size in KiB..TB, tokens/s, a step time, a speed-up, a commit id, a
  date) in a comment, docstring or string of core/ and dsv4cli/, or in a YAML comment of configs/:
  such a figure belongs in docs/, and the code links to the section that measures it (the link
  itself may name anything).
- README.md is the front door (at most 250 lines); docs/planning.md and docs/benchmarks.md hold
  today's figures (at most 300 lines each); no page has dated or per-change headings or names a
  path outside the repository (the checks of CI's reviewer hook, mirrored).
- Every relative link of README.md and docs/*.md reaches a file, and a heading where it names one.
- docs/configuration.md's key table is what core.config.key_table renders from configs/base.yml.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from core.config.files import base_config
from core.config.key_table import BEGIN, END, parse, render

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_UNIT = r"(?:[KMGT]i?B|[KMGT]B|tokens/s|tokens per second|s/step|s a step|ms a step|[GT]FLOP/s)"
FIGURE = re.compile(
    r"\d(?:[\d,]*\d)?(?:\.\d+)?\s?" + _UNIT + r"\b"  # 63.20 GiB, 854 MB, 1,003 tokens/s, 0.9 s a step
    r"|\b\d+(?:\.\d+)?x (?:faster|slower|the time)\b"  # 1.33x faster, 0.94x the time
    r"|\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"  # a commit id
    r"|\b20\d\d-\d\d-\d\d\b"  # a date
)
# A link to the docs (or the web) may name anything: its anchor is where the figure lives.
_LINK = re.compile(r"(?:\.\./)*docs/[\w./-]+\.md(?:#[\w-]+)?|https?://\S+")
# Figures that are a library's documented constant, not a measurement of ours.
UPSTREAM = {("core/checkpoint/host_tree.py", "2 GiB"),  # Orbax's default ocdbt_target_data_file_size
            ("core/parallel/chips.py", "80GB")}  # the H100 SXM's device_kind, as CUDA names it


def _figures(text: str) -> list[str]:
    return FIGURE.findall(_LINK.sub("", text))


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal (docstrings included) of a Python file."""
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(tok.start[0] + i, line) for tok in tokens if tok.type in kinds
            for i, line in enumerate(tok.string.splitlines())]


def _yaml_comments(path: Path) -> list[tuple[int, str]]:
    return [(n, line.split("#", 1)[1]) for n, line in enumerate(path.read_text().splitlines(), 1) if "#" in line]


def test_no_figures_in_code_comments():
    found = []
    for top in ("core", "dsv4cli"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            found += [f"{name}:{n}: {', '.join(f)}" for n, text in _python_prose(path)
                      if (f := [x for x in _figures(text) if (name, x) not in UPSTREAM])]
    for path in sorted((ROOT / "configs").glob("*.yml")):
        found += [f"{path.relative_to(ROOT)}:{n}: {', '.join(f)}" for n, text in _yaml_comments(path)
                  if (f := _figures(text))]
    assert not found, ("figures in comments, docstrings or YAML comments: move each to its docs section "
                       "and link to it instead\n" + "\n".join(found))


def test_the_figure_pattern():
    for text in ("63.20 GiB of 105.75", "854 against 447 MB", "1,003 tokens/s", "0.94x the time", "at 14fa7fe",
                 "measured 2026-12-03", "2.3 TB of weights", "16 MiB chunks"):
        assert _figures(text), text
    for text in ("docs/planning.md#v4-flash-sparse-at-4096-6320-gib", "UTF-8 bytes 0..255", "bf16[20,1,4096]",
                 "a 128x128 block", "default 1024,4096", "sha256 of the text", "1.5-7x further"):
        assert not _figures(text), text


def test_page_lengths():
    limits = {"README.md": 250, "docs/planning.md": 300, "docs/benchmarks.md": 300}
    long = [f"{name}: {n} lines (at most {limit})" for name, limit in limits.items()
            if (n := len((ROOT / name).read_text().splitlines())) > limit]
    assert not long, long


def test_pages_are_references():
    dated = re.compile(r"^#+ .*(session|'s change|20[0-9]{2}-[0-9]{2}-[0-9]{2})", re.I | re.M)
    outside = re.compile(r"(^|[^A-Za-z0-9_.])/(work|tmp|root|home)/", re.M)
    problems = []
    for page in PAGES:
        text = page.read_text()
        problems += [f"{page.name}: dated or per-change heading {m.group(0)!r}" for m in dated.finditer(text)]
        problems += [f"{page.name}:{text.count(chr(10), 0, m.start()) + 1}: a path outside the repository"
                     for m in outside.finditer(text)]
    assert not problems, problems


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: the text without markup, lower case, punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    anchors, counts = set(), {}
    for heading in re.findall(r"^#+ (.+)$", _prose(page.read_text()), re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
        counts[slug] = counts.get(slug, 0) + 1
    return anchors


def _prose(markdown: str) -> str:
    """Markdown without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_docs_links_in_code_resolve():
    """A `docs/PAGE.md#anchor` named in code, configs, tools or tests reaches its heading."""
    broken = []
    for top in ("core", "dsv4cli", "configs", "tools", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".yml", ".md", ".sh") or path.name == "test_docs.py":
                continue
            for page, anchor in re.findall(r"\bdocs/([\w-]+\.md)(?:#([\w-]+))?", path.read_text()):
                dest = ROOT / "docs" / page
                if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                    broken.append(f"{path.relative_to(ROOT)}: docs/{page}{'#' + anchor if anchor else ''}")
    assert not broken, sorted(set(broken))


def test_key_table_is_base_yml():
    sections, stages = parse((ROOT / "configs" / "base.yml").read_text())
    defaults, presets = base_config()
    assert [key for _, rows in sections for key, _, _ in rows] == list(defaults)
    assert {stage: [key for key, _, _ in rows] for stage, rows in stages.items()} == {
        stage: list(preset) for stage, preset in presets.items()}
    page = (ROOT / "docs" / "configuration.md").read_text()
    start, stop = page.index(BEGIN), page.index(END) + len(END)
    expected = render((ROOT / "configs" / "base.yml").read_text())
    assert page[start:stop] == expected, "docs/configuration.md's key table is not base.yml's: run python tools/config_table.py"
