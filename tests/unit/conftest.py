"""Unit tests start no process: a command line run or a rank launch here fails the test, naming where it belongs
(tests/multirank/). Loader worker processes are part of a unit (a DataLoader) and stay allowed."""

import subprocess

import pytest
import torch.multiprocessing


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test started {what}: move the test to tests/multirank/")

    return refuse


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a process (subprocess.Popen)"))
    monkeypatch.setattr(torch.multiprocessing, "start_processes", _refuse("ranks (torch.multiprocessing)"))
    yield
