"""DETR-class detectors' weights in transformers' own layout, and the model a config builds with
them.

`build_detr` (`model.family=detr`) builds `DetrDetector` and loads `model.weights`: a local state
dict of the wrapper's keys, a directory in the library's `from_pretrained` layout (config.json +
model.safetensors), or a Hugging Face repo name whose snapshot is in the local cache.
`library_state` reads such a directory through the library (its renamed keys included) and checks it
against the model: its kind, its variant (naming the config that fits), class heads of another count
left to start afresh. `save_library_dir` writes that layout (`format=hf`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from visiondist.models.detr import DetrDetector
from visiondist.models.detr_archs import (
    ARCHS,
    Arch,
    _transformers,
    arch_of,
    build_hf_detector,
    library_values,
)
from visiondist.models.weights import load_local_weights, output_mode
from visiondist.utils.pretrained import local_file

log = logging.getLogger(__name__)


def build_detr(cfg: Any) -> nn.Module:
    """`model.family=detr`: the `DetrDetector` of `model.arch` for `model.num_classes` classes at
    `model.img_size`, random weights or `model.weights`: a local state dict of this wrapper's keys,
    a directory in the library's layout (config.json + model.safetensors, as `from_pretrained` reads
    and format=hf writes) or a Hugging Face repo name read from the local cache."""
    spec = arch_of(str(cfg.arch))
    scales = [int(s) for s in cfg.get("multi_scale") or []]
    model = DetrDetector(
        build_hf_detector(str(cfg.arch), int(cfg.num_classes), model_values(cfg)),
        int(cfg.img_size),
        spec,
        scales,
    )
    if cfg.weights:
        # a repo name: its snapshot in the cache
        where = local_file(str(cfg.weights), "model.weights")
        if is_library_dir(where):
            state, fresh = library_state(model, where, str(cfg.weights), str(cfg.name))
            if fresh:
                log.info(
                    "model.weights=%s: %s classes there, %d here: the class heads (%s) start "
                    "afresh",
                    cfg.weights,
                    _labels_of(where),
                    int(cfg.num_classes),
                    ", ".join(fresh),
                )
            model.load_state_dict({**model.state_dict(), **state}, strict=True)
            log.info(
                "model.weights=%s: %d of the model's %d tensors loaded from %s",
                cfg.weights,
                len(state),
                len(model.state_dict()),
                where,
            )
        else:
            load_local_weights(model, str(where))
    return model


# RT-DETR's and D-FINE's configs: the backbone's BatchNorms frozen
FROZEN_BN = "freeze_backbone_batch_norms"


def model_values(cfg: Any) -> dict[str, Any]:
    """The library configuration's values for the model config `cfg`: `library_values`
    (model.kwargs, model.num_queries) and whether the backbone's BatchNorms are frozen
    (`_frozen_backbone_batchnorms`)."""
    values = library_values(cfg)
    if FROZEN_BN not in values and _has_frozen_bn_setting(arch_of(str(cfg.arch))):
        values[FROZEN_BN] = _frozen_backbone_batchnorms(cfg)
    return values


def _has_frozen_bn_setting(arch: Arch) -> bool:
    return hasattr(getattr(_transformers(), arch.config)(), FROZEN_BN)


def _frozen_backbone_batchnorms(cfg: Any) -> bool:
    """Whether the backbone's BatchNorms are frozen (the library's default) or train: frozen only
    where the model starts from a directory in the library's layout whose config.json has them
    frozen. A state dict of this wrapper's keys needs nothing here: its loader
    (`load_local_weights`) freezes the BatchNorms saved without their `num_batches_tracked`. From
    random weights they train, as D-FINE-N/S and RT-DETRv2-R18 train theirs: frozen at their initial
    statistics they normalise nothing, the backbone's activations shrink about 10x a layer and its
    first gradients reach 1e12 (measured for D-FINE-N), and the detector sits on the DETR loss
    plateau for epochs. `model.kwargs.freeze_backbone_batch_norms` sets it either way."""
    if not cfg.weights:
        return False
    where = local_file(str(cfg.weights), "model.weights")
    return is_library_dir(where) and bool(_library_config(where).get(FROZEN_BN, True))


# -- weights in the library's layout: a from_pretrained directory (config.json + model.safetensors)


def is_library_dir(path) -> bool:
    where = Path(path)
    return (
        where.is_dir()
        and (where / "config.json").is_file()
        and (where / "model.safetensors").is_file()
    )


def _library_config(where) -> dict:
    return json.loads((Path(where) / "config.json").read_text())


def _labels_of(where) -> int:
    config = _library_config(where)
    return int(len(config.get("id2label") or {}) or config.get("num_labels") or 0)


def library_state(
    model: DetrDetector, where, spec: str, name: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The weights of a directory in the library's layout under `model`'s keys, checked against it:
    the same kind of model (config.json's model_type), every tensor present with the model's shape;
    the class heads of another class count are left out (they start afresh: the names are returned).
    `model` may live on the meta device. A ValueError names the fix."""
    config = _library_config(where)
    kind = config.get("model_type")
    if kind != model.arch.model_type:
        same = [n for n, a in ARCHS.items() if a.model_type == kind]
        use = (
            f"use model={' or model='.join(same)}"
            if same
            else f"the models here are {', '.join(ARCHS)}"
        )
        raise ValueError(
            f"model.weights={spec} holds a {kind} model, not model={name}'s "
            f"{model.arch.model_type}: {use}"
        )
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = model.model.config.num_labels
    if ours is None:  # a detector's library config counts its labels
        raise ValueError(f"model={name}: its library config counts no labels")
    theirs_labels = _labels_of(where)
    # the library reads its own layout (its renamed keys included)
    stored = _from_pretrained(model.arch, where)
    state, fresh, unknown, wrong = {}, [], [], []
    for key, tensor in stored.items():
        ours_key = model.aliases.get("model." + key, "model." + key)
        if ours_key not in own:
            # trained BatchNorms there, frozen ones here: nothing lost
            if not key.endswith("num_batches_tracked"):
                unknown.append(key)
        elif tuple(tensor.shape) == own[ours_key]:
            state[ours_key] = tensor
        elif _class_head(tuple(tensor.shape), own[ours_key], theirs_labels, ours):
            fresh.append(ours_key)
        else:
            wrong.append((key, tuple(tensor.shape), own[ours_key]))
    missing = sorted(
        k for k in set(own) - set(state) - set(fresh) if not k.endswith("num_batches_tracked")
    )
    if wrong or unknown or missing:
        what = (
            f"{wrong[0][0]} is {list(wrong[0][1])} there but {list(wrong[0][2])} here"
            if wrong
            else f"{(unknown or missing)[0]} is "
            f"{'there but not here' if unknown else 'here but not there'}"
        )
        fits = _variant_of(
            stored, kind, theirs_labels, {k: config[k] for k in ("num_queries",) if k in config}
        )
        use = f"use model={fits}" if fits else "pick the model config of the weights' variant"
        raise ValueError(
            f"model.weights={spec} is another variant than model={name} ({what}; {len(wrong)} "
            f"tensors differ, {len(unknown)} unknown, {len(missing)} missing): {use}"
        )
    return state, sorted({k[len("model.") :].rsplit(".", 1)[0] for k in fresh})


@contextlib.contextmanager
def _quiet():
    """transformers without its progress bars and notes (reading or writing a directory here is one
    log line)."""
    transformers = _transformers()
    logging_ = transformers.utils.logging
    verbosity, bars = logging_.get_verbosity(), logging_.is_progress_bar_enabled()
    logging_.set_verbosity_error()
    logging_.disable_progress_bar()
    try:
        yield transformers
    finally:
        logging_.set_verbosity(verbosity)
        if bars:
            logging_.enable_progress_bar()


def _from_pretrained(arch: Arch, where) -> dict[str, torch.Tensor]:
    """The state dict of the library's model read from `where` by its `from_pretrained` (quietly; no
    download)."""
    with _quiet() as transformers:
        loaded, info = getattr(transformers, arch.model).from_pretrained(
            str(where), local_files_only=True, output_loading_info=True
        )
    if info.get("missing_keys") or info.get("mismatched_keys"):
        what = sorted(info.get("missing_keys") or info.get("mismatched_keys"))
        raise ValueError(
            f"model.weights={where}: its model.safetensors does not fit its own config.json "
            f"({len(what)} tensors, e.g. {what[0]}): the directory is damaged or mixed; export it "
            "again"
        )
    return loaded.state_dict()


def _variant_of(
    stored: dict[str, torch.Tensor], kind: str, labels: int, overrides: dict
) -> Optional[str]:
    """The model config whose architecture (with the stored config's `overrides`, e.g. its queries)
    has exactly the stored tensors' names and shapes (built on the meta device), if one has."""

    def shapes_of(state: dict) -> dict:  # BatchNorms frozen or not alike
        return {
            k: tuple(v.shape) for k, v in state.items() if not k.endswith("num_batches_tracked")
        }

    shapes = shapes_of(stored)
    for name, arch in ARCHS.items():
        if arch.model_type != kind:
            continue
        with torch.device("meta"):
            candidate = build_hf_detector(name, labels, overrides)
        if shapes_of(candidate.state_dict()) == shapes:
            return name
    return None


def library_settings(where) -> Optional[dict[str, Any]]:
    """What a from_pretrained directory says of the model config that reads it, as overrides:
    `model` (its variant, the config whose tensors have exactly the stored names and shapes),
    `data.num_classes` (id2label's count), `model.num_queries` and `model.img_size` (the image
    processor's square side). None where it is no DETR-class model of this project's, or no model
    config here fits its tensors."""
    config = _library_config(where)
    kind = config.get("model_type")
    arch = next((a for a in ARCHS.values() if a.model_type == kind), None)
    if arch is None:
        return None
    labels = _labels_of(where)
    queries = {k: config[k] for k in ("num_queries",) if k in config}
    name = _variant_of(_from_pretrained(arch, where), arch.model_type, labels, queries)
    if name is None:
        return None
    settings: dict[str, Any] = {"model": name, "data.num_classes": labels}
    if "num_queries" in config:
        settings["model.num_queries"] = int(config["num_queries"])
    processor = Path(where) / "preprocessor_config.json"
    size = json.loads(processor.read_text()).get("size") if processor.is_file() else None
    if isinstance(size, dict) and size.get("height") and size.get("height") == size.get("width"):
        settings["model.img_size"] = int(size["height"])
    return settings


def _class_head(theirs: tuple, ours: tuple, theirs_labels: int, our_labels: int) -> bool:
    """A tensor sized by the class count (a classifier's rows; the denoising label embedding has one
    more)."""
    return (
        len(theirs) == len(ours)
        and theirs[1:] == ours[1:]
        and theirs[0] - theirs_labels in (0, 1)
        and ours[0] - our_labels == theirs[0] - theirs_labels
    )


def save_library_dir(
    model: DetrDetector,
    out,
    classes: Optional[list[str]] = None,
    category_ids: Optional[list[int]] = None,
) -> list:
    """`model` as a directory transformers' `from_pretrained` reads: config.json (with the class
    names and, for a COCO-trained model, `category_ids`: the COCO category id of each 0-based
    library label, which transformers keeps as `model.config.category_ids`), model.safetensors, and
    preprocessor_config.json (the library's image processor at model.img_size)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    inner = model.model
    if classes:
        inner.config.id2label = dict(enumerate(classes))
        inner.config.label2id = {c: i for i, c in enumerate(classes)}
    if category_ids:
        if classes and len(category_ids) != len(classes):
            raise ValueError(f"{len(category_ids)} category ids for {len(classes)} classes")
        inner.config.category_ids = [int(c) for c in category_ids]
    # read with weights of another data set: not this model's map
    elif hasattr(inner.config, "category_ids"):
        del inner.config.category_ids
    with _quiet() as transformers:
        inner.save_pretrained(str(out), safe_serialization=True)
        processor = getattr(transformers, model.arch.processor)(
            size={"height": model.img_size, "width": model.img_size},
            do_normalize=model.arch.normalize,
        )
        processor.save_pretrained(str(out))
    files = [out / "config.json", out / "model.safetensors", out / "preprocessor_config.json"]
    for file in files:  # safetensors writes 0o600
        output_mode(file)
    return files
