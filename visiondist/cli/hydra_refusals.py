"""Hydra's own flags and keys that the tools do not take, each with the project's equivalent (the
tools compose their config with Hydra but run no Hydra app): `REFUSED_FLAGS`, `REFUSED_KEYS`
(matched by prefix), and Hydra's short flags by their long names (`SHORT_FLAGS`)."""

from __future__ import annotations

NO_APP = "visiondist composes its config with Hydra but runs no Hydra app"
_LOGGING = (
    "visiondist sets up its own logging (the console and the run dir's train.log): use "
    "trainer.progress=false (no progress bar), trainer.log_every=N (step lines), "
    "trainer.loggers=[csv] (no TensorBoard)"
)
_LAUNCHER = (
    "visiondist starts its own ranks: use parallel.dp=N or trainer.devices=N, or torchrun / srun "
    "(docs/multi-node.md)"
)
OTHER_KEY = (
    f"{NO_APP}, so this Hydra setting would do nothing: hydra.run.dir=DIR and, with -m, "
    "hydra.sweep.dir=DIR are the ones it takes"
)
_SWEEPER = (
    "-m expands comma-separated values and range(a,b) itself: Hydra's sweeper plugins are not used"
)
# Hydra flags that have no counterpart here, and why; honoured: --help, --version, --cfg, --resolve,
# -p, -cd, -m
REFUSED_FLAGS = {
    "--info": f"{NO_APP}: --cfg job prints the composed config and --help each group's options",
    "--shell-completion": "visiondist installs no shell completion: --help lists each group's "
    "options",
    "--config-name": (
        "the tools compose configs/train.yaml: pick a recipe with experiment=<name> "
        "(configs/experiment/), or add options with -cd DIR"
    ),
    "--config-path": "use -cd DIR (--config-dir): its <group>/<option>.yaml files add to configs/",
    "--hydra-help": f"{NO_APP}: --help is the tool's usage",
    "--run": "one run is what a tool does without -m: drop --run",
    "--experimental-rerun": "to continue a run, give trainer.run_dir=<run dir> "
    "(trainer.resume=auto)",
}
SHORT_FLAGS = {
    "-i": "--info",
    "-sc": "--shell-completion",
    "-cn": "--config-name",
    "-cp": "--config-path",
    "-r": "--run",
    "-c": "--cfg",
    "-p": "--package",
    "-cd": "--config-dir",
    "-m": "--multirun",
    "-h": "--help",
}
# Hydra's own keys (hydra.<key> or the hydra/<group> options) and what to use instead; matched by
# prefix
REFUSED_KEYS = (
    ("hydra.job.chdir", "visiondist never changes directory; paths are relative to where you run"),
    (
        "hydra.verbose",
        "visiondist logs INFO on rank 0 to the console and the run dir's train.log: "
        "use trainer.log_every=N for more or fewer step lines",
    ),
    ("hydra/job_logging", _LOGGING),
    ("hydra/hydra_logging", _LOGGING),
    ("hydra.job_logging", _LOGGING),
    ("hydra.hydra_logging", _LOGGING),
    (
        "hydra.output_subdir",
        "visiondist writes no .hydra/ folder: the run dir's config.yaml is the resolved config",
    ),
    ("hydra.sweep.subdir", "job k of a sweep goes to <sweep dir>/k: set hydra.sweep.dir=DIR only"),
    ("hydra/launcher", _LAUNCHER),
    ("hydra.launcher", _LAUNCHER),
    ("hydra/sweeper", _SWEEPER),
    ("hydra.sweeper", _SWEEPER),
    ("hydra.mode", "use -m for a sweep"),
    ("hydra.searchpath", "use -cd DIR (--config-dir)"),
)
