"""The planner's activation estimate against measurement, one process, for several ViT shapes.

CPU: the bytes of the tensors autograd saves for the backward of the blocks (saved-tensor hooks, distinct storages,
parameters left out), next to `block_activation_bytes`. CUDA (when present): the peak memory of a real training step
(`torch.cuda.max_memory_allocated`, AdamW, the given precision, with and without activation checkpointing) next to
the planner's whole-rank estimate for one device.

    python benchmarks/memory_model.py                     # CPU, fp32
    python benchmarks/memory_model.py --device cuda --precision bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from visiondist.models.vit import VisionTransformer  # noqa: E402
from visiondist.parallel import enable_activation_checkpointing  # noqa: E402
from visiondist.parallel.memory import ViTShape, block_activation_bytes, rank_memory, saved_activation_bytes  # noqa: E402

SHAPES = {  # name: (embed_dim, depth, heads, img, patch, batch)
    "vit_tiny/16 @224": (192, 12, 3, 224, 16, 32),
    "vit_small/16 @224": (384, 12, 6, 224, 16, 32),
    "vit_base/16 @224": (768, 12, 12, 224, 16, 16),
    "vit_large/16 @224": (1024, 24, 16, 224, 16, 8),
}


def cpu_row(name, dim, depth, heads, img, patch, batch) -> str:
    model = VisionTransformer(img_size=img, patch_size=patch, num_classes=1000, embed_dim=dim, depth=depth,
                              num_heads=heads)
    tokens = model.embed(torch.randn(batch, 3, img, img)).detach().requires_grad_()
    measured = saved_activation_bytes(model.blocks, tokens)
    estimate = depth * block_activation_bytes(ViTShape(dim, depth, heads, 4.0, patch, img, 1000), batch, 1)
    return f"| {name} | {batch} | {measured / 1e6:.1f} | {estimate / 1e6:.1f} | {estimate / measured:.3f} |"


def cuda_row(name, dim, depth, heads, img, patch, batch, precision, checkpointing) -> str:
    torch.cuda.empty_cache()
    model = VisionTransformer(img_size=img, patch_size=patch, num_classes=1000, embed_dim=dim, depth=depth,
                              num_heads=heads).cuda()
    if checkpointing:
        enable_activation_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randn(batch, 3, img, img, device="cuda")
    labels = torch.randint(0, 1000, (batch,), device="cuda")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for step in range(2):  # the second step has the optimizer state in place
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=dtype, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    shape = ViTShape(dim, depth, heads, 4.0, patch, img, 1000)
    est = rank_memory(shape, 1, 1, 1, batch, precision=precision, checkpointing=checkpointing)
    del model, opt
    return (f"| {name} | {batch} | {precision}{' +ckpt' if checkpointing else ''} | {peak / 1e9:.2f} | "
            f"{est.total / 1e9:.2f} | {est.activations / 1e9:.2f} | {est.total / peak:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="32", choices=("32", "bf16"))
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        print("| shape | batch | saved by autograd (MB) | estimate (MB) | estimate / measured |")
        print("| --- | --- | --- | --- | --- |")
        for name, dims in SHAPES.items():
            print(cpu_row(name, *dims), flush=True)
        return
    print(f"device: {torch.cuda.get_device_name()}")
    print("| shape | batch | precision | peak allocated (GB) | planner total (GB) | of which activations | "
          "planner / peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, dims in SHAPES.items():
        for checkpointing in (False, True):
            print(cuda_row(name, *dims, args.precision, checkpointing), flush=True)


if __name__ == "__main__":
    main()
