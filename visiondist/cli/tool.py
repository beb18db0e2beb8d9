"""The tools' one command-line convention (`Tool`, `parse`, `main`, `run_tool`): flags, tool keys
and config overrides told apart, Hydra's own flags and keys refused with the project's equivalent,
and bad input as one `error:` line with exit code 2 (the help and version text: `cli.usage`).

Every tool imports this module for its --help (0.2-0.35 s, no torch): the stop signals' handling
(3 ms) is imported where a tool runs, and the sweeps' module (Hydra's override parser, the
launcher) for -m (`# noqa: PLC0415 (--help)`).
"""

from __future__ import annotations

import difflib
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf

from visiondist.cli.errors import not_a_setting
from visiondist.cli.hydra_refusals import (
    NO_APP,
    OTHER_KEY,
    REFUSED_FLAGS,
    REFUSED_KEYS,
    SHORT_FLAGS,
)
from visiondist.cli.load import load_config
from visiondist.cli.usage import Tool, config_text, groups, usage, versions
from visiondist.config import ConfigError, TrainConfig


@dataclass
class Command:
    """One parsed command line.

    Args:
        args: the tool's own keys and their values.
        overrides: the config's overrides (hydra.run.dir already trainer.run_dir).
        paths: bare arguments (only where `Tool.positional`).
        show: --cfg: "job" or "all" (the same here: there is no Hydra config to add); None: not
            asked.
        resolve: --resolve.
        package: -p: print only this part of the config.
        multirun: -m.
        config_dir: -cd: a directory of more group options.
    """

    args: dict[str, str] = field(default_factory=dict)  # tool keys
    # the config's, hydra.run.dir already trainer.run_dir
    overrides: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # bare arguments (only where Tool.positional)
    # --cfg: "job" or "all" (the same here: there is no Hydra config to add)
    show: Optional[str] = None
    resolve: bool = False
    package: Optional[str] = None  # -p: print only this part of the config
    multirun: bool = False
    config_dir: Optional[Path] = None  # -cd

    @property
    def search(self) -> list[str]:
        """The overrides that add -cd's directory to the config search path (after configs/, as
        Hydra's -cd)."""
        return (
            [f"hydra.searchpath=[file://{self.config_dir}]"] if self.config_dir is not None else []
        )

    def switch(self, key: str, default: bool = False) -> bool:
        """A tool key that is true or false (`link=true`); `default` where it is not given.

        Raises:
            ConfigError: another value, naming the two.
        """
        if key not in self.args:
            return default
        return truth(key, self.args[key])


def truth(key: str, text: str) -> bool:
    """`text` read as true or false (any case), else a one-line refusal naming the key."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"{key}={text}: give true or false")
    return value == "true"


def parse(tool: Tool, config_dir: Path, argv: list[str]) -> Command:
    """`argv` by the convention (see the module's docstring); raises ConfigError with a one-line
    fix.

    Args:
        tool: what the tool takes.
        config_dir: configs/ (its groups tell a group=option from a tool key).
        argv: the command line after the script's name.

    Returns:
        The parsed command.
    """
    cmd, rest = _flags(tool, list(argv))
    for token in rest:
        key = token.split("=", 1)[0].lstrip("+~") if "=" in token else None
        if key is None:
            if token.startswith("~"):  # Hydra's deletion of a key
                cmd.overrides.append(token)
            elif tool.positional:
                cmd.paths.append(token)
            elif not tool.config:
                raise ConfigError(
                    f"{token}: not a key=value: tools/{tool.name} takes {_key_list(tool)}, e.g. "
                    f"{tool.key_names[0]}={token}"
                )
            else:
                raise ConfigError(
                    f"{token}: not an override; write key=value or group=option, e.g. "
                    "data.root=/path (Hydra's override grammar)"
                )
        elif key == "hydra" or key.startswith(("hydra.", "hydra/")):
            _hydra_key(tool, cmd, key, token.split("=", 1)[1])
        elif key in tool.key_names and key == token.split("=", 1)[0]:
            cmd.args[key] = token.split("=", 1)[1]
        elif "." not in key and "/" not in key and key not in _top_level(config_dir):
            raise ConfigError(_not_a_key(tool, config_dir, key))
        elif not tool.config:
            raise ConfigError(
                f"{token}: tools/{tool.name} takes {_key_list(tool)} only (the model and its "
                "settings come from the run's config.yaml)"
            )
        else:
            cmd.overrides.append(token)
    dirs = sorted(
        {
            o.split("=", 1)[1]
            for o in cmd.overrides
            if o.split("=", 1)[0].lstrip("+") == "trainer.run_dir"
        }
    )
    if len(dirs) > 1:  # e.g. hydra.run.dir=A trainer.run_dir=B
        raise ConfigError(
            f"trainer.run_dir={dirs[0]} and {dirs[1]}: hydra.run.dir / hydra.sweep.dir and "
            "trainer.run_dir name the same directory: give one of them"
        )
    return cmd


def _flags(tool: Tool, argv: list[str]) -> tuple[Command, list[str]]:
    """The flags out of `argv` (in any position): the command with them, and the other arguments."""
    cmd, rest = Command(), []
    while argv:
        token = argv.pop(0)
        if not token.startswith("-") or "=" in token and not token.startswith("--"):
            rest.append(token)
            continue
        flag, _, value = token.partition("=")
        flag = SHORT_FLAGS.get(flag, flag)
        if flag in REFUSED_FLAGS:
            raise ConfigError(f"{token.split('=')[0]}: {REFUSED_FLAGS[flag]}")
        if flag == "--cfg":
            if not value and argv and argv[0] in ("job", "all", "hydra"):
                value = argv.pop(0)
            if value == "hydra":
                raise ConfigError(
                    f"--cfg hydra: {NO_APP}, so there is no Hydra config: --cfg job prints the "
                    "composed config"
                )
            if value not in ("", "job", "all"):
                raise ConfigError(f"--cfg {value}: choose --cfg job or --cfg all (the same here)")
            cmd.show = value or "job"
        elif flag in ("--package", "--config-dir"):
            if not value and (not argv or argv[0].startswith("-") or "=" in argv[0]):
                example = (
                    "a package, e.g. -p trainer"
                    if flag == "--package"
                    else "a directory, e.g. -cd my_configs"
                )
                raise ConfigError(f"{token}: give {example}")
            value = value or argv.pop(0)
            if flag == "--package":
                cmd.package = value
            else:
                cmd.config_dir = _config_dir(tool, value)
        elif flag == "--resolve" and not value:
            cmd.resolve = True
        elif flag == "--multirun" and not value:
            if not tool.multirun:
                raise ConfigError(
                    f"{token}: tools/{tool.name} runs once per command; sweeps are for "
                    "tools/train.py and tools/benchmark.py"
                )
            cmd.multirun = True
        else:
            raise ConfigError(f"{token}: not a flag of tools/{tool.name}: --help lists them")
    if (cmd.resolve or cmd.package) and cmd.show is None:
        raise ConfigError(
            f"{'--resolve' if cmd.resolve else '-p'} goes with --cfg: e.g. --cfg job "
            f"{'--resolve' if cmd.resolve else '-p trainer'}"
        )
    return cmd, rest


def _config_dir(tool: Tool, value: str) -> Path:
    if not tool.config:
        raise ConfigError(
            f"-cd {value}: tools/{tool.name} reads the run's config.yaml, not configs/"
        )
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(
            f"-cd {value}: no such directory: give a folder of <group>/<option>.yaml files"
        )
    return path


def _hydra_key(tool: Tool, cmd: Command, key: str, value: str) -> None:
    """hydra.run.dir (one run) and hydra.sweep.dir (-m) become trainer.run_dir; any other Hydra key
    is refused."""
    if key in ("hydra.run.dir", "hydra.sweep.dir") and not tool.run_dir:
        out = " (out=<path> names where it writes)" if "out" in tool.key_names else ""
        raise ConfigError(f"{key}: tools/{tool.name} writes no run directory{out}")
    if key == "hydra.run.dir" and cmd.multirun:
        raise ConfigError(
            "hydra.run.dir: with -m each job goes to <sweep dir>/<job>: use hydra.sweep.dir=DIR"
        )
    if key == "hydra.sweep.dir" and not cmd.multirun:
        raise ConfigError(
            "hydra.sweep.dir names the directory of a sweep (-m): for one run use "
            "hydra.run.dir=DIR (or trainer.run_dir=DIR)"
        )
    if key in ("hydra.run.dir", "hydra.sweep.dir"):
        cmd.overrides.append(f"trainer.run_dir={value}")
        return
    why = next(
        (why for prefix, why in REFUSED_KEYS if key == prefix or key.startswith(prefix + ".")), None
    )
    raise ConfigError(f"{key}: {why or OTHER_KEY}")


def _top_level(config_dir: Path) -> set[str]:
    """The names a dotless key=value can start with: the config groups and the schema's top-level
    settings."""
    groups = {p.name for p in Path(config_dir).iterdir() if p.is_dir()}
    return groups | set(OmegaConf.structured(TrainConfig).keys())


def _not_a_key(tool: Tool, config_dir: Path, key: str) -> str:
    """`max_steps is not a setting: did you mean trainer.max_steps?`, or a tool key / group close to
    it."""
    if not tool.config:  # its own keys only: the same list as any other refusal of it
        close = difflib.get_close_matches(key, tool.key_names, n=1)
        if close:
            return f"{key} is not a setting of tools/{tool.name}: did you mean {close[0]}?"
        return (
            f"{key} is not a setting: tools/{tool.name} takes {_key_list(tool)} only (the model "
            "and its settings come from the run's config.yaml)"
        )
    same = not_a_setting(key)
    if same:
        return same
    close = difflib.get_close_matches(key, [*tool.key_names, *sorted(groups(config_dir))], n=1)
    if close:
        return f"{key} is not a setting of tools/{tool.name}: did you mean {close[0]}?"
    takes = f"the keys {_key_list(tool)}, " if tool.keys else ""
    return (
        f"{key} is not a setting: tools/{tool.name} takes {takes}group=option and group.key=value "
        "(--help lists them)"
    )


def _key_list(tool: Tool) -> str:
    return ", ".join(f"{key}=" for key in tool.key_names)


def main(tool: Tool, config_dir: Path, argv: list[str], body: Callable[[Command], object]) -> int:
    """A tool's whole command line: --help and --version answered, else `body(parsed command)`. Exit
    code: `body`'s integer, 0, 2 for bad input (one `error:` line), or a failed rank's code
    (`launch.RunFailed`'s one line).

    Args:
        tool: what the tool takes (its parsing and --help).
        config_dir: configs/.
        argv: the command line after the script's name.
        body: the tool's work on the parsed command; an int it returns is the exit code.

    Returns:
        The exit code.
    """
    if any(a in ("-h", "--help") for a in argv):
        print(usage(tool, config_dir))
        return 0
    if "--version" in argv:
        print(versions())
        return 0
    from visiondist.utils.signals import StopNow, StopSignals  # noqa: PLC0415 (--help)

    # work in this process (export, start-up) stops at once; a rank
    signals = StopSignals().install(at_once=True)
    # and the launcher of several install their own on top
    try:
        code = body(parse(tool, config_dir, argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StopNow as stop:
        print(
            f"{tool.name.removesuffix('.py')} stopped by {stop.signal_name}: "
            f"{tool.on_stop or 'nothing written'}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(getattr(signal, stop.signal_name))
    # a rank failed: `launch.RunFailed` says which, where and why in one line; a stop signal
    except Exception as exc:
        # `launch.JobStopped` says what was kept
        if type(exc).__name__ not in ("RunFailed", "JobStopped"):
            raise
        if str(exc):
            print(
                f"error: {exc}" if type(exc).__name__ == "RunFailed" else str(exc),
                file=sys.stderr,
                flush=True,
            )
        # told apart by name: --help must not import visiondist.launch (torch)
        return exc.exit_code  # type: ignore[attr-defined]
    finally:
        signals.restore()
    return code if isinstance(code, int) else 0


def run_tool(
    tool: Tool | str, config_dir: Path, argv: list[str], run: Callable[[DictConfig], object]
) -> int:
    """A tool that composes configs/ and runs `run(cfg)` (train, benchmark), once or per sweep job
    (-m).

    Args:
        tool: what the tool takes, or its script's name (then tools/train.py's defaults).
        config_dir: configs/.
        argv: the command line after the script's name.
        run: the tool's work on a composed, checked config; an int it returns is the exit code.

    Returns:
        The exit code (`main`'s).
    """
    spec = tool if isinstance(tool, Tool) else Tool(name=tool)

    def body(cmd: Command) -> object:
        show = (lambda cfg: config_text(cfg, cmd.package)) if cmd.show else None
        if cmd.multirun:
            from visiondist.cli.sweep import run_sweep  # noqa: PLC0415 (--help)

            return run_sweep(spec.name, config_dir, cmd.overrides, run, show, search=cmd.search)
        cfg = load_config(config_dir, cmd.overrides + cmd.search, inputs=None if show else "train")
        if show:
            print(show(cfg))
            return 0
        return run(cfg)

    return main(spec, config_dir, argv, body)
