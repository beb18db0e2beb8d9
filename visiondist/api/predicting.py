"""Prediction from Python: `predict(source, run=... | weights=...)` yields a `Result` per image, in
the source's order, with `.plot()` (the image drawn as tools/predict.py draws it), `.save()` and an
inline picture in a notebook. The source is what tools/predict.py takes (an image, a folder, a
glob, a .txt list, a video) or images in memory: a numpy array, a PIL image, a torch tensor, or a
list of any of them and paths. Nothing is written unless asked (`.save()`)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union, overload

import numpy as np
from omegaconf import OmegaConf

from visiondist.api.jobs import as_overrides, refusals
from visiondist.config import ConfigError, TrainConfig
from visiondist.inference.sources import KINDS, Source

IN_MEMORY = "a numpy array (H, W, 3) RGB, a PIL image, a torch tensor (3, H, W) or (N, 3, H, W)"


def _array(item: Any, where: str) -> np.ndarray:
    """An image in memory as an upright HxWx3 uint8 RGB array; ConfigError for anything else."""
    if hasattr(item, "convert") and hasattr(item, "size"):  # a PIL image
        from visiondist.data.decode import upright_rgb  # noqa: PLC0415 (OpenCV: a PIL image's)

        # upright, as its file by path reads (Image.open keeps a photo's EXIF orientation)
        return upright_rgb(item)
    if hasattr(item, "detach") and hasattr(item, "cpu"):  # a torch tensor: channels first
        item = item.detach().cpu().numpy()
        if item.ndim == 3 and item.shape[0] in (1, 3, 4):
            item = np.moveaxis(item, 0, -1)
    if not isinstance(item, np.ndarray):
        raise ConfigError(
            f"{where}: {type(item).__name__} is not an image: give {KINDS}; or {IN_MEMORY}"
        )
    if item.ndim == 2:
        item = item[..., None]
    if item.ndim != 3 or item.shape[-1] not in (1, 3, 4) or min(item.shape[:2]) < 1:
        raise ConfigError(
            f"{where}: shape {tuple(item.shape)} is not an image: give an array (H, W, 3) RGB, "
            "(H, W, 4) RGBA or (H, W) grey, or a tensor (3, H, W)"
        )
    if item.dtype != np.uint8:  # floats in [0, 1], as torchvision's tensors hold them
        scale = 255.0 if np.issubdtype(item.dtype, np.floating) and item.max() <= 1.0 else 1.0
        item = np.clip(item.astype(np.float32) * scale, 0, 255).round().astype(np.uint8)
    if item.shape[-1] == 1:
        item = np.repeat(item, 3, axis=-1)
    image = np.ascontiguousarray(item[..., :3])
    return image if image.flags.writeable else image.copy()  # np.asarray(a PIL image): read-only


def as_source(source: Any) -> Union[str, Source]:
    """What `predict` was given: a path or pattern as tools/predict.py's `source=` (a string), or
    the images in memory as a `Source`."""
    if isinstance(source, (str, Path)):
        return str(source)
    batched = getattr(source, "ndim", 0) == 4
    items = list(source) if batched or isinstance(source, (list, tuple)) else [source]
    if not items:
        raise ConfigError(f"source=[]: no images: give {KINDS}; or {IN_MEMORY}")
    paths: list[str] = []
    arrays: list[Optional[np.ndarray]] = []
    for i, item in enumerate(items):
        if isinstance(item, (str, Path)):  # one that cannot be read: its Result says why
            paths.append(str(Path(item).expanduser()))
            arrays.append(None)
        else:
            paths.append(f"image{i}")
            arrays.append(_array(item, f"source[{i}]" if len(items) > 1 else "source"))
    count = f"{len(items)} image{'' if len(items) == 1 else 's'}"
    return Source(f"<{count} given in Python>", "memory", paths, arrays=arrays)


class Result:
    """One image's prediction: a classifier's `top` ([{label, name, prob}]) or a detector's
    `boxes` (x0, y0, x1, y1 in the original image's pixels), `scores`, `labels`, `names` and
    `masks`; `error` for an image that could not be read. `record` is the dict tools/predict.py
    writes for it."""

    def __init__(self, record: dict[str, Any], source: Source, index: int):
        self.record, self._source, self._index = record, source, index
        self.file: str = record["file"]
        self.error: Optional[str] = record.get("error")
        # None: not read
        self.width: Optional[int] = None if self.error else record.get("width")
        self.height: Optional[int] = None if self.error else record.get("height")
        self.top: Optional[list[dict[str, Any]]] = record.get("top")
        self.detections: Optional[list[dict[str, Any]]] = record.get("detections")

    def __repr__(self) -> str:
        if self.error:
            return f"Result({self.file!r}, error: {self.error})"
        if self.top is not None:
            best = ", ".join(f"{t['name']} {t['prob']:.2f}" for t in self.top[:3])
            return f"Result({self.file!r}, {self.width}x{self.height}, top: {best})"
        found = len(self.detections or [])
        return f"Result({self.file!r}, {self.width}x{self.height}, {found} detections)"

    @property
    def boxes(self) -> np.ndarray:
        """(n, 4) float32 boxes, x0 y0 x1 y1 in the original image's pixels."""
        return np.array([d["box"] for d in self.detections or []], np.float32).reshape(-1, 4)

    @property
    def scores(self) -> np.ndarray:
        return np.array([d["score"] for d in self.detections or []], np.float32)

    @property
    def labels(self) -> np.ndarray:
        """The model's class indexes (`names` gives their names)."""
        return np.array([d["label"] for d in self.detections or []], np.int64)

    @property
    def names(self) -> list[str]:
        return [d["name"] for d in self.detections or []]

    @property
    def masks(self) -> Optional[np.ndarray]:
        """(n, H, W) bool masks of a mask model, else None."""
        found = [d["mask"] for d in self.detections or [] if "mask" in d]
        if not found or self.width is None or self.height is None:
            return None
        from visiondist.data.masks import decode  # noqa: PLC0415 (pycocotools)

        return decode(found, self.height, self.width).astype(bool)

    def image(self) -> np.ndarray:
        """The original image, upright RGB (read again from its file)."""
        return self._source.image(self._index)

    def plot(self) -> np.ndarray:
        """The image with its result drawn (boxes, names, scores, masks; a classifier's top labels
        as a caption), as tools/predict.py draws it: an HxWx3 uint8 RGB array."""
        from visiondist.inference.outputs import draw  # noqa: PLC0415 (torchvision: 1 s)

        if self.error:
            raise ValueError(f"{self.file}: nothing to draw ({self.error})")
        return draw(self.image(), self.record)

    def save(self, path: Optional[Union[str, Path]] = None) -> Path:
        """Write `plot()` to `path`, in the format its extension names (.jpg, .png, .webp, ...;
        default: `<the image's name>_predicted.jpg` here).

        Returns:
            The written file.
        """
        from visiondist.inference.outputs import save_drawn  # noqa: PLC0415 (torchvision: 1 s)

        out = Path(path) if path else Path(f"{Path(self.file.split('#')[0]).stem}_predicted.jpg")
        save_drawn(out, self.plot())
        return out

    def _repr_png_(self) -> Optional[bytes]:
        """A notebook shows the drawn image."""
        import cv2  # noqa: PLC0415 (a notebook's display)

        if self.error:
            return None
        ok, png = cv2.imencode(".png", self.plot()[..., ::-1])
        return png.tobytes() if ok else None


@overload
def predict(
    source: Any,
    *overrides: str,
    run: Any = None,
    weights: Optional[Union[str, Path]] = None,
    step: Optional[Union[int, str]] = None,
    device: Optional[str] = None,
    save: Literal[False] = False,
    **settings: Any,
) -> Iterator[Result]: ...


@overload
def predict(
    source: Any,
    *overrides: str,
    run: Any = None,
    weights: Optional[Union[str, Path]] = None,
    step: Optional[Union[int, str]] = None,
    device: Optional[str] = None,
    save: Union[Literal[True], str, Path],
    **settings: Any,
) -> Optional[Path]: ...


def predict(
    source: Any,
    *overrides: str,
    run: Any = None,
    weights: Optional[Union[str, Path]] = None,
    step: Optional[Union[int, str]] = None,
    device: Optional[str] = None,
    save: Union[bool, str, Path] = False,
    **settings: Any,
) -> Union[Iterator[Result], Optional[Path]]:
    """Predict with a run's weights (or `weights=` under `overrides`), in this process: a `Result`
    per image of `source`, as each batch is done. Bad input raises `ConfigError` here, before the
    model is loaded. With `save`, tools/predict.py's job instead: its files, written by the
    config's ranks (`trainer={"devices": 2}`), continued when asked again; the folder is returned.

        for r in visiondist.predict("photos/", run=run):
            print(r.file, r.top[0]["name"])

    Args:
        source: a path, folder, glob, .txt list or video (as tools/predict.py's source=), or
            images in memory: a numpy array (H, W, 3) RGB, a PIL image, a tensor (3, H, W) or
            (N, 3, H, W), or a list of them and paths.
        *overrides: for `weights`: "model=...", "data=..." (what model it is).
        run: a `Run` (`api.run`) or a run dir (give this or `weights`).
        weights: a weights file, checkpoint or from_pretrained directory.
        step: the run's checkpoint (a step number or "best").
        device: "cuda" or "cpu"; None: the GPU when there is one.
        save: write tools/predict.py's files (predictions.csv or COCO results, drawn images) into
            `<run>/predict/<date>_<time>/` (True) or this folder, as the tool does.
        **settings: tools/predict.py's: topk, score_thresh, max_det, classes, batch_size,
            vid_stride; with `save` also save_images and save_txt. Config overrides as keywords
            too, as `train` takes them (`model="vit_tiny"`, `trainer={"devices": 2}`).

    Returns:
        A generator of results, in the source's order; with `save`, the folder written.
    """
    if save is not False and save is not None:
        return _saved(source, overrides, run, weights, step, save, settings)
    import torch  # noqa: PLC0415 (torch: 2 s)

    from visiondist.inference.run import predict as records  # noqa: PLC0415 (torch: 2 s)
    from visiondist.inference.sources import resolve_source  # noqa: PLC0415 (cv2 for a video)

    with refusals():
        config = _config_keywords(settings)  # model="...", data={...}: as the tools' overrides
        _check_settings(settings)
        if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={device}: torch sees no GPU here: give device='cpu'")
        given = as_source(source)
        items = (
            given
            if isinstance(given, Source)
            else resolve_source(given, settings.get("vid_stride", 1))
        )
        where = getattr(run, "dir", run)
        found = records(
            items,
            run_dir=None if where is None else str(where),
            weights=None if weights is None else str(weights),
            step=step,
            overrides=as_overrides(overrides, config),
            device=device,
            keep_index=True,
            **settings,
        )
    return (Result(record, items, record.pop("index")) for record in found)


def _saved(
    source: Any,
    overrides: tuple[str, ...],
    run: Any,
    weights: Any,
    step: Any,
    save: Union[bool, str, Path],
    settings: dict[str, Any],
) -> Optional[Path]:
    """tools/predict.py's job for `predict(..., save=...)`."""
    from visiondist.api.predict_job import (  # noqa: PLC0415 (a job's)
        predict_job,
        prediction_job_config,
    )

    with refusals():
        if not isinstance(source, (str, Path)):
            raise ConfigError(
                "save= writes a prediction of files, as tools/predict.py does: give a path, "
                f"folder, glob, list or video as the source (without save, {IN_MEMORY} too)"
            )
        keys = ("topk", "score_thresh", "max_det", "classes", "batch_size", "vid_stride")
        own = {k: settings.pop(k) for k in (*keys, "save_images", "save_txt") if k in settings}
        _check_settings({k: v for k, v in own.items() if k in keys})
        if save is not True:
            own["out"] = str(save)
        where = getattr(run, "dir", run)
        cfg, base = prediction_job_config(
            where,
            weights,
            step,
            as_overrides(overrides, settings),
            {"source": str(source), **own},
            tool="predict()",
        )
        return predict_job(cfg, base)


def _config_keywords(settings: dict[str, Any]) -> dict[str, Any]:
    """The keywords that name a part of the config (`model="vit_tiny"`, `data={"img_size": 64}`),
    taken out of `settings`: the same overrides as `"model=vit_tiny"`."""
    parts = {str(k) for k in OmegaConf.structured(TrainConfig).keys()}
    return {key: settings.pop(key) for key in list(settings) if key in parts}


def _check_settings(settings: dict[str, Any]) -> None:
    """predict's settings as tools/predict.py checks them."""
    known = ("topk", "score_thresh", "max_det", "classes", "batch_size", "vid_stride")
    for key in settings:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}=? " if close else ""
            raise ConfigError(
                f"{key}= is not a setting of predict: {hint}it takes {', '.join(known)}"
            )
    from visiondist.api.predict_job import check_settings  # noqa: PLC0415 (a job's)

    check_settings(settings)
