"""What the ViT declares to `visiondist.parallel`, beside the model: its tensor-parallel plan
(module path pattern -> style, see `visiondist.parallel.tensor`), its transformer block (the unit
FSDP wraps, activation checkpointing recomputes and `trainer.compile` compiles) and its pipeline
stage cut (the embeddings go with the first stage, the norm and head with the last). The parallel
package applies these and never imports the models.

- attn, mlp: ParallelInput: the sub-block's input enters the TP region: copied (its gradient
  all-reduced), or, under sequence parallelism, all-gathered along tokens;
- attn.q / k / v, mlp.fc1: ColwiseParallel: output features split (each rank holds
  `num_heads / tp` whole heads of q, k and v);
- attn.proj, mlp.fc2: RowwiseParallel: input features split; partial outputs all-reduced (or
  reduce-scattered along tokens), then the replicated bias is added once.
    blocks           SequenceRegion  (SP only) tokens split on entry, gathered on exit
    norm1, norm2     SequenceParallel (SP only) replicated weights that see only this rank's tokens
"""

from __future__ import annotations

from typing import Protocol

import torch

from visiondist.parallel.fsdp import register_block
from visiondist.parallel.stages import StageCut, register_stage_cut
from visiondist.parallel.tensor import (
    ColwiseParallel,
    ParallelInput,
    RowwiseParallel,
    SequenceParallel,
    SequenceRegion,
    Style,
    register_plan,
)

VIT_PLAN: dict[str, Style] = {
    "blocks": SequenceRegion(),
    "blocks.*.norm1": SequenceParallel(),
    "blocks.*.norm2": SequenceParallel(),
    "blocks.*.attn": ParallelInput(),
    "blocks.*.attn.q": ColwiseParallel(),
    "blocks.*.attn.k": ColwiseParallel(),
    "blocks.*.attn.v": ColwiseParallel(),
    "blocks.*.attn.proj": RowwiseParallel(),
    "blocks.*.mlp": ParallelInput(),
    "blocks.*.mlp.fc1": ColwiseParallel(),
    "blocks.*.mlp.fc2": RowwiseParallel(),
}


class _StagedModel(Protocol):
    """What `declare` reads off the model's class: the ends of the pipeline stage cut (run on a
    stage that holds the model's parts under their names) and the tensors kept from weight
    decay."""

    def embed(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward_head(self, x: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    def no_weight_decay() -> set[str]: ...


def declare(model: type[_StagedModel], block: type) -> None:
    """Declare the ViT (`visiondist.models.vit` calls this with its classes, so that a ViT made
    anywhere brings its declarations): its TP plan, its transformer block, and its stage cut. The
    stage holds the model's own parts under their names, so the model's own methods run on it."""
    register_plan(model, VIT_PLAN)
    register_block(block)
    register_stage_cut(
        model,
        StageCut(
            first=("patch_embed", "cls_token", "pos_embed"),
            last=("norm", "head_drop", "head"),
            enter=model.embed,
            leave=model.forward_head,
            no_weight_decay=tuple(sorted(model.no_weight_decay())),
        ),
    )
