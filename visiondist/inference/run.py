"""Predicting: the batch loop both entries share, `predict` (a generator of per-image results, for a
notebook or a script) and `predict_ranks` (every rank of `tools/predict.py`: its share of the
source's batches, written as parts, then merged by rank 0: `inference/finish.py`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union, cast

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from visiondist.config import ConfigError
from visiondist.config.compose import compose, detection_data_for, run_config
from visiondist.config.schema import PredictConfig
from visiondist.data.robust import READ_ERRORS
from visiondist.data.sampler import eval_shard
from visiondist.data.workers import close_loaders, register, watched
from visiondist.inference.finish import finish
from visiondist.inference.job import (
    batch_size,
    check_file,
    drawn_count,
    recorded_data,
    request,
    run_of_weights,
    weights_of_run,
)
from visiondist.inference.model import Predictor, load_model
from visiondist.inference.names import count_classes, kept_labels, read_names
from visiondist.inference.outputs import (
    PartWriter,
    batches,
    done,
    draw,
    drawn_name,
    read_manifest,
    remaining,
    save_drawn,
    write_manifest,
)
from visiondist.inference.sources import Source, VideoFrames, resolve_source
from visiondist.models import TASKS
from visiondist.models.weights_check import weights_settings
from visiondist.observe.console import setup_logging
from visiondist.observe.progress import tracked
from visiondist.plan import check
from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class Items(Dataset):
    """Item i of a source, read by the one reader and prepared as the run's evaluation prepares it:
    (index, tensor, (width, height), error, the upright image when it is to be drawn). An unreadable
    file gives its reason instead."""

    def __init__(self, source: Source, predictor: Predictor, drawn: int):
        self.source, self.predictor, self.drawn = source, predictor, drawn
        self.frames: Optional[VideoFrames] = None

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        try:
            if self.source.video:
                self.frames = self.frames or VideoFrames(self.source.video)
            image = self.source.image(i, self.frames)
        except READ_ERRORS as exc:
            return i, None, (0, 0), _reason(exc), None
        size = (int(image.shape[1]), int(image.shape[0]))
        return i, self.predictor.prepare(image, i), size, None, image if i < self.drawn else None


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, FileNotFoundError):
        return "no such file"
    return text.split(": ", 1)[-1] if text.startswith("cannot decode image ") else text


def _collate(items: list) -> list:
    return items


def loader(
    source: Source, predictor: Predictor, mine: Sequence[range], drawn: int, workers: int
) -> DataLoader:
    """The loader of this rank's batches (whole batches of the source's order), with the run's
    loader options; a video is read by one worker, in order."""
    # the launching process reads this module (check_classes): the loaders' imports stay out of it
    from visiondist.data.loaders import loader_options  # noqa: PLC0415 (albumentations: 0.7 s)

    data = predictor.cfg.data
    options = loader_options(
        OmegaConf.merge(data, {"num_workers": workers}) if workers >= 0 else data,
        pin_memory=predictor.device.type == "cuda",
        collate_fn=_collate,
    )
    if source.video and options["num_workers"] > 1:
        options.update(num_workers=1)
    return register(
        DataLoader(
            Items(source, predictor, drawn), batch_sampler=[list(b) for b in mine], **options
        )
    )


def run_batches(
    predictor: Predictor,
    source: Source,
    batches_in: DataLoader,
    draw_into: Optional[Path],
    progress: bool = False,
    total: Optional[int] = None,
    name_bad: bool = True,
) -> Iterator[list[dict[str, Any]]]:
    """Each batch's records, in order: the result of every readable item, the `error` of every other
    (named once in the log unless not `name_bad`). Items to be drawn are drawn into `draw_into`."""
    for items in tracked(
        watched(iter(batches_in)), progress, "predict", total=total or len(batches_in)
    ):
        good = [item for item in items if item[1] is not None]
        results = predictor([item[1] for item in good]) if good else []
        by_index = {item[0]: result for item, result in zip(good, results)}
        records = []
        for i, _, (width, height), error, image in items:
            record: dict[str, Any] = {"index": i, "file": source.name(i)}
            if error is not None:
                if name_bad:
                    log.warning("skipped %s: %s", source.name(i), error)
                record["error"] = error
            else:
                record.update(width=width, height=height, **by_index[i])
                if image is not None and draw_into is not None:
                    save_drawn(draw_into / drawn_name(i, source.name(i)), draw(image, record))
            records.append(record)
        yield records


def predict(
    source: Union[str, Source],
    run_dir: Optional[str] = None,
    weights: Optional[str] = None,
    step=None,
    overrides: Sequence[str] = (),
    device: Optional[str] = None,
    keep_index: bool = False,
    **settings: Any,
) -> Iterator[dict[str, Any]]:
    """Predict with a trained model: a result dict per item of `source`, as each batch is done.

    Per-image results of a trained model on `source` (an image, a folder, a glob, a .txt list or
    a video), one dict per item in the source's order: `file`, `width`, `height` and a classifier's
    `top` ([{label, name, prob}]) or a detector's `detections` ([{box (x0, y0, x1, y1 in pixels),
    score, label, name, category_id, mask (COCO RLE)}]), or `error` for a file that cannot be read.
    The model comes from `run_dir` (its model.safetensors, or its checkpoint `step`) or `weights`
    (with `overrides` such as "model=vit_small", "data=imagenet"); `settings` are predict's (topk,
    score_thresh, max_det, classes, batch_size). `device`: "cuda", "cpu" (default: the GPU when
    there is one). Nothing is written.

        from visiondist.inference import predict
        for r in predict("photos/", run_dir="outputs/2026-11-21/21-10-24"):
            print(r["file"], r["top"][0]["name"])

    A bad source, weights or setting raises ConfigError here, before the model is loaded.

    Args:
        source: an image, a folder, a glob, a .txt list of images or a video; or its `Source`
            (`visiondist.predict`'s images in memory).
        run_dir: a training run (give this or `weights`).
        weights: a weights file, checkpoint or from_pretrained directory (with `overrides`).
        step: the run's checkpoint: a step number or "best"; None: its model.safetensors, else
            its newest checkpoint.
        overrides: config overrides for `weights`, e.g. "model=vit_small", "data=imagenet".
        device: "cuda" or "cpu"; None: the GPU when there is one.
        keep_index: each record keeps its item's position in the source ("index").
        **settings: predict's settings (topk, score_thresh, max_det, classes, batch_size,
            vid_stride).

    Returns:
        A generator of one result dict per item.
    """
    spec = source.spec if isinstance(source, Source) else source
    cfg = prediction_config(run_dir, weights, step, overrides, {"source": spec, **settings})
    items = (
        source
        if isinstance(source, Source)
        else resolve_source(source, int(cfg.predict.vid_stride))
    )
    device_ = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = read_names(cfg)
    check_detector_settings(cfg)
    if cfg.predict.classes:
        check_classes(cfg, names)
    return _records(Predictor(cfg, load_model(cfg, device_), device_, names), items, keep_index)


def _records(
    predictor: Predictor, items: Source, keep_index: bool = False
) -> Iterator[dict[str, Any]]:
    order = batches(len(items), batch_size(predictor.cfg))
    try:  # no log line per unreadable file: its record carries the error
        for records in run_batches(
            predictor, items, loader(items, predictor, order, 0, -1), None, name_bad=False
        ):
            for record in records:
                if not keep_index:
                    record.pop("index")
                yield record
    finally:
        close_loaders()


def check_detector_settings(cfg: DictConfig) -> None:
    """A classifier's prediction given a detector's settings (`score_thresh`, `max_det`,
    `save_txt` away from their defaults): ConfigError naming them, as `classes=` is refused, since
    they would change nothing it writes."""
    if TASKS[cfg.model.family] == "detection":
        return
    p, default = cfg.predict, PredictConfig()
    given = [
        f"{key}={str(p[key]).lower() if isinstance(p[key], bool) else p[key]}"
        for key in ("score_thresh", "max_det", "save_txt")
        if p.get(key) is not None and p[key] != getattr(default, key)
    ]
    if given:
        what = "a detector setting" if len(given) == 1 else "detector settings"
        raise ConfigError(
            f"{', '.join(given)}: {what}; "
            f"{cfg.model.name} is a classifier, whose predictions.csv ranks every class (topk=<k> "
            "keeps the k most likely)"
        )


def check_classes(cfg: DictConfig, names) -> None:
    """`predict.classes` against the model: a detector's classes it was trained for (else
    ConfigError naming them); a classifier takes none."""
    if TASKS[cfg.model.family] != "detection":
        raise ConfigError(
            f"classes={','.join(map(str, cfg.predict.classes))}: keeps a detector's classes; "
            f"{cfg.model.name} is a classifier, whose predictions.csv ranks every class (topk=<k> "
            "keeps the k most likely)"
        )
    kept_labels(list(cfg.predict.classes), names)


def prediction_config(
    run_dir: Optional[str],
    weights: Optional[str],
    step,
    overrides: Sequence[str],
    settings: dict[str, Any],
) -> DictConfig:
    """The config a prediction runs under.

    A run's config.yaml with its weights (model.safetensors, else its newest checkpoint, or
    checkpoint `step`), or configs/ composed with `overrides` for `weights`; `settings` into
    `predict`. Checked as tools/predict.py checks it (ConfigError).

    Args:
        run_dir: a training run (give this or `weights`).
        weights: a weights file, checkpoint or from_pretrained directory.
        step: the run's checkpoint: a step number or "best"; None: as said above.
        overrides: config overrides (`weights`: what model and data it is).
        settings: the `predict` group's values (source, topk, score_thresh, ...).

    Returns:
        The resolved config.
    """
    if (run_dir is None) == (weights is None):
        raise ConfigError(
            "give run_dir=<run> (a training run) or weights=<file> with model=... data=..."
        )
    if weights is not None:  # a ViT's format=hf directory: its weights
        from visiondist.models.exported import weights_file  # noqa: PLC0415 (onnx: its files')

        weights = str(weights_file(Path(weights).expanduser()))
    own_run = None if weights is None else run_of_weights(Path(weights), overrides)
    run = run_dir if run_dir is not None else own_run
    if run is not None:
        cfg = run_config(run, list(overrides))
        cfg.model.weights = str(
            Path(weights).expanduser().resolve()
            if weights is not None
            else weights_of_run(Path(str(run_dir)), step, cfg)
        )
    else:
        assert weights is not None  # one of the two (checked above)
        path = Path(weights).expanduser().resolve()
        said = weights_settings(path, list(overrides), "predict()", data_needed=False)
        said += detection_data_for(CONFIGS, said + list(overrides))  # as tools/predict.py does
        cfg = compose(CONFIGS, said + list(overrides))
        cfg.model.weights = str(path)
        count_classes(cfg, path)
        # an export's record
        preprocessing = {"data": recorded_data(Path(cfg.model.weights), list(overrides))[0]}
        cfg = cast(DictConfig, OmegaConf.merge(cfg, preprocessing))
        check_file(cfg, path)
    cfg.model.init_from = None
    cfg = cast(DictConfig, OmegaConf.merge(cfg, {"predict": settings}))
    check(cfg, mandatory=False)
    return cfg


def predict_ranks(cfg: DictConfig, layout, out: Path) -> dict[str, Any]:
    """Entry point of every rank of tools/predict.py (module doc of
    `visiondist.inference.outputs`).

    Args:
        cfg: the prediction's config (`prediction_config`'s, as tools/predict.py makes it).
        layout: this rank's `Layout` (device, ranks).
        out: the prediction's directory (parts, outputs, predict.json).

    Returns:
        On rank 0 the counts of what was written and the seconds taken; {} on the others.
    """
    setup_logging(out, layout.is_main, "predict.log")
    source = resolve_source(cfg.predict.source, int(cfg.predict.vid_stride))
    PROGRESS.at("loading the weights")
    names = read_names(cfg)
    predictor = Predictor(cfg, load_model(cfg, layout.device), layout.device, names)
    size, ask = batch_size(cfg), request(cfg, source)
    if layout.is_main:
        before = read_manifest(out)
        started = before.get("started") if before and before.get("request") == ask else None
        write_manifest(
            out,
            {
                "request": ask,
                "state": "running",
                "started": started or time.time(),
                "names from": names.read_from,
                **({"images read": predictor.reads} if predictor.reads else {}),
            },
        )
        log.info(
            "predicting %s with %s (%sclasses from %s%s)",
            source.describe(),
            cfg.model.weights,
            f"run by {predictor.model.runtime}; " if hasattr(predictor.model, "runtime") else "",
            names.read_from,
            f"; images read {predictor.reads}" if predictor.reads else "",
        )
    dist.barrier()
    all_batches = batches(len(source), size)
    todo = remaining(all_batches, done(out, len(source)))
    if layout.is_main and len(todo) < len(all_batches):
        log.info(
            "continuing: %d of %d batches were predicted before; %d to go",
            len(all_batches) - len(todo),
            len(all_batches),
            len(todo),
        )
    mine = (
        [todo[k] for k in eval_shard(len(todo), layout.dp_rank, layout.dp)]
        if layout.tp == layout.pp == 1
        else []
    )
    drawn = drawn_count(cfg, len(source)) if not source.video else 0
    writer = PartWriter(out, layout.rank)
    start = time.perf_counter()
    PROGRESS.at("predicting")
    finished = False
    try:
        for records in run_batches(
            predictor,
            source,
            loader(source, predictor, mine, drawn, -1),
            out / "images" if drawn else None,
            bool(cfg.trainer.progress) and layout.is_main,
        ):
            writer.write(records)
        finished = True
    finally:
        writer.close()
        close_loaders()
        # a stop or a failure: what the parts hold is kept for the next attempt
        if not finished and layout.is_main:
            manifest = read_manifest(out) or {}
            manifest.update(state="stopped", stopped=time.time())
            write_manifest(out, manifest)
            log.info(
                "prediction stopped: the batches written to %s/parts are kept; the same command "
                "continues",
                out,
            )
    seconds = time.perf_counter() - start
    dist.barrier()
    if not layout.is_main:
        return {}
    return finish(
        cfg, out, source, predictor, names, seconds, sum(len(b) for b in todo), layout.world_size
    )


predict_ranks.run_kind = "predict"  # type: ignore[attr-defined]  # its default run dir: <output dir>/predict/...
