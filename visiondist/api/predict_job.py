"""tools/predict.py's job, which `visiondist.predict(..., save=True)` runs too: the files of a
prediction (predictions.csv or COCO results, drawn images, labels) written by the config's ranks,
each with whole batches of the source, continued when asked again.

The launcher and the model's loading (torch, 2 s) are imported when the job runs
(`# noqa: PLC0415 (a job's)`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf, open_dict

from visiondist.api.jobs import CONFIGS, step_of
from visiondist.cli.load import load_run_config, load_weights_config
from visiondist.config import ConfigError
from visiondist.inference.job import (
    check_file,
    recorded_data,
    request,
    run_of_weights,
    weights_of_run,
)
from visiondist.inference.outputs import read_manifest
from visiondist.inference.sources import resolve_source

# one model a rank: prediction shards the images, never the model (whatever layout trained it)
ONE_MODEL_A_RANK = {
    "name": "ddp",
    "dp": -1,
    "tp": 1,
    "pp": 1,
    "sequence_parallel": False,
    "fsdp": False,
    "offload": False,
    "auto": False,
    "activation_checkpointing": False,
}


def prediction_job_config(
    run_dir: Optional[Union[str, Path]],
    weights: Optional[Union[str, Path]],
    step: Optional[Union[int, str]],
    overrides: Sequence[str],
    settings: dict[str, Any],
    tool: str = "predict.py",
    check_weights: bool = True,
) -> tuple[DictConfig, Optional[Path]]:
    """The config a prediction job runs under: a run's config.yaml with its weights (or checkpoint
    `step`), or configs/ composed with `overrides` for `weights`; `settings` into `predict`.

    Returns:
        The config, and the folder whose predict/ gets the files (the run's; None: the output dir).
    """
    if (run_dir is None) == (weights is None):
        raise ConfigError(
            "give run_dir=<run> (a training run) or weights=<file> with model=... data=...: --help "
            "shows both"
        )
    if step is not None and run_dir is None:
        raise ConfigError(f"step={step} picks a checkpoint of a run: add run_dir=<run>")
    base: Optional[Path] = None
    if run_dir is not None:
        base = Path(run_dir).expanduser()
        cfg = load_run_config(base, list(overrides), inputs=None)
        path = weights_of_run(base, None if step is None else step_of(step), cfg)
    else:
        path = Path(str(weights)).expanduser()
        if not path.exists():
            raise ConfigError(f"weights={weights}: no such file or checkpoint directory")
        from visiondist.models.exported import weights_file  # noqa: PLC0415 (a job's)

        path = weights_file(path)  # a ViT's format=hf directory: its weights
        own_run = run_of_weights(path, list(overrides))
        if own_run is not None:  # a run's own file: predicted under its config.yaml
            base = own_run
            cfg = load_run_config(own_run, list(overrides), inputs=None)
        else:
            cfg = load_weights_config(CONFIGS, path, list(overrides), tool, data_needed=False)
        if check_weights and own_run is None:  # --cfg prints the config, reading no weights
            from visiondist.inference.names import count_classes  # noqa: PLC0415 (a job's)

            count_classes(cfg, path)  # before the check, which compares the file with the count
            check_file(cfg, path)
    data: dict[str, Any] = {}
    if base is None:  # an export: the run's own eval preprocessing, as the export recorded it
        data, said = recorded_data(path, overrides)
        if said:
            print(said, flush=True)
    merged = OmegaConf.merge(
        cfg,
        {
            "predict": settings,
            "data": data,
            "model": {"weights": str(path.resolve()), "init_from": None},
            "parallel": ONE_MODEL_A_RANK,
        },
    )
    return merged, base  # type: ignore[return-value]


def check_settings(values: Any) -> None:
    """A prediction's numbers as tools/predict.py and `predict()` take them (a config's `predict`
    or the keyword arguments given): the first out of range, in one line naming it."""
    for key, least in (("topk", 1), ("max_det", 1), ("vid_stride", 1), ("batch_size", 0)):
        value = values.get(key)
        if value is not None and (not isinstance(value, int) or value < least):
            default = " (0: data.eval_batch_size)" if key == "batch_size" else ""
            raise ConfigError(f"{key}={value}: give a whole number, {least} or more{default}")
    value = values.get("score_thresh")
    if value is not None and not 0 <= float(value) <= 1:
        raise ConfigError(f"score_thresh={value}: give a score in [0, 1]")


def predict_job(cfg: DictConfig, base: Optional[Path]) -> Optional[Path]:
    """The prediction's files, written by the config's ranks.

    Returns:
        The folder that holds them (None: nothing was predicted).
    """
    p = cfg.predict
    check_settings(p)
    if str(p.save_images).lower() in ("false", "none"):  # save_images=false: none drawn
        with open_dict(cfg):
            p.save_images = "0"
    if str(p.save_images).lower() != "all" and not str(p.save_images).isdigit():
        raise ConfigError(
            f"save_images={p.save_images}: give a count (default 32; 0 or false: none) or all"
        )
    # a missing or empty source: refused here, in one line
    source = resolve_source(p.source, int(p.vid_stride))
    from visiondist.inference.names import read_names  # noqa: PLC0415 (a job's)
    from visiondist.inference.run import (  # noqa: PLC0415 (a job's)
        check_classes,
        check_detector_settings,
    )

    names = read_names(cfg)
    check_detector_settings(cfg)
    if p.classes:
        # a classifier's, or classes the detector was not trained for: refused here
        check_classes(cfg, names)
    out, state = _choose_out(cfg, base, source)
    if state == "complete" and out is not None:
        # an earlier attempt of the same request that predicted nothing answers as it did
        _refuse_nothing(out, (read_manifest(out) or {}).get("counts", {}), p.source)
        print(
            f"complete: {out} already holds this prediction (predict.json); give out=<dir> to "
            "predict again",
            flush=True,
        )
        return out
    if out is not None:
        cfg.trainer.run_dir = str(out)
        cfg.trainer.resume = "auto"  # an earlier attempt's directory is continued, not refused
        if state == "running":
            print(f"continuing the prediction in {out}", flush=True)
    else:
        cfg.trainer.run_dir = None
        cfg.trainer.output_dir = str(base) if base is not None else cfg.trainer.output_dir
    from visiondist.inference.run import predict_ranks  # noqa: PLC0415 (a job's)
    from visiondist.launch import launch  # noqa: PLC0415 (a job's)

    results: dict[int, Any] = {}
    launch(predict_ranks, cfg, results=results)
    first = results.get(min(results)) if results else None
    if not isinstance(first, dict) or not first.get("dir"):
        return out
    folder = Path(first["dir"])
    _refuse_nothing(folder, first.get("counts", {}), p.source)
    return folder


def _refuse_nothing(folder: Path, counts: dict[str, Any], source: Any) -> None:
    """A prediction of nothing but unreadable files is an error (exit 2), whenever it is asked."""
    if counts.get("images") == 0 and counts.get("unreadable"):
        n = counts["unreadable"]
        which = "the only file" if n == 1 else f"all {n} files"
        raise ConfigError(
            f"predicted nothing: {which} of source={source} {'is' if n == 1 else 'are'} "
            f"unreadable ({folder / 'unreadable.txt'} names each with its reason)"
        )


def _choose_out(cfg: DictConfig, base: Optional[Path], source: Any) -> tuple[Optional[Path], str]:
    """(the directory, its state: new | running | complete) of this prediction: out=, or the newest
    earlier attempt of the same request under <run>/predict/ (a stopped one is continued); (None,
    "new") for a new default dir."""
    ask = request(cfg, source)
    if cfg.predict.out:
        out = Path(cfg.predict.out).expanduser().resolve()
        manifest = read_manifest(out)
        if manifest is None:
            if out.is_dir() and any(out.iterdir()):
                raise ConfigError(
                    f"out={cfg.predict.out} is a folder that holds no prediction: give a new or "
                    "empty folder"
                )
            return out, "new"
        if manifest.get("request") != ask:
            other = manifest.get("request", {}).get("source")
            raise ConfigError(
                f"out={cfg.predict.out} holds a prediction of {other} with other weights or "
                "settings: give another out=, or remove that folder"
            )
        return out, manifest.get("state", "running")
    parent = (base if base is not None else Path(cfg.trainer.output_dir).expanduser()) / "predict"
    earlier = (
        sorted((d for d in parent.iterdir() if d.is_dir()), reverse=True) if parent.is_dir() else []
    )
    for folder in earlier:
        manifest = read_manifest(folder)
        if manifest is not None and manifest.get("request") == ask:
            return folder.resolve(), manifest.get("state", "running")
    return None, "new"
