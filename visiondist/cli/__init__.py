"""Command-line front of the tools: one convention for every tool, the Hydra config composed and
validated, bad input reported in one clear line (exit code 2).

    python tools/<tool>.py [flags] [key=value ...] [group=option ...] [group.key=value ...]

- tool keys are plain `key=value` without a dot, each tool its own (`run_dir=`, `step=`, `weights=`,
  `format=`, `out=`); every other `key=value` is the config's, as in tools/train.py: `group=option`
  picks `configs/<group>/<option>.yaml`, `group.key=value` sets one field (Hydra's override grammar:
  `+key=`, `~key`);
- flags: `-h/--help` (the tool's own usage), `--version`, `--cfg [job|all]` (with `--resolve`,
  `-p/--package`), `-cd/--config-dir DIR` (more options in `DIR/<group>/<option>.yaml`),
  `-m/--multirun` (train and benchmark);
- Hydra's own settings: `hydra.run.dir=DIR` is `trainer.run_dir=DIR`, and under -m
  `hydra.sweep.dir=DIR` the sweep's directory; every other Hydra flag or `hydra.*` / `hydra/...` key
  is refused with the project's equivalent: visiondist composes its config with Hydra but runs no
  Hydra app, so they would do nothing.

`tool.py`: the convention (`Tool`, `parse`, `main`, `run_tool`, usage); `load.py`: a tool's config
composed, checked and its inputs looked at (`load_config`, `load_run_config`, `load_weights_config`,
`checked`); `sweep.py`: `-m` multiruns; a tool's `__main__` ends with `exit_now(main(...))`
(`visiondist.utils.exit`).
"""

from visiondist.cli.load import checked, load_config, load_run_config, load_weights_config
from visiondist.cli.tool import Command, Tool, config_text, main, parse, run_tool, truth
from visiondist.utils.exit import exit_now

__all__ = [
    "Command",
    "Tool",
    "checked",
    "config_text",
    "exit_now",
    "load_config",
    "load_run_config",
    "load_weights_config",
    "main",
    "parse",
    "run_tool",
    "truth",
]
