"""The baselines of `tools/benchmark.py`: a training loop as a plain PyTorch user writes it, built
from one benchmark configuration (precision, optimizer and its kernels, clipping, channels-last,
activation checkpointing, compiled blocks), on one of two models:

- `reference`: the architecture as people get it elsewhere: timm's ViT of the config's shape (random
  init, nothing downloaded). ours / plain-on-reference is what a user gains or loses by switching,
  model and harness together.
- `same_model`: visiondist's own model, built as `Trainer` builds it (same seed, so the same initial
  weights). ours / plain-on-same-model is the harness's overhead alone; plain-on-same-model /
  plain-on-reference is the model's difference. A torchvision detector *is* visiondist's model, and
  a ViTDet has no reference elsewhere: they get this baseline only. A DETR-class detector's
  `reference` is the transformers model itself, fed as its users feed it (the square batch stacked,
  boxes made relative, `model(pixel_values=, labels=).loss`).

When the configuration compiles (`trainer.compile`), the plain loop on timm's model compiles the
whole model, as timm's train.py does (`torch.compile(model)`; with `mode="reduce-overhead"` where
visiondist replays CUDA graphs): the fastest loop timm documents, whatever visiondist's scope. The
plain loop on our model compiles what visiondist compiles (the whole model, or each block), so that
ours / it is the harness's overhead alone. The row says each scope (`compile_scope`).

timm (0.6-0.8 s) is imported where a reference loop or timm's recipe needs it: a benchmark of
several ranks runs no plain loop (`# noqa: PLC0415 (timm)`); the DETR family's modules (and with
them torchvision's ops and torch._dynamo, about 1 s) where a DETR's loop needs them
(`# noqa: PLC0415 (detector-side)`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from visiondist.data.augment_ops import DeviceAugment
from visiondist.data.transforms import Normalize, unit_float
from visiondist.engine.build import seed_everything
from visiondist.engine.fp8 import to_float8
from visiondist.engine.optim import KERNELS, describe_optimizer, resolve_impl
from visiondist.engine.precision import autocast_dtype, autocast_for
from visiondist.models import build_model, select_attention
from visiondist.parallel import (
    compile_blocks,
    compile_model,
    enable_activation_checkpointing,
    keep_matmuls_context,
    transformer_blocks,
)


def baseline_roles(cfg: DictConfig) -> list[str]:
    """The plain loops one configuration gets: both for a ViT classifier with a timm name and a
    DETR, else `same_model`; of those, the ones `bench.plain_loops` names."""
    m = cfg.model
    roles = (
        ["same_model", "reference"]
        if (m.family == "vit" and m.timm_name) or m.family == "detr"
        else ["same_model"]
    )
    named = cfg.bench.get("plain_loops", roles)
    return [role for role in roles if role in ([named] if isinstance(named, str) else named)]


class _Checkpointed(nn.Module):
    """A timm block that keeps only its input for the backward, as visiondist's
    `Block.checkpointing` does (non-reentrant), so that compiling it compiles the same unit as
    ours."""

    def __init__(self, block: nn.Module, keep: str = "input"):
        super().__init__()
        self.block = block
        self.context: dict[str, Any] = {}
        # parallel.checkpoint_keep=matmuls: torch's selective checkpointing, the same policy
        if keep == "matmuls":
            self.context = {"context_fn": keep_matmuls_context}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                self.block, x, use_reentrant=False, **self.context
            )
        return self.block(x)


def _timm_vit(cfg: DictConfig) -> nn.Module:
    import timm  # noqa: PLC0415 (timm)

    m = cfg.model
    return timm.create_model(
        m.timm_name,
        pretrained=False,
        num_classes=m.num_classes,
        img_size=m.img_size,
        patch_size=m.patch_size,
        embed_dim=m.embed_dim,
        depth=m.depth,
        num_heads=m.num_heads,
        mlp_ratio=m.mlp_ratio,
        qkv_bias=m.qkv_bias,
        drop_rate=m.drop_rate,
        drop_path_rate=m.drop_path_rate,
    )


def _checkpointed_and_compiled(model: nn.Module, cfg: DictConfig, role: str, switches) -> str:
    """Apply the activation checkpointing of `switches` (the variant's `RunLayout`) and the
    configuration's compilation to the model; returns what was compiled (the row's
    `compile_scope`)."""
    p = switches
    graphs = ", CUDA graphs" if p.compile and p.cuda_graphs else ""
    if role == "same_model":  # the model's own switches, without the layout around them
        if p.activation_checkpointing:
            enable_activation_checkpointing(model, p.checkpoint_blocks, p.checkpoint_keep)
        if p.compile and p.compile_scope == "model":
            compile_model(model, p.cuda_graphs)
            return "whole model" + graphs
        return f"per block ({compile_blocks(model)} blocks)" if p.compile else "none"
    # the transformers model: its network compiled as the run compiles ours
    if cfg.model.family == "detr":
        if not p.compile:
            return "none"
        # `...ForObjectDetection.model`: backbone, encoder, decoder (the loss eager)
        compile_model(model.get_submodule("model"))
        return "whole model"
    blocks = model.get_submodule("blocks")
    if not isinstance(blocks, nn.Sequential):  # timm's ViT holds its blocks in one
        raise TypeError(f"timm's blocks are an nn.Sequential, not {type(blocks).__name__}")
    if p.activation_checkpointing:
        for i in range(p.checkpoint_blocks):
            blocks[i] = _Checkpointed(blocks[i], p.checkpoint_keep)
    if not p.compile:
        return "none"
    compile_model(model, p.cuda_graphs)  # timm's train.py: torch.compile(model)
    return "whole model" + graphs


class PlainLoop:
    """forward under autocast, loss, backward, `clip_grad_norm_`, `optimizer.step()`: on one device,
    with one parameter group."""

    # set by `loops.plain_loops` once the loop is warmed up
    compile_faults: list[str]
    peak_memory_gb: Optional[float]

    def __init__(self, cfg: DictConfig, role: str, device: torch.device, switches):
        seed_everything(cfg.trainer.seed)  # same_model: the initial weights of `Trainer`'s model
        m = cfg.model
        if role == "same_model":
            select_attention(m.sdpa)
            model = build_model(m).to(device)
            if m.channels_last:
                model = model.to(memory_format=torch.channels_last)
            self.model_name = (
                f"torchvision {m.arch} (visiondist's model)"
                if m.family == "torchvision"
                else f"visiondist {type(model).__name__}"
            )
        elif m.family == "detr":
            from visiondist.models.detr_archs import build_hf_detector  # noqa: PLC0415 (detector-side)
            from visiondist.models.detr_library import model_values  # noqa: PLC0415 (detector-side)

            # the network the run trains (its backbone's BatchNorms training from random weights, as
            # ours)
            detector: nn.Module = build_hf_detector(
                str(m.arch), int(m.num_classes), model_values(m)
            )
            model = detector.to(device)
            self.model_name = f"transformers {type(model).__name__}"
        else:
            model = _timm_vit(cfg).to(device)
            if m.channels_last:
                model = model.to(memory_format=torch.channels_last)
            self.model_name = f"timm {m.timm_name}"
        # the trainer's float8 layers, converted as a user of torchao converts them
        if cfg.trainer.fp8 != "off":
            to_float8(
                transformer_blocks(model) if role == "same_model" else list(model.blocks),
                cfg.trainer.fp8,
                cfg.trainer.fp8_layers,
            )
        self.role, self.model = role, model.train()
        self._recipe(cfg)  # before compiling: timm's EMA deep-copies the model
        self.compile_scope = _checkpointed_and_compiled(model, cfg, role, switches)
        self.cuda_graphs = "CUDA graphs" in self.compile_scope
        o, t = cfg.optim, cfg.trainer
        kernels = KERNELS[resolve_impl(o.impl, o.name, model.parameters())]
        self.optimizer: torch.optim.Optimizer
        if o.name == "adamw":
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=o.lr,
                betas=tuple(o.betas),
                eps=o.eps,
                weight_decay=o.weight_decay,
                **kernels,
            )
        else:
            self.optimizer = torch.optim.SGD(
                model.parameters(),
                lr=o.lr,
                momentum=o.momentum,
                weight_decay=o.weight_decay,
                **kernels,
            )
        self.optimizer_name = describe_optimizer(self.optimizer, o.impl)
        dtype = autocast_dtype(t.precision)
        self.autocast = autocast_for(t.precision, device)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self.clip, self.smoothing = t.clip_grad, t.label_smoothing
        self.classification = m.family == "vit"
        self.library = role == "reference" and m.family == "detr"
        # the batches are uint8, as the loaders yield them: normalised on the device, as the
        # trainer's step does
        self.inputs = Normalize(cfg.data.mean, cfg.data.std) if self.classification else unit_float
        self.device = device

    def _recipe(self, cfg: DictConfig) -> None:
        """The recipe's work beyond the model, done as a user of timm does it, so that a ratio
        compares equal work: the device augmentation the batches' rows ask for (the same batched
        ops: there is no other), timm's `Mixup` and `SoftTargetCrossEntropy`, timm's
        `ModelEmaV3`."""
        d, t = cfg.data, cfg.trainer
        self.classification = cfg.model.family == "vit"
        self.augment = DeviceAugment(d, cfg.model.img_size) if self.classification else None
        self.mixup = None
        if self.classification and (d.get("mixup", 0) > 0 or d.get("cutmix", 0) > 0):
            from timm.data import Mixup  # noqa: PLC0415 (timm)

            self.mixup = Mixup(
                mixup_alpha=d.mixup,
                cutmix_alpha=d.cutmix,
                prob=d.mixup_prob,
                switch_prob=d.mixup_switch_prob,
                label_smoothing=t.label_smoothing,
                num_classes=cfg.model.num_classes,
            )
        self.ema = None
        if t.get("ema_decay", 0) > 0:
            from timm.utils import ModelEmaV3  # noqa: PLC0415 (timm)

            self.ema = ModelEmaV3(self.model, decay=t.ema_decay)

    def _loss(self, images, targets, rows) -> torch.Tensor:
        if self.augment is not None and rows:  # a classifier's (`_recipe`)
            images = self.augment(images, rows[0], self.device, self.inputs)
        else:
            images = self.inputs(images, self.device)
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        # the loader's squares, stacked; boxes relative (cx, cy, w, h), labels 0-based
        if self.library:
            from visiondist.models.detr import library_target  # noqa: PLC0415 (detector-side)

            labels = [
                library_target(t, im.shape[-2], im.shape[-1]) for t, im in zip(targets, images)
            ]
            labels = [{k: v.to(self.device) for k, v in t.items()} for t in labels]
            with self.autocast:
                return self.model(pixel_values=torch.stack(images), labels=labels).loss.float()
        with self.autocast:
            out = self.model(images) if self.classification else self.model(images, targets)
        if not self.classification:
            return sum(v.float() for v in out.values())
        if self.mixup is not None:
            from timm.loss import SoftTargetCrossEntropy  # noqa: PLC0415 (timm)

            return SoftTargetCrossEntropy()(out.float(), targets)
        return F.cross_entropy(out.float(), targets, label_smoothing=self.smoothing)

    def step(self, batches: list[tuple]) -> None:
        """One optimizer step over the micro-batches (gradient accumulation)."""
        for images, targets, *rows in batches:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss = self._loss(images, targets, rows)
            loss = loss / len(batches)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model)
        self.optimizer.zero_grad(set_to_none=True)
