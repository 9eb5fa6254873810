"""README.md stays a first page (issue #56: at most 15 kB, the rest in docs/), and every relative link in README.md,
docs/ and benchmarks/README.md resolves: the file exists, and a ``#fragment`` names a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than ``-`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_readme_is_a_first_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15 * 1024
    first = readme.split("\n```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    linked = {Path(t.partition("#")[0]).name for t in links(ROOT / "README.md")}
    for page in (ROOT / "docs").glob("*.md"):
        assert page.name in linked, f"README does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not bad, bad


def test_the_slug_rule():
    assert slug("The `\"vllm\"` backend's adapter sync") == "the-vllm-backends-adapter-sync"
    assert slug("On Marlin (before Humming)") == "on-marlin-before-humming"
    assert slug("The FP4 kernel: Humming or Marlin") == "the-fp4-kernel-humming-or-marlin"
