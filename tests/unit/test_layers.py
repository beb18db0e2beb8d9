"""Imports go down only. Every `visiondist` import (at module level or inside a function) must point to a lower
layer of the table below, or stay inside its own package: a back-edge fails here, naming both ends."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "visiondist"

# lowest first; a package may import only from the layers before its own
LAYERS = [
    {"compat", "utils"},  # torch feature detection; signals and DCP metadata shared by every layer
    {"config"},  # the schema, validation, RunLayout: no torch
    {"parallel"},  # generic: mesh, TP styles, pipeline runtime, FSDP, planner; never the models
    {"models"},  # models and what they declare to parallel (TP plan, blocks)
    {"plan", "data"},  # the one layout resolver; loaders
    {"synthetic"},  # the built-in data sets, written in the real ones' formats (COCO's mask encoding from data)
    {"preflight", "checkpoint", "observe"},  # input checks; what is saved and exported; what people see (reads only)
    {"faults", "evaluation"},  # a failing rank's record (into the run's log); scoring (with progress bars)
    {"train"},  # the loop and every part it is built from: reads checkpoints, shows, fails, scores
    {"bench"},  # times the trainer's own step beside plain loops
    {"verify"},  # the dry run: the training code stepped on a fake group, with the benchmark's synthetic batches
    {"runs"},  # continuing a run
    {"launch"},  # run dir, self-launch, ranks
    {"cli"},  # the tools' command line and multirun sweeps
]


# rooms that promise less than their layer allows (their docstrings say so): what each may import, at most
NARROWER = {
    "observe": {"compat", "utils", "config"},  # shows what others measured; measures nothing itself
    "faults": {"compat", "utils", "observe"},  # the failure line goes into the run's log
    "evaluation": {"compat", "utils", "data", "parallel", "models", "observe"},  # never the trainer or checkpoints
    "checkpoint": {"compat", "utils", "config", "parallel", "models", "plan", "data"},  # never the trainer or observe
}

def layer_of(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)


def imported(source: str) -> set[str]:
    """The `visiondist` modules a source imports, anywhere in it (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m == "visiondist" or m.startswith("visiondist.")}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def back_edges(modules: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """{(importer package, imported package): [importing module -> imported module, ...]} for every import that
    does not go down. `modules`: module name -> source."""
    found: dict[tuple[str, str], list[str]] = {}
    for name, source in modules.items():
        here = package_of(name)
        for target in imported(source):
            there = package_of(target)
            if not here or not there or here == there:
                continue
            if layer_of(there) >= layer_of(here):
                found.setdefault((here, there), []).append(f"{name} -> {target}")
    return found


def _modules() -> dict[str, str]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text()
    return out


def test_every_package_is_in_the_layer_table():
    packages = {package_of(name) for name in _modules()} - {""}
    listed = set().union(*LAYERS)
    assert packages == listed, f"not in LAYERS: {sorted(packages - listed)}; gone: {sorted(listed - packages)}"


def test_imports_go_down_only():
    found = back_edges(_modules())
    assert not found, "imports that go up or sideways:\n" + "\n".join(w for ws in found.values() for w in ws)


def test_rooms_import_only_what_they_promise():
    found = []
    for name, source in _modules().items():
        here = package_of(name)
        for target in imported(source):
            there = package_of(target)
            if here in NARROWER and there and there != here and there not in NARROWER[here]:
                found.append(f"{name} -> {target} ({here} may import only {sorted(NARROWER[here])})")
    assert not found, "\n".join(found)


def test_a_back_edge_inside_a_function_is_caught():
    sources = {
        "visiondist.data.loader": "import os\n\ndef f():\n    from visiondist.train.trainer import Trainer\n",
        "visiondist.train.trainer": "from visiondist.data import loader\n",
        "visiondist.config": "import visiondist.parallel.mesh\n",
    }
    assert back_edges(sources) == {("data", "train"): ["visiondist.data.loader -> visiondist.train.trainer"],
                                   ("config", "parallel"): ["visiondist.config -> visiondist.parallel.mesh"]}


def test_a_unit_test_cannot_start_a_process():
    """tests/unit/conftest.py keeps this directory to one process: a command line run fails the test at once; a system
    tool a library runs for itself (matplotlib's first font scan runs `fc-list`) does not."""
    import subprocess
    import sys

    for command in ([sys.executable, "tools/train.py"], ["torchrun", "tools/train.py"], "python -c pass"):
        with pytest.raises(AssertionError, match="move the test to tests/multirank/"):
            subprocess.run(command, shell=isinstance(command, str))
    assert subprocess.run(["true"]).returncode == 0


# -- sizes: they drift where nothing checks them -------------------------------------------------------------------
MAX_FILE_LINES = 450  # split a file along its responsibilities well before this (the aim is ~400)
MAX_FUNCTION_LINES = 60
MAX_PACKAGE_SHARE = 0.2  # of all of visiondist's lines, subpackages included


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_file_is_over_the_size_limit():
    big = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := _lines(p)) > MAX_FILE_LINES}
    assert not big, f"files over {MAX_FILE_LINES} lines, split along their responsibilities: {big}"


def test_no_function_is_over_the_size_limit():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_package_holds_more_than_a_fifth_of_the_code():
    sizes: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        key = parts[0] if len(parts) > 1 else path.name
        sizes[key] = sizes.get(key, 0) + _lines(path)
    total = sum(sizes.values())
    over = {k: f"{v / total:.1%}" for k, v in sizes.items() if v > MAX_PACKAGE_SHARE * total}
    assert not over, f"packages over {MAX_PACKAGE_SHARE:.0%} of {total} lines: give a question its own package: {over}"


def test_every_package_says_its_job():
    """Each package's __init__.py starts with a docstring: what question it answers (and, for the engine's rooms,
    what it may import)."""
    silent = [str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")
              if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not silent, f"packages without a docstring: {silent}"


def test_the_hooks_import_the_trainer_for_its_type_only():
    """train/hooks.py and train/trainer.py would import each other; the hooks' side stays under TYPE_CHECKING."""
    tree = ast.parse((PACKAGE / "train" / "hooks.py").read_text())
    guarded = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) ==
               "TYPE_CHECKING" for n in ast.walk(block)}
    runtime = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "visiondist.train.trainer"
               and id(n) not in guarded]
    assert not runtime, f"train/hooks.py imports the trainer at run time (lines {runtime})"
