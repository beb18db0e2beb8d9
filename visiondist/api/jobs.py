"""The jobs of training, evaluation and export, one code path for the tools and the Python API:
tools/train.py, eval.py and export.py are shells over the `*_job` functions here, and so are
`visiondist.train`, `evaluate` and `export` (`api.run`): the same files, the same refusals in the
same one line (`ConfigError`).

The launcher, the trainer and the exporters (torch, about 2 s) are imported when a job runs, not
with `import visiondist` (`# noqa: PLC0415 (a job's)`)."""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union, cast

from omegaconf import DictConfig, OmegaConf

from visiondist.api.callbacks import TrainWithCallbacks, unpack
from visiondist.cli.load import checked, load_run_config, load_weights_config
from visiondist.config import ConfigError
from visiondist.runs import completed_step, train_longer

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXPORT_SUFFIX = {
    "safetensors": ".safetensors",
    "onnx": ".onnx",
    "pt2": ".pt2",
    "torchscript": ".pt",
    "hf": "_hf",
    "naflex": "_naflex.safetensors",
    "openvino": "_openvino.xml",
}
# exporters' loggers that speak per initializer or per pass (a few hundred lines an ONNX export)
CHATTY = (
    "onnxscript",
    "onnx_ir",
    "torch.onnx",
    "torch._dynamo",
    "torch.export",
    # torch.compile on a machine without CUDA: "No CUDA runtime is found, using CUDA_HOME"
    "torch.utils.cpp_extension",
    # a library importing torchao (transformers' loaders): its Enums registered with pytree
    "torch.utils._pytree",
)


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """At the API's edge: a refusal is one `ConfigError` line, raised from here (not from deep
    inside the config's composition)."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None


def _value(value: Any) -> str:
    """A Python value as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    text = str(value)
    if re.fullmatch(r"[\w./:@+-]+", text) and text not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def as_overrides(overrides: Sequence[str], settings: Mapping[str, Any]) -> list[str]:
    """`overrides` (as the tools take them) and nested keyword `settings` as one override list:
    `trainer={"max_steps": 10}` is `trainer.max_steps=10`, `model="vit_tiny"` is `model=vit_tiny`.

    Args:
        overrides: "group=option" / "group.key=value" strings.
        settings: keys (dotted or not) to values, a mapping for a group's keys.

    Returns:
        The overrides, `overrides` first.
    """
    out = []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(
                f"{item!r}: give overrides as the tools take them, e.g. 'model=vit_tiny' or "
                "'trainer.max_steps=10', or as keywords: trainer={'max_steps': 10}"
            )
        out.append(item)

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{prefix}.{key}", inner)
        else:
            out.append(f"{prefix}={_value(value)}")

    for key, value in settings.items():
        walk(key, value)
    return out


def train_job(
    cfg: DictConfig, packed: Optional[bytes] = None, stop_returns: bool = False
) -> tuple[Optional[Path], dict[int, list]]:
    """tools/train.py's job: a composed, checked config trained on its ranks.

    Args:
        cfg: the config (`load_config`).
        packed: the callbacks (`callbacks.pack`), or None.
        stop_returns: a stop signal returns the stopped run (its line printed); otherwise
            `JobStopped` is raised (the tool exits 128 + the signal).

    Returns:
        The run dir (None on a node of a pod's job that does not know it: node 0 chose it), and
        each rank's callbacks as it ended the run (by rank).
    """
    from visiondist.engine.run import train as train_rank  # noqa: PLC0415 (a job's)
    from visiondist.launch import JobStopped, launch  # noqa: PLC0415 (a job's)

    step = completed_step(cfg)
    if step is not None:  # e.g. a requeued cluster job: nothing to do, nothing rewritten
        print(
            f"{cfg.trainer.run_dir} is complete at step {step}: nothing to do (to train longer, "
            f"{train_longer(cfg, step)})",
            flush=True,
        )
        return Path(cfg.trainer.run_dir), {}
    results: dict[int, Any] = {}
    entry = TrainWithCallbacks(packed) if packed is not None else train_rank
    try:
        launch(entry, cfg, results=results)
    except JobStopped as stopped:
        if not stop_returns or not results:
            raise
        if str(stopped):
            print(stopped, flush=True)
    callbacks = unpack(results)
    first = results[min(results)] if results else {}
    where = first.get("run dir") if isinstance(first, dict) else None
    where = where or cfg.trainer.run_dir
    return (Path(where) if where else None), callbacks


def benchmark_job(cfg: DictConfig) -> list[dict[str, Any]]:
    """tools/benchmark.py's job: the config's training step timed beside plain PyTorch loops built
    from it, on the config's ranks; results.jsonl and results.md in its run dir (or
    bench.results_dir).

    Returns:
        One result row per configuration (rank 0's).
    """
    if cfg.data.get("resolution", "square") == "native":
        raise ConfigError(
            "tools/benchmark.py times square batches against plain loops of them; "
            "data.resolution=native is measured by benchmarks/native.py (square and native steps "
            "side by side): drop data.resolution=native here"
        )
    from visiondist.bench.harness import run_benchmark  # noqa: PLC0415 (a job's)
    from visiondist.launch import launch  # noqa: PLC0415 (a job's)

    results: dict[int, Any] = {}
    # Ctrl-C / SIGTERM: the step in flight finishes, nothing is recorded (launch.JobStopped)
    launch(run_benchmark, cfg, results=results)
    rows = results.get(min(results)) if results else None
    return [rows] if isinstance(rows, dict) else list(rows or [])


def evaluation_config(
    run_dir: Optional[Union[str, Path]] = None,
    step: Optional[Union[int, str]] = None,
    weights: Optional[Union[str, Path]] = None,
    overrides: Sequence[str] = (),
    tool: str = "eval.py",
) -> tuple[DictConfig, Optional[Path]]:
    """The config an evaluation runs under (tools/eval.py's `run_dir=` / `step=` / `weights=`):
    a run's config.yaml with its weights, or configs/ composed with `overrides` for `weights`.

    Returns:
        The config, and the folder whose eval/ gets the results (the run's; None: the output dir).
    """
    from visiondist.inference.job import recorded_data, weights_of_run  # noqa: PLC0415 (a job's)

    if weights is not None and run_dir is not None:
        raise ConfigError(
            "give run_dir=<run> (evaluated under its config.yaml) or weights=<file> (under the "
            "config of group=option / key=value), not both"
        )
    if step is not None and run_dir is None:
        raise ConfigError(f"step={step} picks a checkpoint of a run: add run_dir=<run>")
    if weights is not None:
        path = Path(weights).expanduser()
        if not path.exists():
            raise ConfigError(f"weights={weights}: no such file or checkpoint directory")
        from visiondist.models.exported import weights_file  # noqa: PLC0415 (a job's)

        path = weights_file(path)  # a ViT's format=hf directory: its weights
        cfg = load_weights_config(CONFIGS, path, list(overrides), tool, data_needed=True)
        base = None
        # an export: scored with the run's preprocessing, as the export recorded it
        data, said = recorded_data(path, list(overrides))
        if said:
            print(said, flush=True)
            cfg = cast(DictConfig, OmegaConf.merge(cfg, {"data": data}))
    elif run_dir is not None:
        base = Path(run_dir).expanduser()
        cfg = load_run_config(base, list(overrides), inputs=None)
        _warn_if_trained_on(base, cfg)
        path = weights_of_run(base, step_of(step) if step is not None else None, cfg)
    else:
        raise ConfigError(
            "give run_dir=<run dir> (a training run) or weights=<file> with model=... data=...: "
            "--help shows both"
        )
    cfg.model.weights = str(path.resolve())
    cfg.model.init_from = None  # a fine-tuned run: its own weights, not the ones it started from
    return cfg, base


def _warn_if_trained_on(run_dir: Path, cfg: DictConfig) -> None:
    """A warning when the split to be scored is the one the run trained on (`data.val_split=train`,
    or a run that trained with both splits the same): its scores measure how well the model fits
    those images, not how it does on new ones."""
    trained = cast(DictConfig, OmegaConf.load(run_dir / "config.yaml")).get("data", {})
    d = cfg.data
    same_root = str(Path(str(trained.get("root"))).expanduser()) == str(
        Path(str(d.get("root"))).expanduser()
    )
    if same_root and d.val_split == trained.get("train_split"):
        log.warning(
            "data.val_split=%s is the split %s trained on: these scores measure how well the "
            "model fits its training images, not how it does on new ones",
            d.val_split,
            run_dir,
        )


def step_of(value: Any) -> Union[int, str]:
    """A checkpoint's step as given (`step=500`, `step=best`); ConfigError for anything else."""
    if value == "best":
        return value
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(
            f"step={value}: give a checkpoint's step number, e.g. step=500, or step=best"
        ) from None


def evaluate_job(cfg: DictConfig, base: Optional[Path], own_dir: bool = False) -> dict[str, Any]:
    """tools/eval.py's job: the weights in `cfg.model.weights` evaluated on the val split, on the
    config's ranks; eval.json and the rest into `<base>/eval/<date>_<time>/`.

    Returns:
        The evaluation's metrics (rank 0's).
    """
    from visiondist.inference.names import check_same_classes  # noqa: PLC0415 (a job's)

    try:  # the val split and the weights against the model, before any rank starts
        checked(cfg, "eval")
        check_same_classes(cfg, "model.weights")
    except ConfigError as exc:
        if base is not None:  # run_dir=: the run's own weights
            raise
        raise ConfigError(str(exc).replace("model.weights=", "weights=")) from None
    from visiondist.engine.run import evaluate_checkpoint  # noqa: PLC0415 (a job's)
    from visiondist.launch import launch  # noqa: PLC0415 (a job's)

    if not own_dir:  # eval/<date>_<time> under `base`
        cfg.trainer.run_dir = None
        cfg.trainer.output_dir = str(base) if base is not None else cfg.trainer.output_dir
    results: dict[int, Any] = {}
    launch(evaluate_checkpoint, cfg, results=results)
    return dict(results[min(results)]) if results else {}
