"""What a Kubernetes job of `tools/k8s.py` does when a pod fails, is stopped or is misconfigured,
and what its checkpoints cost: the lines the tool prints beside the manifest
(`visiondist.launch.k8s` writes what they describe).

- on failure (a crash, a lost node, a pod killed): a TrainJob restarts every pod once all are gone,
  `restarts=` times; a PyTorchJob restarts the failed pod, and the others through their failed
  collectives, until its backoffLimit, which the Training Operator counts over every pod's
  container restarts (so the manifest sets `restarts` x the pods);
- on a stop (SIGTERM: a drained or preempted node; the ranks checkpoint their step and exit 143): a
  TrainJob restarts without using a restart, where the node leaves the pods their grace period; a
  spot reclaim with less notice is a kill, a failure;
- on a configuration error (exit code 2): a TrainJob ends, a PyTorchJob restarts until its
  backoffLimit;
- from where: the newest checkpoint, one every `trainer.checkpoint_every_min` (or steps), and what a
  checkpoint's write costs the training where it waits for it.
"""

from __future__ import annotations

import math
from typing import Any

from visiondist.launch.stop import WRITE_BYTES_PER_S, state_bytes, write_seconds

# a checkpoint's planned write above this share of the period is said, with what lowers it
COST_SHARE = 0.05


def staging_gib(cfg: Any, run: Any) -> int:
    """The host memory a rank adds for trainer.checkpoint_async's copy of its state (whole GiB)."""
    return math.ceil(state_bytes(cfg, run) / 1024**3) if cfg.trainer.checkpoint_async else 0


def backoff_limit(restarts: int, nodes: int) -> int:
    """A PyTorchJob's backoffLimit for `restarts` failures of the job: the Training Operator counts
    the container restarts of every pod, and one failure restarts each pod (the others' ranks fail
    in their next collective)."""
    return restarts * nodes


def continues_from(t: Any) -> str:
    """Where a restarted job's pods continue, by the config's trainer `t`."""
    from visiondist.engine.checkpointing import cadence  # noqa: PLC0415 (torch)

    every = cadence(t)
    if every:
        minutes = float(t.checkpoint_every_min)
        longest = (
            f": a failure loses up to {minutes:g} minute{'s' if minutes != 1 else ''}"
            if minutes > 0
            else ""
        )
        return f"from its newest checkpoint ({every}{longest})"
    return (
        "from a stop's checkpoint, else from step 1 (trainer.checkpoint_every_min=0: none during "
        "the run; give trainer.checkpoint_every_min=<minutes> to bound what a failure loses)"
    )


def what_happens(
    kind: str, name: str, nodes: int, restarts: int, grace_s: int, t: Any
) -> list[str]:
    """The tool's lines on a failure, a stop and a configuration error of the job."""
    where = continues_from(t)
    times = f"{restarts} time{'s' if restarts != 1 else ''}"
    if kind == "pytorchjob":
        limit = backoff_limit(restarts, nodes)
        failure = (
            f"on failure (a crash, a lost node, a pod killed): the failed pod restarts, and every "
            f"other pod through its failed collectives, {where}; the Training Operator counts each "
            f"pod's restarts, so backoffLimit {limit} ({restarts} x {nodes} pods) allows about "
            f"{restarts} failure{'s' if restarts != 1 else ''}"
            if restarts
            else "on failure (a crash, a lost node, a pod killed): the job ends (restarts=0: "
            f"backoffLimit 0); restarts=<n> restarts it {where}"
        )
        stop = (
            "the pods restart from that checkpoint, and the restarts count against the "
            "backoffLimit as a failure's do (kind=trainjob does not count them)"
            if restarts
            else "the job ends with that checkpoint (kind=trainjob restarts it)"
        )
        return [
            failure,
            f"on a stop (SIGTERM: a drained or preempted node, {grace_s} s to checkpoint the "
            f"step): {stop}",
            "on a configuration error (exit code 2): the pods restart too, until the backoffLimit "
            "(kind=trainjob ends the job at once)"
            if restarts
            else "on a configuration error (exit code 2): the job ends",
        ]
    failure = (
        f"on failure (a crash, a lost node, a pod killed): every pod is recreated once all are "
        f"gone (TrainingRuntime {name}), at most {times}, {where}"
        if restarts
        else "on failure (a crash, a lost node, a pod killed): the job ends (restarts=0); "
        f"restarts=<n> recreates its pods {where}"
    )
    return [
        failure,
        f"on a stop (SIGTERM: a drained or preempted node): the pods checkpoint the step and the "
        f"job restarts from it, without using a restart, where the node leaves them the {grace_s} "
        "s grace period; a spot reclaim with less notice is a failure. These rules on exit codes "
        "need JobSet 0.10 or newer on the cluster: an older JobSet drops them, and a stop then "
        "ends the job (docs/multi-node.md)",
        "on a configuration error (exit code 2): the job ends at once (a restart would repeat it)",
    ]


def checkpoint_cost(cfg: Any, run: Any) -> str:
    """One line on what the periodic checkpoints cost, or "": under trainer.checkpoint_async, the
    host memory it takes; else, where the planned write (`write_seconds`, at the 50 MB/s a node of
    a slow shared file system) is over `COST_SHARE` of trainer.checkpoint_every_min, the training
    time it takes and the two settings that lower it; a write longer than the period, said so."""
    t = cfg.trainer
    minutes, write = float(t.checkpoint_every_min), write_seconds(cfg, run)
    if minutes <= 0 or write <= 0:
        return ""
    rate = f"{WRITE_BYTES_PER_S / 1e6:.0f} MB/s, a slow shared file system"
    if write >= minutes * 60:
        least = math.ceil(write / 60 / COST_SHARE)
        return (
            f"checkpoint cost: a write is planned at {write:.0f} s a node ({rate}), longer than "
            f"the {minutes:g}-minute period, so the job would mostly checkpoint: give "
            f"trainer.checkpoint_every_min={least} (the write {COST_SHARE:.0%} of the time) or "
            "more"
        )
    if t.checkpoint_async:
        return (
            f"checkpoint cost: each write (planned at {write:.0f} s a node) overlaps training "
            f"(trainer.checkpoint_async=true); each rank keeps one more copy of its training state "
            f"in host memory, {state_bytes(cfg, run) / 1e9:.1f} GB, which the pods' memory counts"
        )
    if write <= COST_SHARE * minutes * 60:
        return ""
    return (
        f"checkpoint cost: training waits for each write, planned at {write:.0f} s a node "
        f"({rate}): {write / (minutes * 60):.0%} of its time at one every {minutes:g} minutes; "
        "trainer.checkpoint_async=true overlaps the write with training (one more copy of the "
        "state in host memory), a larger trainer.checkpoint_every_min writes fewer (a failure "
        "then loses more)"
    )
