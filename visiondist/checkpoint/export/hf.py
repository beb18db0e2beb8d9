"""format=hf: a directory Hugging Face libraries load without visiondist.

- A DETR-class detector: the directory transformers' `from_pretrained` reads: config.json (with the
  class names as id2label and, for a COCO-trained model, `category_ids`: the COCO category id of
  each 0-based label), model.safetensors and preprocessor_config.json (the library's image
  processor at the run's input size), so `AutoModelForObjectDetection.from_pretrained(dir)` and
  `AutoImageProcessor.from_pretrained(dir)` give the trained model. The same directory is a
  `model.weights=` here.
- A ViT classifier: a timm model repository as timm's own `save_for_hf` writes it (config.json:
  the architecture, its arguments, the class names as `label_names` and the run's preprocessing as
  `pretrained_cfg`; model.safetensors in timm's keys), which
  `timm.create_model("local-dir:<dir>", pretrained=True)` and transformers'
  `AutoModelForImageClassification.from_pretrained(dir)` (its TimmWrapper) load, and
  `huggingface_hub.upload_folder` publishes as it is; beside them `model.json`, this project's
  record (the tools take the directory as `weights=`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from visiondist.checkpoint.export.preprocessing import sidecar
from visiondist.checkpoint.export.state_dict import export_state_dict
from visiondist.checkpoint.export.trained import LOGITS_COMPARED, Trained, logits_difference
from visiondist.models.detr import DetrDetector
from visiondist.models.detr_library import save_library_dir
from visiondist.models.weights import output_mode


def write_hf(trained: Trained, path: Path, out: Path) -> list[Path]:
    """The run's model as a Hugging Face directory at `path` (module doc).

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary directory name of `out`, renamed by `export`).
        out: the export's final path.

    Returns:
        The directory's files, under their final path.
    """
    family = trained.cfg.model.family
    if family == "vit":
        files = _write_timm_repo(trained, path)
        for file in files:  # safetensors writes 0o600: the mode every other output gets
            output_mode(file)
        return [out / f.name for f in files]
    if family != "detr":
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
    for file in files:
        output_mode(file)
    return [out / f.name for f in files]


def _timm_model(trained: Trained) -> tuple[torch.nn.Module, dict]:
    """timm's model of the run's ViT, built as the export's record says (`sidecar`'s `create`),
    its weights loaded strictly; and the constructor arguments beside the architecture."""
    import timm  # noqa: PLC0415 (timm: 2-3 s, a ViT's hf export alone)

    info = sidecar(trained)
    create = dict(info["create"])
    name, overlay = create.pop("model_name"), create.pop("pretrained_cfg_overlay")
    model = timm.create_model(name, pretrained=False, pretrained_cfg_overlay=overlay, **create)
    model.load_state_dict(export_state_dict(trained), strict=True)
    return model.eval(), create


def _write_timm_repo(trained: Trained, path: Path) -> list[Path]:
    from timm.models import save_for_hf  # noqa: PLC0415 (timm: see above)

    model, create = _timm_model(trained)
    # num_classes is the config's own key, which transformers passes beside model_args
    args = {k: v for k, v in create.items() if k != "num_classes"}
    labels = {"label_names": list(trained.classes)} if trained.classes else {}
    save_for_hf(model, str(path), model_config=labels, model_args=args, safe_serialization=True)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.get("model_args", {}).pop("num_classes", None)
    # the architecture's published tag names weights these are not
    config.get("pretrained_cfg", {}).pop("tag", None)
    config_file.write_text(json.dumps(config, indent=2))
    record = path / "model.json"
    record.write_text(json.dumps(sidecar(trained), indent=2))
    return sorted(p for p in path.iterdir() if p.is_file())


def check_hf(trained: Trained, path: Path) -> Optional[str]:
    """One line for a ViT's directory: the model transformers loads from it (else timm's, where
    transformers is not installed) against the PyTorch model; None for a detector's."""
    if trained.cfg.model.family != "vit":
        return None
    loaded: Callable[[torch.Tensor], torch.Tensor]
    try:
        from transformers import AutoModelForImageClassification  # noqa: PLC0415 (optional)
        from transformers.utils import logging as hf_logging  # noqa: PLC0415 (optional)

        # its loading bar and notes (an image backend chosen) are not this check's
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            wrapped = AutoModelForImageClassification.from_pretrained(str(path)).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
        loaded = lambda x: wrapped(pixel_values=x).logits  # noqa: E731 (one expression)
        by = f"transformers ({type(wrapped).__name__})"
    except ImportError:
        import timm  # noqa: PLC0415 (timm: see above)

        model = timm.create_model(f"local-dir:{path}", pretrained=True).eval()
        loaded, by = model, "timm (local-dir:)"
    diff = logits_difference(trained, loaded)
    return f"{by} vs PyTorch: {LOGITS_COMPARED}, max abs difference {diff:.3g}"
