"""The DETR-class variants built here (`ARCHS`: RT-DETRv2, D-FINE, RF-DETR at their published
sizes) and how transformers builds one with random weights (`build_hf_detector`); no torch at
import, so that the config checks and the registry read the table without it. The wrapper that
trains and evaluates them is `detr.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # the optional extra [detr]; its models are built through `_transformers`
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Arch:
    """How one published variant is built and fed."""

    config: str  # transformers' configuration class
    model: str  # its ...ForObjectDetection class
    # its image processor: the resize the published weights expect, and the post-processing
    processor: str
    model_type: str  # config.json's model_type of weights in the library's layout
    # the published variant's architecture values (the rest are the configuration's defaults)
    values: dict[str, Any]
    # feature strides whose positions the encoder's top-k query selection draws from
    strides: tuple[int, ...]
    # ImageNet mean / std after the resize (RF-DETR's DINOv2); else pixels in [0, 1]
    normalize: bool = False
    # the processor's resize antialiases when it shrinks (torchvision's default; RF-DETR: off)
    antialias: bool = True
    # model.img_size must be a multiple of it, for this reason (RT-DETR's and D-FINE's feature
    # pyramid: other sizes fail at their first step)
    multiple: int = 32
    multiple_why: str = "its stride-32 features are upsampled onto the finer ones"

    def mean_std(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The input scaling after the resize: ImageNet's mean / std where the model normalises,
        else none."""
        return (_MEAN, _STD) if self.normalize else ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


_HGNET_B0 = {
    "model_type": "hgnet_v2",
    "stem_channels": [3, 16, 16],
    "stage_in_channels": [16, 64, 256, 512],
    "stage_mid_channels": [16, 32, 64, 128],
    "stage_out_channels": [64, 256, 512, 1024],
    "stage_num_blocks": [1, 1, 2, 1],
    "stage_downsample": [False, True, True, True],
    "stage_light_block": [False, False, True, True],
    "stage_kernel_size": [3, 3, 5, 5],
    "stage_numb_of_layers": [3, 3, 3, 3],
    "use_learnable_affine_block": True,
}
# RF-DETR's windowed DINOv2-S backbone (patch 16, 2 x 2 windows, features of blocks 3, 6, 9, 12), at
# the published variant's resolution (the size of its position-embedding grid; other sizes
# interpolate it)
_DINOV2_S = {
    "model_type": "rf_detr_dinov2",
    "hidden_size": 384,
    "num_attention_heads": 6,
    "num_hidden_layers": 12,
    "mlp_ratio": 4,
    "patch_size": 16,
    "num_windows": 2,
    "out_indices": [3, 6, 9, 12],
    "num_register_tokens": 0,
}

# model.arch -> how it is built; a model built from these values has the published parameter count
# at COCO's 80 classes: RT-DETRv2-S 20.2M, -L 42.9M, D-FINE-N 3.8M, -S 10.3M, RF-DETR-N 30.4M, -S
# 32.1M
ARCHS: dict[str, Arch] = {
    # RT-DETRv2 (lyuwenyu/RT-DETR, Apache-2.0): ResNet-vd backbones, hybrid encoder, deformable
    # decoder
    "rtdetr_v2_r18": Arch(
        "RTDetrV2Config",
        "RTDetrV2ForObjectDetection",
        "RTDetrImageProcessor",
        "rt_detr_v2",
        {
            "backbone_config": {
                "model_type": "rt_detr_resnet",
                "hidden_sizes": [64, 128, 256, 512],
                "depths": [2, 2, 2, 2],
                "layer_type": "basic",
                "out_indices": [2, 3, 4],
            },
            "encoder_in_channels": [128, 256, 512],
            "hidden_expansion": 0.5,
            "decoder_layers": 3,
        },
        (8, 16, 32),
    ),
    "rtdetr_v2_r50": Arch(
        "RTDetrV2Config",
        "RTDetrV2ForObjectDetection",
        "RTDetrImageProcessor",
        "rt_detr_v2",
        {},
        (8, 16, 32),
    ),
    # D-FINE (Peterande/D-FINE, Apache-2.0): HGNetV2 backbones, fine-grained distribution refinement
    # of the boxes
    "dfine_n": Arch(
        "DFineConfig",
        "DFineForObjectDetection",
        "RTDetrImageProcessor",
        "d_fine",
        {
            "backbone_config": {
                **_HGNET_B0,
                "hidden_sizes": [128, 256, 512, 1024],
                "out_indices": [3, 4],
            },
            "num_feature_levels": 2,
            "encoder_ffn_dim": 512,
            "encode_proj_layers": [1],
            "d_model": 128,
            "encoder_hidden_dim": 128,
            "decoder_ffn_dim": 512,
            "encoder_in_channels": [512, 1024],
            "decoder_n_points": [6, 6],
            "decoder_in_channels": [128, 128],
            "feat_strides": [16, 32],
            "depth_mult": 0.5,
            "decoder_layers": 3,
            "hidden_expansion": 0.34,
        },
        (16, 32),
    ),
    "dfine_s": Arch(
        "DFineConfig",
        "DFineForObjectDetection",
        "RTDetrImageProcessor",
        "d_fine",
        {
            "backbone_config": {
                **_HGNET_B0,
                "hidden_sizes": [64, 256, 512, 1024],
                "out_indices": [2, 3, 4],
            },
            "encoder_in_channels": [256, 512, 1024],
            "hidden_expansion": 0.5,
            "depth_mult": 0.34,
            "decoder_layers": 3,
        },
        (8, 16, 32),
    ),
    # RF-DETR (roboflow/rf-detr, Apache-2.0 for N-L): windowed DINOv2 backbone, one P4 projector,
    # LW-DETR's decoder with 13 query groups in training
    "rfdetr_nano": Arch(
        "RfDetrConfig",
        "RfDetrForObjectDetection",
        "RfDetrImageProcessor",
        "rf_detr",
        {
            "backbone_config": {**_DINOV2_S, "image_size": 384},
            "decoder_layers": 2,
            "decoder_n_points": 2,
        },
        (16,),
        normalize=True,
        antialias=False,
        multiple_why="patch 16 x 2 windows a side",
    ),
    "rfdetr_small": Arch(
        "RfDetrConfig",
        "RfDetrForObjectDetection",
        "RfDetrImageProcessor",
        "rf_detr",
        {
            "backbone_config": {**_DINOV2_S, "image_size": 512},
            "decoder_layers": 3,
            "decoder_n_points": 2,
        },
        (16,),
        normalize=True,
        antialias=False,
        multiple_why="patch 16 x 2 windows a side",
    ),
}
# ImageNet's, as RF-DETR's processor normalises
_MEAN, _STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _transformers():
    from visiondist.compat import quiet_pytree  # noqa: PLC0415 (torch)

    try:
        # transformers imports torchao where it is installed (here, or when it builds a model)
        quiet_pytree()
        import transformers  # noqa: PLC0415 (the optional extra [detr])
    except ImportError as e:  # the optional extra
        raise ImportError(
            "DETR-class detectors are transformers' models: pip install -e '.[detr]'"
        ) from e
    return transformers


def arch_of(name: str) -> Arch:
    if name not in ARCHS:
        raise ValueError(
            f"model.arch={name!r} is not a DETR-class detector here: use one of {', '.join(ARCHS)}"
        )
    return ARCHS[name]


def build_hf_detector(
    arch: str, num_classes: int, overrides: Optional[dict] = None
) -> PreTrainedModel:
    """transformers' model of `arch` for `num_classes` object classes (no background class), random
    weights."""
    spec = arch_of(arch)
    transformers = _transformers()
    values = {**spec.values, **(overrides or {})}
    backbone = values.pop("backbone_config", None)
    config = getattr(transformers, spec.config)(num_labels=num_classes, **values)
    if backbone is not None:
        kind = dict(backbone)
        config.backbone_config = transformers.AutoConfig.for_model(kind.pop("model_type"), **kind)
    return getattr(transformers, spec.model)(config)


def library_values(cfg: Any) -> dict[str, Any]:
    """The library configuration's values the model config sets: `model.kwargs` (any key),
    `model.num_queries`."""
    values = dict(cfg.get("kwargs") or {})
    if cfg.get("num_queries"):
        values["num_queries"] = int(cfg.num_queries)
    return values
