"""Deciding how a job runs, in the launching process only: the world (accelerator, ranks, nodes) from the config and
the environment (`world`), and from it the one `RunLayout` every rank runs under (`resolve`)."""

from visiondist.plan.resolve import announce, check, plan_for, rank_layout, resolve, resolve_on, with_switches
from visiondist.plan.world import World, cuda_device_count, device_memory_gb, find_world, planning_world, under_torchrun

__all__ = ["World", "announce", "check", "cuda_device_count", "device_memory_gb", "find_world", "plan_for",
           "planning_world", "rank_layout", "resolve", "resolve_on", "under_torchrun", "with_switches"]
