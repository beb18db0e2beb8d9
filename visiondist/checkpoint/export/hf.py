"""format=hf: a DETR-class detector as the directory transformers' `from_pretrained` reads:
config.json (with the class names as id2label and, for a COCO-trained model, `category_ids`: the
COCO category id of each 0-based label), model.safetensors and preprocessor_config.json (the
library's image processor at the run's input size), so
`AutoModelForObjectDetection.from_pretrained(dir)` and `AutoImageProcessor.from_pretrained(dir)`
give the trained model without visiondist. The same directory is a `model.weights=` here."""

from __future__ import annotations

from pathlib import Path

from visiondist.checkpoint.export.trained import Trained
from visiondist.models.detr import DetrDetector
from visiondist.models.detr_library import save_library_dir


def write_hf(trained: Trained, path: Path, out: Path) -> list[Path]:
    """A DETR-class detector's from_pretrained directory at `path` (module doc).

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary directory name of `out`, renamed by `export`).
        out: the export's final path.

    Returns:
        The directory's files, under their final path.
    """
    if trained.cfg.model.family != "detr":
        raise ValueError(
            f"format=hf writes transformers' layout, which model={trained.cfg.model.name} is not "
            "in: export format=safetensors (or onnx)"
        )
    assert isinstance(trained.model, DetrDetector)  # what model.family=detr builds
    files = save_library_dir(
        trained.model,
        path,
        list(trained.classes) if trained.classes else None,
        list(trained.categories) if trained.categories else None,
    )
    return [out / f.name for f in files]
