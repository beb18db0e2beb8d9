"""Rank-side code of the exact-evaluation test: every rank scores its shard of a val folder whose
size no world size here divides."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from visiondist.models.vit import VisionTransformer

CLASSES = 7
PER_CLASS = [6, 5, 5, 4, 4, 4, 3]  # 31 images


def make_model() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=32, patch_size=8, num_classes=CLASSES, embed_dim=32, depth=2, num_heads=2
    ).eval()


def data_config(root: str):
    return OmegaConf.create(
        dict(
            root=root,
            train_split="val",
            val_split="val",
            num_classes=CLASSES,
            batch_size=6,
            eval_batch_size=4,
            num_workers=0,
            mean=[0.5] * 3,
            std=[0.25] * 3,
            train_crop_scale=[0.5, 1.0],
            hflip=0.5,
            crop_pct=1.0,
            auto_augment="none",
            max_bad_images=1,
        )
    )


def inputs(cfg):
    """The loader's uint8 images -> the model's input (what the classification task hands the
    evaluator)."""
    from visiondist.data.transforms import Normalize

    return Normalize(cfg.mean, cfg.std)


def run(root: str) -> dict:
    from visiondist.data import build_classification_data
    from visiondist.evaluation.classification import evaluate_classification
    from visiondist.parallel import build_layout

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        layout = build_layout(dist.get_world_size(), 1, 1, torch.device("cpu"), 0)
        data = build_classification_data(
            data_config(root), 32, layout.dp_rank, layout.dp, 1, 0, False
        )
        seen = [i for batch in data.val_loader.batch_sampler for i in batch]
        metrics = evaluate_classification(
            make_model(), data.val_loader, layout, None, CLASSES, inputs=inputs(data_config(root))
        )
        return {"metrics": metrics, "seen": seen}
    finally:
        dist.destroy_process_group()
