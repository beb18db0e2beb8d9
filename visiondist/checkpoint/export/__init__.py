"""Export a trained run: one consolidated file that the model's own library loads without
visiondist.

- `safetensors` (`state_dict.py`): the unsharded weights under the anchor library's key names
  (timm's for ViTs: fused `qkv`; torchvision's for torchvision detectors) plus `<out>.json`
  (`preprocessing.py`), saying how to build the model that loads them (`create` / `builder` +
  `kwargs`), the input size, the normalisation and the class names; a detector's also `labels`, the
  COCO category id and name of each label it predicts. The file's own metadata holds the names too.
- `onnx` (`onnx.py`): the eval-mode model (classifier: images -> logits with a dynamic batch;
  torchvision detector: one image -> boxes, labels, scores), the names in its metadata, checked
  against PyTorch with ONNX Runtime when it is installed (`onnx_check.py`).
- `pt2` (`pt2.py`): a classifier as torch.export's ExportedProgram (any batch), the sidecar inside
  the archive.
- `torchscript` (`torchscript.py`): traced (classifiers) or scripted (torchvision detectors).
- `hf` (`hf.py`): a DETR-class detector as the directory transformers' `from_pretrained` reads.
- `naflex` (`naflex.py`): a ViT as timm's NaFlexVit holds it (images at their own size and aspect
  ratio).

Weights come from a run's checkpoint (any parallel layout; DCP reads the shards into this one
process) or, for a run without checkpoints, its `model.safetensors` (`trained.py`). A new format is
a module with a `write_<format>(trained, path, out) -> [other files written]` function and a row of
`WRITERS`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from visiondist.checkpoint.export.hf import write_hf
from visiondist.checkpoint.export.naflex import write_naflex
from visiondist.checkpoint.export.onnx import write_onnx
from visiondist.checkpoint.export.pt2 import write_pt2
from visiondist.checkpoint.export.state_dict import write_safetensors
from visiondist.checkpoint.export.torchscript import write_torchscript
from visiondist.checkpoint.export.trained import Trained, load_trained

__all__ = ["FORMATS", "WRITERS", "Trained", "export", "load_trained"]

# format -> its writer: (the trained model, a temporary path, the final path) -> the other files it
# wrote
WRITERS = {
    "safetensors": write_safetensors,
    "onnx": write_onnx,
    "pt2": write_pt2,
    "torchscript": write_torchscript,
    "hf": write_hf,
    "naflex": write_naflex,
}
FORMATS = tuple(WRITERS)


def export(trained: Trained, fmt: str, out: Path) -> list[Path]:
    """Write the export; returns the files written (the main one, or the directory, to a temporary
    name, then renamed).

    Args:
        trained: the run's model and what it records (`load_trained`).
        fmt: the format, one of `FORMATS`.
        out: the export's path (its folder is made).

    Returns:
        `out`, then the other files its writer wrote (a sidecar, a directory's files).
    """
    if fmt not in WRITERS:
        raise ValueError(f"format={fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    others = WRITERS[fmt](trained, tmp, out)
    if tmp.is_dir() and out.is_dir():  # a directory export (hf) replaces the previous one whole
        shutil.rmtree(out)
    tmp.replace(out)
    return [out, *others]
