"""The documentation's own links, and what package code may cite: every relative link in README.md and docs/
resolves to a file of the repository; every subject page under docs/performance/ is linked from
docs/PERFORMANCE.md; package code cites documentation by page and section title, never by "PERFORMANCE §N",
a PERFORMANCE section number or an issue number (docs/ARCHITECTURE.md, "Documentation")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "distbench", "sla", "chaos", "reports", "ci", "planner")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)
# "issue 26", "issue #26", "PERFORMANCE §10", "docs/PERFORMANCE.md section 9"
FORBIDDEN = re.compile(r"\bissue #?[0-9]|PERFORMANCE §|PERFORMANCE\.md,? (section|§)", re.I)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        out.append(target.split("#", 1)[0])
    return out


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for page in _markdown_files():
        for target in _relative_links(page):
            resolved = (page.parent / target).resolve()
            if not resolved.exists() or ROOT not in resolved.parents:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links that lead nowhere (or out of the repository): " + "; ".join(broken)


def test_every_performance_subject_page_is_linked_from_the_one_page() -> None:
    index = ROOT / "docs" / "PERFORMANCE.md"
    linked = {(index.parent / t).resolve() for t in _relative_links(index)}
    pages = sorted((ROOT / "docs" / "performance").glob("*.md"))
    assert pages, "docs/performance/ holds no page"
    # a dated note (<topic>-YYYY-MM-DD.md, or -YYYY-MM-DDb.md for a day's second session) is a measurement
    # waiting to be folded into its subject page
    pages = [p for p in pages if not re.search(r"-\d{4}-\d{2}-\d{2}[a-z]?\.md$", p.name)]
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"subject pages not linked from docs/PERFORMANCE.md: {missing}"


def test_package_code_cites_no_section_numbers_or_issue_numbers() -> None:
    hits = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*")):
            if path.suffix not in (".py", ".yaml", ".yml", ".md", ".txt") or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if FORBIDDEN.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "cite a docs page and its section title instead:\n" + "\n".join(hits)
