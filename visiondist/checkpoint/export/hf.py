"""format=hf: a DETR-class detector as the directory transformers' `from_pretrained` reads:
config.json (with the class names as id2label and, for a COCO-trained model, `category_ids`: the
COCO category id of each 0-based label), model.safetensors and preprocessor_config.json (the
library's image processor at the run's input size), so
`AutoModelForObjectDetection.from_pretrained(dir)` and `AutoImageProcessor.from_pretrained(dir)`
give the trained model without visiondist. The same directory is a `model.weights=` here."""

from __future__ import annotations

from pathlib import Path

from visiondist.checkpoint.export.trained import Trained


def write_hf(trained: Trained, path: Path, out: Path) -> list[Path]:
    if trained.cfg.model.family != "detr":
        raise ValueError(
            f"format=hf writes transformers' layout, which model={trained.cfg.model.name} is not "
            "in: export format=safetensors (or onnx)"
        )
    from visiondist.models.detr_library import save_library_dir

    files = save_library_dir(
        trained.model,
        path,
        list(trained.classes) if trained.classes else None,
        list(trained.categories) if trained.categories else None,
    )
    return [out / f.name for f in files]
