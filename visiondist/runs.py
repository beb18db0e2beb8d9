"""Continuing a run: `trainer.run_dir=<run>` (with `trainer.resume=auto`, the default) continues
that run with the config it was started with, not the defaults.

- The run's `config.yaml` is the base; the command line's overrides go on top (the printed continue
  command `trainer.resume=auto trainer.run_dir=<run>` changes nothing else). A group switch
  (`parallel=tp2`) replaces that group; a recipe (`experiment=`, `tuned=`) applies what it sets.
  Changing the model, the data or the global batch of a run is refused unless
  `trainer.allow_changes=true`.
- What the command leaves unset (`???`) is not asked: a value the run inferred (`data.num_classes`
  from the class folders) stays. Running the command that started a run again, after a crash, a stop
  or its end, continues it or says it is complete.
- `config.yaml` is never rewritten; each continuation appends what it changed to `attempts.jsonl`.
- A run whose newest checkpoint is its last step and which has its summary is complete: running its
  command again says so and changes nothing.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from pathlib import Path
from typing import Any, Optional, cast

from omegaconf import DictConfig, OmegaConf

from visiondist.checkpoint.files import latest_checkpoint, read_trainer_state
from visiondist.config import ConfigError, TrainConfig
from visiondist.config.compose import as_setting, flatten, model_first
from visiondist.config.layout import RunLayout

# what a continued run may not change without trainer.allow_changes=true: the model, the data, the
# global batch
FIXED = (
    "model.",
    "data.name",
    "data.root",
    "data.format",
    "data.num_classes",
    "data.img_size",
    "data.train_split",
    "data.batch_size",
)
ATTEMPTS = "attempts.jsonl"
PER_PROCESS = ("trainer.stop_at_step", "trainer.run_dir", "trainer.resume", "trainer.allow_changes")


def saved_config(cfg: DictConfig) -> Optional[DictConfig]:
    """The config of the run `cfg` continues, or None when it starts a new one.

    Args:
        cfg: the command line's config (`trainer.run_dir`, `trainer.resume`).
    """
    if not cfg.trainer.run_dir or cfg.trainer.resume != "auto":
        return None
    path = Path(cfg.trainer.run_dir).expanduser() / "config.yaml"
    return cast(DictConfig, OmegaConf.load(path)) if path.is_file() else None  # a mapping


def continue_config(fresh: DictConfig, saved: DictConfig, overrides: list[str]) -> DictConfig:
    """The run's own config with the command line's choices on top (read from `fresh`, the command
    line composed on the defaults, so that their values are typed and resolved as usual).

    Args:
        fresh: the command line composed on the defaults.
        saved: the run's config.yaml (`saved_config`).
        overrides: the command line's overrides, which say what it asks to change.

    Returns:
        The config the run continues with; changing its model, data or global batch is refused
        (`ConfigError`) unless `trainer.allow_changes`.
    """
    cfg = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))
    for key in PER_PROCESS:  # what one process was asked to do, not the run
        OmegaConf.update(cfg, key, OmegaConf.select(fresh, key), merge=False)
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if "=" not in override or key.startswith("hydra"):
            continue
        if "." not in key:  # a group switch: model=..., parallel=tp2
            # a recipe: group switches and keys, whatever it sets
            if key in ("experiment", "tuned"):
                asked = flatten(OmegaConf.to_container(fresh, resolve=True))
                for changed in changed_keys(saved, fresh):
                    # unset: the run's value stays (`_keep_inferred`)
                    if asked.get(changed, "???") != "???":
                        OmegaConf.update(cfg, changed, asked[changed], merge=False)
            else:
                cfg[key] = fresh[key]
        else:
            OmegaConf.update(cfg, key, OmegaConf.select(fresh, key), merge=False)
    _keep_inferred(cfg, saved)
    changes = changed_keys(saved, cfg)
    fixed = model_first([k for k in changes if k.startswith(FIXED)])
    if fixed and not cfg.trainer.allow_changes:
        first = fixed[0]
        was, asked = OmegaConf.select(saved, first), OmegaConf.select(cfg, first)
        more = f" (and {len(fixed) - 1} more)" if len(fixed) > 1 and first != "model.name" else ""
        raise ConfigError(
            f"trainer.run_dir={cfg.trainer.run_dir} was trained with {as_setting(first, was)}, "
            f"this command asks {as_setting(first, asked)}{more}: drop the override to continue "
            "the run as it was, start a new run dir, or add trainer.allow_changes=true (the "
            "checkpoint loads into the changed config as asked)"
        )
    return cfg


def _keep_inferred(cfg: DictConfig, saved: DictConfig) -> None:
    """Every key `cfg` leaves unset (`???`) takes the run's value: the command did not ask for one,
    the run inferred it (`data.num_classes` from the class folders; the model's follows by
    interpolation)."""
    for key, value in flatten(OmegaConf.to_container(saved, resolve=True)).items():
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if (
            isinstance(node, DictConfig)
            and leaf in node.keys()
            and OmegaConf.is_missing(node, leaf)
        ):
            OmegaConf.update(cfg, key, value, merge=False)


def changed_keys(a: DictConfig, b: DictConfig) -> list[str]:
    """Dotted keys whose values differ (trainer.run_dir and trainer.resume are not a change). A
    setting `a` (a saved run's config.yaml) predates is no change while `b` holds its default."""
    flat_a, flat_b = (flatten(OmegaConf.to_container(c, resolve=True)) for c in (a, b))
    keys = sorted(set(flat_a) | set(flat_b))
    return [
        k
        for k in keys
        if flat_a.get(k) != flat_b.get(k)
        and k not in PER_PROCESS
        and not (k not in flat_a and flat_b.get(k) == _default(k))
    ]


@functools.cache
def _schema() -> DictConfig:
    return OmegaConf.structured(TrainConfig)


def _default(key: str) -> Any:
    """The schema's default of a dotted key (None where it has none)."""
    try:
        return OmegaConf.select(_schema(), key, default=None, throw_on_missing=False)
    except Exception:  # a key under a group the schema types loosely (model.kwargs...)
        return None


def record_attempt(run_dir: Path, saved: DictConfig, cfg: DictConfig, run=None) -> None:
    """Append this continuation's changes to `<run>/attempts.jsonl` (config.yaml keeps the first
    attempt's), and the layout it runs under when that differs from layout.json's, the attempt
    before's (checkpoints reshard)."""
    changes = {k: OmegaConf.select(cfg, k) for k in changed_keys(saved, cfg)}
    entry = {"time": dt.datetime.now().isoformat(timespec="seconds"), "changes": changes}
    first = RunLayout.load(run_dir)
    if run is not None and (first is None or first.describe() != run.describe()):
        entry["layout"] = run.to_json()
    line = json.dumps(entry, default=str)
    with (Path(run_dir) / ATTEMPTS).open("a") as f:
        f.write(line + "\n")


def completed_step(cfg: DictConfig) -> Optional[int]:
    """The last step of a complete run that `cfg` continues unchanged in length, or asks no more
    steps of (a length it has already trained past); None otherwise.

    Args:
        cfg: the command line's config (`trainer.run_dir`, `trainer.resume`, the run's length).
    """
    if not cfg.trainer.run_dir or cfg.trainer.resume != "auto":
        return None
    run_dir = Path(cfg.trainer.run_dir).expanduser()
    newest = latest_checkpoint(run_dir)
    if (
        newest is None
        or not (run_dir / "summary.json").is_file()
        or not (run_dir / "model.safetensors").is_file()
    ):
        return None
    state = read_trainer_state(newest)
    step, total = int(state["step"]), state.get("total_steps")
    if total is None or step < int(total):
        return None
    length = _last_length(run_dir)
    if all(length[k] == OmegaConf.select(cfg, k) for k in length):
        return step
    asked = _asked_steps(cfg, length, int(total))
    return step if asked is not None and step >= asked else None


def _asked_steps(cfg: DictConfig, length: dict[str, Any], total: int) -> Optional[int]:
    """The steps `cfg`'s length comes to, where the run's own says it: trainer.max_steps, or
    trainer.max_epochs at the steps per epoch of a run whose length was its epochs; None where the
    epochs' steps are not known here."""
    if cfg.trainer.max_steps > 0:
        return int(cfg.trainer.max_steps)
    steps, epochs = length.get("trainer.max_steps") or 0, length.get("trainer.max_epochs") or 0
    if steps > 0 or epochs <= 0 or total % epochs:
        return None
    return int(cfg.trainer.max_epochs) * (total // epochs)


def train_longer(cfg: DictConfig, step: int) -> str:
    """What trains a complete run (at `step`) longer: the key that sets its length (its last
    attempt's: `trainer.max_epochs` counts only where `trainer.max_steps` is unset)."""
    length = _last_length(Path(cfg.trainer.run_dir).expanduser())
    if (length.get("trainer.max_steps") or 0) > 0 or cfg.trainer.max_steps > 0:
        epochs = (
            " (trainer.max_epochs counts only without it)"
            if OmegaConf.select(cfg, "trainer.max_epochs") != length.get("trainer.max_epochs")
            else ""
        )
        return f"give trainer.max_steps above {step}{epochs}"
    return (
        f"give trainer.max_epochs above {length.get('trainer.max_epochs')}, or trainer.max_steps "
        f"above {step}"
    )


def _last_length(run_dir: Path) -> dict[str, Any]:
    """trainer.max_steps and trainer.max_epochs as the run's last attempt had them: config.yaml's,
    with what that continuation changed (a run trained on with a longer length is complete at that
    length)."""
    # rich comes with it (12 ms), which every tool's --help would pay (visiondist.cli imports this)
    from visiondist.observe.console import latest_length  # noqa: PLC0415 (--help)

    saved = OmegaConf.load(run_dir / "config.yaml")
    return {
        **{k: OmegaConf.select(saved, k) for k in ("trainer.max_steps", "trainer.max_epochs")},
        **latest_length(run_dir),
    }
