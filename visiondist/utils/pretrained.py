"""Pretrained weights by name, from the caches their libraries use.

- `model.init_from=timm/<architecture>.<tag>` (any name `timm.list_pretrained()` lists): the weights
  timm's pretrained config points to, resolved through huggingface_hub's cache (`HF_HUB_CACHE`, by
  default ~/.cache/huggingface/hub), downloaded there when the network allows. With
  `HF_HUB_OFFLINE=1` only the cache is read. The pretrained config that comes with them (input size,
  mean, std, crop_pct, interpolation) becomes the data's defaults (`utils/data_defaults.py`).
- `model.weights=` / `model.backbone_weights=` naming one of torchvision's weight enums
  (`ResNet50_Weights.IMAGENET1K_V2`, `FasterRCNN_ResNet50_FPN_Weights.COCO_V1`): the file its URL
  names in torch hub's cache (`$TORCH_HOME/hub/checkpoints`, by default
  ~/.cache/torch/hub/checkpoints), downloaded there (hash checked) unless `HF_HUB_OFFLINE=1` or
  `VISIONDIST_OFFLINE=1`.
- `model.weights=<owner>/<name>` for a DETR-class detector: a Hugging Face repo in the library's
  layout (config.json + model.safetensors, as transformers' `from_pretrained` reads), e.g.
  `PekingU/rtdetr_v2_r18vd`: its snapshot in huggingface_hub's cache, downloaded there when the
  network allows (not with `HF_HUB_OFFLINE=1`).

Resolution happens in the launching process before any rank starts (`local_file(...,
download=True)`); ranks only read the cache. A name that is not cached where nothing can be
downloaded is one line naming the file looked for and the command that fetches it. Files are read
like local weights: safetensors, or torch files with weights_only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, cast

_hub_constants: Optional[ModuleType]
try:  # timm's dependency; its offline switch (the downloads are imported where they are used)
    from huggingface_hub import constants as _hub_constants
except ImportError:
    _hub_constants = None

# The libraries that resolve a name are imported where they are used (noqa: PLC0415): this module
# is read by the torch-free config checks (`tools/train.py --cfg job`), which timm (3-4 s: it
# brings torch and torchvision), torchvision (3.5 s), torch (2 s) or huggingface_hub's downloads
# (0.15 s) would slow.

TIMM = "timm/"
_ENUM = re.compile(r"^([A-Za-z0-9_]+_Weights)\.([A-Za-z0-9_]+)$")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".json")
# what a repo in transformers' layout holds that a model needs
HF_FILES = ("config.json", "model.safetensors")


class WeightsNotFound(ValueError):
    """A named weights file that is not cached and cannot be downloaded here; the message says how
    to fetch it."""


def is_timm_name(spec: Optional[str]) -> bool:
    return bool(spec) and str(spec).startswith(TIMM) and not Path(str(spec)).expanduser().exists()


def is_enum_name(spec: Optional[str]) -> bool:
    return (
        bool(spec)
        and _ENUM.match(str(spec)) is not None
        and not Path(str(spec)).expanduser().exists()
    )


def is_hf_repo(spec: Optional[str]) -> bool:
    """`owner/name` that is not a local path, a timm name or a file name: a Hugging Face repo."""
    text = str(spec or "")
    return (
        bool(_REPO.match(text))
        and not text.startswith(TIMM)
        and not text.lower().endswith(_FILE_SUFFIXES)
        and not Path(text).expanduser().exists()
    )


def is_named(spec: Optional[str]) -> bool:
    return is_timm_name(spec) or is_enum_name(spec) or is_hf_repo(spec)


def _offline_flag() -> str:
    """The setting that forbids downloads ("HF_HUB_OFFLINE=1", "VISIONDIST_OFFLINE=1"), or ""."""
    on = ("1", "true", "yes", "on")
    for name in ("HF_HUB_OFFLINE", "VISIONDIST_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in on:
            return f"{name}=1"
    if _hub_constants is not None and str(_hub_constants.HF_HUB_OFFLINE).strip().lower() in on:
        return "HF_HUB_OFFLINE=1"
    return ""


def offline() -> bool:
    return bool(_offline_flag())


# -- timm ------------------------------------------------------------------------------------------


def timm_pretrained_cfg(spec: str, key: str = "model.init_from") -> Any:
    """timm's `PretrainedCfg` of `timm/<architecture>[.<tag>]` (no tag: timm's default tag of the
    architecture)."""
    import timm  # noqa: PLC0415 (timm: 3-4 s, see the top)
    from timm.models import get_pretrained_cfg  # noqa: PLC0415 (timm: 3-4 s, see the top)

    name = spec[len(TIMM) :]
    arch = name.split(".", 1)[0]
    hint = (
        f"`python -c \"import timm; print(timm.list_pretrained('{arch.split('_')[0]}*'))\"` lists "
        f"the names, e.g. {key}=timm/vit_base_patch16_224.augreg2_in21k_ft_in1k"
    )
    if arch not in timm.list_models():
        raise ValueError(
            f"{key}={spec}: timm {timm.__version__} has no architecture {arch}: {hint}"
        )
    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError:
        cfg = None
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{arch}.*")]
        raise ValueError(
            f"{key}={spec}: timm has no pretrained weights of that name; {arch} has "
            f"{', '.join(tags[:8]) or 'none'}{' ...' if len(tags) > 8 else ''} ({hint})"
        )
    return cfg


def _timm_candidates(cfg) -> list[str]:
    """The files of a Hugging Face repo timm reads, in its order: a safetensors file first."""
    name = cfg.hf_hub_filename or "pytorch_model.bin"
    if name.endswith(".safetensors"):
        return [name]
    if name == "pytorch_model.bin":
        return ["model.safetensors", name]
    if name == "open_clip_pytorch_model.bin":
        return ["open_clip_model.safetensors", name]
    return [name]


def _timm_file(spec: str, key: str, download: bool) -> Path:
    from huggingface_hub import (  # noqa: PLC0415 (hub downloads: 0.15 s, see the top)
        constants,
        hf_hub_download,
        try_to_load_from_cache,
    )

    cfg = timm_pretrained_cfg(spec, key)
    # an older model whose weights are a plain URL: torch hub's cache, as timm uses
    if not cfg.hf_hub_id:
        return _hub_file(cfg.url, key, spec, download)
    repo, _, revision = cfg.hf_hub_id.partition("@")
    revision = revision or None
    names = _timm_candidates(cfg)
    for name in names:
        cached = try_to_load_from_cache(repo, name, revision=revision)
        if isinstance(cached, str) and Path(cached).is_file():
            return Path(cached)
    cache = constants.HF_HUB_CACHE
    fetch = (
        f"fetch it where there is network with `hf download {repo} {names[0]}` (huggingface_hub's "
        f"CLI) and copy that machine's {cache} here, or point HF_HUB_CACHE at a copy"
    )
    if not download or offline():
        why = _offline_flag() or "ranks read only the cache"
        raise WeightsNotFound(
            f"{key}={spec}: {names[0]} of {repo} is not in the Hugging Face cache {cache} "
            f"({why}): {fetch}"
        )
    from huggingface_hub.errors import (  # noqa: PLC0415 (hub: 0.15 s, see the top)
        EntryNotFoundError,
        LocalEntryNotFoundError,
    )

    error: Optional[BaseException] = None
    for name in names:
        try:
            return Path(hf_hub_download(repo, name, revision=revision))
        except EntryNotFoundError as exc:
            if isinstance(exc, LocalEntryNotFoundError):  # the hub could not be reached: no network
                raise WeightsNotFound(
                    f"{key}={spec}: {names[0]} of {repo} is not in the Hugging Face cache {cache} "
                    f"and the hub could not be reached: {fetch} (HF_HUB_OFFLINE=1 skips the "
                    "download attempts)"
                ) from None
            error = exc  # the repo has the other file
        except Exception as exc:  # no such repo, refused, ...
            raise WeightsNotFound(
                f"{key}={spec}: {names[0]} of {repo} is not in the Hugging Face cache {cache} and "
                f"could not be downloaded ({type(exc).__name__}): {fetch}"
            ) from None
    raise WeightsNotFound(f"{key}={spec}: {repo} has none of {', '.join(names)} ({error})")


def timm_shape(spec: str) -> Optional[dict[str, int]]:
    """The ViT shape of a timm name's architecture (embed_dim, depth, num_heads, patch_size), built
    on the meta device (nothing allocated, nothing read); None for an architecture that is not a
    plain ViT."""
    import timm  # noqa: PLC0415 (timm: 3-4 s, see the top)
    import torch  # noqa: PLC0415 (torch: 2 s, see the top)

    arch = timm_pretrained_cfg(spec).architecture
    with torch.device("meta"):
        model = timm.create_model(arch, pretrained=False)
    blocks, embed = getattr(model, "blocks", None), getattr(model, "patch_embed", None)
    if blocks is None or embed is None or not hasattr(blocks[0], "attn"):
        return None
    patch = getattr(embed, "patch_size", (0,))
    return {
        # timm types create_model's model as a plain nn.Module: a ViT's field, read as such
        "embed_dim": int(cast(Any, model).embed_dim),
        "depth": len(blocks),
        "num_heads": int(blocks[0].attn.num_heads),
        "patch_size": int(patch[0] if isinstance(patch, (tuple, list)) else patch),
    }


# -- torchvision -----------------------------------------------------------------------------------


def torchvision_weights(spec: str, key: str):
    """The member of torchvision's weight enum `spec` names, e.g.
    `ResNet50_Weights.IMAGENET1K_V2`."""
    import torchvision.models as tvm  # noqa: PLC0415 (torchvision: 3.5 s, see the top)
    from torchvision.models import get_weight  # noqa: PLC0415 (torchvision: see the top)

    try:
        return get_weight(spec)
    except (KeyError, ValueError, AttributeError):
        match = _ENUM.match(spec)
        enum = match.group(1) if match else spec
        members = [m.name for m in getattr(tvm, enum, getattr(tvm.detection, enum, None)) or []]
        which = (
            f"{enum} has {', '.join(members)}"
            if members
            else f"torchvision has no weight enum {enum} (e.g. ResNet50_Weights, "
            "FasterRCNN_ResNet50_FPN_Weights)"
        )
        raise ValueError(f"{key}={spec}: not one of torchvision's weights: {which}") from None


def _hub_file(url: str, key: str, spec: str, download: bool) -> Path:
    import torch.hub  # noqa: PLC0415 (torch: 2 s, see the top)

    file = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url.split("?")[0])
    if file.is_file():
        return file
    fetch = (
        f"fetch it where there is network (`curl -L -o {file.name} {url}`) and put it at {file} "
        "(TORCH_HOME moves the cache)"
    )
    if not download or offline():
        why = _offline_flag() or "ranks read only the cache"
        raise WeightsNotFound(f"{key}={spec}: {file} is not in torch hub's cache ({why}): {fetch}")
    match = torch.hub.HASH_REGEX.search(file.name)
    file.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(
            url, str(file), match.group(1) if match else None, progress=True
        )
    except Exception as exc:
        raise WeightsNotFound(
            f"{key}={spec}: {file} is not in torch hub's cache and could not be downloaded "
            f"({type(exc).__name__}): {fetch}"
        ) from None
    return file


# -- Hugging Face repos in transformers' layout ----------------------------------------------------


def _hf_repo_dir(spec: str, key: str, download: bool) -> Path:
    """The cached snapshot of repo `spec` holding config.json and model.safetensors (downloaded
    first when allowed)."""
    from huggingface_hub import (  # noqa: PLC0415 (hub downloads: 0.15 s, see the top)
        constants,
        snapshot_download,
    )

    cache = constants.HF_HUB_CACHE
    fetch = (
        f"fetch it where there is network with `hf download {spec} {' '.join(HF_FILES)}` "
        f"(huggingface_hub's CLI) and copy that machine's {cache} here, or point HF_HUB_CACHE at "
        "a copy"
    )
    try:
        where = Path(snapshot_download(spec, allow_patterns=list(HF_FILES), local_files_only=True))
    except Exception:  # not cached (huggingface_hub's LocalEntryNotFoundError and friends)
        where = None
    if where is not None and all((where / f).is_file() for f in HF_FILES):
        return where
    if not download or offline():
        why = _offline_flag() or "ranks read only the cache"
        raise WeightsNotFound(
            f"{key}={spec}: no local file or directory of that name, and the Hugging Face repo "
            f"{spec} is not in the cache {cache} ({why}): {fetch}"
        )
    try:
        where = Path(snapshot_download(spec, allow_patterns=list(HF_FILES)))
    except Exception as exc:  # no network, no such repo, refused
        raise WeightsNotFound(
            f"{key}={spec}: no local file or directory of that name, and the Hugging Face repo "
            f"{spec} is not in the cache {cache} and could not be downloaded "
            f"({type(exc).__name__}): {fetch}"
        ) from None
    missing = [f for f in HF_FILES if not (where / f).is_file()]
    if missing:
        raise WeightsNotFound(
            f"{key}={spec}: the repo has no {', '.join(missing)}: it is not a model in "
            "transformers' layout with safetensors weights"
        )
    return where


# -- either ----------------------------------------------------------------------------------------


def local_file(spec: str, key: str, download: bool = False) -> Path:
    """The local file of `spec`: a path as given, or a timm / torchvision name resolved through its
    cache, or a Hugging Face repo's cached snapshot directory (`download`: fetch it when it is not
    cached and the network allows; only the launching process does)."""
    if is_hf_repo(spec):
        return _hf_repo_dir(spec, key, download)
    if is_timm_name(spec):
        return _timm_file(spec, key, download)
    if is_enum_name(spec):
        return _hub_file(torchvision_weights(spec, key).url, key, spec, download)
    return Path(spec).expanduser()
