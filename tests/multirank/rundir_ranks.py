"""Rank-side code of tests/multirank/test_rundir.py (run by `helpers.spawn_ranks`): each rank checks
the run dir it was given, as a rank of a job over several nodes checks the one it was told of."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def check(dirs: list[str]) -> str:
    """`launch.rundir.check_shared` on rank k's `dirs[k]`, each rank its own node: "" where it
    passed, else the error's message (every rank's)."""
    from devices import init_test_rank

    from visiondist.config import ConfigError
    from visiondist.launch.rundir import check_shared

    init_test_rank()
    try:
        check_shared(Path(dirs[dist.get_rank()]), spans_nodes=True, wait_s=1.0)
        return ""
    except ConfigError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
