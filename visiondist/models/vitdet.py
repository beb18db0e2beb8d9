"""ViTDet: a Faster R-CNN (Mask R-CNN with `model.masks=true`) on this project's ViT blocks through
a simple feature pyramid, so the tensor-parallel plan of the ViT applies to its backbone. The heads
are torchvision's, adapted as every detector here is (`models.detection`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
import torchvision.models.detection as tvd
from torch import nn

from visiondist.models.detection import adapt_detector, keep_boxes_fp32
from visiondist.models.vit import Block
from visiondist.models.vit_parallel import VIT_PLAN
from visiondist.models.weights import load_local_weights
from visiondist.parallel.tensor import register_plan


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ViTBackbone(nn.Module):
    """ViT blocks over the patch tokens of an image of any size (multiple of the patch); no class
    token. The position embedding is learned for `img_size` and interpolated to each input's grid.
    Returns the (B, C, H/p, W/p) map."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        self.patch_size, self.embed_dim, self.num_heads = patch_size, embed_dim, num_heads
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.grid = img_size // patch_size
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid * self.grid, embed_dim))
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(
            *(Block(embed_dim, num_heads, mlp_ratio, True, r) for r in rates)
        )
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.blocks.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def _pos_embed(self, h: int, w: int) -> torch.Tensor:
        # a trace (ONNX export) keeps the interpolation whatever the example's size, so that the
        # graph takes any size; bicubic to the same grid is the identity, so eager runs skip it
        if (h, w) == (self.grid, self.grid) and not torch.jit.is_tracing():
            return self.pos_embed
        grid = self.pos_embed.reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(1, h * w, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2) + self._pos_embed(h, w)
        tokens = self.blocks(tokens)
        return tokens.transpose(1, 2).reshape(b, c, h, w)


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's pyramid from the single stride-p map: strides p/4, p/2 (deconvolutions), p, 2p and
    4p (max-pools), each projected to `out_channels`. Keys "0".."3" and "pool", as torchvision's FPN
    backbones return."""

    def __init__(self, backbone: ViTBackbone, out_channels: int = 256):
        super().__init__()
        self.body, self.out_channels = backbone, out_channels
        c = backbone.embed_dim
        self.up4 = nn.Sequential(
            nn.ConvTranspose2d(c, c // 2, 2, stride=2),
            LayerNorm2d(c // 2),
            nn.GELU(),
            nn.ConvTranspose2d(c // 2, c // 4, 2, stride=2),
        )
        self.up2 = nn.ConvTranspose2d(c, c // 2, 2, stride=2)
        self.project = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(cin, out_channels, 1, bias=False),
                LayerNorm2d(out_channels),
                nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
                LayerNorm2d(out_channels),
            )
            for cin in (c // 4, c // 2, c, c)
        )

    def forward(self, images: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        x = self.body(images)
        levels = [self.up4(x), self.up2(x), x, F.max_pool2d(x, 2)]
        out = OrderedDict(
            (str(i), proj(level)) for i, (proj, level) in enumerate(zip(self.project, levels))
        )
        out["pool"] = F.max_pool2d(out["3"], 1, 2)
        return out


def build_vitdet(cfg: Any) -> nn.Module:
    """Faster R-CNN (torchvision's RPN and RoI heads) on a ViT backbone with a simple feature
    pyramid; Mask R-CNN (its mask head too) with `model.masks=true`, as in the ViTDet paper."""
    backbone = ViTBackbone(
        cfg.img_size,
        cfg.patch_size,
        cfg.embed_dim,
        cfg.depth,
        cfg.num_heads,
        cfg.mlp_ratio,
        cfg.drop_path_rate,
    )
    pyramid = SimpleFeaturePyramid(backbone, cfg.fpn_channels)
    detector = tvd.MaskRCNN if cfg.get("masks") else tvd.FasterRCNN
    model = detector(
        pyramid,
        num_classes=cfg.num_classes + 1,
        min_size=cfg.min_size,
        max_size=cfg.max_size,
        **dict(cfg.kwargs or {}),
    )
    adapt_detector(model, cfg)
    keep_boxes_fp32(model)
    if cfg.weights:
        load_local_weights(model, cfg.weights)
    return model


# ViTDet's backbone takes the ViT's tensor-parallel plan: the same blocks, no class token, the same
# token-sharded region (registered here rather than in vit_parallel, so that a ViT classifier's
# processes never import torchvision)
register_plan(ViTBackbone, VIT_PLAN)
