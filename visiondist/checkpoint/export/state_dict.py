"""format=safetensors: the unsharded weights under the anchor library's key names (timm's for ViTs:
fused `qkv`; torchvision's for its detectors), the names in the file's own metadata, and the
preprocessing record as `<out>.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from visiondist.checkpoint.export.preprocessing import name_metadata, sidecar
from visiondist.checkpoint.export.trained import Trained
from visiondist.models.vit import to_timm_state_dict
from visiondist.models.weights import save_weights


def export_state_dict(trained: Trained) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in trained.model.state_dict().items()}
    return to_timm_state_dict(state) if trained.cfg.model.family == "vit" else state


def write_safetensors(trained: Trained, path: Path, out: Path) -> list[Path]:
    """The weights at `path` (a temporary name of `out`) and the sidecar at `out` with the suffix
    .json.

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary name of `out`, renamed by `export`).
        out: the export's final path.

    Returns:
        The other file written: the sidecar.
    """
    save_weights(
        export_state_dict(trained), path, metadata={"format": "pt", **name_metadata(trained)}
    )
    meta = out.with_suffix(".json")
    meta.write_text(json.dumps(sidecar(trained), indent=2))
    return [meta]
