"""A rank's failure record (`visiondist.faults.failures`): the first cause of an attempt wins, an
earlier attempt's record is replaced, and a complete run sets the records of what its restarts
recovered from aside, so that `failure/` holds only what ended a run."""

import os
import time

from visiondist.faults import failures


def test_records_of_an_attempt_a_restart_recovered_from_are_replaced_then_set_aside(tmp_path):
    earlier = failures.record_failure(tmp_path, 1, RuntimeError("the first attempt's"))
    record = tmp_path / "failure" / "rank1.txt"
    old = failures._STARTED - 60  # written by a process of an earlier attempt
    os.utime(record, (old, old))
    line = failures.record_failure(tmp_path, 1, ValueError("this attempt's"))
    assert line != earlier and record.read_text().startswith(line)
    # within one attempt the first cause wins
    failures.record_failure(tmp_path, 1, KeyError("a follow-on"))
    assert record.read_text().startswith(line)
    failures.record_failure(tmp_path, 0, OSError("rank 0's"))
    time.sleep(0.01)

    moved = failures.set_aside_recovered(tmp_path)
    assert [f.rank for f in moved] == [1, 0]  # earliest first
    assert not list((tmp_path / "failure").glob("rank*.txt"))
    assert sorted(p.name for p in (tmp_path / "failure" / "recovered").iterdir()) == [
        "rank0.txt",
        "rank1.txt",
    ]
    assert moved[0].file.read_text().startswith(line)
    assert failures.first_failure(tmp_path) is None
    assert failures.set_aside_recovered(tmp_path) == []
