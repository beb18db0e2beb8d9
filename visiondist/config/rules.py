"""The two rules most keys follow: one of a list of values, a finite number above 0."""

from __future__ import annotations

import math
from typing import Any

from visiondist.config.schema import ConfigError


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported: use one of {', '.join(allowed)}")


def positive(key: str, value: float, allow_zero: bool = False, fix: str = "") -> None:
    """`value` a finite number above 0 (or 0 with `allow_zero`), else a refusal: `fix` after the
    value where given, "must be > 0" otherwise."""
    if math.isfinite(value) and (value > 0 or (value == 0 and allow_zero)):
        return
    if fix:
        raise ConfigError(f"{key}={value:g}: {fix}")
    finite = "a finite number " if not math.isfinite(value) else ""
    raise ConfigError(f"{key}={value} must be {finite}{'>= 0' if allow_zero else '> 0'}")
