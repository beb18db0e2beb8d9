"""Imports go down only. Every `visiondist` import (at module level or inside a function) must point
to a lower layer of the table below, or stay inside its own package: a back-edge fails here, naming
both ends."""

import ast
import io
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "visiondist"

# lowest first; a package may import only from the layers before its own
LAYERS = [
    {"compat", "utils"},  # torch feature detection; signals and DCP metadata shared by every layer
    {"config"},  # the schema, validation, RunLayout: no torch
    {"parallel"},  # generic, at run time: mesh, TP styles, pipeline runtime, FSDP; never the models
    {"models"},  # models and what they declare to parallel (TP plan, blocks)
    # the layout, decided before ranks start (memory and time models, planner); loaders
    {"plan", "data"},
    # the built-in data sets, written in the real ones' formats (COCO's mask encoding from data)
    {"synthetic"},
    # input checks; what is saved and exported; what people see (reads only)
    {"preflight", "checkpoint", "observe"},
    # a failing rank's record (into the run's log); scoring (with progress bars)
    {"faults", "evaluation"},
    {"engine"},  # the loop and every part it is built from: reads checkpoints, shows, fails, scores
    # times the trainer's own step beside plain loops; a trained model's answers for new images
    {"bench", "inference"},
    # the dry run: the training code stepped on a fake group, with the benchmark's synthetic batches
    {"verify"},
    {"runs"},  # continuing a run
    {"launch"},  # run dir, self-launch, ranks
    {"cli"},  # the tools' command line and multirun sweeps
    {"api"},  # the Python API: the tools' jobs, `Run`, predict's results, a user's callbacks
    {"ray"},  # Ray Train's entry: a tool's config loading and the launcher, inside Ray's workers
]


# rooms that promise less than their layer allows (their docstrings say so): what each may import,
# at most
NARROWER = {
    "observe": {"compat", "utils", "config"},  # shows what others measured; measures nothing itself
    "faults": {"compat", "utils", "observe"},  # the failure line goes into the run's log
    # never the trainer or checkpoints
    "evaluation": {"compat", "utils", "data", "parallel", "models", "observe"},
    # never the trainer or observe
    "checkpoint": {"compat", "utils", "config", "parallel", "models", "plan", "data"},
}


def layer_of(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)


def imported(source: str) -> set[str]:
    """The `visiondist` modules a source imports, anywhere in it (function-level imports
    included)."""
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
    """{(importer package, imported package): [importing module -> imported module, ...]} for every
    import that does not go down. `modules`: module name -> source."""
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
    assert packages == listed, (
        f"not in LAYERS: {sorted(packages - listed)}; gone: {sorted(listed - packages)}"
    )


def test_imports_go_down_only():
    found = back_edges(_modules())
    assert not found, "imports that go up or sideways:\n" + "\n".join(
        w for ws in found.values() for w in ws
    )


def test_rooms_import_only_what_they_promise():
    found = []
    for name, source in _modules().items():
        here = package_of(name)
        for target in imported(source):
            there = package_of(target)
            if here in NARROWER and there and there != here and there not in NARROWER[here]:
                found.append(
                    f"{name} -> {target} ({here} may import only {sorted(NARROWER[here])})"
                )
    assert not found, "\n".join(found)


def test_a_back_edge_inside_a_function_is_caught():
    sources = {
        "visiondist.data.loader": "import os\n\ndef f():\n    from visiondist.engine.trainer "
        "import Trainer\n",
        "visiondist.engine.trainer": "from visiondist.data import loader\n",
        "visiondist.config": "import visiondist.parallel.mesh\n",
    }
    assert back_edges(sources) == {
        ("data", "engine"): ["visiondist.data.loader -> visiondist.engine.trainer"],
        ("config", "parallel"): ["visiondist.config -> visiondist.parallel.mesh"],
    }


SCRIPT_FOLDERS = ("tools", "benchmarks", "benchmarks/gpu")  # each on sys.path when its scripts run


def _tree_modules() -> dict[str, str]:
    """Every module of the package (dotted names) and every script (`tools/train`, ...)."""
    scripts = {
        f"{folder}/{path.stem}": path.read_text()
        for folder in SCRIPT_FOLDERS
        for path in sorted((PACKAGE.parent / folder).glob("*.py"))
    }
    return {**_modules(), **scripts}


def imports_among(name: str, source: str, known: set[str]) -> set[str]:
    """The modules of `known` that `source` (of module `name`) imports, anywhere in it: type-only
    imports too (a reader follows them as well). A package's modules by their dotted names (an
    import of the package itself is one of its `__init__`, its face); a script's neighbours by their
    bare names, as its folder is on sys.path."""
    raw = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            raw.add(node.module)
            raw.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            raw.update(alias.name for alias in node.names)
    folder = name.rpartition("/")[0]
    found = set()
    for target in raw:
        neighbour = f"{folder}/{target.split('.')[0]}"
        if folder and neighbour in known:
            found.add(neighbour)
            continue
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != name:
            found.add(target)
    return found


def module_cycles(modules: dict[str, str]) -> list[list[str]]:
    """The cycles of imports between `modules` (name -> source), each as its modules in order."""
    known = set(modules)
    graph = {name: imports_among(name, source, known) for name, source in modules.items()}
    cycles, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt) :]
                if frozenset(cycle) not in done:
                    done.add(frozenset(cycle))
                    cycles.append(cycle)
            elif len(path) < len(graph) + 1:
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def test_no_import_circle_anywhere_in_the_tree():
    """Modules that import each other work only in the import order that happens to run first (the
    layer test looks at packages and cannot see a circle inside one), and a reader cannot start
    anywhere in them: a module below the others breaks it. Type-only imports count, as do the
    scripts of tools/ and benchmarks/."""
    cycles = module_cycles(_tree_modules())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles)


def test_a_circle_through_a_function_level_or_type_only_import_is_caught():
    sources = {
        "visiondist.data.augment_ops": "def f():\n    from visiondist.data.transforms import "
        "to_device\n",
        "visiondist.data.transforms": "from visiondist.data.device_decode import EncodedBatch\n",
        "visiondist.data.device_decode": "from visiondist.data.augment_ops import host_to\n",
        "visiondist.engine.hooks": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from visiondist.engine.trainer import Trainer\n",
        "visiondist.engine.trainer": "from visiondist.engine.hooks import default_hooks\n",
        "benchmarks/a": "from b import SIZE\n",
        "benchmarks/b": "def f():\n    from a import rate\n",
    }
    assert module_cycles(sources) == [
        ["benchmarks/a", "benchmarks/b"],
        [
            "visiondist.data.augment_ops",
            "visiondist.data.transforms",
            "visiondist.data.device_decode",
        ],
        ["visiondist.engine.hooks", "visiondist.engine.trainer"],
    ]


def test_a_unit_test_cannot_start_a_process():
    """tests/unit/conftest.py keeps this directory to one process: a command line run fails the test
    at once; a system tool a library runs for itself (matplotlib's first font scan runs `fc-list`)
    does not."""
    import subprocess
    import sys

    for command in (
        [sys.executable, "tools/train.py"],
        ["torchrun", "tools/train.py"],
        "python -c pass",
    ):
        with pytest.raises(AssertionError, match="move the test to tests/multirank/"):
            subprocess.run(command, shell=isinstance(command, str))
    assert subprocess.run(["true"]).returncode == 0


# -- sizes: they drift where nothing checks them ---------------------------------------------------
# Counted in statements (logical lines, as Python's tokenizer ends them), not in physical lines: the
# formatter spreads a call over one line per argument where it does not fit in 100 columns, which
# says nothing of how much a reader must hold. A file of 300 statements was about 420 lines at 120
# columns.
MAX_FILE_STATEMENTS = 300  # split a file along its responsibilities well before this
MAX_FUNCTION_STATEMENTS = 50
MAX_PACKAGE_SHARE = 0.2  # of all of visiondist's statements, subpackages included
MAX_FACE_STATEMENTS = 30  # a package's __init__ is its face: its docstring, the names it hands on


def _statement_rows(source: str) -> list[int]:
    """The row each statement of `source` ends on (docstrings included, comments not)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.start[0] for t in tokens if t.type == tokenize.NEWLINE]


def _statements(path: Path) -> int:
    return len(_statement_rows(path.read_text()))


def test_statements_are_counted_whatever_the_line_breaks():
    dense = "def f(a, b):\n    return g(a, b, c=1)\n"
    spread = (
        "def f(\n    a,\n    b,\n):\n    return g(\n        a,\n        b,\n        c=1,\n    )\n"
    )
    assert len(_statement_rows(dense)) == len(_statement_rows(spread)) == 2


def test_every_package_init_is_a_face():
    """Opening a package's folder shows its job as a module named for it; `__init__.py` says what
    the package is and hands names on (a dispatch table at most), it does not hold the logic (cli's
    was 372 lines, launch's 362)."""
    big = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("__init__.py")
        if (n := _statements(p)) > MAX_FACE_STATEMENTS
    }
    assert not big, (
        f"__init__.py files over {MAX_FACE_STATEMENTS} statements: move the logic to a module "
        f"named for its job: {big}"
    )


def test_no_file_is_over_the_size_limit():
    big = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := _statements(p)) > MAX_FILE_STATEMENTS
    }
    assert not big, (
        f"files over {MAX_FILE_STATEMENTS} statements, split along their responsibilities: {big}"
    )


def test_no_function_is_over_the_size_limit():
    long = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        rows = _statement_rows(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = sum(1 for row in rows if node.lineno <= row <= node.end_lineno)
                if n > MAX_FUNCTION_STATEMENTS:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({n})")
    assert not long, f"functions over {MAX_FUNCTION_STATEMENTS} statements: {long}"


def test_no_package_holds_more_than_a_fifth_of_the_code():
    sizes: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        key = parts[0] if len(parts) > 1 else path.name
        sizes[key] = sizes.get(key, 0) + _statements(path)
    total = sum(sizes.values())
    over = {k: f"{v / total:.1%}" for k, v in sizes.items() if v > MAX_PACKAGE_SHARE * total}
    assert not over, (
        f"packages over {MAX_PACKAGE_SHARE:.0%} of {total} statements: give a question its own "
        f"package: {over}"
    )


def test_every_package_says_its_job():
    """Each package's __init__.py starts with a docstring: what question it answers (and, for the
    engine's rooms, what it may import)."""
    silent = [
        str(p.parent.relative_to(PACKAGE))
        for p in PACKAGE.rglob("__init__.py")
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not silent, f"packages without a docstring: {silent}"


def test_the_training_loop_names_no_hook():
    """train/trainer.py is the loop and the hooks' interface; the layer above (train/run.py) builds
    the hooks and hands them in (detectron2's shape): the loop imports nothing of train/hooks/, so
    it can be built and tested with any hooks, and the hooks can import the loop without a
    circle."""
    found = sorted(
        m
        for m in imported((PACKAGE / "engine" / "trainer.py").read_text())
        if m.startswith("visiondist.engine.hooks")
    )
    assert not found, f"train/trainer.py imports {found}"


def _state_writes(source: str, names: set[str]) -> list[tuple[str, str, int]]:
    """(class, field, line) of each assignment to `<...>state.<field>` inside a class."""
    found = []
    for cls in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in names:
                    holder = ast.unparse(target.value)
                    if holder == "state" or holder.endswith(".state"):
                        found.append((cls.name, target.attr, node.lineno))
    return found


def test_each_field_of_the_loop_state_is_written_by_its_owner_alone():
    """`LoopState`'s fields each name the one class that writes them (the hooks and the parts read
    the others'): every assignment to a field, in the training code and the benchmark, stands in
    its owner's class."""
    from dataclasses import fields

    from visiondist.engine.state import LoopState

    names = {f.name for f in fields(LoopState)}
    wrong = [
        f"{path.name}:{line} {cls} writes {name} (owner: {LoopState.owners(name)})"
        for folder in ("engine", "bench")
        for path in (PACKAGE / folder).rglob("*.py")
        for cls, name, line in _state_writes(path.read_text(), names)
        if cls not in LoopState.owners(name)
    ]
    assert not wrong, "\n".join(wrong)


def test_a_write_by_another_than_the_owner_is_caught(tmp_path, monkeypatch):
    """The check above on a hook that writes the log line's field."""
    source = (
        "class StrayHook:\n    def after_step(self, trainer):\n"
        "        trainer.state.final_loss = 0.0\n"
    )
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "stray.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    with pytest.raises(AssertionError, match="StrayHook writes final_loss"):
        test_each_field_of_the_loop_state_is_written_by_its_owner_alone()
