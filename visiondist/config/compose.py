"""Composition: `configs/` + command-line overrides -> a resolved, typed config; and the plain dict
that crosses process boundaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, cast

from omegaconf import DictConfig, OmegaConf

from visiondist.config.layout import RunLayout
from visiondist.config.schema import ConfigError, TrainConfig, upgrade_saved
from visiondist.utils.dcp import step_of

# Hydra is imported where a config is composed (noqa: PLC0415): 0.09 s of `tools/*.py --help`
# (0.35 s in all), which composes nothing.


def _patch_multiple(size: int, patch: int) -> int:
    """The largest multiple of the patch size not above `size` (at least one patch): a 64-pixel
    dataset feeds a /16 model 64-pixel images and a /14 model 56-pixel ones."""
    return max(1, int(size) // int(patch)) * int(patch)


if not OmegaConf.has_resolver("patch_multiple"):
    OmegaConf.register_new_resolver("patch_multiple", _patch_multiple)


def register_schema() -> None:
    """Registers the schema (`TrainConfig`) with Hydra's config store as `train_schema`, the first
    default of configs/train.yaml, so that composition types every key.
    """
    from hydra.core.config_store import ConfigStore  # noqa: PLC0415 (Hydra: see the top)

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose(config_dir: str | Path, overrides: list[str], config_name: str = "train") -> DictConfig:
    """Compose `configs/<config_name>.yaml` with command-line overrides into a resolved, typed
    config.

    Args:
        config_dir: the configs/ directory.
        overrides: command-line overrides (`key=value`, `group=option`).
        config_name: the entry config in `config_dir` (configs/train.yaml).

    Returns:
        The config, interpolations resolved and `trainer.precision`'s spellings made canonical.
    """
    from hydra import compose as hydra_compose  # noqa: PLC0415 (Hydra: see the top)
    from hydra import initialize_config_dir  # noqa: PLC0415 (Hydra: see the top)

    register_schema()
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    OmegaConf.resolve(cfg)
    spelling = PRECISION_SPELLINGS.get(
        str(OmegaConf.select(cfg, "trainer.precision", default="32"))
    )
    if spelling is not None:  # fp32 / fp16, as the summary prints them, are 32 / 16
        cfg.trainer.precision = spelling
    return cfg


# trainer.precision: the spellings taken, and the value each means
PRECISION_SPELLINGS = {"32": "32", "fp32": "32", "bf16": "bf16", "16": "16", "fp16": "16"}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"model.depth": 12, ...}: the leaves of a nested dict under dotted keys (lists stay
    whole)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def model_first(keys: list[str]) -> list[str]:
    """Changed keys with `model.name` first: another model config explains the rest of its keys."""
    return sorted(keys, key=lambda key: key != "model.name")


def as_setting(key: str, value: Any) -> str:
    """A changed key as the command line sets it: `model=vit_tiny` for a model config's name (a
    group's option), `key=value` otherwise."""
    return f"model={value}" if key == "model.name" else f"{key}={value}"


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """A plain, picklable dict (what crosses process boundaries).

    Args:
        cfg: a composed config.

    Returns:
        Its values as nested dicts and lists, interpolations resolved.
    """
    # a DictConfig's container is a dict with the config's string keys
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))


def from_container(data: dict[str, Any]) -> DictConfig:
    """A typed config from a plain dict (`to_container`'s, on the other side of a process boundary).

    Args:
        data: the config as nested dicts and lists.

    Returns:
        The config merged onto the schema (`TrainConfig`): keys typed, the missing ones at their
        defaults.
    """
    # OmegaConf types a merge as DictConfig | ListConfig; onto a structured dataclass it is a dict
    return cast(DictConfig, OmegaConf.merge(OmegaConf.structured(TrainConfig), data))


def _same_devices(ran: RunLayout, overrides: Sequence[str]) -> bool:
    """Whether `overrides` leave the ranks per node of the run's layout as they were
    (trainer.devices unset, or the run's count)."""
    devices = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.devices=")]
    return not devices or devices[-1] == str(ran.per_node)


def run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """A run's config.yaml (as asked) with key=value `overrides`, not yet checked. A `parallel=auto`
    run comes back in the layout it ran under (its layout.json) unless the overrides name another
    or another number of devices (`trainer.devices=2` for a run of one: planned again for them),
    so that evaluating or exporting it rebuilds the model that was trained. Raises ConfigError when
    the dir holds no run."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        run, step = Path(run_dir).parent.parent, step_of(Path(run_dir))
        if step is not None and (run / "config.yaml").is_file():
            raise ConfigError(
                f"{run_dir} is a checkpoint of the run {run}: give run_dir={run} step={step}"
            )
        if not Path(run_dir).exists():
            raise ConfigError(f"{run_dir}: no such directory: give the directory of a training run")
        raise ConfigError(f"{run_dir} holds no config.yaml: give the directory of a training run")
    ran = RunLayout.load(Path(run_dir))
    as_it_ran: dict[str, Any] = {}
    if (
        ran is not None
        and ran.chosen_by == "parallel=auto"
        and not any(o.startswith("parallel.") for o in overrides)
        and _same_devices(ran, overrides)
    ):
        as_it_ran = {"parallel": {**ran.parallel_overrides(), "auto": False}}
    saved = upgrade_saved(OmegaConf.load(path))  # a run from before trainer.loggers
    merged = OmegaConf.merge(
        OmegaConf.structured(TrainConfig),
        saved,
        as_it_ran,
        OmegaConf.from_dotlist(list(overrides)),
    )
    return cast(DictConfig, merged)  # onto a structured dataclass: a DictConfig


def detection_data_for(config_dir: Path, overrides: list[str]) -> list[str]:
    """data=detection where the command names a detector (model=...) and no data: prediction reads
    no data, and the default data (the built-in classification set) cannot go with a detector."""
    if any(o.startswith(("data=", "+data=")) for o in overrides):
        return []
    model = next((o.split("=", 1)[1] for o in overrides if o.startswith("model=")), None)
    file = config_dir / "model" / f"{model}.yaml"
    if model is None or not file.is_file():
        return []
    family = OmegaConf.select(OmegaConf.load(file), "family", default="vit")
    return [] if family == "vit" else ["data=detection"]
