"""Rank-side code of the pipeline tests: a depth-8 tiny ViT laid out by `parallelize` over a (pp,
dp, tp) mesh and trained for a few steps with each of torch's schedules, or in one process (the
reference), on the test device (`devices`); what comes back is on the CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from devices import init_test_rank, reference_device

from visiondist.models.vit import VisionTransformer
from visiondist.parallel import (
    PipelineSpec,
    average_over_data_parallel,
    build_layout,
    clip_grad_norm,
    finish_gradients,
    full_state_dict,
    parallelize,
)

TINY = dict(
    img_size=32, patch_size=8, num_classes=6, embed_dim=32, depth=8, num_heads=4, mlp_ratio=4.0
)
BATCH, STEPS, CHUNKS = 8, 3, 4  # global batch; optimizer steps; dp x micro-batches
EVAL_AFTER = 2  # an evaluation pass between steps 2 and 3 must leave training untouched
EVAL_IMAGES = 7  # fewer than a full batch of 8: padded inside the pipeline


def make_model() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**TINY)


def make_batches(device: torch.device = torch.device("cpu")):
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 3, 32, 32, generator=g).to(device),
            torch.randint(0, 6, (BATCH,), generator=g).to(device),
        )
        for _ in range(STEPS)
    ]


def eval_images(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    return torch.randn(EVAL_IMAGES, 3, 32, 32, generator=torch.Generator().manual_seed(2)).to(
        device
    )


def _optimizer(params):
    # SGD: a parameter difference is then the gradient difference times lr. (Adam divides by the
    # gradient's own scale, which turns a 1-ulp difference in a near-zero gradient into a visible
    # one.)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)


def train_reference() -> dict:
    """One process with the same micro-batching: the global batch cut into CHUNKS contiguous pieces
    (dp ranks x micro-batches), each piece's mean loss backpropagated, the summed gradients divided
    by CHUNKS."""
    device = reference_device()
    model = make_model().to(device)
    opt = _optimizer(model.parameters())
    losses, norms, logits = [], [], None
    for step, (images, labels) in enumerate(make_batches(device), 1):
        opt.zero_grad()
        micro = []
        for x, y in zip(images.chunk(CHUNKS), labels.chunk(CHUNKS)):
            loss = F.cross_entropy(model(x), y) / CHUNKS
            loss.backward()
            micro.append(loss.detach())
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        opt.step()
        losses.append(torch.stack(micro).sum().item())
        if step == EVAL_AFTER:
            with torch.no_grad():
                logits = model.eval()(eval_images(device)).cpu()
            model.train()
    return {
        "losses": losses,
        "norms": norms,
        "logits": logits,
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
    }


def _train(
    layout,
    schedule: str,
    stages_per_rank: int,
    microbatches: int,
    sequence_parallel: bool,
    host_boundary: bool = None,
) -> dict:
    """`host_boundary`: the stages exchange host tensors (what ranks sharing a GPU over gloo do),
    here asked for."""
    assert layout.dp * microbatches == CHUNKS
    spec = PipelineSpec(schedule, stages_per_rank, microbatches, host_boundary)
    model = parallelize(make_model().to(layout.device), layout, sequence_parallel, spec)
    opt = _optimizer(model.parameters())
    local = BATCH // layout.dp
    losses, norms, logits, p2p = [], [], None, None
    for step, (images, labels) in enumerate(make_batches(layout.device), 1):
        opt.zero_grad()
        model.p2p.reset()
        # the DP rank's part of the batch
        mine = slice(layout.dp_rank * local, (layout.dp_rank + 1) * local)
        loss = model.train_step(
            images[mine] if layout.reads_images else None,
            labels[mine] if layout.reads_labels else None,
        )
        if step == 2:  # the first step also runs the schedule's shape inference
            p2p = model.p2p.bytes
        average_over_data_parallel(model.parameters(), layout)
        finish_gradients(model.parameters(), layout)
        norms.append(clip_grad_norm(model.parameters(), 0.0, layout).item())
        opt.step()
        losses.append((layout.all_reduce_dp(loss.clone()) / layout.dp).item())
        if step == EVAL_AFTER:
            model.eval()
            out = model.predict(
                eval_images(layout.device) if layout.reads_images else None, EVAL_IMAGES, BATCH
            )
            logits = None if out is None else out.cpu()
            model.train()
    return {
        "stages": model.stage_ids,
        "n_stages": model.n_stages,
        "p2p": p2p,
        "losses": losses,
        "norms": norms,
        "is_last": model.is_last,
        "host_boundary": model.host_boundary,
        "logits": logits,
        "state": {k: v.cpu() for k, v in full_state_dict(model, layout.tp_comm).items()},
    }


def run(dims: tuple[int, int, int], cases: list[tuple[str, int, int, bool]]) -> dict:
    """dims: (pp, dp, tp); cases: (schedule, stages_per_rank, microbatches, sequence_parallel[,
    host_boundary])."""
    device = init_test_rank()
    torch.set_num_threads(1)
    try:
        pp, dp, tp = dims
        layout = build_layout(dp, tp, pp, device, 0)
        return {case: _train(layout, *case) for case in cases}
    finally:
        dist.destroy_process_group()


def bucketed_mean(limit: int) -> dict:
    """Gradients of mixed sizes averaged over 2 ranks in buckets of `limit` bytes, against the mean
    of the gathered gradients; and the most bucket-buffer bytes alive at once."""
    from visiondist.parallel.grad import mean_over_group

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(rank)
        shapes = [(3,), (40, 30), (7,), (2048,), (5, 5), (3000,), (1,), (16, 16, 3)]
        grads = [torch.randn(s, generator=g) for s in shapes]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, grads)
        peak = mean_over_group(grads, dist.group.WORLD, dist.get_world_size(), limit)
        expected = [sum(ranks[i] for ranks in everyone) / len(everyone) for i in range(len(shapes))]
        return {
            "equal": all(torch.equal(a, b) for a, b in zip(grads, expected)),
            "peak": peak,
            "total": sum(x.numel() * x.element_size() for x in grads),
        }
    finally:
        dist.destroy_process_group()
