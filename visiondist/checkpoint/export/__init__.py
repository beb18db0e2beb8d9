"""Export a trained run: one consolidated file that the model's own library loads without
visiondist.

- `safetensors` (`state_dict.py`): the unsharded weights under the anchor library's key names
  (timm's for ViTs: fused `qkv`; torchvision's for torchvision detectors) plus `<out>.json`
  (`preprocessing.py`), saying how to build the model that loads them (`create` / `builder` +
  `kwargs`), the input size, the normalisation and the class names; a detector's also `labels`, the
  COCO category id and name of each label it predicts. The file's own metadata holds the names too.
- `onnx` (`onnx.py`): the eval-mode model (classifier: images -> logits; detector: a batch of images
  and their sizes -> a fixed number of boxes, labels, scores per image, `onnx_batch.py`), the names
  in its metadata, checked against PyTorch with ONNX Runtime when it is installed
  (`onnx_check.py`); `runtimes.py` runs it (and a pt2 program) where predict and eval take
  weights.
- `pt2` (`pt2.py`): a classifier as torch.export's ExportedProgram (any batch), the sidecar inside
  the archive.
- `torchscript` (`torchscript.py`): traced (classifiers) or scripted (torchvision detectors).
- `hf` (`hf.py`): a DETR-class detector as the directory transformers' `from_pretrained` reads.
- `naflex` (`naflex.py`): a ViT as timm's NaFlexVit holds it (images at their own size and aspect
  ratio).
- `openvino` (`openvino.py`): the ONNX graph as OpenVINO's IR (.xml, .bin) with a sidecar .json.

Weights come from a run's checkpoint (any parallel layout; DCP reads the shards into this one
process) or, for a run without checkpoints, its `model.safetensors` (`trained.py`). A new format is
a module with a `write_<format>(trained, path, out) -> [other files written]` function and a row of
`WRITERS`.
"""

from visiondist.checkpoint.export.trained import Trained, load_trained
from visiondist.checkpoint.export.writers import FORMATS, WRITERS, export

__all__ = ["FORMATS", "WRITERS", "Trained", "export", "load_trained"]
