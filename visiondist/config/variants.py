"""A benchmark variant's config: the run's config with the variant's overrides, validated, its
ranks, mesh and batch the run's."""

from __future__ import annotations

from typing import cast

from omegaconf import DictConfig, OmegaConf

from visiondist.config.schema import ConfigError
from visiondist.config.validate import validate

_LAYOUT_KEYS = (
    "parallel.dp",
    "parallel.tp",
    "parallel.pp",
    "parallel.auto",
    "trainer.devices",
    "trainer.accelerator",
    "data.batch_size",
    "trainer.grad_accum",
    "bench.",
)


def variant_config(cfg: DictConfig, overrides) -> DictConfig:
    """`cfg` with one benchmark variant's key=value overrides (a string of them separated by spaces,
    or a list), validated. The ranks, the mesh and the batch are the run's: a variant changes how a
    step computes, not what it computes over.

    Args:
        cfg: the run's config (read-only; not changed).
        overrides: the variant's `key=value` overrides: one string separated by spaces, or a list.

    Returns:
        A new config with the overrides, validated.

    Raises:
        ConfigError: an override changes the ranks, the mesh or the batch, or breaks a rule.
    """
    if not isinstance(overrides, str):  # ['a=1','b=2'] inside bench.variants' list
        overrides = " ".join(str(o) for o in overrides)
    pairs = overrides.split()
    bad = [p for p in pairs if "=" not in p]
    if not pairs or bad:
        raise ConfigError(
            f"bench.variants entry {overrides!r}: give key=value overrides separated by spaces"
        )
    fixed = [p for p in pairs if p.split("=", 1)[0].startswith(_LAYOUT_KEYS)]
    if fixed:
        raise ConfigError(
            f"bench.variants entry {overrides!r}: {', '.join(fixed)} would change the ranks, the "
            "mesh or the batch, which all variants share: benchmark it in a run of its own"
        )
    try:
        merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(pairs))
    except Exception as exc:  # an unknown key or a wrong type, from the schema
        raise ConfigError(
            f"bench.variants entry {overrides!r}: {str(exc).splitlines()[0]}"
        ) from None
    # a new object: the run's config is read-only (a merge onto a DictConfig is one)
    merged = cast(DictConfig, OmegaConf.merge(merged, {"bench": {"variants": []}}))
    try:
        validate(merged)
    except ConfigError as exc:  # the fix belongs in this entry, not in the run's keys
        raise ConfigError(f"bench.variants entry {overrides!r}: {exc} (in this entry)") from None
    return merged
