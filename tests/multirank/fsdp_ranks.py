"""Rank-side code of the FSDP tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from visiondist.models.vit import VisionTransformer
from visiondist.parallel import blank_forwards, build_layout, forwards_needed, parallelize


def uneven_evaluation(forwards_per_rank: list[int]) -> list[list[float]]:
    """Each rank has its own number of evaluation batches, agrees on the count first and pads with
    blank forwards: no rank may hang, and the logits must equal the unsharded model's."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        layout = build_layout(dist.get_world_size(), 1, 1, torch.device("cpu"), 0)
        torch.manual_seed(0)
        reference = VisionTransformer(
            img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2
        )
        torch.manual_seed(0)
        model = parallelize(
            VisionTransformer(
                img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2
            ),
            layout,
            fsdp=True,
        ).eval()
        errors = []
        mine = forwards_per_rank[layout.rank]
        needed = forwards_needed(model, layout, mine)
        with torch.no_grad():
            for i in range(mine):
                images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(i))
                errors.append((model(images) - reference(images)).abs().max().item())
        blank_forwards(model, layout, needed - mine)
        return errors
    finally:
        dist.destroy_process_group()
