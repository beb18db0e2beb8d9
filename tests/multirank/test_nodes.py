"""Losing a node, and a node's preemption, through the launchers a cluster runs: two "nodes" on this
machine, each one agent (torchrun) or one pod's `python tools/train.py` (visiondist/launch/pods.py),
one rank each, gloo.

- Node loss: under torchrun with elastic membership (--nnodes=1:2 --max-restarts=1), the second
  node's agent and its rank are killed mid-run; the first node's agent restarts its rank, the
  rendezvous closes with one node (after the rendezvous' last call for more nodes: 2 s here, 30 s by
  default), and the run goes on from its last checkpoint on one rank, ending with the losses of a
  run that changed world size at that step.
- Preemption: SIGTERM to one pod's launcher during a step longer than torchrun's 30 s shutdown wait;
  every rank of both pods finishes the step and writes its checkpoint, both pods end with the stop's
  exit code, and the same pod commands continue the run to the uninterrupted run's losses.

Steps are slowed by tests/multirank/fault_train.py (`slow_step:n`), set on one node only where only
that node needs it: a peer waits for it in the step's collective anyway.
"""

import os
import signal
import socket
import sys
import time

import pytest
from helpers import REPO, finish_job, job_env, losses_of, start_job, train_args, train_ok, wait_for

from visiondist.utils.dcp import list_checkpoints

# not in the "faults" group that runs the timed fault tests one after another: these assert no tight
# timing (the preemption's window is the 40 s step's, with 40 s to spare), so they need not wait for
# that group's worker

FAULT_TRAIN = REPO / "tests" / "multirank" / "fault_train.py"
RUN = [
    "model.num_heads=2",
    "trainer.max_steps=8",
    "trainer.max_epochs=1000",
    "trainer.eval_every=1000",
    "trainer.checkpoint_every=4",
]


def _kill_node(pid: int) -> None:
    """SIGKILL an agent and every process under it (its ranks run in sessions of their own): a node
    gone."""
    from pathlib import Path

    tree, found = {pid}, True
    while found:
        found = False
        for entry in Path("/proc").iterdir():
            try:
                ppid = (
                    int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    if entry.name.isdigit()
                    else 0
                )
            except (OSError, IndexError, ValueError):
                continue
            if ppid in tree and int(entry.name) not in tree:
                tree.add(int(entry.name))
                found = True
    for each in tree:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def changed_world(tmp_path_factory, tiny_shapes):
    """The reference: 2 ranks to step 4, then 1 rank from its checkpoint to step 8."""
    run = tmp_path_factory.mktemp("nodes") / "changed"
    train_ok(*train_args(tiny_shapes, run, *RUN, "trainer.devices=2", "trainer.stop_at_step=4"))
    train_ok(*train_args(tiny_shapes, run, *RUN, "trainer.devices=1"))
    return run


def test_a_lost_node_leaves_the_job_to_the_other_from_the_last_checkpoint(
    tmp_path, tiny_shapes, changed_world
):
    run, port = tmp_path / "run", _port()

    def agent(host: bool) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=lose-a-node",
            f"--rdzv-conf=is_host={int(host)},last_call_timeout=2",
            "--max-restarts=1",
            str(FAULT_TRAIN),
            *train_args(tiny_shapes, run, *RUN),
        ]

    first = start_job(agent(True), job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    time.sleep(2.0)  # the first agent hosts the rendezvous; the node lost is the second
    second = start_job(
        agent(False),
        job_env(
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            VISIONDIST_FAULT="slow_step:5",
            VISIONDIST_SLOW_S="60",
        ),
    )
    try:
        wait_for(
            lambda: (
                any(step == 4 for step, _ in list_checkpoints(run))
                and (run / "metrics.csv").exists()
                and max(losses_of(run), default=0) >= 4
            ),
            first,
            240,
            "step 4's checkpoint",
        )
        time.sleep(1.0)  # into step 5, which the second node makes last a minute
        _kill_node(second.pid)  # the node is gone: its agent and its rank
        finish_job(second, 30, "the lost node")
        out = finish_job(first, 300, "the remaining node")
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert first.returncode == 0, out[-4000:]
    log = (run / "train.log").read_text()
    assert "resumed from" in log and "step 4" in log.split("resumed from")[-1].splitlines()[0], log[
        -3000:
    ]
    assert sorted(losses_of(run)) == list(range(1, 9))
    assert losses_of(run) == pytest.approx(losses_of(changed_world), rel=1e-5)


def test_sigterm_to_one_pod_checkpoints_every_rank_of_every_pod(tmp_path, tiny_shapes):
    """Step 4 lasts 40 s more (longer than torchrun's 30 s wait before SIGKILL); SIGTERM to the
    second pod's launcher 1 s into it, as Kubernetes sends a pod on a reclaimed spot node. The
    signalled pod's ranks know at once, the other pod's at the next exchange of the step flags,
    which travel with a step's collectives (step 4's were sent before the signal): every rank stops
    after step 5, checkpointed."""
    run, port = tmp_path / "run", _port()
    pods = [
        {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(pod),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
            "VISIONDIST_FAULT": "slow_step:4",
            "VISIONDIST_SLOW_S": "40",
        }
        for pod in (0, 1)
    ]
    command = [
        sys.executable,
        str(FAULT_TRAIN),
        *train_args(tiny_shapes, run, *RUN, "trainer.max_steps=6"),
    ]
    procs = [start_job(command, job_env(**env)) for env in pods]
    try:
        wait_for(
            lambda: len(losses_of(run)) >= 3 if (run / "metrics.csv").exists() else False,
            procs[0],
            240,
            "step 3",
        )
        time.sleep(1.0)
        sent = time.time()
        os.kill(procs[1].pid, signal.SIGTERM)
        outs = [finish_job(proc, 240, f"pod {i}") for i, proc in enumerate(procs)]
        waited = time.time() - sent
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [143, 143], "\n----\n".join(o[-2000:] for o in outs)
    ((step, path),) = list_checkpoints(run)[-1:]
    assert step == 5 and (path / ".metadata").is_file()
    # past torchrun's wait: the steps and the save, nothing more
    assert 30 < waited < 39 + 40, waited
    for out in outs:
        assert (
            "stopped by SIGTERM after step 5 with a checkpoint; continue with: the same torchrun "
            "/ srun / pod command" in out
        ), out[-2000:]

    # the pods restarted with the same commands continue the run; it ends as one never stopped
    port = _port()
    procs = [
        start_job(command, job_env(**{**env, "PET_MASTER_PORT": str(port), "VISIONDIST_FAULT": ""}))
        for env in pods
    ]
    outs = [finish_job(proc, 240, f"pod {i}, continued") for i, proc in enumerate(procs)]
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-2000:] for o in outs)
    assert f"resumed from {path}: step 5" in (run / "train.log").read_text()
    reference = tmp_path / "reference"
    train_ok(*train_args(tiny_shapes, reference, *RUN, "trainer.max_steps=6", "trainer.devices=2"))
    assert losses_of(run) == pytest.approx(losses_of(reference), rel=1e-5)
