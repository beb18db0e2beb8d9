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


def test_under_torchrun_a_rank_that_lost_its_peer_says_the_cause_is_the_peers(
    tmp_path, monkeypatch
):
    """A rank of a torchrun job whose peer on another node was killed fails on the lost
    connection: its line says the cause is the rank that ended first and where that rank's record
    is, and names the ranks' own command to continue from the last checkpoint."""
    import pytest

    from visiondist.launch import RunFailed
    from visiondist.launch.failed import one_line_failure
    from visiondist.utils.signals import RUN_DIR_ENV

    step = tmp_path / "checkpoints" / "step_10"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "trainer_state.json").write_text("{}")
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    lost = RuntimeError("[gloo] Connection reset by peer")
    # the rank's line, as its failure record made it (`launch.failed.record_rank_failure`)
    line = f"rank 1 failed at step 14 (training): {failures.one_line(lost)}"
    lost.visiondist_line = line  # type: ignore[attr-defined]
    with pytest.raises(RunFailed) as failed, one_line_failure(None):
        raise lost
    assert str(failed.value) == (
        "rank 1 failed at step 14 (training): RuntimeError: [gloo] Connection reset by peer; this "
        "rank lost its connection to a rank that ended first: that rank's own output (its "
        f"node's, under torchrun) says why, and {tmp_path}/failure/ holds what it recorded; once "
        "fixed, continue from step 10 with: the same torchrun / srun / pod command with "
        f"trainer.run_dir={tmp_path}"
    )
