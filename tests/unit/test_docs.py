"""The README and docs/ pages link only to files that exist, and every layout has its page."""

import re

from helpers import REPO


def test_every_relative_link_resolves():
    pages = [REPO / "README.md", REPO / "RELIABILITY.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_each_layout_has_a_page_that_says_when_to_use_it():
    for name in ("data-parallel", "tensor-parallel", "pipeline-parallel", "memory-planning", "multi-node"):
        text = (REPO / "docs" / f"{name}.md").read_text()
        assert name in (REPO / "README.md").read_text(), name
        assert "When to use" in text or "Where each group sits" in text, name
