"""What a tool takes (`Tool`) and prints without running: --help (`usage`, the config groups'
options), --version, and --cfg (`config_text`).

Every tool imports this module for its --help (no torch): the libraries only --version reports
(torch, torchvision, Hydra, the installed packages' metadata) are imported there
(`# noqa: PLC0415 (--help)`)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import omegaconf
from omegaconf import DictConfig, OmegaConf

from visiondist.config import ConfigError


@dataclass(frozen=True)
class Tool:
    """What `tools/<name>` takes and does, for its parsing and its --help. The defaults are
    tools/train.py's.

    Args:
        name: the script's name under tools/ ("train.py").
        about: the usage's first line: what the tool does.
        keys: its own `key=<placeholder>` keys (no dot), each with what it means.
        reads: what it reads, for --help.
        writes: what it writes, for --help.
        examples: command lines --help shows.
        config: it takes the config's group=option and group.key=value.
        run_dir: it writes a run dir, which hydra.run.dir / trainer.run_dir choose.
        multirun: it takes -m.
        positional: it takes a bare path (a deprecated spelling; the tool names the key it became).
        command: a tool with subcommands: the usage line's first word (tools/data.py: "pack").
    """

    name: str = "train.py"
    about: str = (
        "Train a model: its own ranks (parallel.dp / tp / pp, or every GPU), or one "
        "rank of a torchrun job."
    )
    # ("key=<placeholder>", what it means): plain key=value without a dot
    keys: tuple[tuple[str, str], ...] = ()
    reads: str = "configs/ (train.yaml with one option of each group), the data under data.root"
    writes: str = (
        "a run dir: outputs/<date>/<time>/ (trainer.output_dir), or hydra.run.dir=DIR / "
        "trainer.run_dir=DIR; -m: outputs/multirun/<date>/<time>/<job>/, or hydra.sweep.dir=DIR"
    )
    examples: tuple[str, ...] = (
        "python tools/train.py model=vit_small parallel=tp2 trainer.max_epochs=20",
        "python tools/train.py -m optim.lr=1e-3,3e-4 trainer.max_steps=3",
        "python tools/train.py --cfg job model=vit_huge -p model",
    )
    config: bool = True  # takes the config's group=option / key=value
    run_dir: bool = True  # writes a run dir, which hydra.run.dir / trainer.run_dir choose
    multirun: bool = True  # -m
    # takes a bare path (a deprecated spelling; the tool says which key it became)
    positional: bool = False
    # a tool with subcommands: the usage line's first word (tools/data.py: "pack")
    command: str = ""
    # what a stop signal leaves behind, said after it; "": nothing written
    on_stop: str = ""

    @property
    def key_names(self) -> list[str]:
        return [key.split("=", 1)[0] for key, _ in self.keys]


def groups(config_dir: Path) -> dict[str, list[str]]:
    """Each config group a user picks from (not `tuned`, which follows the model and the data) and
    its options."""
    found = {
        p.name: sorted(f.stem for f in p.glob("*.yaml"))
        for p in sorted(Path(config_dir).iterdir())
        if p.is_dir() and p.name != "tuned"
    }
    return {name: options for name, options in found.items() if options}


def config_text(cfg: DictConfig, package: Optional[str] = None) -> str:
    """--cfg: the composed config as YAML with its interpolations resolved, or only its `package`
    (-p).

    Args:
        cfg: the composed config.
        package: a dotted key (e.g. "model") to print alone; None: the whole config.

    Returns:
        The YAML text.
    """
    if not package:
        return OmegaConf.to_yaml(cfg, resolve=True)
    parent, _, leaf = package.rpartition(".")
    holder = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(holder, DictConfig) or leaf not in holder.keys():
        raise ConfigError(
            f"-p {package}: the config has no such part: use one of "
            f"{', '.join(map(str, cfg.keys()))} or a dotted key in them"
        )
    if OmegaConf.is_missing(holder, leaf):
        return "???"
    node = holder[leaf]
    return OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node)


def usage(tool: Tool, config_dir: Path) -> str:
    """--help: the form, the tool's keys, what it reads and writes, the flags, each config group's
    options."""
    form = " ".join(
        [
            *([tool.command] if tool.command else []),
            "[flags]",
            *(f"[{key}]" for key, _ in tool.keys),
            *(["[group=option ...] [group.key=value ...]"] if tool.config else []),
        ]
    )
    lines = [f"usage: python tools/{tool.name} {form}", "", _wrap(tool.about), ""]
    if tool.keys:
        lines += ["keys of this tool (plain key=value, no dot):"]
        # a long key keeps a space before its text
        width = max(18, *(len(key) + 1 for key, _ in tool.keys))
        lines += [_wrap(text, f"  {key:<{width}}") for key, text in tool.keys] + [""]
    lines += [_wrap(tool.reads, "reads:  "), _wrap(tool.writes, "writes: "), ""]
    if tool.config:
        lines += [
            _wrap(
                "config (as tools/train.py): group=option picks configs/<group>/<option>.yaml, "
                "group.key=value sets one field (e.g. data.root=/path trainer.max_steps=100); "
                "--cfg job prints every field. The groups and their options:"
            )
        ]
        lines += [
            _wrap(" ".join(options), f"  {name:<11}")
            for name, options in groups(config_dir).items()
        ] + [""]
    lines += ["flags:", *_flag_lines(tool), "", "examples:", *(f"  {e}" for e in tool.examples)]
    return "\n".join(lines)


def _wrap(text: str, head: str = "") -> str:
    return textwrap.fill(
        text,
        width=118,
        initial_indent=head,
        subsequent_indent=" " * len(head),
        break_on_hyphens=False,
        break_long_words=False,
    )


def _flag_lines(tool: Tool) -> list[str]:
    flags = [
        ("-h, --help", "this text"),
        ("--version", "visiondist, torch, torchvision and hydra versions"),
        (
            "--cfg [job|all]",
            "print the config as asked (interpolations resolved; the layout it resolves to is the "
            "run dir's layout.json) and exit; -p PKG: only that part, e.g. -p trainer; --resolve: "
            "the same output (it is always resolved)",
        ),
    ]
    if tool.config:
        flags += [
            (
                "-cd, --config-dir DIR",
                "more options in DIR/<group>/<option>.yaml (DIR/model/my_vit.yaml: model=my_vit)",
            )
        ]
    if tool.multirun:
        flags += [
            (
                "-m, --multirun",
                "one job per combination of comma-separated values (range(a,b) too), one after "
                "the other, each launching its own ranks",
            )
        ]
    if tool.run_dir:
        flags += [
            (
                "hydra.run.dir=DIR",
                "the same as trainer.run_dir=DIR"
                + (
                    "; with -m, hydra.sweep.dir=DIR is the sweep's directory"
                    if tool.multirun
                    else ""
                ),
            )
        ]
    lines = [_wrap(text, f"  {flag:<24}") for flag, text in flags]
    return lines + [
        _wrap(
            "other Hydra flags (--info, -cn, --shell-completion, ...) and hydra.* keys are "
            "refused, each with the setting to use instead (README.md: Command line)",
            "  ",
        )
    ]


def versions() -> str:
    """--version: this project's and its main libraries' versions."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 (--help)

    import hydra  # noqa: PLC0415 (--help)
    import torch  # noqa: PLC0415 (--help)
    import torchvision  # noqa: PLC0415 (--help)

    try:
        own = version("visiondist")
    except PackageNotFoundError:
        own = "(not installed: run from the source tree)"
    return (
        f"visiondist {own}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"hydra {hydra.__version__}, omegaconf {omegaconf.__version__}"
    )
