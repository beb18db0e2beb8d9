"""Every command README.md, RELIABILITY.md and docs/*.md show runs as written: bash accepts it and
the tool accepts its arguments, so a page cannot drift from the command line.

Which text is a command:
- every line of a ```bash fence (`\\` continuations joined; comment-only lines skipped);
- a `$ ` prompt line in any fence (the lines after it, up to a blank line, are what it prints);
- an inline code span that starts with `python tools/`, `sbatch tools/` or `torchrun` (after
  `VAR=value` assignments), in a table row or in a sentence.

Placeholders (`<run>`, `<date>/<time>`, `<N>`): in a fence, after a prompt and in a table the
command is there to be copied, so it must run as written; bash reads `<date>` as a redirection, so a
placeholder there fails (write a concrete example such as `outputs/2026-11-21/21-10-24`, as the
tools' --help does). Only in a sentence is a span a template: each `<name>` is replaced by the value
in PLACEHOLDERS (a name missing there fails the test) and a `...` argument (more arguments of the
reader's own) is dropped before the checks.

Each command is checked in three steps:
1. `bash -n -c <command>`: no syntax bash would reject (an unquoted `range(0,3)`);
2. `shlex.split` splits it as bash does; a leading `VAR=value` is set in the environment, `$VAR` is
   left as is;
3. the tool's `main(argv + ["--cfg", "job"])` runs in this process, in a temporary working
   directory: the config is composed and validated (keys, types, layout; a missing `data.root` such
   as /data/imagenet is checked only when a run starts, not under --cfg) and printed, exit code 0; a
   sweep (-m) prints one config per job, as many jobs as its values make. eval.py / export.py under
   --cfg load the run's config.yaml (with eval.py's overrides) and pick the weights (`step=`,
   `weights=`) without reading data or weights. A `$ ` prompt whose next line is `error: ...` must
   exit 2 with exactly that line. `sbatch tools/slurm_train.sh ARGS` is checked as the script's own
   `python tools/train.py` line with ARGS; `torchrun OPTS tools/train.py ARGS` has OPTS parsed by
   torchrun's parser and ARGS checked as train.py's. Other programs (pip, pytest, torchvision's
   references) get step 1 only.
Paths a command reads before anything runs exist in the working directory as tiny stand-ins: the
`run_dir=` of eval.py / export.py (a run dir with the config.yaml of a default run, an empty
model.safetensors and the complete checkpoint `step=` names, `best.json` for step=best), a
`trainer.resume=<run>/checkpoints/step_<N>`, a `weights=` file and a relative local weights file
(`model.init_from=vit_base.safetensors`, the reader's own download; a timm or torchvision name is
checked as a name). Nothing is trained, evaluated or exported: --cfg exits after printing.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import REPO
from omegaconf import OmegaConf

CONFIGS = REPO / "configs"
PAGES = [REPO / "README.md", REPO / "RELIABILITY.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = "outputs/2026-11-21/21-10-24"  # the run dir the tools' --help examples name
PLACEHOLDERS = {
    "<run>": RUN,
    "<run dir>": RUN,
    "<date>": "2026-11-21",
    "<time>": "21-10-24",
    "<N>": "3",
    "<file>": f"{RUN}/model.safetensors",
    "<name>": "vit_b16_imagenet",
}
# a local file, or a library's name
WEIGHT_KEYS = ("model.init_from", "model.weights", "model.backbone_weights")
TOOL_START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:python tools/|sbatch tools/|torchrun\s)")


@dataclass
class DocCommand:
    page: str
    line: int
    kind: str  # "fence", "prompt", "table" or "sentence"
    text: str
    prints: list[str] = field(default_factory=list)  # a prompt's output, as the page shows it

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def extract(page: Path) -> list[DocCommand]:
    """The commands of one page (see the module's docstring)."""
    name, lines = str(page.relative_to(REPO)), page.read_text().splitlines()
    found, fence, fenced = [], None, set()
    i = 0
    while i < len(lines):
        opening = re.match(r"^\s*```(\S*)", lines[i])
        if opening or fence is not None:
            fenced.add(i)
        if opening:
            fence = None if fence is not None else opening.group(1)
            i += 1
            continue
        if fence is None:
            i += 1
            continue
        start = i
        text, i = _joined(lines, i)
        fenced.update(range(start, i))
        if text.lstrip().startswith("$ "):
            prints = []
            while (
                i < len(lines)
                and lines[i].strip()
                and not lines[i].lstrip().startswith(("$ ", "```"))
            ):
                prints.append(lines[i])
                fenced.add(i)
                i += 1
            found.append(DocCommand(name, start + 1, "prompt", text.lstrip()[2:], prints))
        elif (
            fence in ("bash", "sh", "shell") and text.strip() and not text.lstrip().startswith("#")
        ):
            found.append(DocCommand(name, start + 1, "fence", text.strip()))
    # inline spans: outside fences
    body = "\n".join("" if n in fenced else line for n, line in enumerate(lines))
    for span in re.finditer(r"`([^`]+)`", body):
        text = " ".join(span.group(1).split())
        if "\n\n" in span.group(1) or not TOOL_START.match(text) or "tools/" not in text:
            continue  # e.g. `torchrun --max-restarts`: an option named, not a command
        line = body.count("\n", 0, span.start())
        kind = "table" if lines[line].lstrip().startswith("|") else "sentence"
        found.append(DocCommand(name, line + 1, kind, text))
    return found


def _joined(lines: list[str], i: int) -> tuple[str, int]:
    """The logical line starting at `i` (backslash continuations joined), and the index after it."""
    parts = [lines[i]]
    while parts[-1].rstrip().endswith("\\") and i + 1 < len(lines):
        parts[-1] = parts[-1].rstrip()[:-1]
        i += 1
        parts.append(lines[i])
    return " ".join(p.strip() for p in parts), i + 1


COMMANDS = [c for page in PAGES for c in extract(page)]
IDS = [
    c.id + (f"#{n}" if n else "")
    for c, n in
    # two on one line: #1
    ((c, [d.id for d in COMMANDS[:k]].count(c.id)) for k, c in enumerate(COMMANDS))
]


def test_the_pages_commands_are_found():
    """The extraction itself, so that the check below cannot pass by finding nothing: every kind of
    place a command stands is read, continuations joined, each at its line."""
    kinds = {c.kind for c in COMMANDS}
    assert kinds == {"fence", "prompt", "table", "sentence"}, kinds
    tools = {c.text for c in COMMANDS if TOOL_START.match(c.text)}
    assert len(tools) >= 40, len(tools)
    for tool in ("train", "eval", "export", "predict", "plan", "benchmark", "slurm_train"):
        assert any(f"tools/{tool}." in t for t in tools), tool
    assert all(c.prints for c in COMMANDS if c.kind == "prompt")  # each prompt with what it prints
    multi = [c for c in COMMANDS if c.page == "docs/memory-planning.md" and "vit_22b" in c.text]
    # 2 lines
    assert len(multi) == 1 and "parallel.nodes=8 parallel.device_memory_gb=80" in multi[0].text, (
        multi
    )
    assert any(c.kind == "sentence" and "<" in c.text for c in COMMANDS)
    # an option named in a sentence
    assert not any(c.text.startswith("torchrun --max-restarts") for c in COMMANDS)
    for c in COMMANDS:
        page = (REPO / c.page).read_text().splitlines()
        # a span may wrap after its first word
        start = " ".join(" ".join(page[c.line - 1 : c.line + 1]).split())
        assert " ".join(c.text.split()[:2]) in start, (c.id, c.text)


def _filled(command: DocCommand) -> str:
    """The command as bash gets it: as written, or for a sentence's template with its placeholders
    filled in."""
    holes = re.findall(r"<[^<>]*>", command.text)
    if command.kind != "sentence":
        assert not holes, (
            f"{command.id}: {' '.join(holes)} in a command to copy: bash reads `<` as a "
            f"redirection; write a concrete example (e.g. {RUN}) or move the template into a "
            "sentence"
        )
        return command.text
    unknown = sorted(set(holes) - set(PLACEHOLDERS))
    assert not unknown, f"{command.id}: no value for {unknown}: add one to PLACEHOLDERS"
    text = command.text
    for hole, value in PLACEHOLDERS.items():
        text = text.replace(hole, value)
    return " ".join(t for t in text.split(" ") if t != "...")


_TOOLS: dict = {}


def _tool(name: str):
    if name not in _TOOLS:
        spec = importlib.util.spec_from_file_location(
            f"doc_tool_{name}", REPO / "tools" / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _TOOLS[name] = module
    return _TOOLS[name]


def _slurm_prefix() -> list[str]:
    """The arguments tools/slurm_train.sh puts before its own ("$@"), with its run dir filled in."""
    line = next(
        line
        for line in (REPO / "tools" / "slurm_train.sh").read_text().splitlines()
        if line.startswith("srun ") and "tools/train.py" in line
    )
    words = shlex.split(line.replace("${RUN_DIR}", "outputs/slurm/1"))
    return words[words.index("tools/train.py") + 1 : words.index("$@")]


def _tool_argv(words: list[str], where: str) -> tuple[str, list[str]] | None:
    """(tool name, its arguments) of a command split into words, or None for a program that is not a
    tool."""
    if words[:1] == ["python"] and len(words) > 1 and re.fullmatch(r"tools/\w+\.py", words[1]):
        return words[1][len("tools/") : -len(".py")], words[2:]
    if words[:2] == ["sbatch", "tools/slurm_train.sh"]:
        return "train", _slurm_prefix() + words[2:]
    if words[:1] == ["torchrun"]:
        from torch.distributed.run import get_args_parser

        try:
            args = get_args_parser().parse_args(words[1:])
        except SystemExit:
            raise AssertionError(f"{where}: torchrun does not take {' '.join(words[1:])}") from None
        if args.training_script != "tools/train.py":
            return None  # e.g. torchvision's reference script, quoted for comparison
        return "train", list(args.training_script_args)
    return None


def _stand_ins(tool: str, argv: list[str]) -> None:
    """The inputs the command names that are read before anything runs, as tiny stand-ins in the
    working dir."""
    from visiondist.utils.pretrained import is_named

    args = dict(a.split("=", 1) for a in argv if "=" in a)
    # data.native.* read a native run
    if tool in ("eval", "export", "predict") and "run_dir" in args:
        _fake_run(
            Path(args["run_dir"]),
            args.get("step"),
            any(key.startswith("data.native.") for key in args),
        )
    if "weights" in args:
        path = Path(args["weights"])
        if not path.exists():
            _fake_run(path.parent if path.parent.name else Path(RUN), None)
            path.touch()
    match = re.fullmatch(r"(.+)/checkpoints/step_(\d+)", args.get("trainer.resume", ""))
    if match:
        _fake_run(Path(match.group(1)), match.group(2))
    # the reader's own weights file, e.g. model.init_from=vit_base.safetensors
    for key in WEIGHT_KEYS:
        value = args.get(key)
        if value and not is_named(value) and not Path(value).is_absolute():
            Path(value).parent.mkdir(parents=True, exist_ok=True)
            Path(value).touch()


def _fake_run(run: Path, step: str | None, native: bool = False) -> None:
    """A run dir as far as the command line looks: a default run's config.yaml (`native`: with
    data.resolution=native), model.safetensors, a complete checkpoint of `step` (step=best: of step
    3, recorded as the best)."""
    from visiondist.checkpoint.files import BEST
    from visiondist.cli import load_config
    from visiondist.utils.dcp import METADATA, STATE_FILE

    run.mkdir(parents=True, exist_ok=True)
    if not (run / "config.yaml").exists():
        OmegaConf.save(
            load_config(
                CONFIGS,
                [f"trainer.run_dir={run}", *(["data.resolution=native"] if native else [])],
                inputs=None,
            ),
            run / "config.yaml",
            resolve=True,
        )
    (run / "model.safetensors").touch()
    if step is None:
        return
    number = "3" if step == "best" else step
    checkpoint = run / "checkpoints" / f"step_{number}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / METADATA).write_bytes(b"")
    (checkpoint / STATE_FILE).write_text("{}")
    if step == "best":
        (run / "checkpoints" / BEST).write_text(
            json.dumps({"metric": "val_top1", "mode": "max", "value": 0.5, "step": int(number)})
        )


def _jobs(argv: list[str]) -> int:
    """How many jobs a sweep's arguments make: the product of each swept value's count."""
    count = 1
    for arg in argv:
        value = arg.split("=", 1)[1] if "=" in arg else ""
        bounds = re.fullmatch(r"range\((\d+),\s*(\d+)\)", value)
        if bounds:
            count *= int(bounds.group(2)) - int(bounds.group(1))
        elif "," in value and not value.startswith(("[", "{", "'", '"')):
            count *= len(value.split(","))
    return count


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_each_documented_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    text = _filled(command)
    syntax = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{command.id}: bash rejects `{text}`: {syntax.stderr.strip()}"
    words = shlex.split(text, comments=True)
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # VAR=value python ...
        key, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(key, value)
    found = _tool_argv(words, command.id)
    if found is None:
        return
    tool, argv = found
    assert (REPO / "tools" / f"{tool}.py").is_file(), f"{command.id}: no tools/{tool}.py"
    monkeypatch.chdir(tmp_path)
    _stand_ins(tool, argv)
    capsys.readouterr()
    shows = "--cfg" in argv or "-c" in argv
    code = _tool(tool).main(argv if shows else [*argv, "--cfg", "job"])
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    shown = [line for line in command.prints if line.startswith("error:")]
    if shown:  # the page shows the command's error: exactly that, nothing run
        assert (code, errors) == (2, shown), (command.id, code, out.err)
        return
    assert code == 0 and not errors, f"{command.id}: `{text}` exits {code}: {out.err.strip()}"
    if "-m" in argv or "--multirun" in argv:
        assert out.out.count("# job ") == _jobs(argv), (command.id, out.out[:2000])
        return
    cfg = OmegaConf.create(out.out)
    assert {"model", "data", "trainer"} <= set(cfg.keys()), (command.id, out.out[:2000])
