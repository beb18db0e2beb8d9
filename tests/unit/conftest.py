"""Unit tests start no process of the project's: a command line run (Python, torchrun, srun) or a
rank launch here fails the test, naming where it belongs (tests/multirank/). Loader worker processes
are part of a unit (a DataLoader) and stay allowed, as do the system tools a library asks once
(matplotlib's first font scan runs `fc-list`)."""

import os
import subprocess

import pytest
import torch.multiprocessing

LAUNCHERS = ("python", "torchrun", "srun")


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test started {what}: move the test to tests/multirank/")

    return refuse


def _program(args, kwargs) -> str:
    command = args[0] if args else kwargs.get("args", "")
    if isinstance(command, (str, bytes, os.PathLike)):
        command = os.fsdecode(command).split()[:1] if kwargs.get("shell") else [command]
    return os.path.basename(os.fsdecode(list(command)[0])) if command else ""


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    popen = subprocess.Popen.__init__

    def guarded(self, *args, **kwargs):
        program = _program(args, kwargs)
        if program.startswith(LAUNCHERS):
            _refuse(f"a process ({program}, subprocess.Popen)")()
        popen(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    monkeypatch.setattr(
        torch.multiprocessing, "start_processes", _refuse("ranks (torch.multiprocessing)")
    )
    yield
