"""format=naflex: a ViT's weights as timm's NaFlexVit holds them
(`visiondist.models.patches.to_timm_naflex`), which takes images at their own size and aspect ratio
as patch sequences, as a run with data.resolution=native trained; and `<out>.json` with the
`timm.create_model` call that loads them strictly. Any ViT run exports so (the weights are the
square model's too)."""

from __future__ import annotations

import json
from pathlib import Path

from visiondist.checkpoint.export.preprocessing import name_metadata, sidecar
from visiondist.checkpoint.export.state_dict import export_state_dict
from visiondist.checkpoint.export.trained import Trained
from visiondist.config.resolution import native_settings
from visiondist.models.patches import TIMM_NAFLEX, timm_naflex_kwargs, to_timm_naflex
from visiondist.models.weights import save_weights


def write_naflex(trained: Trained, path: Path, out: Path) -> list[Path]:
    """A ViT's weights as timm's NaFlexVit holds them at `path`, and their sidecar (module doc).

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary name of `out`, renamed by `export`).
        out: the export's final path.

    Returns:
        The other file written: the sidecar (`out` with the suffix .json).
    """
    m = trained.cfg.model
    if m.family != "vit":
        raise ValueError(
            f"format=naflex writes a ViT for timm's NaFlexVit; model={m.name} is not one: export "
            "format=safetensors (or onnx)"
        )
    side = int(m.img_size) // int(m.patch_size)
    save_weights(
        to_timm_naflex(export_state_dict(trained), (side, side)),
        path,
        metadata={"format": "pt", **name_metadata(trained)},
    )
    kwargs = timm_naflex_kwargs(
        int(m.img_size),
        int(m.patch_size),
        int(m.embed_dim),
        int(m.depth),
        int(m.num_heads),
        float(m.mlp_ratio),
        int(m.num_classes),
    )
    kwargs["pos_embed_grid_size"] = list(kwargs["pos_embed_grid_size"])
    # the square model's preprocessing fields (create, usage, input size, crop) say nothing of this
    # one
    info = {
        key: value
        for key, value in sidecar(trained).items()
        if key not in ("create", "usage", "input_size", "crop_pct")
    }

    _, eval_len = native_settings(trained.cfg.data, int(m.img_size), int(m.patch_size))
    info.update(
        library="timm",
        timm_model=TIMM_NAFLEX,
        kwargs=kwargs,
        patch_size=int(m.patch_size),
        eval_seq_len=eval_len,
        timm_model_note=f"{TIMM_NAFLEX} is the registered NaFlexVit without layer scale or "
        "register tokens; kwargs make it this run's model (width, depth, heads, "
        "patch, classes, pooling)",
        usage="model = timm.create_model(timm_model, pretrained=False, **kwargs); "
        "model.load_state_dict(safetensors.torch.load_file(path), strict=True); "
        "model({'patches': (B, N, p*p*3) pixels normalised with mean / std, each patch's in "
        "(row, column, channel) order, 'patch_coord': (B, N, 2) (row, column) of each "
        "patch, 'patch_valid': (B, N) bool}). Each image resized, aspect kept, to the grid "
        "timm.data.naflex_transforms.get_image_size_for_seq(image_hw, patch_size, "
        "eval_seq_len) gives, with OpenCV's resize (interpolation) as the run's evaluation "
        "did, then cut by timm.data.naflex_transforms.patchify_image: "
        "docs/native-resolution.md has the code. timm's ResizeToSequence picks the same "
        "grid but antialiases where it shrinks: about 1e-3 apart on an image near its "
        "grid's size, and a shrunk image can change class",
    )
    meta = out.with_suffix(".json")
    meta.write_text(json.dumps(info, indent=2))
    return [meta]
