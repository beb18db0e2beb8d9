"""A weights file (`model.weights`, `tools/eval.py weights=`) against the model a config builds,
before any rank starts: what the file holds read off its tensor names and shapes (a safetensors
header, a checkpoint's metadata), and one `ConfigError` naming what differs and what to set. A ViT's
shape (width, depth, patch, MLP, classes, grid) is compared field by field and the model config of
the file's shape named; a file with no tensor name in common with the model says what it seems to be
instead (a ViT, a torchvision detector, a DETR-class detector in this project's keys or in
transformers' layout); a class count is blamed only where the classifier is all that differs."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

import visiondist
from visiondist.config import ConfigError
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
_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_FUSED = re.compile(r"^(.*\.attn)\.qkv\.(weight|bias)$")


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
        _compare_vits(model_cfg, stored, own)
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
            "data.img_size) the weights were trained with"
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
        )


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
        return f"holds {_vit_text(vit)}", vit_fix(vit)
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


# -- ViTs: the shape read off the tensors ----------------------------------------------------------


def split_fused(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """timm's layout (a fused `attn.qkv`) seen under the model's keys (`attn.q`, `attn.k`,
    `attn.v`), as the ViT loader reads it."""
    if not any(_FUSED.match(k) for k in shapes):
        return shapes
    out = {}
    for key, shape in shapes.items():
        match = _FUSED.match(key)
        if match is None:
            out[key] = shape
            continue
        for part in ("q", "k", "v"):
            out[f"{match.group(1)}.{part}.{match.group(2)}"] = (shape[0] // 3, *shape[1:])
    return out


def vit_shape(shapes: dict[str, tuple]) -> Optional[dict[str, Any]]:
    """A ViT classifier's shape from its tensors (ours or timm's names), or None when they are not
    one's."""
    embed = shapes.get("patch_embed.proj.weight")
    if embed is None or len(embed) != 4:
        return None
    blocks = [int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))]
    hidden = shapes.get("blocks.0.mlp.fc1.weight", (0,))[0]
    tokens = shapes.get("pos_embed", (1, 1, 0))[1]
    return {
        "width": embed[0],
        "depth": max(blocks) + 1 if blocks else 0,
        "patch": embed[-1],
        "mlp_ratio": hidden / embed[0],
        "qkv_bias": "blocks.0.attn.q.bias" in shapes,
        "classes": shapes.get("head.weight", (0,))[0],
        "grid": round((tokens - 1) ** 0.5),
    }


# a ViT's shape (`vit_shape`) -> the model config key that sets it (and its default where a config
# leaves it out)
_VIT_KEYS = (
    ("width", "embed_dim", None),
    ("patch", "patch_size", None),
    ("depth", "depth", None),
    ("mlp_ratio", "mlp_ratio", None),
    ("qkv_bias", "qkv_bias", True),
)


def named_vit(vit: dict[str, Any]) -> Optional[str]:
    """The ViT model config of this width, patch, MLP and bias (one of this depth first), or
    None."""
    found = [
        name
        for name, cfg in _vit_configs().items()
        if all(
            _value(cfg, key, default) == vit[field]
            for field, key, default in _VIT_KEYS
            if field != "depth"
        )
    ]
    same_depth = [name for name in found if _vit_configs()[name].depth == vit["depth"]]
    return next(iter(same_depth or found), None)


@functools.lru_cache(maxsize=1)
def _vit_configs() -> dict[str, Any]:
    """The ViT model configs (configs/model/*.yaml of family vit; none where the package was
    installed without them)."""
    folder = Path(visiondist.__file__).resolve().parents[1] / "configs" / "model"
    found: dict[str, Any] = {}
    for file in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        cfg = OmegaConf.load(file)
        if isinstance(cfg, DictConfig) and cfg.get("family") == "vit":  # a model config is a map
            found[str(cfg.name)] = cfg
    return found


def _value(cfg, key: str, default: Any) -> Any:
    value = cfg.get(key, default)
    return float(value) if key == "mlp_ratio" else value


def vit_fix(vit: dict[str, Any], model_cfg=None) -> str:
    """The settings that build a ViT of the file's shape: `model=<config>` of that shape and the
    `model.<key>=` it further needs. Given the config in use (`model_cfg`), keys set on the command
    line (those that differ from its model config's file) count as staying: they are named whenever
    they differ from the file."""
    variant = named_vit(vit)
    configs = _vit_configs()
    # the config to switch to: the file's variant where it is not the one in use
    target = (
        configs[variant]
        if variant is not None and (model_cfg is None or variant != model_cfg.name)
        else None
    )
    mine = configs.get(str(model_cfg.name)) if model_cfg is not None else None
    settings = []
    for field, key, default in _VIT_KEYS:
        if model_cfg is None:
            result = _value(configs[variant], key, default) if variant else None
        else:
            current = _value(model_cfg, key, default)
            overridden = mine is None or _value(mine, key, default) != current
            result = (
                _value(target, key, default) if target is not None and not overridden else current
            )
        if result != vit[field]:
            settings.append(
                f"model.{key}={vit[field]:g}"
                if field == "mlp_ratio"
                else f"model.{key}={str(vit[field]).lower()}"
                if field == "qkv_bias"
                else f"model.{key}={vit[field]}"
            )
    if variant is None and any(s.startswith("model.embed_dim=") for s in settings):
        settings.append(f"model.num_heads=<a divisor of {vit['width']}>")
    if variant is None and model_cfg is None:
        return "use a ViT model config (model=vit_*) with " + " ".join(settings)
    return "use " + " ".join(([f"model={variant}"] if target is not None else []) + settings)


def _compare_vits(model_cfg, stored: dict, own: dict, key: str = "model.weights") -> None:
    """The file's ViT shape against the model's: what differs, named with the settings that fix it.
    `key`: model.init_from resamples another image size's position embedding, so only the
    architecture must agree."""
    theirs, ours = vit_shape(stored), vit_shape(own)
    if theirs is None or ours is None:
        return
    spec, name = model_cfg.get(key.split(".")[1]), model_cfg.name
    texts = {
        "width": "{} wide",
        "patch": "patch {}",
        "depth": "{} blocks deep",
        "mlp_ratio": "MLP ratio {:g}",
        "qkv_bias": "qkv bias {}",
    }
    differ = [
        texts[field].format(ours[field])
        for field, _, _ in _VIT_KEYS
        if theirs[field] != ours[field]
    ]
    if differ:
        raise ConfigError(
            f"{key}={spec} is {_vit_text(theirs)} but model={name} is {', '.join(differ)}: "
            f"{vit_fix(theirs, model_cfg)}"
        )
    if key == "model.init_from":
        return
    if theirs["grid"] != ours["grid"]:
        size = theirs["grid"] * theirs["patch"]
        raise ConfigError(
            f"model.weights={spec} is a ViT for {size} px images ({theirs['grid']} x "
            f"{theirs['grid']} patches) but model={name} takes {ours['grid'] * ours['patch']} px "
            f"({ours['grid']} x {ours['grid']}): set data.img_size={size} (or start from it with "
            "model.init_from=, which resamples the position embedding)"
        )


def _vit_text(vit: dict[str, Any]) -> str:
    """The file's ViT as a message says it: `a vit_tiny (width 192, depth 12, patch 16, 6 classes)`,
    or `a ViT (...)` for a shape no model config has."""
    variant = named_vit(vit)
    named = variant is not None and _vit_configs()[variant].depth == vit["depth"]
    head = f"{vit['classes']} classes" if vit["classes"] else "no classification head"
    shape = f"width {vit['width']}, depth {vit['depth']}, patch {vit['patch']}, {head}"
    return f"a {variant if named else 'ViT'} ({shape})"


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
    from visiondist.models.detr import ARCHS  # noqa: PLC0415 (torch: see the top)

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
        return []
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
            f"{tool} weights={weights}: {'; '.join(parts)} (any of them given on the command line "
            "wins)",
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
    _compare_vits(model_cfg, stored, own, "model.init_from")
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
