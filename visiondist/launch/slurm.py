"""srun tasks as a torch.distributed job: SLURM's variables translated to the ones
init_process_group reads."""

from __future__ import annotations

import re
from typing import Mapping

from visiondist.config import ConfigError


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """Under `srun` with several tasks (one per device) and no launcher's RANK, the
    torch.distributed variables derived from SLURM's: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK (the node), and MASTER_ADDR / MASTER_PORT unless set (the step's
    first node; a port from the job id). Empty when not under such a step.

    Args:
        env: the process's environment (SLURM's variables).

    Returns:
        The variables to add to it; {} when they are not needed.
    """
    if "RANK" in env or int(env.get("SLURM_STEP_NUM_TASKS", "1")) <= 1:
        return {}
    per_node = re.match(
        r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", "1"))
    )
    derived = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": per_node.group(0) if per_node else "1",
        "GROUP_RANK": env.get("SLURM_NODEID", "0"),
    }
    if "MASTER_ADDR" not in env:
        derived["MASTER_ADDR"] = first_host(
            env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
        )
    if "MASTER_PORT" not in env:
        derived["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return derived


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (`gpu[03-04,07],cpu1` -> `gpu03`), as `scontrol show
    hostnames` lists it.

    Args:
        nodelist: SLURM's compressed node list.

    Returns:
        The first host's name.
    """
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise ConfigError(
            f"cannot read a host from SLURM's node list {nodelist!r}: export MASTER_ADDR before "
            "srun"
        )
    prefix, ranges = head.groups()
    return prefix + (re.split(r"[-,]", ranges)[0] if ranges else "")
