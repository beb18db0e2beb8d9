"""The console and the run's log file: rank 0's log lines (through rich in a terminal, plain lines
into a pipe) and `train.log` / `eval.log` / `benchmark.log` in the run dir, and the paths and
commands the run prints for people."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Iterator, Optional

from rich import get_console
from rich.logging import RichHandler

import visiondist
from visiondist.utils.logs import said_before
from visiondist.utils.procenv import environment_kept

log = logging.getLogger(__name__)

# the run dir's log: train.log, or eval.log / benchmark.log for those jobs (setup_logging)
LOG_FILE = "train.log"
# set while the Python API runs a job (its ranks inherit it): what to run next is said as the
# returned `Run`'s methods, not as command lines
FROM_PYTHON_ENV = "VISIONDIST_FROM_PYTHON"


@contextlib.contextmanager
def said_to_python() -> Iterator[None]:
    """The job in the block was started from Python (`visiondist.train`)."""
    with environment_kept([FROM_PYTHON_ENV]):
        os.environ[FROM_PYTHON_ENV] = "1"
        yield


def from_python() -> bool:
    return os.environ.get(FROM_PYTHON_ENV) == "1"


class _Stdout(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is at the time, as rich's console does (a library's chatter
    that a caller silences with `contextlib.redirect_stdout` stays silenced)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Plain(logging.Formatter):
    """A message per line; warnings and errors say so, as the tools' own lines do (`warning: `,
    `error: `)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


def in_terminal() -> bool:
    """Whether rank 0's console is a terminal (rich's console, which the log lines and the progress
    bars share)."""
    return get_console().is_terminal


def setup_logging(run_dir: Path, is_main: bool, log_file: str = "train.log") -> None:
    """Rank 0 logs INFO to the console (in a terminal through rich, so progress bars stay intact;
    otherwise plain lines) and to `log_file` in the run dir (train.log; eval.log, benchmark.log for
    those jobs). A record logged with `extra={"file_only": True}` (what the console printed before
    the run dir existed) goes to the file alone: the job's lines said before launch
    (`utils.logs.say`) open the file so."""
    global LOG_FILE
    LOG_FILE = log_file

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if not is_main:
        # Ray's driver reads this module (runs.completed_step) before, and without, torch
        import torch.distributed as dist  # noqa: PLC0415 (torch: 1.2 s)

        rank = dist.get_rank() if dist.is_initialized() else "?"
        logging.basicConfig(
            level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
        )
        return
    # rich's columns; into a pipe or a file, plain lines that do not wrap at 80 columns
    console: logging.Handler
    if in_terminal():
        console = RichHandler(show_path=False, show_time=False, markup=False, rich_tracebacks=False)
        console.setFormatter(logging.Formatter("%(message)s"))
    else:
        console = _Stdout()
        console.setFormatter(_Plain("%(message)s"))
    console.addFilter(lambda record: not getattr(record, "file_only", False))
    file = logging.FileHandler(run_dir / log_file)
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(console)
    root.addHandler(file)
    root.setLevel(logging.INFO)
    before = logging.getLogger("visiondist.before_launch")
    for level, line in said_before():
        before.log(level, line, extra={"file_only": True})


def next_commands(
    run_dir: Path,
    family: str = "",
    images: Optional[Path] = None,
    longer: str = "",
    under_torchrun: bool = False,
) -> str:
    """Where a training run is, and what to run on it next, in the tools' key=value convention (the
    export formats the model `family` has; `images`: a folder of the run's own val images, which the
    predict line names as its example source; `longer`: the length setting that trains it on, e.g.
    `trainer.max_epochs=20`; `under_torchrun`: torchrun, srun or a pod started the ranks, and the
    same command trains it on)."""
    if from_python() and not under_torchrun:
        return _next_in_python(run_dir, family, images, longer)
    run = shlex.quote(shown_path(run_dir))
    formats = _formats(family)
    source = (
        f"source={shlex.quote(shown_path(images))}   (or any image, folder, glob, .txt list or "
        "video)"
        if images is not None
        else "source=<images, folder, glob, list or video>"
    )
    launcher = (
        continue_command(run_dir, under_torchrun=True)
        if under_torchrun
        else f"python {tool_path('train')} trainer.run_dir={run}"
    )
    # the latest attempt's other changes (a layout, a setting): the run goes on as that attempt ran
    again = "" if under_torchrun else latest_overrides(run_dir, length=False)
    train_on = (
        f"  train on: {launcher}{again} {longer}   (from its newest checkpoint, "
        f"{'as its last attempt ran' if again else 'its config as it was'})\n"
        if longer
        else ""
    )
    return (
        f"run dir: {run}\n"
        f"{train_on}"
        f"  evaluate: python {tool_path('eval')} run_dir={run}\n"
        f"  predict:  python {tool_path('predict')} run_dir={run} {source}\n"
        f"  export:   python {tool_path('export')} run_dir={run}   (safetensors; {formats}; "
        "format=onnx half=true or int8=true: float16 or int8, the accuracy it costs printed)"
    )


def _formats(family: str) -> str:
    return (
        "format=hf: transformers' from_pretrained directory; format=onnx or openvino"
        if family == "detr"
        else "format=naflex: timm's NaFlexVit, images at their own shapes; format=onnx"
        if family == "native"
        else "format=onnx or openvino"
        if family == "vitdet"
        else "format=onnx, openvino or torchscript"
        if family == "torchvision"
        else "format=onnx, openvino, pt2 or hf"
    )


def _next_in_python(run_dir: Path, family: str, images: Optional[Path], longer: str) -> str:
    """`next_commands` for a run started from Python: the methods of the `Run` it returned."""
    words = [*latest_words(run_dir, length=False), *([longer] if longer else [])]
    more = ", ".join(map(repr, words))
    source = repr(shown_path(images)) if images is not None else '"<images, folder, glob, list>"'
    # run.export's format argument: "onnx", "openvino", ...
    formats = re.sub(
        r"\b(onnx|openvino|pt2|torchscript|hf|naflex)\b", r'"\1"', _formats(family)
    ).replace("format=", "")
    return (
        f"run dir: {shown_path(run_dir)}   (the Run visiondist.train returned; later: "
        f"run = visiondist.Run({str(run_dir)!r}))\n"
        + (f"  train on: run.resume({more})   (from its newest checkpoint)\n" if longer else "")
        + "  evaluate: run.evaluate()\n"
        f"  predict:  run.predict({source})   (a Result per image)\n"
        f'  export:   run.export()   (safetensors; {formats}; "onnx", half=True or int8=True: '
        "float16 or int8, the accuracy it costs printed)"
    )


def continue_command(run_dir: str | Path, under_torchrun: bool = False) -> str:
    """The one command that continues the run in `run_dir`: its config.yaml is the base, so nothing
    else is repeated but what the latest attempt changed (`attempts.jsonl`: its length, its layout,
    any other setting), so that the continuation runs and ends as that attempt would have. From
    Python (`from_python`): the `Run`'s `resume` with those changes."""
    if from_python() and not under_torchrun:
        again = ", ".join(map(repr, latest_words(Path(run_dir))))
        return f"visiondist.Run({str(run_dir)!r}).resume({again})"
    if under_torchrun:
        return (
            "the same torchrun / srun / pod command with "
            f"trainer.run_dir={shlex.quote(str(run_dir))}"
        )
    return (
        f"python {tool_path('train')} "
        f"trainer.run_dir={shlex.quote(shown_path(Path(run_dir)))}"
        f"{latest_overrides(Path(run_dir))}"
    )


LENGTH_KEYS = ("trainer.max_steps", "trainer.max_epochs")


def latest_changes(run_dir: Path) -> dict:
    """What the run's latest attempt changed against config.yaml (each line of attempts.jsonl holds
    that attempt's changes); empty for a run of one attempt."""
    try:
        lines = (run_dir / "attempts.jsonl").read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            changes = json.loads(line).get("changes", {})
        except ValueError:  # a line cut short by a kill
            continue
        return changes if isinstance(changes, dict) else {}
    return {}


def latest_length(run_dir: Path) -> dict:
    """trainer.max_steps / trainer.max_epochs as the run's latest attempt changed them; empty where
    it changed neither."""
    changes = latest_changes(run_dir)
    return {k: changes[k] for k in LENGTH_KEYS if k in changes}


def latest_overrides(run_dir: Path, length: bool = True) -> str:
    """The latest attempt's changes as the command line's key=value overrides (" k=v ...", each
    applied to config.yaml as that attempt's was: its layout, its length unless not `length`, any
    other setting)."""
    return "".join(f" {shlex.quote(w)}" for w in latest_words(run_dir, length))


def latest_words(run_dir: Path, length: bool = True) -> list[str]:
    """`latest_overrides`' key=value words, unquoted (a Python call's arguments)."""
    changes = latest_changes(run_dir)
    return [
        f"{k}={_typed(v)}" for k, v in sorted(changes.items()) if length or k not in LENGTH_KEYS
    ]


def _typed(value) -> str:
    """A value as Hydra reads it back: true / false, null, [a,b]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # as typed: checkpoint_every_min=0
    return str(value)


def tool_path(name: str) -> str:
    """`tools/<name>.py` as the user can type it from where they are (relative inside the working
    directory, else absolute); `tools/<name>.py` when the package was installed without its
    tools."""
    path = Path(visiondist.__file__).resolve().parents[1] / "tools" / f"{name}.py"
    return shlex.quote(shown_path(path)) if path.is_file() else f"tools/{name}.py"


def shown_path(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (what a user types), else as it
    is."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
