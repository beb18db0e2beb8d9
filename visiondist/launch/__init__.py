"""Start the ranks of a job: self-launched through torch's elastic launcher, or joined under
torchrun.

`launch(entry, cfg)` runs `entry(cfg, layout, run_dir)` on every rank:
- under torchrun (one or many nodes) each process joins the group torchrun set up;
- otherwise, one rank runs in this process, and several are spawned here with `elastic_launch` (c10d
  rendezvous on localhost, no restarts) — plain `python tools/train.py parallel.dp=4` needs no
  torchrun. SIGTERM / Ctrl-C are then this process's to forward and bound
  (`visiondist.launch.stop`), not the elastic agent's.
The run directory is created once, by the launching process or by global rank 0, and handed to every
rank; ranks get the resolved config as a plain dict, never a fresh composition. Its default is
`<trainer.output_dir>/<date>/<time>/` for training, `<trainer.output_dir>/<kind>/<date>_<time>/` for
an entry with a `run_kind` (`eval`, `benchmark`).

`ranks.py`: `launch` and a stopped job's last line; `rank.py`: each rank's set-up and body;
`failed.py`: a failed job's last line and each rank's failure record; `spawn.py`: the elastic agent
of a node's ranks; `pods.py`: a Kubernetes pod's place in its job; `k8s.py`: its manifests;
`rundir.py`: the run directory; `slurm.py`: srun tasks' ranks; `stop.py`: stop signals and what a
stopped job kept; `estimate.py`: a GPU layout's time on the CPU; `shared.py`: ranks sharing one GPU
(`trainer.share_gpu`), the line that says so and their memory together.
"""

from visiondist.launch.failed import RunFailed
from visiondist.launch.ranks import launch
from visiondist.launch.rundir import default_run_dir, run_kind, unique_dir
from visiondist.launch.slurm import first_host, slurm_env
from visiondist.launch.spawn import spawn_local
from visiondist.launch.stop import JobStopped
from visiondist.plan.world import cuda_index

__all__ = [
    "JobStopped",
    "RunFailed",
    "cuda_index",
    "default_run_dir",
    "first_host",
    "launch",
    "run_kind",
    "slurm_env",
    "spawn_local",
    "unique_dir",
]
