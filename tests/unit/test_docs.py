"""The README and docs/ pages link only to files that exist, every layout has its page, and the data-parallel
claim states what its test checks."""

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


def test_the_data_parallel_claim_is_what_its_test_checks():
    """dp=2 equals one process step by step, to the tolerances of the test the pages cite; not over long runs."""
    cited = "tests/multirank/test_train.py::test_dp2_equals_dp1_and_writes_one_run_dir"
    source = (REPO / cited.split("::")[0]).read_text()
    assert f"def {cited.split('::')[1]}(" in source
    steps = re.search(r"^STEPS = (\d+)$", source, re.M).group(1)
    loss = re.search(r'a\["loss"\] == pytest.approx\(b\["loss"\], rel=([0-9e.-]+)', source).group(1)
    norm = re.search(r'a\["grad_norm"\] == pytest.approx\(b\["grad_norm"\], rel=([0-9e.-]+)', source).group(1)
    for page in ("README.md", "docs/data-parallel.md"):
        text = " ".join((REPO / page).read_text().split())
        assert cited in text, page
        for said in (f"{steps} steps", f"loss to {loss}", f"gradient norm to {norm}", "not bit-identical",
                     "54.33% and 54.83% top-1"):
            assert said in text, (page, said)
        assert "reproduces one process's losses" not in text and "reproduces a one-process run's losses" not in text
