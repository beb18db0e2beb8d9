"""`trainer.fp8`: the transformer blocks' linear layers trained in float8 (torchao's
`Float8Linear`), the rest in bf16.

Each chosen `nn.Linear` becomes a `Float8Linear` (a subclass, same parameter names: checkpoints,
EMA, export and resuming without fp8 are unchanged) whose matmuls cast their operands to float8 with
dynamic scales: `tensorwise` one scale per tensor (e4m3 forward, e5m2 gradients), `rowwise` one per
row (e4m3 throughout; more accurate, slower per matmul). Only the blocks' layers are candidates
(attention's q, k, v and output projections, the MLP's two): the patch embedding is a convolution
and the head is small. Of those, `trainer.fp8_layers=auto` converts what torchao's own filter picks
for the recipe (the shapes where float8 gained on an H100: `layer_filter`), `all` every layer whose
in and out features are multiples of 16 (float8 matmuls need them). The casts are worth it only
compiled (`trainer.compile`, auto on CUDA): torchao's scaling is elementwise work Inductor fuses
into the matmuls' neighbours.

Speed is the GPU's: float8 tensor cores exist from compute capability 8.9 (L4, L40S, H100, H200); an
older GPU is refused before step 1. On the CPU torch's float8 matmul is a reference path (~150x
slower than bf16 on 2 cores; tensorwise on torch 2.11, which has no rowwise CPU kernel): for tests,
with a warning. Tensor parallelism is refused (its row-parallel layers are not `nn.Linear`s;
torchao's float8 TP styles expect DTensor's). Public figures say float8 gains little at ViT-B/L
widths (torchao: 0.80x bf16 at 1024x2048x1024, +4% at ~1600 wide): `benchmarks/fp8_layers.py` times
each of a model's linear shapes in bf16 and float8 on the GPU at hand.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from visiondist.compat import quiet_pytree
from visiondist.config import ConfigError

log = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)


def _float8():
    """torchao.float8, imported without the warning torch logs about an Enum torchao registers with
    pytree."""
    quiet_pytree()
    import torchao.float8 as float8  # noqa: PLC0415 (optional extra: torchao)

    return float8


def float8_config(recipe: str):
    """torchao's `Float8LinearConfig` for `recipe`, padding a matmul's inner dimension to a multiple
    of 16 where the tokens of a batch are not (the weight gradient's inner dimension is batch x
    tokens)."""
    return dataclasses.replace(
        _float8().Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True
    )


def eligible(module: nn.Module) -> bool:
    """A layer float8 matmuls can run: in and out features multiples of 16."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def layer_filter(recipe: str, layers: str = "auto"):
    """(module, name) -> whether to convert it. `auto`: torchao's own filter for the recipe
    (`_auto_filter_for_recipe`, what torchtitan uses), which keeps bf16 the layers whose matmuls
    float8 makes slower on an H100: rowwise only where out > 2048 and in > 1024 (and not both out <=
    4096 and in <= 2048), tensorwise not where in <= 4096 and out <= 1024. Rowwise converts fc1
    alone in ViT-H and nothing in ViT-B or ViT-L; tensorwise fc1 alone in ViT-B and ViT-L, every
    layer in ViT-H. `all`: every layer whose features are multiples of 16. `mlp`: the MLP's two
    (fc1, fc2: two thirds of a block's matmul FLOPs), the attention's projections in bf16."""
    if layers == "all":
        return lambda module, _name: eligible(module)
    if layers == "mlp":
        return lambda module, name: eligible(module) and name.split(".")[0] == "mlp"
    from torchao.float8.float8_linear_utils import (  # noqa: PLC0415 (optional extra: torchao)
        _auto_filter_for_recipe,
    )

    chooses = _auto_filter_for_recipe(recipe, filter_fqns=[])
    return lambda module, name: eligible(module) and chooses(module, name)


def to_float8(blocks: list[nn.Module], recipe: str, layers: str = "auto") -> tuple[int, int]:
    """Convert the linear layers inside `blocks` that `layer_filter(recipe, layers)` picks, in
    place; returns (converted, linear layers seen)."""
    convert_to_float8_training = _float8().convert_to_float8_training
    config = float8_config(recipe)
    chooses = layer_filter(recipe, layers)
    seen = converted = 0
    for block in blocks:
        linears = [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        seen += len(linears)
        converted += sum(bool(chooses(m, n)) for n, m in linears)
        convert_to_float8_training(block, config=config, module_filter_fn=chooses)
    return converted, seen


def check_device(recipe: str, device: torch.device) -> None:
    """Refuse a CUDA device without float8 tensor cores; warn on the CPU."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ConfigError(
                f"trainer.fp8={recipe} needs float8 tensor cores (compute capability 8.9+: L4, "
                f"L40S, H100, H200); {torch.cuda.get_device_name(device)} is "
                f"{capability[0]}.{capability[1]}: drop trainer.fp8"
            )
    elif device.type == "cpu":
        log.warning(
            "trainer.fp8=%s on the CPU: torch's CPU float8 matmul is a reference path (~150x "
            "slower than bf16 here), for testing; float8 is faster only on GPUs with float8 "
            "tensor cores",
            recipe,
        )


def apply_fp8(
    model: nn.Module,
    recipe: str,
    device: torch.device,
    blocks: list[nn.Module],
    is_main: bool,
    layers: str = "auto",
) -> None:
    """`trainer.fp8=recipe` on this rank's (not yet laid out) model, the layers `trainer.fp8_layers`
    picks."""
    check_device(recipe, device)
    converted, seen = to_float8(blocks, recipe, layers)
    if not is_main:
        return
    which = {
        "auto": "torchao's filter for the recipe",
        "all": "every layer with features in multiples of 16",
        "mlp": "the MLPs' layers",
    }[layers]
    if converted == 0:
        log.warning(
            "trainer.fp8=%s converts none of the blocks' %d linear layers (trainer.fp8_layers=%s: "
            "%s keeps bf16 where float8 would be slower): the run is bf16; drop trainer.fp8, or "
            "force it with trainer.fp8_layers=all",
            recipe,
            seen,
            layers,
            which,
        )
        return
    log.info(
        "fp8 (trainer.fp8=%s): %d of the blocks' %d linear layers in float8 (torchao; "
        "trainer.fp8_layers=%s: %s), the patch embedding, head and the rest in bf16",
        recipe,
        converted,
        seen,
        layers,
        which,
    )
