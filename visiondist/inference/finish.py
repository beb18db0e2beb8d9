"""Rank 0's end of a prediction of `tools/predict.py` (`run.predict_ranks`), once every rank is
done: the parts merged into the outputs (`inference/outputs.py`), a detector's results.json keyed
by the annotation file's image ids where the source is the run's val images, the manifest marked
complete, and the summary line."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from visiondist.data.formats.exports import coco_paths
from visiondist.inference.job import drawn_count
from visiondist.inference.model import Predictor
from visiondist.inference.outputs import (
    merged,
    read_manifest,
    write_classifications,
    write_detections,
    write_manifest,
    write_video,
)
from visiondist.inference.sources import Source
from visiondist.observe.console import shown_path

log = logging.getLogger(__name__)


def finish(
    cfg: DictConfig,
    out: Path,
    source: Source,
    predictor: Predictor,
    names,
    seconds: float,
    predicted: int,
    ranks: int,
) -> dict[str, Any]:
    """Rank 0, once every rank is done: the parts merged into the outputs, the manifest marked
    complete, the summary printed."""
    if predictor.task == "classification":
        counts = write_classifications(merged(out), out, predictor.topk)
        files = ["predictions.csv"]
    else:
        ids = _val_image_ids(cfg, source)
        save_txt = bool(cfg.predict.get("save_txt", False))
        counts = write_detections(
            merged(out), out, lambda r: ids.get(r["file"], r["index"] + 1), save_txt
        )
        files = ["detections.jsonl", "results.json", *(["labels/"] if save_txt else [])]
    if source.video and cfg.predict.save_images != "0":
        video = out / f"{Path(source.video).stem}_predicted.mp4"
        if write_video(merged(out), source.video, source.frames, source.fps, video):
            files.append(video.name)
    drawn = drawn_count(cfg, len(source)) if not source.video else 0
    if drawn:
        files.append(f"images/ ({min(drawn, counts['images'])} drawn)")
    if counts["unreadable"]:
        files.append("unreadable.txt")
    manifest = read_manifest(out) or {}
    manifest.update(state="complete", finished=time.time(), counts=counts)
    write_manifest(out, manifest)
    rate = predicted / seconds if seconds > 0 else 0.0
    kind = "frame" if source.video else "image"
    found = (
        f", {_count(counts['detections'], 'detection')} (score >= "
        f"{float(cfg.predict.score_thresh):g})"
        if "detections" in counts
        else ""
    )
    bad = (
        f" ({_count(counts['unreadable'], 'unreadable file')} skipped: unreadable.txt)"
        if counts["unreadable"]
        else ""
    )
    log.info(
        "predicted %s%s%s; this attempt: %s in %.1f s, %.1f %ss/s on %s",
        _count(counts["images"], kind),
        found,
        bad,
        _count(predicted, "item"),
        seconds,
        rate,
        kind,
        _count(ranks, "rank"),
    )
    print(
        f"predict dir: {shown_path(out)} ({', '.join([*files, 'predict.json', 'predict.log'])})",
        flush=True,
    )
    return {"counts": counts, "seconds": seconds, "dir": str(out)}


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _val_image_ids(cfg: DictConfig, source: Source) -> dict[str, int]:
    """The annotation file's image id of each source file that is one of the run's val images (so
    that results.json scores against that file as eval.py's detections.json does); empty when none
    is."""
    d = cfg.data
    # predicted from weights with no data.root: no annotation file to match
    if source.video or d.get("format") == "shards" or OmegaConf.is_missing(d, "root"):
        return {}
    try:
        images, ann = coco_paths(d, d.val_split)
        if not ann.is_file():
            return {}
        by_path = {
            str((images / im["file_name"]).resolve()): int(im["id"])
            for im in json.loads(ann.read_text())["images"]
        }
    except (OSError, ValueError, KeyError, AttributeError, MissingMandatoryValue):
        return {}
    return {
        source.name(i): by_path[p]
        for i, p in enumerate(map(lambda s: str(Path(s).resolve()), source.paths))
        if p in by_path
    }
