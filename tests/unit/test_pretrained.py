"""Pretrained weights by name, resolved offline from caches built here in the layouts
huggingface_hub and torch hub write (the real resolution code runs; nothing is downloaded)."""

import pytest
import torch
from helpers import REPO, hf_cache_with, torch_hub_cache_with

CONFIGS = REPO / "configs"
TIMM_NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 with an empty Hugging Face cache and an empty torch hub under tmp_path."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path


def _timm_state() -> dict:
    import timm

    torch.manual_seed(1)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict()


def test_a_timm_name_is_read_from_the_hub_cache_with_its_data_defaults(offline, capsys):
    """`model.init_from=timm/<name>` finds the file in the cache offline; the weights' pretrained
    config sets the data defaults (224 px, mean / std 0.5, crop 0.9, bicubic) except what the
    command line sets; the model starts from the file (qkv split into ours), its 1000-class head
    replaced by a new 6-class one."""
    from visiondist.cli import load_config
    from visiondist.models import build_model

    state = _timm_state()
    hf_cache_with(offline / "hf", TIMM_NAME, state)
    cfg = load_config(CONFIGS, [f"model.init_from=timm/{TIMM_NAME}"])
    assert (cfg.data.img_size, cfg.model.img_size, cfg.data.crop_pct, cfg.data.interpolation) == (
        224,
        224,
        0.9,
        "bicubic",
    )
    assert list(cfg.data.mean) == [0.5] * 3 and list(cfg.data.std) == [0.5] * 3
    assert (
        "its pretrained config sets data.img_size=224 data.std=[0.5,0.5,0.5] data.crop_pct=0.9"
        in capsys.readouterr().out
    )
    model = build_model(cfg.model)
    torch.testing.assert_close(model.pos_embed.detach(), state["pos_embed"], rtol=0, atol=0)
    torch.testing.assert_close(
        model.blocks[0].attn.k.weight.detach(),
        state["blocks.0.attn.qkv.weight"][192:384],
        rtol=0,
        atol=0,
    )
    assert model.head.weight.shape == (6, 192)

    kept = load_config(
        CONFIGS,
        [f"model.init_from=timm/{TIMM_NAME}", "data.img_size=64", "data.std=[0.25,0.25,0.25]"],
    )
    assert (kept.data.img_size, kept.model.img_size, list(kept.data.std)) == (64, 64, [0.25] * 3)
    assert kept.data.interpolation == "bicubic"
    small = build_model(kept.model)  # 14 x 14 patches resampled to 4 x 4, as timm does
    assert small.pos_embed.shape == (1, 17, 192)


def test_b_names_not_cached_offline_say_which_file_and_how_to_fetch_it(offline):
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS, [f"model.init_from=timm/{TIMM_NAME}"])
    text = str(err.value)
    assert (
        "\n" not in text
        and "model.safetensors of timm/" + TIMM_NAME in text
        and str(offline / "hf") in text
    )
    assert f"hf download timm/{TIMM_NAME} model.safetensors" in text and "HF_HUB_OFFLINE=1" in text

    with pytest.raises(ConfigError) as err:
        load_config(
            CONFIGS,
            [
                "data=shapes_coco",
                "model=fasterrcnn_r50",
                "model.backbone_weights=ResNet50_Weights.IMAGENET1K_V2",
            ],
        )
    text = str(err.value)
    assert (
        "\n" not in text
        and str(offline / "torch" / "hub" / "checkpoints" / "resnet50-11ad3fa6.pth") in text
    )
    assert "https://download.pytorch.org/models/resnet50-11ad3fa6.pth" in text

    # weights of another shape: refused before anything is looked for, naming the model that fits
    with pytest.raises(
        ConfigError,
        match="vit_tiny_patch16_224 has embed_dim 192, num_heads 3; model=vit_small has "
        "embed_dim 384, num_heads 6: use model=vit_tiny",
    ):
        load_config(CONFIGS, ["model=vit_small", f"model.init_from=timm/{TIMM_NAME}"])
    with pytest.raises(
        ConfigError,
        match=r"of another detector than model=fasterrcnn_mobilenet_v3 "
        r"\(fasterrcnn_mobilenet_v3_large_fpn\): use "
        r"FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1",
    ):
        load_config(
            CONFIGS,
            [
                "data=shapes_coco",
                "model=fasterrcnn_mobilenet_v3",
                "model.weights=FasterRCNN_ResNet50_FPN_Weights.COCO_V1",
            ],
        )
    with pytest.raises(
        ConfigError, match="vit_tiny_patch16_224 has augreg_in21k, augreg_in21k_ft_in1k"
    ):
        load_config(CONFIGS, ["model.init_from=timm/vit_tiny_patch16_224.no_such_tag"])
    with pytest.raises(ConfigError, match="ResNet50_Weights has IMAGENET1K_V1, IMAGENET1K_V2"):
        load_config(
            CONFIGS,
            [
                "data=shapes_coco",
                "model=fasterrcnn_r50",
                "model.backbone_weights=ResNet50_Weights.IMAGENET1K_V3",
            ],
        )


def test_c_a_torchvision_backbone_by_name_comes_from_torch_hubs_cache(offline):
    import torchvision

    from visiondist.cli import load_config
    from visiondist.models import build_model

    torch.manual_seed(2)
    resnet = torchvision.models.resnet50().state_dict()
    torch_hub_cache_with(
        offline / "torch", torchvision.models.ResNet50_Weights.IMAGENET1K_V2.url, resnet
    )
    cfg = load_config(
        CONFIGS,
        [
            "data=shapes_coco",
            "model=fasterrcnn_r50",
            "model.backbone_weights=ResNet50_Weights.IMAGENET1K_V2",
        ],
    )
    model = build_model(cfg.model)
    body = model.backbone.body
    torch.testing.assert_close(
        body.layer3[0].conv1.weight.detach(), resnet["layer3.0.conv1.weight"], rtol=0, atol=0
    )
    assert (
        not body.layer1[0].conv1.weight.requires_grad and body.layer2[0].conv1.weight.requires_grad
    )


def test_d_a_whole_torchvision_detector_by_name_gets_a_new_head_for_other_classes(offline):
    """`model.weights=FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1` (a 91-class COCO file in
    torchvision's layout: frozen BatchNorms) starts a 6-class detector: everything from the file but
    the classifier and box regressor, BatchNorms frozen and the early backbone stages not trained,
    as torchvision builds it."""
    import torchvision
    from torchvision.models.detection import FasterRCNN_MobileNet_V3_Large_FPN_Weights as W
    from torchvision.ops.misc import FrozenBatchNorm2d

    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.weights import freeze_batchnorms

    torch.manual_seed(3)
    coco = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=91
    )
    freeze_batchnorms(coco.backbone.body)
    file_state = coco.state_dict()
    assert not any(k.endswith("num_batches_tracked") for k in file_state)
    torch_hub_cache_with(offline / "torch", W.COCO_V1.url, file_state)
    cfg = load_config(
        CONFIGS,
        [
            "data=shapes_coco",
            "model=fasterrcnn_mobilenet_v3",
            f"model.weights={W.__name__}.COCO_V1",
        ],
    )
    model = build_model(cfg.model)
    own = model.state_dict()
    for key, value in file_state.items():
        if "box_predictor" in key:
            assert own[key].shape[0] == {"cls_score": 7, "bbox_pred": 28}[key.split(".")[2]]
        else:
            torch.testing.assert_close(own[key], value, rtol=0, atol=0, msg=key)
    assert any(isinstance(m, FrozenBatchNorm2d) for m in model.backbone.body.modules())
    # the stem: frozen (3 trainable stages)
    assert not model.backbone.body["0"][0].weight.requires_grad
    assert model.backbone.body["16"][0].weight.requires_grad


def test_a_local_file_takes_the_preprocessing_recorded_beside_it_or_says_what_it_trains_with(
    tmp_path, capsys
):
    """`model.init_from=<file>`: a config.json beside it holding timm's pretrained_cfg (what
    `hf download timm/<name> --local-dir` writes) sets the data defaults as the name would; an
    export's sidecar <name>.json likewise; a bare file changes nothing and one line says which
    normalisation the run uses and what timm's ViT weights mostly expect."""
    import json

    from safetensors.torch import save_file

    from visiondist.cli import load_config

    state = {k: v.contiguous() for k, v in _timm_state().items()}
    bare = tmp_path / "bare" / "vit_tiny_patch16_224.safetensors"
    hub = tmp_path / "hub" / "model.safetensors"
    for file in (bare, hub):
        file.parent.mkdir()
        save_file(state, str(file))
    pretrained_cfg = {
        "input_size": [3, 224, 224],
        "interpolation": "bicubic",
        "crop_pct": 0.9,
        "mean": [0.5, 0.5, 0.5],
        "std": [0.5, 0.5, 0.5],
    }
    (hub.parent / "config.json").write_text(
        json.dumps({"architecture": "vit_tiny_patch16_224", "pretrained_cfg": pretrained_cfg})
    )
    cfg = load_config(CONFIGS, [f"model.init_from={hub}", "data.img_size=64"])
    assert list(cfg.data.mean) == list(cfg.data.std) == [0.5] * 3
    assert (cfg.data.img_size, cfg.data.crop_pct, cfg.data.interpolation) == (64, 0.9, "bicubic")
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"model.init_from={hub}: its config.json sets data.std=[0.5,0.5,0.5] data.crop_pct=0.9 "
        "data.interpolation=bicubic (set any on the command line to keep another)" in out
    )

    default = load_config(CONFIGS, ["data.img_size=64"])
    cfg = load_config(CONFIGS, [f"model.init_from={bare}", "data.img_size=64"])
    assert cfg.data == default.data  # nothing changed
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"model.init_from={bare}: the file records no preprocessing (no "
        "vit_tiny_patch16_224.json or config.json beside it): training with "
        f"data.mean={list(default.data.mean)} data.std={list(default.data.std)} ".replace(", ", ",")
        + "data.interpolation=bilinear; timm's ViT weights mostly expect data.mean=[0.5,0.5,0.5]"
        in out
    )
    load_config(CONFIGS, [f"model.init_from={bare}", "data.mean=[0.5,0.5,0.5]"])
    assert "records no preprocessing" not in capsys.readouterr().out  # the user chose

    # an export's sidecar: the run's preprocessing
    (bare.parent / "vit_tiny_patch16_224.json").write_text(
        json.dumps({"input_size": 96, "mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]})
    )
    cfg = load_config(CONFIGS, [f"model.init_from={bare}"])
    assert (cfg.data.img_size, list(cfg.data.mean)) == (96, [0.1, 0.2, 0.3])
    assert "its vit_tiny_patch16_224.json sets data.img_size=96" in capsys.readouterr().out
