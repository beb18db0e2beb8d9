"""The configuration: its schema (`schema`, the dataclasses behind `configs/`), composition
(`compose`), validation (`validate`), the resolved layout (`layout.RunLayout`, with the pipeline
arithmetic) and data.resolution=native's settings (`resolution`). No torch at import time.

Hydra composes the YAML groups into the dataclasses, so a misspelt key or a value of the wrong type
fails at composition; `validate` then checks what types cannot express (ranges, divisibility) and
raises one `ConfigError` whose message names the fix. Both happen before any rank is started.
"""

from visiondist.config.compose import compose, from_container, register_schema, to_container
from visiondist.config.schema import (
    BenchConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ScheduleConfig,
    SyntheticConfig,
    TrainConfig,
    TrainerConfig,
)
from visiondist.config.validate import check_mandatory, validate
from visiondist.config.variants import variant_config

__all__ = [
    "BenchConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "SyntheticConfig",
    "TrainConfig",
    "TrainerConfig",
    "check_mandatory",
    "compose",
    "from_container",
    "register_schema",
    "to_container",
    "validate",
    "variant_config",
]
