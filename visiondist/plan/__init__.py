"""Deciding how a job runs, in the launching process only, before any rank starts: the world
(accelerator, ranks, nodes) from the config and the environment (`world`), and from it the one
`RunLayout` every rank runs under (`resolve`). The arithmetic it decides with: the memory model of a
ViT under a layout (`memory`: bytes per rank), the time model (`time_model`), `parallel=auto`'s
search over layouts (`planner`) and its table (`table`), a device's and a node's budget and the
planned bytes of a resolved layout (`budget`), and a named layout fitted to the device (`fit`).
The dry run that checks a plan on a fake process group is `visiondist.verify`, beside it; what lays
a model out at run time is `visiondist.parallel`.

Imports: `config` and `models` (what each family supports, its shape); `parallel` only inside
`rank_layout`, in a process group already up. Nothing here imports torch at import time: the
launcher plans without DTensor or the rest of torch.distributed (tests/multirank/test_imports.py).
"""

from visiondist.plan.resolve import (
    announce,
    check,
    plan_for,
    rank_layout,
    resolve,
    resolve_on,
    with_switches,
)
from visiondist.plan.world import (
    World,
    cuda_device_count,
    device_memory_gb,
    find_world,
    planning_world,
    under_torchrun,
)

__all__ = [
    "World",
    "announce",
    "check",
    "cuda_device_count",
    "device_memory_gb",
    "find_world",
    "plan_for",
    "planning_world",
    "rank_layout",
    "resolve",
    "resolve_on",
    "under_torchrun",
    "with_switches",
]
