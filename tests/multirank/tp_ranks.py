"""Rank-side code of the tensor-parallel tests: a tiny ViT trained for a few steps from fixed
weights and data, in one process (the reference) or laid out over a mesh (run on every rank by
`visiondist.launch.spawn_local`), on the test device (`devices`: the CPU, or a GPU shared by the
ranks, or one each); what comes back is on the CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from devices import init_test_rank, reference_device
from omegaconf import OmegaConf

from visiondist.engine.optim import build_optimizer
from visiondist.models.vit import VisionTransformer, to_timm_state_dict
from visiondist.parallel import (
    build_layout,
    clip_grad_norm,
    finish_gradients,
    full_state_dict,
    parallelize,
    unwrap,
)

# 32 px / patch 8 = 16 patches + cls = 17 tokens: odd, so sequence parallelism must pad (tp=2 -> 18,
# tp=4 -> 20).
TINY = dict(
    img_size=32, patch_size=8, num_classes=6, embed_dim=32, depth=2, num_heads=4, mlp_ratio=4.0
)
BATCH, STEPS, CLIP = 8, 3, 0.5
OPTIM = OmegaConf.create(
    {"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, "betas": [0.9, 0.999], "eps": 1e-8}
)


def make_model() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**TINY)


def make_batches(
    device: torch.device = torch.device("cpu"),
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 3, 32, 32, generator=g).to(device),
            torch.randint(0, TINY["num_classes"], (BATCH,), generator=g).to(device),
        )
        for _ in range(STEPS)
    ]


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on `device` (the bf16 cases), or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def train_reference(bf16: bool = False) -> dict:
    """The single-process run every layout must reproduce (on the test device; returned on the
    CPU)."""
    device = reference_device()
    model = make_model().to(device)
    batches = make_batches(device)
    with autocast(device, bf16):
        logits = model(batches[0][0]).detach().float()
    opt = build_optimizer(OPTIM, model)
    losses, norms = [], []
    for images, labels in batches:
        opt.zero_grad()
        with autocast(device, bf16):
            loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    return {
        "logits": logits.cpu(),
        "losses": losses,
        "norms": norms,
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
    }


def _train_layout(
    device: torch.device, dp: int, tp: int, sp: bool, compile: bool = False, bf16: bool = False
) -> dict:
    layout = build_layout(dp, tp, 1, device, int(os.environ.get("LOCAL_RANK", 0)))
    model = parallelize(make_model().to(device), layout, sp, compile=compile)
    batches = make_batches(device)
    with autocast(device, bf16):
        logits = unwrap(model)(batches[0][0]).detach().float()
    opt = build_optimizer(OPTIM, unwrap(model))
    local = BATCH // dp
    rows = slice(layout.dp_rank * local, (layout.dp_rank + 1) * local)
    losses, norms, traffic = [], [], None
    layout.tp_comm.reset()
    for images, labels in batches:
        opt.zero_grad()
        with autocast(device, bf16):
            loss = F.cross_entropy(model(images[rows]).float(), labels[rows])
        loss.backward()
        finish_gradients(model.parameters(), layout)
        norms.append(clip_grad_norm(model.parameters(), CLIP, layout).item())
        opt.step()
        losses.append(layout.all_reduce_dp(loss.detach().clone()).item() / dp)
        if traffic is None:
            traffic = {"payload": dict(layout.tp_comm.payload), "calls": dict(layout.tp_comm.calls)}
    return {
        "dp": dp,
        "tp": tp,
        "sp": sp,
        "compile": compile,
        "bf16": bf16,
        "dp_rank": layout.dp_rank,
        "tp_rank": layout.tp_rank,
        "logits": logits.cpu(),
        "losses": losses,
        "norms": norms,
        "traffic": traffic,
        "rank_params": sum(p.numel() for p in model.parameters()),
        "state": {k: v.cpu() for k, v in full_state_dict(unwrap(model), layout.tp_comm).items()},
    }


def naive_fused_qkv_logits(device: torch.device, tp: int) -> torch.Tensor:
    """What a plan that column-splits timm's fused qkv (rows q|k|v) into `tp` contiguous pieces
    computes: rank 0 gets all of q and part of k, reads the first third of its piece as q, and so
    on. Nothing raises."""
    layout = build_layout(1, tp, 1, device, 0)
    fused = to_timm_state_dict(make_model().to(device).state_dict())
    model = parallelize(make_model().to(device), layout)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            for kind in ("weight", "bias"):
                piece = fused[f"blocks.{i}.attn.qkv.{kind}"].chunk(tp, dim=0)[layout.tp_rank]
                for name, part in zip(("q", "k", "v"), piece.chunk(3, dim=0)):
                    getattr(getattr(block.attn, name), kind).copy_(part)
    return model(make_batches(device)[0][0]).detach().cpu()


def loader_batches(root: str, dp: int, tp: int) -> dict:
    """Sample indices and a pixel checksum of the first real loader batches this rank trains on."""
    from visiondist.data import build_classification_data

    layout = build_layout(dp, tp, 1, torch.device("cpu"), 0)
    cfg = OmegaConf.create(
        {
            "root": root,
            "train_split": "train",
            "val_split": "val",
            "num_classes": 6,
            "batch_size": 8,
            "eval_batch_size": 8,
            "num_workers": 0,
            "mean": [0.5] * 3,
            "std": [0.25] * 3,
            "train_crop_scale": [0.6, 1.0],
            "hflip": 0.5,
            "crop_pct": 1.0,
        }
    )
    data = build_classification_data(
        cfg, 32, layout.dp_rank, dp, grad_accum=1, seed=0, pin_memory=False
    )
    data.train_sampler.set_epoch(0)
    indices = [list(batch) for _, batch in zip(range(2), iter(data.train_sampler))]
    images = torch.cat([images for (images, _), _ in zip(data.train_loader, range(2))])
    return {
        "dp_rank": layout.dp_rank,
        "tp_rank": layout.tp_rank,
        "indices": indices,
        "checksum": float(images.double().sum()),
        "first_pixels": images[:, 0, 0, :4].tolist(),
    }


def make_vitdet():
    """A tiny ViT-backbone detector's feature pyramid (the part tensor parallelism shards)."""
    from visiondist.models.vitdet import SimpleFeaturePyramid, ViTBackbone

    torch.manual_seed(0)
    return SimpleFeaturePyramid(
        ViTBackbone(img_size=64, patch_size=16, embed_dim=32, depth=2, num_heads=4), 16
    )


def vitdet_images(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    # a 4 x 6 grid: 24 tokens, no cls
    return torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(2)).to(device)


def vitdet_loss(features: dict) -> torch.Tensor:
    """A fixed random projection of every level (a sum of squares would be constant after the final
    LayerNorms, with a gradient of pure round-off)."""
    g = torch.Generator().manual_seed(3)
    return sum(
        (f * torch.randn(f.shape, generator=g).to(f.device)).sum()
        for _, f in sorted(features.items())
    )


def vitdet_reference() -> tuple[dict, dict, torch.nn.Module]:
    """One process's pyramid and gradients on the test device (returned on the CPU), and its
    model."""
    device = reference_device()
    model = make_vitdet().to(device)
    features = model(vitdet_images(device))
    vitdet_loss(features).backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return {k: v.detach().cpu() for k, v in features.items()}, grads, model


def vitdet_features(device: torch.device, tp: int, sp: bool) -> dict:
    layout = build_layout(1, tp, 1, device, 0)
    model = parallelize(make_vitdet().to(device), layout, sp)
    features = model(vitdet_images(device))
    vitdet_loss(features).backward()
    finish_gradients(model.parameters(), layout)
    full = full_state_dict(model, layout.tp_comm)
    return {
        "features": {k: v.detach().cpu() for k, v in features.items()},
        "grads": _gathered_grads(model, layout),
        "params": sum(p.numel() for p in model.parameters()),
        "state_keys": sorted(full),
    }


def _gathered_grads(model: torch.nn.Module, layout) -> dict:
    """Every parameter's whole gradient (the TP shards' gathered), on the CPU."""
    out = {}
    for name, param in model.named_parameters():
        dim = getattr(param, "tp_shard_dim", None)
        if dim is None:
            out[name] = param.grad.clone()
        else:
            pieces = [torch.empty_like(param.grad) for _ in range(layout.tp)]
            dist.all_gather(pieces, param.grad.contiguous(), group=layout.tp_comm.group)
            out[name] = torch.cat(pieces, dim=dim)
    return {k: v.cpu() for k, v in out.items()}


def native_batch(device: torch.device = torch.device("cpu")):
    """Four images at their own sizes (16, 15, 12 and 9 patches of 8 px) packed into three sequences
    of 24 tokens, one holding two images (2 class slots + 24 = 26 tokens: SP splits them evenly),
    and their labels in the batch's image order."""
    from visiondist.models.patches import pack

    g = torch.Generator().manual_seed(4)
    images = [
        torch.randn(3, h, w, generator=g) for h, w in ((32, 32), (40, 24), (16, 48), (24, 24))
    ]
    labels = torch.randint(0, TINY["num_classes"], (4,), generator=g)
    batch = pack(images, TINY["patch_size"], 24, [[1], [2, 3], [0]])
    return batch.to(device), labels[[1, 2, 3, 0]].to(device)


def native_reference() -> tuple[torch.Tensor, dict]:
    """One process's logits and gradients on `native_batch` (on the test device; returned on the
    CPU)."""
    device = reference_device()
    model = make_model().to(device)
    batch, labels = native_batch(device)
    logits = model(batch)
    F.cross_entropy(logits, labels).backward()
    return logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def native_tp(device: torch.device, tp: int, sp: bool) -> dict:
    layout = build_layout(1, tp, 1, device, 0)
    model = parallelize(make_model().to(device), layout, sp)
    batch, labels = native_batch(device)
    logits = model(batch)
    F.cross_entropy(logits, labels).backward()
    finish_gradients(model.parameters(), layout)
    return {"logits": logits.detach().cpu(), "grads": _gathered_grads(model, layout)}


def run(cases: list[tuple[int, int, bool]], extras: dict) -> dict:
    """Entry of every spawned rank: each case on its own mesh over all ranks, then the extra checks
    asked for."""
    device = init_test_rank()
    torch.set_num_threads(1)
    try:
        out = {"cases": [_train_layout(device, *case) for case in cases]}
        if "naive_tp" in extras:
            out["naive_logits"] = naive_fused_qkv_logits(device, extras["naive_tp"])
        if "vitdet_tp" in extras:
            out["vitdet"] = {
                sp: vitdet_features(device, extras["vitdet_tp"], sp) for sp in (False, True)
            }
        if "native_tp" in extras:
            out["native"] = {sp: native_tp(device, extras["native_tp"], sp) for sp in (False, True)}
        if "loader" in extras:
            out["loader"] = loader_batches(*extras["loader"])
        return out
    finally:
        dist.destroy_process_group()
