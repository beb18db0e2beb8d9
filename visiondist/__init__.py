"""visiondist: distributed training for vision models.

    import visiondist
    run = visiondist.train("model=vit_tiny", trainer={"max_steps": 10})
    run.evaluate(); run.export("onnx")
    for result in visiondist.predict("photos/", run=run): ...

`train`, `evaluate`, `predict`, `export` and `Run` are `visiondist.api`'s (docs/python.md),
imported on first use; a refusal is a `ConfigError`, a failed rank a `RunFailed`.
"""

from visiondist.utils.lazy import lazy_exports
from visiondist.utils.procenv import set_process_defaults

# before torch (OpenMP) and albumentations are imported here or in a process started from here
set_process_defaults()

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "api": ("Run", "Result", "train", "evaluate", "predict", "export", "benchmark"),
        "config": ("ConfigError",),
        "launch": ("RunFailed",),
        "engine.hooks.callbacks": ("CallbackState",),
    },
)
