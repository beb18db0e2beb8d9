"""The images an export checks its file on and calibrates an integer graph with, read as the run
read them: a detection split's images that hold objects (float CHW in [0, 1], the originals), a
classification split's evaluation crops (normalised, as the model takes them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from visiondist.data.coco_records import safe_image_path


def detection_images(
    cfg: DictConfig, split: str, limit: int
) -> tuple[list[tuple[str, torch.Tensor]], Optional[str]]:
    """(name, float CHW image in [0, 1]) of up to `limit` images of the run's `split` that hold
    objects, in the annotation file's order, read as the run read them (a folder tree, or a packed
    split of `data.format=shards`), and where they come from: None for a tree (the names are the
    files' paths), else the packed split; none when the data is not on this machine."""
    try:
        from visiondist.data import detection_splits  # noqa: PLC0415 (albumentations: 0.7 s)

        val = detection_splits(cfg.data)(split, train=False)
        coco = json.loads(Path(val.ann_file).read_text())
        with_objects = {
            a["image_id"] for a in coco.get("annotations", ()) if not a.get("iscrowd", 0)
        }
        entries = [i for i in coco.get("images", ()) if i["id"] in with_objects]
    except Exception:  # no data here (or not COCO-format): a random image serves
        return [], None
    store = getattr(val, "store", None)
    source = None if store is None else f"the packed {split} split of {store.root}"
    images = []
    for entry in entries:
        try:
            image = val.image_by_id(entry)
        except (OSError, ValueError):  # unreadable: the next one
            continue
        name = (
            entry["file_name"]
            if store is not None
            else str(safe_image_path(val.image_root, entry["file_name"]))
        )
        images.append((name, torch.from_numpy(image).permute(2, 0, 1).float().div_(255)))
        if len(images) == limit:
            break
    return images, source


def classification_crops(cfg: DictConfig, split: str, limit: int) -> torch.Tensor:
    """Up to `limit` images of a classification run's `split`, spread over it (every
    len / limit-th), as its evaluation gives them to the model: (N, 3, S, S), resized, centre
    cropped and normalised; empty (0, 3, S, S) when the data is not on this machine."""
    from visiondist.data import classification_splits  # noqa: PLC0415 (albumentations: 0.7 s)
    from visiondist.data.transforms import (  # noqa: PLC0415
        ClassificationTransform,
        Normalize,
    )

    size = int(cfg.model.img_size)
    # decoded by the one reader here, as a CPU evaluation decodes
    data = OmegaConf.merge(cfg.data, {"decode_on": "loader"})
    transform = ClassificationTransform(data, train=False, size=size, seed=int(cfg.trainer.seed))
    try:
        dataset = classification_splits(cfg.data)(split, transform)
    except Exception:  # no data here: nothing to read
        return torch.zeros(0, 3, size, size)
    step = max(1, len(dataset) // max(1, limit))
    crops = [dataset[i][0] for i in range(0, len(dataset), step)][:limit]
    if not crops:
        return torch.zeros(0, 3, size, size)
    out = Normalize(cfg.data.mean, cfg.data.std)(torch.stack(crops), torch.device("cpu"))
    assert isinstance(out, torch.Tensor)  # square crops: a tensor (native: patches)
    return out
