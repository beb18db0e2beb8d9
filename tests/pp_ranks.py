"""Rank-side code of the pipeline tests: a depth-8 tiny ViT cut into stages and trained for a few steps with each of
torch's schedules, or in one process (the reference)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from visiondist.models.vit import VisionTransformer
from visiondist.parallel.pipeline import build_schedule, build_stages, stage_indices

TINY = dict(img_size=32, patch_size=8, num_classes=6, embed_dim=32, depth=8, num_heads=4, mlp_ratio=4.0)
BATCH, STEPS, MICROBATCHES = 8, 3, 4


def make_model() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**TINY)


def make_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 6, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _optimizer(params):
    # SGD: a parameter difference is then the gradient difference times lr. (Adam divides by the gradient's own
    # scale, which turns a 1-ulp difference in a near-zero gradient into a visible one.)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)


def train_reference() -> dict:
    """One process with the pipeline's micro-batching: each micro-batch's mean loss backpropagated, the summed
    gradients divided by their number (what torch's schedules do with scale_grads=True)."""
    model = make_model()
    opt = _optimizer(model.parameters())
    losses = []
    for images, labels in make_batches():
        opt.zero_grad()
        micro = []
        for x, y in zip(images.chunk(MICROBATCHES), labels.chunk(MICROBATCHES)):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            micro.append(loss.detach())
        for p in model.parameters():
            p.grad.div_(MICROBATCHES)
        opt.step()
        losses.append(torch.stack(micro).mean().item())
    return {"losses": losses, "state": model.state_dict()}


def _train(schedule: str, stages_per_rank: int) -> dict:
    pp, rank = dist.get_world_size(), dist.get_rank()
    n = pp * stages_per_rank
    ids = stage_indices(rank, pp, stages_per_rank)
    stages = build_stages(make_model(), rank, pp, stages_per_rank)
    pipe = build_schedule(schedule, stages, ids, n, MICROBATCHES, torch.device("cpu"), None, F.cross_entropy)
    opt = _optimizer([p for s in stages for p in s.parameters()])
    losses = []
    for images, labels in make_batches():
        opt.zero_grad()
        out: list = []
        if 0 in ids:
            pipe.step(images, target=labels, losses=out)
        else:
            pipe.step(target=labels, losses=out)
        opt.step()
        losses.append(torch.stack(out).mean().item() if out else None)  # micro-batch means: the last stage only
    return {"stages": ids, "losses": losses,
            "state": {k: v.detach().clone() for s in stages for k, v in s.state_dict().items()}}


def run(schedules: list[tuple[str, int]]) -> dict:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        return {name: _train(name, spr) for name, spr in schedules}
    finally:
        dist.destroy_process_group()
