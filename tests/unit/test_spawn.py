"""What the elastic launcher's report of a failed job says (`visiondist.launch.spawn`)."""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from visiondist.launch.spawn import _every_report


def _report(monkeypatch, error_file, exc: BaseException) -> None:
    """What `@record` writes for a rank that raised `exc` (torch's own error handler)."""
    os.makedirs(os.path.dirname(error_file), exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise exc
    except type(exc) as raised:
        ErrorHandler().record_exception(raised)


def test_the_failing_rank_is_reported_when_the_agent_saw_its_peer_end_first(tmp_path, monkeypatch):
    # The agent reports the first rank it sees end: here rank 2 (of node ranks 2..4), which only
    # lost its connection to rank 3, the rank that raised. Rank 3's own report lies in the same
    # attempt's directory.
    attempt = tmp_path / "run_x" / "attempt_0"
    _report(monkeypatch, attempt / "0" / "error.json", RuntimeError("Connection closed by peer"))
    _report(monkeypatch, attempt / "1" / "error.json", ValueError("injected failure on rank 3"))
    (attempt / "2").mkdir()  # rank 4: still waiting, ended by the agent without a report
    seen = ProcessFailure(
        local_rank=0, pid=123, exitcode=1, error_file=str(attempt / "0" / "error.json")
    )
    exc = ChildFailedError("fn", {2: seen})

    every = _every_report(exc)

    assert sorted(every.failures) == [2, 3]
    assert every.failures[2] is seen
    assert "injected failure on rank 3" in every.failures[3].message["message"]
    assert "Traceback" in every.failures[3].message["extraInfo"]["py_callstack"]
    assert "injected failure on rank 3" in str(every)


def test_a_report_without_error_files_is_left_as_it_is(tmp_path):
    exc = ChildFailedError(
        "fn", {0: ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file=os.devnull)}
    )
    assert _every_report(exc) is exc
