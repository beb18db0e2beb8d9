"""A ViT's shape as plain numbers (`ViTShape`), read off a model config without building the model:
what the memory and time models of the planner count (`visiondist.plan.memory`,
`visiondist.plan.time_model`) and the analytic FLOPs per image
(`visiondist.models.flops.vit_train_flops`). No torch here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ViTShape:
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float
    patch_size: int
    img_size: int
    num_classes: int
    qkv_bias: bool = True
    # tokens an image computes where not its square grid's and a class token: under
    # data.resolution=native, the most of any step per image of data.batch_size
    # (`visiondist.config.resolution.planned_tokens`); 0: the square grid's
    seq_tokens: int = 0

    @classmethod
    def from_config(cls, m) -> ViTShape:
        return cls(
            int(m.embed_dim),
            int(m.depth),
            int(m.num_heads),
            float(m.mlp_ratio),
            int(m.patch_size),
            int(m.img_size),
            int(m.num_classes),
            bool(m.qkv_bias),
        )

    @property
    def hidden(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def tokens(self) -> int:
        """Tokens per image in the activations and matmuls."""
        return self.seq_tokens or self.pos_tokens

    @property
    def pos_tokens(self) -> int:
        """The position embedding's rows: the square grid and the class token."""
        return (self.img_size // self.patch_size) ** 2 + 1
