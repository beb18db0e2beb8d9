"""A batch through a torchvision detector's ONNX graph (ViTDet's too): the one-image graph that
`onnx.py` traces, with its detections padded to a fixed count, run for each image of a batch by an
ONNX `Loop`, so that every output's shape follows the batch alone.

The batched graph takes `images` (N, 3, H, W), float in [0, 1]: the originals, each in the top-left
corner of a zero canvas as large as the largest (`canvas`), and `sizes` (N, 2), each original's
(height, width); it gives boxes (N, K, 4, in the original's pixels), labels (N, K), scores (N, K),
detections (N: the real ones, first; the rest have label 0, score 0 and a zero box) and a mask
model's masks (N, K, 1, H, W: each original's probabilities, on the canvas), K = the model's
detections per image. Each image is cut from its canvas inside the graph and goes through the
model's own resize, so the graph returns for each image what the PyTorch model returns for it alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


def detections_per_image(model: nn.Module) -> int:
    """K: the most detections the torchvision detector returns for one image."""
    owner: Any = model.roi_heads if hasattr(model, "roi_heads") else model
    return int(owner.detections_per_img)


class PaddedDetections(nn.Module):
    """The detector on one image (3, h, w) with its outputs padded to K (`detections_per_image`);
    `canvas` (3, H, W) gives the size a mask is padded to (its values are not read)."""

    def __init__(self, model: nn.Module, masks: bool):
        super().__init__()
        self.model, self.masks, self.k = model, masks, detections_per_image(model)

    def forward(self, image: torch.Tensor, canvas: torch.Tensor):
        out = self.model([image])[0]
        k = self.k
        boxes = torch.cat([out["boxes"], out["boxes"].new_zeros(k, 4)])[:k]
        labels = torch.cat([out["labels"], out["labels"].new_zeros(k)])[:k]
        scores = torch.cat([out["scores"], out["scores"].new_zeros(k)])[:k]
        count = torch.ones_like(out["labels"]).sum()
        if not self.masks:
            return boxes, labels, scores, count
        masks = out["masks"]
        height, width = canvas.shape[-2], canvas.shape[-1]
        masks = F.pad(masks, (0, width - image.shape[-1], 0, height - image.shape[-2]))
        masks = torch.cat([masks, masks.new_zeros(k, 1, height, width)])[:k]
        return boxes, labels, scores, count, masks


def canvas(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (3, h, w) of any sizes -> the batched graph's inputs: `images` (N, 3, H, W), each in
    the top-left corner of a zero canvas as large as the largest, and `sizes` (N, 2) int64."""
    height = max(int(im.shape[-2]) for im in images)
    width = max(int(im.shape[-1]) for im in images)
    batch = images[0].new_zeros(len(images), 3, height, width)
    for i, im in enumerate(images):
        batch[i, :, : im.shape[-2], : im.shape[-1]] = im
    sizes = torch.tensor([[int(im.shape[-2]), int(im.shape[-1])] for im in images])
    return batch, sizes


def loop_over_batch(proto, outputs: list[str], k: Optional[int] = None):
    """The one-image graph `proto` (inputs "image" (3, h, w), "canvas" (3, H, W); `outputs` K
    long, `k` where it is known: declared in the outputs' shapes) as the body of a `Loop` over a
    batch: a new model taking "images" (N, 3, H, W) and "sizes" (N, 2) whose outputs stack the
    body's (N first). The body cuts image i to its size; the one-image graph's weights become the
    outer graph's (a body reads them from there). Returns the new `onnx.ModelProto` (metadata and
    opset kept)."""
    import onnx  # noqa: PLC0415 (onnx: the export extra)
    from onnx import TensorProto, helper  # noqa: PLC0415

    inner = proto.graph
    consts = [
        helper.make_node("Constant", [], ["batch/zero2"], value=_ints(helper, [0, 0])),
        helper.make_node("Constant", [], ["batch/hw_axes"], value=_ints(helper, [1, 2])),
    ]
    cut = [
        helper.make_node("Gather", ["images", "batch/i"], ["canvas"], axis=0),
        helper.make_node("Gather", ["sizes", "batch/i"], ["batch/size"], axis=0),
        helper.make_node(
            "Slice", ["canvas", "batch/zero2", "batch/size", "batch/hw_axes"], ["image"]
        ),
        helper.make_node("Identity", ["batch/cond_in"], ["batch/cond_out"]),
    ]
    # the body's outputs under names of their own: none may be an outer value's name (the Loop's
    # outputs are "boxes", ...), which ONNX Runtime refuses once a converter moves them
    named = [
        helper.make_node("Identity", [out.name], [f"batch/{out.name}"]) for out in inner.output
    ]
    body = helper.make_graph(
        [*consts, *cut, *inner.node, *named],
        "one_image",
        [
            helper.make_tensor_value_info("batch/i", TensorProto.INT64, []),
            helper.make_tensor_value_info("batch/cond_in", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("batch/cond_out", TensorProto.BOOL, [])]
        + [_without_shape(helper, out, f"batch/{out.name}") for out in inner.output],
        value_info=list(inner.value_info),
    )
    elem = {v.name: v.type.tensor_type.elem_type for v in inner.output}
    return _looped(proto, body, outputs, elem, ["N", 3, "H", "W"], onnx, k)


def _looped(proto, body, outputs: list[str], elem: dict, image_dims: list, onnx, k=None):
    """The model whose graph runs `body` for each image of "images" (`image_dims`) and "sizes"
    (N, 2), `outputs` stacked, each K = `k` detections long (a number where it is known: what a
    runtime allocating its output buffers, or a serving config, reads from the graph); `proto`'s
    weights, opset and metadata kept; checked."""
    from onnx import TensorProto, helper  # noqa: PLC0415 (onnx: the export extra)

    inner = proto.graph
    outer_nodes = [
        helper.make_node("Shape", ["images"], ["batch/shape"]),
        helper.make_node("Constant", [], ["batch/zero"], value=_ints(helper, 0)),
        helper.make_node("Gather", ["batch/shape", "batch/zero"], ["batch/n"], axis=0),
        helper.make_node(
            "Constant",
            [],
            ["batch/true"],
            value=helper.make_tensor("true", TensorProto.BOOL, [], [True]),
        ),
        helper.make_node("Loop", ["batch/n", "batch/true"], list(outputs), body=body),
    ]
    k = k or "K"
    dims: dict[str, list[Any]] = {
        "boxes": ["N", k, 4],
        "labels": ["N", k],
        "scores": ["N", k],
        "detections": ["N"],
        "masks": ["N", k, 1, "H", "W"],
    }
    graph = helper.make_graph(
        outer_nodes,
        inner.name or "detector",
        [
            helper.make_tensor_value_info("images", TensorProto.FLOAT, image_dims),
            helper.make_tensor_value_info("sizes", TensorProto.INT64, ["N", 2]),
        ],
        [helper.make_tensor_value_info(name, elem[name], dims[name]) for name in outputs],
        initializer=list(inner.initializer),
    )
    model = helper.make_model(graph, opset_imports=list(proto.opset_import))
    model.ir_version = proto.ir_version
    model.producer_name, model.producer_version = proto.producer_name, proto.producer_version
    model.functions.extend(proto.functions)  # the dynamo exporter's local functions
    for prop in proto.metadata_props:
        model.metadata_props.add(key=prop.key, value=prop.value)
    onnx.checker.check_model(model)
    return model


def loop_batch_of_one(proto, outputs: list[str]):
    """A graph traced for a batch of one (inputs "one_images" (1, ...), "one_sizes" (1, 2); outputs
    `outputs` with a batch of one, in order) as the body of a `Loop` over a batch: a new model
    taking "images" and "sizes" (N first) whose outputs stack the body's. For a model whose batch
    the exporter cannot keep symbolic (the library's code takes it as a Python number)."""
    import onnx  # noqa: PLC0415 (onnx: the export extra)
    from onnx import TensorProto, helper  # noqa: PLC0415

    inner = proto.graph
    traced = [out.name for out in inner.output]
    nodes = [
        helper.make_node("Constant", [], ["batch/axis0"], value=_ints(helper, [0])),
        helper.make_node("Unsqueeze", ["batch/i", "batch/axis0"], ["batch/index"]),
        helper.make_node("Gather", ["images", "batch/index"], ["one_images"], axis=0),
        helper.make_node("Gather", ["sizes", "batch/index"], ["one_sizes"], axis=0),
        helper.make_node("Identity", ["batch/cond_in"], ["batch/cond_out"]),
        *inner.node,
        *(
            helper.make_node("Squeeze", [name, "batch/axis0"], [f"batch/{out}"])
            for name, out in zip(traced, outputs)
        ),
    ]
    elem = {out: v.type.tensor_type.elem_type for v, out in zip(inner.output, outputs)}
    body = helper.make_graph(
        nodes,
        "one_image",
        [
            helper.make_tensor_value_info("batch/i", TensorProto.INT64, []),
            helper.make_tensor_value_info("batch/cond_in", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("batch/cond_out", TensorProto.BOOL, [])]
        + [helper.make_tensor_value_info(f"batch/{out}", elem[out], None) for out in outputs],
        value_info=list(inner.value_info),
    )
    images = next(i for i in inner.input if i.name == "one_images")
    dims = [d.dim_value for d in images.type.tensor_type.shape.dim][1:]
    boxes = [d.dim_value for d in inner.output[0].type.tensor_type.shape.dim]  # (1, queries, 4)
    k = boxes[1] if len(boxes) == 3 and boxes[1] > 0 else None
    return _looped(proto, body, outputs, elem, ["N", *dims], onnx, k)


def _ints(helper, values):
    from onnx import TensorProto  # noqa: PLC0415 (onnx: the export extra)

    if isinstance(values, int):
        return helper.make_tensor("v", TensorProto.INT64, [], [values])
    return helper.make_tensor("v", TensorProto.INT64, [len(values)], values)


def _without_shape(helper, value, name: str):
    """A body output `name` of `value`'s type without its shape (the count of detections is the
    trace's)."""
    return helper.make_tensor_value_info(name, value.type.tensor_type.elem_type, None)


def detector_feed(given: dict, images: list[torch.Tensor]) -> dict[str, Any]:
    """The inputs of a detector graph written here for `images` (3, h, w), float in [0, 1], of any
    sizes: as its `input` metadata (`given`) says, each resized to the model's side ("resized", as
    `DetrDetector.resized` does) or the originals on one canvas ("canvas"), with their sizes; numpy
    arrays by input name."""
    if given.get("images") == "resized":
        side = int(given["side"])
        resized = [
            im[None].float()
            if tuple(im.shape[-2:]) == (side, side)
            else F.interpolate(
                im[None].float(),
                size=(side, side),
                mode="bilinear",
                align_corners=False,
                antialias=bool(given.get("antialias", True)),
            )
            for im in images
        ]
        batch = torch.cat(resized)
        sizes = torch.tensor([[int(im.shape[-2]), int(im.shape[-1])] for im in images])
    else:
        batch, sizes = canvas([im.float() for im in images])
    return {"images": batch.numpy(), "sizes": sizes.numpy()}


def detector_results(
    outputs: dict[str, Any], images: list[torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """A detector graph's outputs (by name, numpy) -> per image what the PyTorch detector returns:
    its real detections (boxes, labels, scores; a mask model's masks (n, 1, h, w) at the image's
    size), the padding left out."""
    out = []
    for i, im in enumerate(images):
        n = int(outputs["detections"][i])
        found = {
            key: torch.from_numpy(outputs[key][i][:n]) for key in ("boxes", "labels", "scores")
        }
        if "masks" in outputs:
            height, width = int(im.shape[-2]), int(im.shape[-1])
            found["masks"] = torch.from_numpy(outputs["masks"][i][:n, :, :height, :width])
        out.append(found)
    return out


def run_detector(session, given: dict, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A detector graph's detections for `images` in one batch, per image: fed as `given` says
    (`detector_feed`), read back without the padding (`detector_results`); `session` an ONNX
    Runtime session or anything answering its `run` and `get_outputs`."""
    got = session.run(None, detector_feed(given, images))
    return detector_results({o.name: v for o, v in zip(session.get_outputs(), got)}, images)
