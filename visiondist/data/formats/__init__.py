"""A user's detection data in the forms it comes in, read as COCO by everything after it.

- `yolo.py`: Ultralytics / YOLO sets (data.yaml, images/ and labels/, boxes and polygons);
- `voc.py`: Pascal VOC sets (Annotations/*.xml read with defusedxml, ImageSets/Main splits);
- `exports.py`: COCO trees in the layouts COCO and annotation tools (Roboflow, CVAT, Label Studio)
  write;
- `labels.py`: a YOLO or VOC split indexed as COCO ground truth, in parallel, its problems named;
- `resolve.py`: the format recognised from `data.root`, the index cached, the data config filled
  (the launching process, before any rank starts);
- `convert.py`: one format written from another (`tools/data.py convert`).

Imports: config, utils, data's own modules.
"""

from visiondist.utils.lazy import lazy_exports

# imported on first use: a rank that only needs `exports.coco_paths` (every detection run's loaders,
# prediction, export) does not import the readers (YAML, PIL, defusedxml)
__getattr__, __all__ = lazy_exports(
    __name__, {"resolve": ("FORMATS", "Recognised", "recognise", "resolve_detection")}
)
