"""A weights file (`model.weights`, `tools/eval.py weights=`) against the model a config builds,
before any rank starts: what the file holds read off its tensor names and shapes (a safetensors
header, a checkpoint's metadata), and one `ConfigError` naming what differs and what to set. A ViT's
shape (width, depth, patch, MLP, classes, grid) is compared field by field and the model config of
the file's shape named; a file with no tensor name in common with the model says what it seems to be
instead (a ViT, a torchvision detector, a DETR-class detector in this project's keys or in
transformers' layout); a class count is blamed only where the classifier is all that differs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from visiondist.config import ConfigError
from visiondist.models.vit_weights import compare_vits, split_fused, vit_fix, vit_shape, vit_text
from visiondist.utils.dcp import is_complete
from visiondist.utils.pretrained import WeightsNotFound, is_named, local_file

# The modules that build or read a model are imported where they are used (noqa: PLC0415): the
# launching process checks weights with this module before its ranks start, without torch (2 s).

# the classifier of each family: its first dimension counts the classes (detectors: plus the
# background, times the anchors per location for RetinaNet / FCOS)
_HEADS = (
    "head.weight",
    "roi_heads.box_predictor.cls_score.weight",
    "head.classification_head.cls_logits.weight",
)
# every tensor sized by the class count (a classifier of another size changes these and nothing
# else)
_CLASS_TENSORS = (
    "head.",
    "roi_heads.box_predictor.cls_score.",
    "roi_heads.box_predictor.bbox_pred.",
    "roi_heads.mask_predictor.mask_fcn_logits.",
    "head.classification_head.cls_logits.",
)


def check_weights(model_cfg, purpose: str = "train", data_classes: Optional[int] = None) -> None:
    """`model.weights` (a file, a checkpoint directory for evaluation, a DETR-class detector's
    from_pretrained directory) exists and fits the model: the same family and shape, every tensor
    present with the model's shape; otherwise one line saying what the file is and what to set.
    `data_classes`: data.num_classes, to name the key that set the class count."""
    from visiondist.models.weights import weight_shapes  # noqa: PLC0415 (torch: see the top)

    spec = str(model_cfg.weights)
    if model_cfg.family == "detr" and _check_library_weights(model_cfg):
        return
    # a detector starting from torchvision's: a head of another class count is new
    if is_named(spec):
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"model.weights={spec}: no such file or checkpoint directory")
    if path.is_dir():
        _check_directory(model_cfg, path, purpose)
    try:
        stored = weight_shapes(path)
    except ValueError as exc:  # an export's graph, a pickle of objects: the message names it
        raise ConfigError(
            str(exc).replace(f"model.weights={path}", f"model.weights={spec}", 1)
        ) from None
    except Exception as exc:  # not a weights file at all
        raise ConfigError(
            f"model.weights={spec} cannot be read as weights ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    if model_cfg.family == "vit":  # the ViT loader reads timm's fused qkv as q, k, v
        stored = split_fused(stored)
    own, names = model_shapes(model_cfg)
    if not own.keys() & stored.keys():
        raise ConfigError(_nothing_in_common(model_cfg, path, stored, own))
    if model_cfg.family == "vit":
        compare_vits(model_cfg, stored, own)
    wrong = [k for k in own if k in stored and tuple(stored[k]) != own[k]]
    head = next((k for k in _HEADS if k in wrong), None)
    if head is not None and all(k.startswith(_CLASS_TENSORS) for k in wrong):
        background = 0 if model_cfg.family == "vit" else 1
        classes = (
            stored[head][0] * (model_cfg.num_classes + background) // own[head][0] - background
        )
        key = _classes_key(model_cfg, data_classes)
        raise ConfigError(
            f"model.weights={spec} is a {classes}-class {model_cfg.name} but "
            f"{key}={model_cfg.num_classes}: set "
            f"{key}={classes}"
            + (f" (and use data with those {classes} classes)" if key == "data.num_classes" else "")
        )
    if wrong:
        key = wrong[0]
        raise ConfigError(
            f"model.weights={spec} does not fit model={model_cfg.name}: {key} is "
            f"{list(stored[key])} there but {list(own[key])} here: use the model (and "
            f"data.img_size) the weights were trained with{_trained_with(path)}"
        )
    # a model saved with frozen BatchNorms stores no num_batches_tracked (the loader freezes those
    # BatchNorms)
    missing = [k for k in own if k not in stored and not k.endswith("num_batches_tracked")]
    unknown = [k for k in stored if k not in names]
    if missing and not unknown and all(k.startswith(_CLASS_TENSORS) for k in missing):
        raise ConfigError(_headless(model_cfg, spec, missing))
    if missing or unknown:
        raise ConfigError(
            f"model.weights={spec} does not fit model={model_cfg.name}: {len(missing)} of the "
            f"model's tensors are not there ({_some(missing)}) and {len(unknown)} of its are not "
            f"the model's ({_some(unknown)}): use the model the weights were trained with"
            f"{_trained_with(path)}"
        )


def _trained_with(path: Path) -> str:
    """`, model=<name> as <file> records it` where the weights' sidecar (or an ONNX file's
    metadata) names the model they were exported from; else nothing."""
    from visiondist.models.exported import recorded_model  # noqa: PLC0415 (onnx: its files')

    try:
        recorded = recorded_model(path) if path.is_file() else None
    except Exception:  # a record that cannot be read names nothing; the message stands
        recorded = None
    return f", model={recorded[0]} as {recorded[1]} records it" if recorded else ""


def _headless(model_cfg, spec: str, missing: list[str]) -> str:
    """The message for a file that is the model without its class head (a backbone to fine-tune):
    the path that reads it."""
    what = (
        f"model.weights={spec} is model={model_cfg.name} without its class head ({_some(missing)})"
    )
    if model_cfg.family == "vit":
        return (
            f"{what}: model.weights loads a whole model; to fine-tune from these weights give "
            f"model.init_from={spec} instead (every tensor it has is loaded and the head starts "
            "afresh)"
        )
    return (
        f"{what}: model.weights loads a whole detector, and only ViT classifiers fine-tune from a "
        "file without its head (model.init_from); give the file the trained model's head "
        "(tools/export.py writes the whole model), or start from torchvision's weights by name"
    )


def _classes_key(model_cfg, data_classes: Optional[int]) -> str:
    """The key that set the model's class count: data.num_classes (model.num_classes follows it), or
    model.num_classes where the user set that to another count."""
    return (
        "model.num_classes"
        if data_classes is not None and model_cfg.num_classes != data_classes
        else "data.num_classes"
    )


def _check_directory(model_cfg, path: Path, purpose: str) -> None:
    """A directory is a checkpoint (evaluation reads it into any layout) or, for DETR-class
    detectors, a from_pretrained directory (checked before this)."""
    from visiondist.models.detr_library import is_library_dir  # noqa: PLC0415 (torch: see the top)

    spec = model_cfg.weights
    if is_library_dir(path):
        raise ConfigError(
            f"model.weights={spec} is transformers' from_pretrained directory of "
            f"{_library_kind(path)}, which DETR-class detectors read, not model={model_cfg.name}: "
            f"{_library_fix(path, str(spec), str(model_cfg.name))}"
        )
    if not is_complete(path):
        raise ConfigError(
            f"model.weights={spec} is a directory but neither a complete checkpoint (its "
            ".metadata and trainer_state.json) nor a from_pretrained directory (config.json + "
            "model.safetensors): give a weights file (.safetensors or a torch file) or a "
            "checkpoint <run>/checkpoints/step_<N>"
        )
    if purpose == "train":
        raise ConfigError(
            f"model.weights={spec} is a checkpoint directory: training starts from a weights file "
            "(<run>/model.safetensors, or python tools/export.py run_dir=<run> step=<N>), or "
            f"continues that run with trainer.resume={spec}"
        )


def _nothing_in_common(model_cfg, path: Path, stored: dict, own: dict) -> str:
    """The message for a file none of whose tensor names the model has: what the file seems to be,
    and the fix."""
    from visiondist.models.detr_library import is_library_dir  # noqa: PLC0415 (torch: see the top)

    spec, name = model_cfg.weights, model_cfg.name
    if path.is_file() and is_library_dir(path.parent):
        return (
            f"model.weights={spec} is the weights file of transformers' from_pretrained directory "
            f"of {_library_kind(path.parent)}, in the library's key names, none of which "
            f"model={name} has: {_library_fix(path.parent, str(path.parent), str(name))}"
        )
    kind, fix = what_it_is(stored)
    return (
        f"model.weights={spec} has no tensor name in common with model={name} (the file's: "
        f"{_some(list(stored))}; the model's: {_some(list(own))}): it {kind}: "
        f"{fix or 'use the model the weights were trained with'}"
    )


def what_it_is(shapes: dict[str, tuple]) -> tuple[str, Optional[str]]:
    """(what a weights file seems to hold, read off its names, and the model setting that reads it,
    if known)."""
    vit = vit_shape(split_fused(shapes))
    if vit is not None:
        return f"holds {vit_text(vit)}", vit_fix(vit)
    if "backbone.body.patch_embed.weight" in shapes:
        return "holds a ViTDet detector", "use the vitdet_* model config it was trained with"
    if any(k.startswith(("roi_heads.", "rpn.", "head.classification_head.")) for k in shapes):
        return (
            "holds a torchvision detector",
            "use the model config it was trained with (model=fasterrcnn_..., ...)",
        )
    if any(k.startswith("model.model.") for k in shapes):
        return (
            "holds a DETR-class detector in this project's keys",
            "use the DETR model config it was trained with",
        )
    if any(k.startswith(("model.backbone.", "model.encoder.", "model.decoder.")) for k in shapes):
        return (
            "holds a detector in transformers' key names",
            "give its from_pretrained directory (config.json + model.safetensors; python "
            "tools/export.py format=hf writes one) with a DETR-class model config",
        )
    return "is no model this project builds", None


# -- DETR-class detectors: transformers' from_pretrained directories -------------------------------


def _library_type(where: Path) -> Optional[str]:
    """The `model_type` in a from_pretrained directory's config.json."""
    try:
        return json.loads((where / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _library_kind(where: Path) -> str:
    kind = _library_type(where)
    return f"a {kind} model" if kind else "a model"


def _library_fix(where: Path, spec: str, model: str) -> str:
    """The settings that read a from_pretrained directory: the model configs of its kind, and the
    directory."""
    from visiondist.models.detr_archs import ARCHS  # noqa: PLC0415 (the DETR variants alone)

    kind = _library_type(where)
    same = [n for n, a in ARCHS.items() if a.model_type == kind]
    if model in same:
        return f"give the directory: model.weights={spec}"
    models = f"model={' or model='.join(same)} " if same else "a DETR-class model config with "
    return f"use {models}model.weights={spec}"


def _check_library_weights(model_cfg) -> bool:
    """A DETR-class detector's `model.weights` in the library's layout (a from_pretrained directory,
    or a Hugging Face repo name, cached by now): its kind and variant fit the model (built on the
    meta device). False: not that layout (a state dict file, checked as any other)."""
    import torch  # noqa: PLC0415 (torch: see the top)

    from visiondist.models import build_model  # noqa: PLC0415 (torch: see the top)
    from visiondist.models.detr_library import (  # noqa: PLC0415 (torch: see the top)
        is_library_dir,
        library_state,
    )

    try:
        where = local_file(str(model_cfg.weights), "model.weights")
    except WeightsNotFound as exc:
        raise ConfigError(str(exc)) from None
    if not is_library_dir(where):
        return False
    with torch.device("meta"):
        model = build_model(OmegaConf.merge(model_cfg, {"weights": None}))
    try:
        library_state(model, where, str(model_cfg.weights), str(model_cfg.name))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return True


def model_shapes(model_cfg) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The model's parameter and buffer shapes (its state dict's), built on the meta device (no
    memory, no initialisation cost), and every name a file may hold them under (a tensor tied under
    two names: either)."""
    import torch  # noqa: PLC0415 (torch: see the top)

    from visiondist.models import build_model  # noqa: PLC0415 (torch: see the top)

    bare = OmegaConf.merge(
        model_cfg, {"weights": None, "init_from": None, "backbone_weights": None}
    )
    with torch.device("meta"):
        model = build_model(bare)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = {
        n
        for n, _ in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        )
    }
    return shapes, names | set(shapes)


def _some(names: list[str], shown: int = 3) -> str:
    if not names:
        return "none"
    return ", ".join(names[:shown]) + (
        f" and {len(names) - shown} more" if len(names) > shown else ""
    )


def weights_settings(
    weights: Path, overrides: list[str], tool: str, data_needed: bool
) -> list[str]:
    """The overrides `weights` give themselves, to go before the command line's. A from_pretrained
    directory says which model reads it (`library_settings`: the variant, its classes, queries and
    input size): those settings are taken where `overrides` do not give them, in one line saying so,
    and only what it cannot say is asked for: the data to evaluate on (`data_needed`: a ConfigError
    naming it; prediction reads no data and gets the built-in COCO-format set's settings). Anything
    else: none."""
    from visiondist.models.detr_library import is_library_dir  # noqa: PLC0415 (torch: see the top)

    if not is_library_dir(weights):
        from visiondist.models.exported import recorded_settings  # noqa: PLC0415 (onnx)

        return recorded_settings(weights, overrides, tool, data_needed)
    from visiondist.models.detr_library import (  # noqa: PLC0415 (torch: see the top)
        library_settings,
    )

    said = library_settings(weights) or {}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    if "model.num_classes" in given:
        given.add("data.num_classes")
    taken = {k: v for k, v in said.items() if k not in given}
    parts = (
        [f"{' '.join(f'{k}={v}' for k, v in taken.items())} as its config.json says"]
        if taken
        else []
    )
    if said and "data" not in given:
        if data_needed:
            raise ConfigError(
                f"weights={weights} is a {said['model']} with {said['data.num_classes']} classes "
                "(its config.json says so): give the data to evaluate it on, e.g. data=coco "
                "data.root=<COCO-format root> (data=shapes_coco: the built-in set)"
            )
        taken["data"] = "shapes_coco"
        parts.append("data=shapes_coco for its settings (prediction reads no data)")
    if parts:
        print(
            f"{tool} weights={weights}: {'; '.join(parts)} (any of them given wins)",
            flush=True,
        )
    return [f"{k}={v}" for k, v in taken.items()]


def check_init_from(model_cfg) -> None:
    """`model.init_from` (a local file; a timm name is fetched and read by its own checks) fits the
    model as fine-tuning reads it, before any rank starts: the same ViT (width, depth, patch, MLP,
    bias: naming the model config of the file's shape), every tensor but the classification head
    (another class count, or none) and the position embedding (resampled to another image size) with
    the model's shape, nothing the model lacks."""
    from visiondist.models.weights import weight_shapes  # noqa: PLC0415 (torch: see the top)

    spec = str(model_cfg.init_from)
    path = Path(spec).expanduser()
    if is_named(spec) or not path.is_file():
        return
    try:
        stored = split_fused(weight_shapes(path))
    except Exception:  # not weights at all: the loader's own error names it
        return
    own, names = model_shapes(model_cfg)
    compare_vits(model_cfg, stored, own, "model.init_from")
    free = ("head.weight", "head.bias", "pos_embed")
    wrong = [k for k in own if k in stored and tuple(stored[k]) != own[k] and k not in free]
    missing = [
        k
        for k in own
        if k not in stored and k not in free and not k.endswith("num_batches_tracked")
    ]
    unknown = [k for k in stored if k not in names]
    if wrong or missing or unknown:
        what = (
            f"{wrong[0]} is {list(stored[wrong[0]])} there but {list(own[wrong[0]])} here"
            if wrong
            else f"{len(missing)} of the model's tensors are not there ({_some(missing)}) and "
            f"{len(unknown)} of its are not the model's ({_some(unknown)})"
        )
        raise ConfigError(
            f"model.init_from={spec} does not fit model={model_cfg.name}: {what}: fine-tuning "
            "reads every tensor but the head and the position embedding; use the model the "
            "weights were trained with"
        )
