"""int8=true of format=onnx: ONNX Runtime's static quantization of the graph's convolutions and
matrix products (QDQ: int8 weights per output channel, uint8 activations per tensor), calibrated on
`CALIBRATION_IMAGES` of the run's train images, prepared as the file is fed (`images.py`). What
turns the outputs into boxes (decoding, NMS, RoIAlign, the scaling to pixels) stays float32.

A detector's graph is quantized before the batch `Loop` wraps it (ONNX Runtime's calibration reads
the tensors of a model's main graph only): `onnx.py` calls `quantize` on its one-image graph with
`one_image_feeds`. A graph ONNX Runtime cannot quantize, or whose quantized form it cannot load, is
refused with the reason, and nothing is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from visiondist.checkpoint.export.images import classification_crops, detection_images

log = logging.getLogger(__name__)

# train images a graph's activation ranges are calibrated on (ONNX Runtime's MinMax calibrator)
CALIBRATION_IMAGES = 32
# the operators quantized; the rest of the graph stays float32
QUANTIZED_OPS = ("Conv", "MatMul", "Gemm")


def calibration_images(cfg) -> tuple[Any, str]:
    """The run's train images a quantization calibrates with, and what they are in words: a
    classifier's normalised crops (N, 3, S, S), or a detector's originals (a list of float CHW in
    [0, 1]); ValueError naming the fix where the train split is not on this machine."""
    from visiondist.models import TASKS  # noqa: PLC0415 (torch: the exporters' caller)

    split = cfg.data.train_split
    if TASKS[cfg.model.family] == "classification":
        crops = classification_crops(cfg, split, CALIBRATION_IMAGES)
        images: Any = crops if len(crops) else None
        count = len(crops)
    else:
        found, _ = detection_images(cfg, split, CALIBRATION_IMAGES)
        images = [image for _, image in found] or None
        count = len(found)
    if images is None:
        raise ValueError(
            f"int8=true calibrates on the run's {split} images, which are not at "
            f"data.root={cfg.data.root}: give the run's data (tools/export.py reads the run's "
            "config.yaml; copy the data there) or export without int8"
        )
    return images, f"{count} {split} images"


def quantize(source: Path, target: Path, feeds: Iterable[dict[str, Any]]) -> None:
    """ONNX Runtime's static QDQ quantization of the float32 graph `source` into `target`,
    calibrated on `feeds` (input name -> numpy array); ValueError with ONNX Runtime's reason where
    it cannot quantize the graph or load the result (`target` is then not written)."""
    try:
        from onnxruntime.quantization import (  # noqa: PLC0415 (onnxruntime: the export extra)
            CalibrationDataReader,
            QuantFormat,
            QuantType,
            quantize_static,
        )
    except ImportError:
        raise ValueError(
            "int8=true quantizes with ONNX Runtime: pip install -e '.[export]'"
        ) from None
    import onnx  # noqa: PLC0415 (onnx: the export extra)
    import onnxruntime as ort  # noqa: PLC0415 (onnxruntime: the export extra)

    # a graph keeps only the inputs it reads (a box model's one-image graph: no canvas)
    inputs = {i.name for i in onnx.load(str(source), load_external_data=False).graph.input}

    class Feeds(CalibrationDataReader):
        def __init__(self, feeds: Iterable[dict[str, Any]]):
            self.feeds = iter(feeds)

        def get_next(self):
            feed = next(self.feeds, None)
            return None if feed is None else {k: v for k, v in feed.items() if k in inputs}

    from onnxruntime.quantization.shape_inference import (  # noqa: PLC0415
        quant_pre_process,
    )

    # ONNX Runtime's quantizer logs each bias it copies through the root logger, at INFO
    with tempfile.TemporaryDirectory() as work, _without_onnxruntime_info():
        written, prepared = Path(work) / "int8.onnx", Path(work) / "prepared.onnx"
        try:  # shapes inferred and the graph optimised first, as ONNX Runtime advises
            quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
        except Exception as exc:  # a graph its optimiser does not take: quantized as it is
            log.debug("quantization's pre-processing skipped: %s", exc)
            prepared = source
        try:
            quantize_static(
                str(prepared),
                str(written),
                Feeds(feeds),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                weight_type=QuantType.QInt8,
                activation_type=QuantType.QUInt8,
                op_types_to_quantize=list(QUANTIZED_OPS),
            )
            ort.InferenceSession(str(written), providers=["CPUExecutionProvider"])
        except Exception as exc:  # ONNX Runtime's own errors: the reason, nothing written
            reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc)
            raise ValueError(
                f"int8=true: ONNX Runtime could not quantize the graph ({reason})"
            ) from None
        written.replace(target)


class _OnnxRuntimeInfo(logging.Filter):
    """Drops the records below WARNING that ONNX Runtime's Python code logs (through the root
    logger, so its module name is not the logger's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from_ort = f"{os.sep}onnxruntime{os.sep}" in record.pathname
        return not from_ort or record.levelno >= logging.WARNING


@contextlib.contextmanager
def _without_onnxruntime_info() -> Iterator[None]:
    """ONNX Runtime's INFO lines kept off the console; and where the root logger has no handler,
    a silent one meanwhile: a `logging.info` call would otherwise configure the root logger for
    the rest of the process (`logging.basicConfig`, its `WARNING:name:` lines)."""
    root, quiet = logging.getLogger(), _OnnxRuntimeInfo()
    placeholder = logging.NullHandler() if not root.handlers else None
    if placeholder is not None:
        root.addHandler(placeholder)
    handlers = list(root.handlers)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
        if placeholder is not None:
            root.removeHandler(placeholder)


def classifier_feeds(crops: torch.Tensor) -> list[dict[str, Any]]:
    """A classifier graph's calibration feeds: one crop a feed."""
    return [{"images": crop[None].numpy()} for crop in crops]


def one_image_feeds(images: list[torch.Tensor], names: tuple[str, str], given: dict) -> list[dict]:
    """The calibration feeds of a detector's one-image graph (before the batch `Loop`): for a
    torchvision detector ("image", "canvas") each original twice (its own canvas); for a DETR-class
    one (`names` its batch-of-one or batched inputs) the image resized as `given` says, with its
    size."""
    from visiondist.checkpoint.export.onnx_batch import detector_feed  # noqa: PLC0415

    if names == ("image", "canvas"):
        return [{"image": im.numpy(), "canvas": im.numpy()} for im in images]
    feeds = []
    for image in images:
        fed = detector_feed(given, [image])
        feeds.append({names[0]: fed["images"], names[1]: fed["sizes"]})
    return feeds
