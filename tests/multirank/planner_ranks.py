"""Rank-side code of the planner test: build a layout, take one AdamW step, count what the rank
holds."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from visiondist.engine.optim import build_optimizer
from visiondist.models.vit import VisionTransformer
from visiondist.parallel import PipelineSpec, build_layout, local_numel, parallelize
from visiondist.plan.measured import saved_activation_bytes

TINY = dict(
    img_size=32, patch_size=8, num_classes=5, embed_dim=32, depth=6, num_heads=4, mlp_ratio=3.0
)
BATCH = 8


class _Optim:
    name, lr, weight_decay, betas, eps = "adamw", 1e-3, 0.05, [0.9, 0.999], 1e-8


def _bytes(tensors) -> int:
    return sum(local_numel(t) * t.element_size() for t in tensors)


def run(dims: tuple[int, int, int], fsdp: bool = False) -> dict:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        pp, dp, tp = dims
        layout = build_layout(dp, tp, pp, torch.device("cpu"), 0)
        torch.manual_seed(0)
        model = parallelize(
            VisionTransformer(**TINY), layout, False, PipelineSpec("1f1b", 1, 2), fsdp=fsdp
        )
        opt = build_optimizer(_Optim, model)
        images, labels = torch.randn(BATCH // dp, 3, 32, 32), torch.randint(0, 5, (BATCH // dp,))
        if pp > 1:
            model.train_step(
                images if layout.reads_images else None, labels if layout.reads_labels else None
            )
        else:
            F.cross_entropy(model(images), labels).backward()
        opt.step()
        params = list(model.parameters())
        activations = None
        if pp == 1 and not fsdp:  # what this rank's blocks save for the backward (TP: its shards)
            tokens = model.embed(images).detach().requires_grad_()
            activations = saved_activation_bytes(model.blocks, tokens)
        return {
            "pp_rank": layout.pp_rank,
            "rank": dist.get_rank(),
            "params": _bytes(params),
            "tensors": len(params),
            "activations": activations,
            "grads": _bytes(p.grad for p in params),
            "optimizer": _bytes(v for state in opt.state.values() for v in state.values()),
        }
    finally:
        dist.destroy_process_group()
