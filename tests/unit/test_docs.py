"""The README and docs/ pages link only to files that exist, every layout has its page, the
data-parallel claim states what its test checks, and docs/architecture.md names every module of the
package and only modules that exist."""

import re
from pathlib import Path

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
    for name in (
        "data-parallel",
        "tensor-parallel",
        "pipeline-parallel",
        "memory-planning",
        "multi-node",
    ):
        text = (REPO / "docs" / f"{name}.md").read_text()
        assert name in (REPO / "README.md").read_text(), name
        assert "When to use" in text or "Where each group sits" in text, name


def test_the_data_parallel_claim_is_what_its_test_checks():
    """dp=2 equals one process step by step, to the tolerances of the test the pages cite; not over
    long runs."""
    cited = "tests/multirank/test_train.py::test_dp2_equals_dp1_and_writes_one_run_dir"
    source = (REPO / cited.split("::")[0]).read_text()
    assert f"def {cited.split('::')[1]}(" in source
    steps = re.search(r"^STEPS = (\d+)$", source, re.M).group(1)
    loss = re.search(r'a\["loss"\] == pytest.approx\(b\["loss"\], rel=([0-9e.-]+)', source).group(1)
    norm = re.search(
        r'a\["grad_norm"\] == pytest.approx\(b\["grad_norm"\], rel=([0-9e.-]+)', source
    ).group(1)
    for page in ("docs/training.md", "docs/data-parallel.md"):  # the README points to them
        text = " ".join((REPO / page).read_text().split())
        assert cited in text, page
        for said in (
            f"{steps} steps",
            f"loss to {loss}",
            f"gradient norm to {norm}",
            "not bit-identical",
            "54.33% and 54.83% top-1",
        ):
            assert said in text, (page, said)
    for page in ("README.md", "docs/training.md", "docs/data-parallel.md"):
        text = " ".join((REPO / page).read_text().split())
        assert (
            "reproduces one process's losses" not in text
            and "reproduces a one-process run's losses" not in text
        )


# -- docs/architecture.md: the one module index ----------------------------------------------------
PACKAGE = REPO / "visiondist"
ARCHITECTURE = REPO / "docs" / "architecture.md"
# `train/run.py`, `utils/`, `compat.py`
PATH_NAME = re.compile(r"(?:visiondist/)?((?:\w+/)*(?:\w+\.py|\w+/))")
# `train.run.train`, `models.EVAL_METRICS`
DOTTED_NAME = re.compile(r"(?:visiondist\.)?(\w+(?:\.\w+)+)")
# a file
FILE_NAME = re.compile(
    r".+\.(?:yaml|yml|json|jsonl|csv|txt|log|md|png|safetensors|onnx|pt|pth|pt2|tar|sh)"
)


def package_modules(package: Path = PACKAGE) -> set[str]:
    """Every module of the package as architecture.md names it: a file by its path under visiondist/
    (`train/run.py`, `compat.py`), a package (its `__init__.py`) by its folder (`train/`,
    `checkpoint/export/`)."""
    names = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        if rel.name != "__init__.py":
            names.add(rel.as_posix())
        elif rel.parent != Path("."):
            names.add(f"{rel.parent.as_posix()}/")
    return names


def _module_of(parts: list[str], package: Path) -> tuple[str, list[str]] | None:
    """The longest leading part of a dotted name that is a module or package (its path name), and
    the attribute names after it; None when no leading part is one."""
    for k in range(len(parts), 0, -1):
        stem = "/".join(parts[:k])
        if (package / f"{stem}.py").is_file():
            return f"{stem}.py", parts[k:]
        if (package / stem / "__init__.py").is_file():
            return f"{stem}/", parts[k:]
    return None


def architecture_names(
    text: str, package: Path = PACKAGE, repo: Path = REPO
) -> tuple[set[str], list[str]]:
    """(the modules a page's code spans name, the spans that name something that does not exist).

    A span in path form (`train/run.py`, `utils/`, optionally under `visiondist/`) names that module
    or package of visiondist; one that is no path under visiondist/ must be the repository's
    (`tools/train.py`, `configs/model/`). A span in dotted form whose first part is a top-level
    module or package of visiondist (`train.run.train`, `models.EVAL_METRICS`) names the longest
    module its leading parts make, and the first name after that must occur in that module's source
    (a function, class or constant it defines or hands on). A config key is written with its value
    (`data.decode_on=auto`), so it is never read as a module, and a file name (`config.yaml`) is
    none."""
    top = {p.stem for p in package.glob("*.py")} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    named, stale = set(), []
    for span in re.findall(r"`([^`\n]+)`", text):
        span = span.strip()
        if match := PATH_NAME.fullmatch(span):
            name = match.group(1)
            if (package / name).exists():
                named.add(name)
            elif not (repo / name).exists():
                stale.append(span)
        elif (
            (match := DOTTED_NAME.fullmatch(span))
            and match.group(1).split(".")[0] in top
            and not FILE_NAME.fullmatch(span)
        ):
            found = _module_of(match.group(1).split("."), package)
            if found is None:
                stale.append(span)
                continue
            module, rest = found
            named.add(module)
            source = package / (module + "__init__.py" if module.endswith("/") else module)
            if rest and not re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()):
                stale.append(span)
    return named, stale


def test_architecture_names_every_module():
    """docs/architecture.md is the one module index: a new module is added there with its job."""
    named, _ = architecture_names(ARCHITECTURE.read_text())
    missing = sorted(package_modules() - named)
    assert not missing, (
        f"modules docs/architecture.md does not name (add each with its job): {missing}"
    )


def test_every_module_architecture_names_exists():
    """A module moved or renamed is renamed in docs/architecture.md too."""
    _, stale = architecture_names(ARCHITECTURE.read_text())
    assert not stale, f"docs/architecture.md names what does not exist (moved or renamed?): {stale}"


def test_the_module_index_check_reads_both_forms(tmp_path):
    """The check itself, on a package of its own: path and dotted names count, a stale path, module
    or attribute is caught, config keys and the repository's paths are left alone, and an unnamed
    module is missing."""
    package = tmp_path / "visiondist"
    for name in (
        "__init__.py",
        "compat.py",
        "config/__init__.py",
        "train/__init__.py",
        "train/run.py",
        "models/__init__.py",
        "models/build.py",
        "models/vit.py",
    ):
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(
            "def build_model():\n    pass\n" if name == "models/build.py" else ""
        )
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "train.py").write_text("")
    named, stale = architecture_names(
        "`train/run.py` `visiondist/train/` `compat.py` `models.build.build_model` "
        "`tools/train.py` `config/` `data.decode_on=auto` `torch.distributed` `config.yaml` "
        "`train/nowhere.py` `nowhere.py` `models.build.no_such_name` `models.nowhere.build`",
        package,
        tmp_path,
    )
    assert named == {
        "train/run.py",
        "train/",
        "compat.py",
        "models/build.py",
        "models/",
        "config/",
    }, named
    assert stale == [
        "train/nowhere.py",
        "nowhere.py",
        "models.build.no_such_name",
        "models.nowhere.build",
    ], stale
    assert package_modules(package) - named == {"models/vit.py"}
