"""One line for a Hydra or OmegaConf error about the command line: a key that is not a setting
(with the closest one), a value of the wrong type, an option that is not in its group, a value
Hydra's grammar cannot parse; each naming the fix."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from visiondist.config import TrainConfig


def grammar(overrides: list[str]) -> Optional[str]:
    """The one line for the first override Hydra's grammar cannot parse (a value holding `{ }`,
    `[ ]`, `( )`, `,`, `=`, spaces or quotes), naming the quoting that fixes it; None when every
    override parses (the error was another one)."""
    from hydra.core.override_parser.overrides_parser import (  # noqa: PLC0415 (--help)
        OverridesParser,
    )
    from hydra.errors import OverrideParseException  # noqa: PLC0415 (--help)

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException:
            key, _, value = override.partition("=")
            if not _:
                return None  # a bare key: `explain` says so
            escaped = value.replace("\\", "\\\\").replace('"', '\\"')
            return (
                f"{override}: Hydra reads {{ }} [ ] ( ) , = spaces and quotes in a value as its "
                f"grammar: quote the value inside the shell's quotes, '{key}=\"{escaped}\"'"
            )
    return None


def explain(exc: BaseException) -> str:
    """One line for a bad override: a key that is not a setting (with the closest one), a value of
    the wrong type; otherwise Hydra's message without its search-path dump and '+key' hint, plus the
    underlying reason."""
    error: Optional[BaseException] = exc
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # the OmegaConf error under Hydra's
        seen.add(id(error))
        key = getattr(error, "full_key", None)
        if key and isinstance(error, (ConfigKeyError, ConfigAttributeError)):
            return not_a_setting(str(key)) or f"{key} is not a setting (--cfg prints them)"
        if key and isinstance(error, ValidationError):
            return _wrong_type(str(key), str(error).strip().splitlines()[0])
        error = error.__cause__ or error.__context__
    text = str(exc).strip()
    missing = _missing_option(text)
    if missing:
        return missing
    if text.startswith("Error parsing override '"):  # e.g. a bare `data.root`
        override = text.split("'")[1]
        return (
            f"{override}: not an override; write key=value or group=option, e.g. data.root=/path "
            "(Hydra's override grammar)"
        )
    lines = []
    for line in text.splitlines():
        if line.startswith("Config search path") or line.startswith("To append to your config"):
            break
        lines.append(line)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        reason = str(cause).strip().splitlines()[0]
        if reason not in lines:
            lines.append(reason)
    return "\n".join(lines)


# OmegaConf's name of a setting's type -> what to give instead
_TYPES = {
    "Integer": "a whole number",
    "Float": "a number",
}


def _wrong_type(key: str, message: str) -> str:
    """OmegaConf's "Value 'abc' of type 'str' could not be converted to Integer" as one line
    naming the fix: `trainer.max_steps=abc: give a whole number`; other messages as they are."""
    match = re.fullmatch(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", message)
    if match and match.group(2) in _TYPES:
        return f"{key}={match.group(1)}: give {_TYPES[match.group(2)]}"
    match = re.fullmatch(r"Value '(.*)' is not a valid bool \(type \w+\)", message)
    if match:
        return f"{key}={match.group(1)}: give true or false"
    return f"{key}: {message}"


# the key a path goes in, for a path given as a group's option (`data=/data/coco.yaml`)
PATH_KEYS = {"data": "data.root", "model": "model.weights"}


def _missing_option(text: str) -> str:
    """One line for Hydra's "Could not find 'group/option'" and its list of options: the closest
    option, or for a path the key that takes it; '' for another message."""
    found = re.match(r"In '[^']*': Could not find '([^/']+)/([^']+)'", text)
    if not found:
        return ""
    group, option = found.groups()
    lines = text.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("Available options")), 0)
    options = []
    for line in lines[start:] if start else []:
        if not line.startswith("\t"):
            break
        options.append(line.strip())
    if "/" in option or option.endswith((".yaml", ".yml", ".json", ".safetensors")):
        # a YOLO set's data.yaml is read by data=detection
        key = PATH_KEYS.get(group, f"{group}.<key>")
        if group == "data" and option.endswith((".yaml", ".yml")):
            key = "data=detection data.root"
        return (
            f"{group}={option}: {group}= picks one of configs/{group}/ ({', '.join(options)}); "
            f"a path goes in {key}={option}"
        )
    # parallel=tp3, parallel=dp8, parallel=pp3: a degree no file names, which a key sets
    degree = re.fullmatch(r"(dp|tp|pp)(\d+)", option) if group == "parallel" else None
    if degree:
        return (
            f"parallel={option} is not a named layout: set the degree itself, "
            f"parallel.{degree[1]}={degree[2]} (the named layouts: {', '.join(options)}, "
            "configs/parallel/)"
        )
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return (
        f"{group}={option} is not an option of {group}: {hint}the options are "
        f"{', '.join(options)} (configs/{group}/)"
    )


# settings that were replaced, and what says the same now
RENAMED = {
    "trainer.tensorboard": "use trainer.loggers, e.g. trainer.loggers=[csv] (no TensorBoard) or "
    "trainer.loggers=[csv,tensorboard] (the default)"
}


def not_a_setting(key: str) -> str:
    """The one line for a key the config does not have, with the closest setting: `trainer.max_step
    is not a setting: did you mean trainer.max_steps?`; for a dotless key, the settings of that name
    anywhere (`max_steps` -> `trainer.max_steps`), or '' when there is none."""
    if key in RENAMED:
        return f"{key} is not a setting any more: {RENAMED[key]}"
    schema = OmegaConf.structured(TrainConfig)
    parent, _, name = key.rpartition(".")
    if not parent:
        same = [
            leaf
            for leaf in _leaves(OmegaConf.to_container(schema, throw_on_missing=False))
            if leaf.rsplit(".", 1)[-1] == key
        ]
        if same:
            return f"{key} is not a setting: did you mean {' or '.join(same)}?"
        groups = difflib.get_close_matches(key, [str(k) for k in schema.keys()], n=1)
        return f"{key} is not a setting: did you mean {groups[0]}?" if groups else ""
    top = parent.split(".")[0]
    if top not in schema:  # `traner.max_steps`
        groups = difflib.get_close_matches(top, [str(k) for k in schema.keys()], n=1)
        if groups:
            return f"{key} is not a setting: did you mean {groups[0]}{key[len(top) :]}?"
    node = OmegaConf.select(schema, parent)
    known = (
        [str(k) for k in node.keys()]
        if isinstance(node, DictConfig)
        else _optional_fields(TrainConfig, parent)
    )
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"{key} is not a setting: did you mean {parent}.{close[0]}?"
    return f"{key} is not a setting ({parent} has {len(known)}: --cfg prints them)"


def _optional_fields(schema: type, path: str) -> list[str]:
    """The fields of the dataclass at `path` in `schema` where the schema's value there is None (an
    optional group, e.g. data.synthetic), read from the annotations; [] where there is none."""
    kind: object = schema
    for part in path.split("."):
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            return []
        kind = typing.get_type_hints(kind).get(part)
        # Optional[X] -> X
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return [f.name for f in dataclasses.fields(kind)]
    return []


def _leaves(tree: object, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return [prefix[:-1]]
    return [leaf for key, value in tree.items() for leaf in _leaves(value, f"{prefix}{key}.")]
