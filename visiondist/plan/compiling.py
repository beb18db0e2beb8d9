"""How a job's model is compiled, decided with its layout before any rank starts: whether
(`trainer.compile`: auto compiles a ViT's blocks on CUDA), what (the whole model, or each block
where the layout works block by block or the ViT is wide) and whether the compiled step is replayed
as CUDA graphs (`trainer.cuda_graphs`: auto for a narrow ViT on one GPU). Each decision carries its
reason, which the launcher prints; a combination that cannot run is refused, naming the fix.
"""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from visiondist.config import ConfigError
from visiondist.config.layout import RunLayout
from visiondist.models.registry import spec_of


def compile_switches(cfg: DictConfig, run: RunLayout, p: Optional[DictConfig] = None) -> dict:
    """The RunLayout fields `compile`, `compile_scope` and `cuda_graphs` for `run`'s mesh (see
    `compile_plan`)."""
    compile_, scope, graphs, _ = compile_plan(cfg, run, p)
    return {"compile": compile_, "compile_scope": scope, "cuda_graphs": graphs}


# ViT widths up to this are launch-bound on a GPU when compiled whole: trainer.cuda_graphs=auto
# replays them
CUDA_GRAPHS_MAX_WIDTH = 384
# compile=auto compiles the whole model up to this width (ViT-Ti/S/B); wider ViTs (L, H, g: 24-40
# blocks) per block, where the step is GPU-bound either way (ViT-B/16 on an H100: 3,260 img/s whole,
# 3,257 per block) and one graph of every block takes minutes to compile (ViT-H/14's, over 150 s on
# an H100) where one block's takes seconds
WHOLE_MODEL_MAX_WIDTH = 768


def compile_plan(
    cfg: DictConfig, run: RunLayout, p: Optional[DictConfig] = None
) -> tuple[bool, str, bool, str]:
    """(compiled, scope, CUDA graphs, why) for `trainer.compile` and `trainer.cuda_graphs` on
    `run`'s mesh.

    Scope: `model` compiles the whole model in one graph where the layout leaves it whole on each
    rank (one device or DDP, whose buckets torch's DDPOptimizer cuts the graph at) and the ViT is at
    most 768 wide (auto; wider ones per block: GPU-bound either way, and far quicker to compile);
    `blocks` compiles each transformer block where tensor parallelism (the block's collectives), a
    pipeline (stages of blocks) or FSDP2 (a block's gathered weights) works block by block, and for
    detectors (their ViT backbone's blocks). `trainer.compile=model|blocks` names it.

    CUDA graphs (auto): on for the whole-model graph of a narrow ViT (width <= 384: ViT-Ti/S) on one
    GPU, one micro-batch per step, where the step is launch-bound; off otherwise (ViT-B and up keep
    the GPU busy)."""
    compiled, why = compile_choice(cfg, run.accelerator, p)
    p = cfg.parallel if p is None else p
    t = cfg.trainer
    asked = t.compile
    if not compiled:
        if t.get("cuda_graphs", "auto") is True:
            raise ConfigError(
                "trainer.cuda_graphs=true replays the compiled model, and nothing is compiled "
                f"here ({why}): CUDA graphs need a GPU and trainer.compile=true or auto there"
            )
        return False, "none", False, why
    if cfg.model.family == "detr":
        if asked == "blocks":
            raise ConfigError(
                f"trainer.compile=blocks: {cfg.model.name} has no transformer blocks; "
                "trainer.compile=model compiles its network (backbone, encoder, decoder) whole"
            )
        if t.get("cuda_graphs", "auto") is True:
            raise ConfigError(
                f"trainer.cuda_graphs=true: {cfg.model.name}'s denoising queries and matching "
                "read the device each step, which a CUDA graph cannot replay; use "
                "trainer.cuda_graphs=auto or false"
            )
        return (
            True,
            "model",
            False,
            (
                "its network (backbone, encoder, decoder) compiled whole, the loss and its "
                "matching eager"
            ),
        )
    if cfg.data.get("resolution", "square") == "native":
        return _native_compile(asked, t.get("cuda_graphs", "auto"))
    apart = (
        "tensor parallelism: each block compiled with its collectives"
        if run.tp > 1
        else "pipeline parallelism: each stage's blocks compiled"
        if run.pp > 1
        else "FSDP2: each block compiled inside its own gather and reduce-scatter"
        if run.fsdp
        else f"{cfg.model.name}: its ViT backbone's blocks compiled"
        if cfg.model.family != "vit"
        else ""
    )
    wide = int(cfg.model.get("embed_dim") or 0) > WHOLE_MODEL_MAX_WIDTH
    if asked == "blocks" or (apart and asked != "model"):
        scope = "blocks"
        why = apart or "trainer.compile=blocks"
    elif wide and asked in ("auto", True):
        scope = "blocks"
        why = (
            f"each block compiled: a ViT {cfg.model.embed_dim} wide keeps the GPU busy block by "
            "block (ViT-B/16 on an H100: 3,260 img/s whole, 3,257 per block) and compiles one "
            "block in seconds where its whole graph takes minutes (trainer.compile=model "
            "compiles it whole)"
        )
    else:
        if apart:
            raise ConfigError(
                f"trainer.compile=model compiles the whole model, but {apart.split(':')[0]} works "
                "block by block: use trainer.compile=blocks (or auto, which chooses it)"
            )
        scope = "model"
        why = (
            "the whole model compiled in one graph (ViT-S/16 bf16 at batch 256 on an H100: 7,508 "
            "img/s against 5,919 compiled per block, which left the GPU idle 46% of the step)"
            if asked in ("auto", True)
            else "trainer.compile=model"
        )
    graphs, graphs_why = _cuda_graphs(cfg, run, scope)
    return True, scope, graphs, why + ("; " + graphs_why if graphs_why else "")


def _native_compile(asked, cuda_graphs) -> tuple[bool, str, bool, str]:
    """`compile_plan` under data.resolution=native: each block compiled; the whole model and CUDA
    graphs refused."""
    if asked == "model" or cuda_graphs is True:
        raise ConfigError(
            f"trainer.{'compile=model' if asked == 'model' else 'cuda_graphs=true'} with "
            "data.resolution=native: the batch's image grids and sequence lengths change from "
            "step to step, a graph for each; use trainer.compile=blocks (or auto, which chooses "
            "it) and trainer.cuda_graphs=auto"
        )
    return (
        True,
        "blocks",
        False,
        (
            "data.resolution=native: each block compiled (its sequence lengths come from a few "
            "buckets); the embedding, resampled to each batch's image grids, eager"
        ),
    )


def _cuda_graphs(cfg: DictConfig, run: RunLayout, scope: str) -> tuple[bool, str]:
    t, m = cfg.trainer, cfg.model
    accum = run.grad_accum or int(t.grad_accum)
    asked = t.get("cuda_graphs", "auto")
    if asked is False:
        return False, ""
    blocker = (
        "it compiles the whole model only (trainer.compile=blocks here)"
        if scope != "model"
        else "it needs CUDA"
        if run.accelerator != "cuda"
        else f"it runs on one GPU only ({run.world_size} ranks here)"
        if run.world_size > 1
        else f"it runs one micro-batch per step (trainer.grad_accum={accum})"
        if accum > 1
        else ""
    )
    if asked is True:
        if blocker:
            raise ConfigError(
                f"trainer.cuda_graphs=true: {blocker}; use trainer.cuda_graphs=auto or false"
            )
        return True, "replayed as CUDA graphs (trainer.cuda_graphs=true)"
    if blocker or str(t.get("fp8", "off")) != "off" or run.activation_checkpointing:
        return False, ""
    if int(m.get("embed_dim") or 0) > CUDA_GRAPHS_MAX_WIDTH:
        return False, ""
    return True, (
        f"replayed as CUDA graphs: a ViT {m.embed_dim} wide launches kernels faster than Python "
        "can (ViT-S/16 on an H100: GPU idle 28% of the compiled step, 3% as CUDA graphs, 1.044x)"
    )


def compile_choice(
    cfg: DictConfig, accelerator: str, p: Optional[DictConfig] = None
) -> tuple[bool, str]:
    """(whether the blocks are compiled, why) for `trainer.compile`: true and false as asked; auto
    compiles a model with transformer blocks on CUDA, where per-block compilation made ViT-B/16's
    step 1.28x faster on an H200 (not on the CPU: 1.045x for Inductor's C++ on 2 cores, with a
    minute of compiling), unless the zero-bubble schedule splits the blocks' backward or Triton is
    missing."""
    asked, p = cfg.trainer.compile, cfg.parallel if p is None else p
    if asked in (True, False, "model", "blocks"):
        return asked is not False, "trainer.compile=" + str(asked).lower()
    if cfg.model.family == "detr":
        return False, (
            f"{cfg.model.name} runs eager unless trainer.compile=model asks (its network compiled "
            "whole; not measured on a GPU yet, and the library's RT-DETR and D-FINE break the "
            "graph at their denoising queries)"
        )
    if not spec_of(cfg.model).has_blocks:
        return False, f"{cfg.model.name} has no transformer blocks to compile"
    if accelerator != "cuda":
        return (
            False,
            "on the CPU, compiling costs minutes and gained 1.045x (benchmarks/RESULTS.md)",
        )
    if p.pp > 1 and p.schedule == "zero_bubble":
        return (
            False,
            "the zero-bubble schedule splits each block's backward, which a compiled block cannot",
        )
    try:
        from torch.utils._triton import has_triton  # noqa: PLC0415 (torch: plan/ is torch-free)

        triton = has_triton()
    except Exception:
        triton = False
    if not triton:
        return False, "Triton, which Inductor compiles CUDA kernels with, is not importable here"
    return True, "compiled on CUDA"
