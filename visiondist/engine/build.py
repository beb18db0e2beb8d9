"""Building a rank's parts: the laid-out model (meta-device build, TP / pipeline / FSDP, weights
drawn or read per shard), the seeds, the logging and the data, and the start-up texts that describe
them."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from visiondist.checkpoint.dcp import freeze_as_saved, load_model_state
from visiondist.checkpoint.files import read_trainer_state
from visiondist.config.layout import RunLayout
from visiondist.data.robust import check_images
from visiondist.engine.fp8 import apply_fp8
from visiondist.engine.precision import autocast_dtype
from visiondist.models import TASKS, build_deferred, build_model, sdpa, select_attention
from visiondist.models.init import is_meta, materialize
from visiondist.models.registry import spec_of
from visiondist.models.weights import save_weights
from visiondist.observe.console import in_terminal, setup_logging
from visiondist.parallel import Layout, PipelineSpec, local_part, parallelize, transformer_blocks
from visiondist.synthetic import prepare_data

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_val_images(loader) -> None:
    """This rank's share of the val split, checked for unreadable files (a rank that reads no images
    has none)."""
    dataset = getattr(loader, "dataset", None)
    # packed shards: `tools/data.py pack` checked every image
    if dataset is None or hasattr(dataset, "packed"):
        return
    index = [i for batch in loader.batch_sampler for i in batch]
    # ImageFolder and COCO: a `PathIndex` each
    check_images([dataset.paths[i] for i in index], "val images")


def build_laid_out(
    cfg: DictConfig, layout: Layout, loss_fn=None, checkpoint: Path | None = None
) -> torch.nn.Module:
    """This rank's model under the layout, with the attention kernel chosen (`model.sdpa`,
    process-wide).

    A ViT is built on the meta device, laid out (TP shards, pipeline stages, FSDP shards), and only
    then are this rank's tensors allocated on its device and drawn (or read from `model.weights` /
    `model.init_from`), each equal to what one process draws for the same seed: no rank ever holds
    the whole model. Other models are built whole on the CPU, moved to the device, then laid out.
    `checkpoint`: the checkpoint that fills the tensors next (no initial weights are drawn or read);
    BatchNorms it saved frozen are built frozen (`freeze_as_saved`), so a run resumes with the model
    it was trained with."""
    m, p = cfg.model, run_of(layout)
    select_attention(m.sdpa)
    if m.sdpa == "auto" and layout.device.type == "cuda":
        order_attention(cfg, layout)
    # chosen, not asked: a block that fails to compile runs eager
    if p.compile and cfg.trainer.compile == "auto":
        # (torch logs why); trainer.compile=true lets the error stop
        torch._dynamo.config.suppress_errors = True
    if cfg.trainer.compile_autotune and not p.compile and layout.is_main:
        log.warning(
            "trainer.compile_autotune=true has nothing to tune: this run compiles nothing "
            "(trainer.compile=auto compiles on CUDA only; trainer.compile=true compiles anywhere)"
        )
    model, source = build_deferred(m, checkpoint is None)
    if checkpoint is not None and not is_meta(model):
        if (frozen := freeze_as_saved(checkpoint, model)) and layout.is_main:
            log.info(
                "%s saved %d BatchNorms frozen: the model has them frozen too", checkpoint, frozen
            )
    # before the layout: FSDP shards and pipeline stages keep the float8 layers
    if cfg.trainer.fp8 != "off":
        apply_fp8(
            model,
            cfg.trainer.fp8,
            layout.device,
            transformer_blocks(model),
            layout.is_main,
            cfg.trainer.fp8_layers,
        )
    fill = None
    if is_meta(model):
        # FSDP offload: shards on the host
        device = torch.device("cpu") if p.fsdp and p.offload else layout.device

        def fill_shards(laid_out: torch.nn.Module) -> None:
            materialize(laid_out, device, source, local_part(layout))

        fill = fill_shards
    else:
        model = model.to(layout.device)
        if m.sync_bn and layout.dp > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
                model, process_group=layout.dp_group
            )
    if m.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return parallelize(
        model,
        layout,
        p.sequence_parallel,
        PipelineSpec.from_layout(p),
        loss_fn,
        fsdp=p.fsdp,
        shard_size=p.shard_size,
        offload=p.offload,
        activation_checkpointing=p.activation_checkpointing,
        checkpoint_blocks=p.checkpoint_blocks,
        checkpoint_keep=p.checkpoint_keep,
        compile=p.compile_scope if p.compile else False,
        cuda_graphs=p.cuda_graphs,
        compile_autotune=cfg.trainer.compile_autotune,
        param_dtype=autocast_dtype(cfg.trainer.precision),
        materialize=fill,
    )


def order_attention(cfg: DictConfig, layout: Layout) -> None:
    """`model.sdpa=auto` on CUDA for a model whose blocks the planner knows (a ViT): time each fused
    attention kernel at this run's shape and let torch try them fastest first
    (`visiondist.models.sdpa`). The times are summed over the ranks, so every rank puts the kernels
    in the same order; rank 0 logs them."""
    planner_shape = spec_of(cfg.model).planner_shape
    # masked: torch's own choice
    if planner_shape is None or cfg.data.get("resolution", "square") == "native":
        return
    s, p = planner_shape(cfg.model), run_of(layout)
    micro = max(
        1, int(cfg.data.batch_size) // p.dp // int(cfg.trainer.grad_accum) // p.microbatches
    )
    shape = (micro, s.num_heads // p.tp, s.tokens, s.embed_dim // s.num_heads)
    dtype = autocast_dtype(cfg.trainer.precision) or torch.float32
    names = ("flash", "cudnn", "efficient")
    times = sdpa.time_kernels(shape, dtype, layout.device, names)
    summed = torch.tensor(
        [times[n] if times[n] is not None else float("inf") for n in names], device=layout.device
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(summed)
    times = {n: (None if t == float("inf") else t) for n, t in zip(names, summed.tolist())}
    select_attention("auto", sdpa.fastest_first(times))
    if layout.is_main:
        log.info(sdpa.describe(times, shape, dtype))


def run_of(layout: Layout) -> RunLayout:
    """The resolved layout a rank's `Layout` carries (every trainer's has one).

    Args:
        layout: the rank's layout, as `visiondist.plan.rank_layout` or `build_layout(..., run=)`
            makes it.

    Returns:
        Its `RunLayout`; a `ValueError` names the fix when it carries none.
    """
    if layout.run is None:
        raise ValueError(
            "this Layout carries no RunLayout: build it with visiondist.plan.rank_layout(cfg) (or "
            "build_layout(..., run=visiondist.plan.resolve(cfg)[0]))"
        )
    return layout.run


def num_params(model_cfg: DictConfig) -> int:
    """Parameters of the whole model, counted on the meta device."""
    bare = OmegaConf.merge(
        model_cfg, {"weights": None, "init_from": None, "backbone_weights": None}
    )
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(bare).parameters())


def prepare_rank(
    cfg: DictConfig, layout: Layout, run_dir: Path, log_file: str = "train.log"
) -> None:
    """Logging on every rank (rank 0 into `log_file` in the run dir); the data generated once per
    node while the other ranks wait."""
    setup_logging(run_dir, layout.is_main, log_file)
    if layout.local_rank == 0:
        # a bar in a terminal; into a pipe or a file rich would leave an empty line per bar
        prepare_data(
            cfg.data, show_progress=layout.is_main and cfg.trainer.progress and in_terminal()
        )
    dist.barrier()


def consolidate(model_cfg: DictConfig, checkpoint: Path, path: Path, is_main: bool) -> Path:
    """The model of a checkpoint as one canonical safetensors file at `path`, whatever the layout it
    was saved under (TP shards and pipeline stages are read back into one full model on the CPU),
    its metadata naming the outputs as an export's does; written by rank 0 to a temporary name and
    renamed, so the file is always whole."""
    # torchvision's detectors and dynamo come with it (1.2 s), which tools/eval.py does not need
    from visiondist.checkpoint.export.preprocessing import (  # noqa: PLC0415 (dynamo, 1.2 s)
        outputs_metadata,
    )

    if is_main:
        # every tensor comes from the checkpoint
        model, _ = build_deferred(model_cfg, weights=False)
        if is_meta(model):
            materialize(model, "cpu", None)
        load_model_state(checkpoint, model, no_dist=True)
        state = read_trainer_state(checkpoint)  # the class names, as the export's file records them
        names = outputs_metadata(
            TASKS[model_cfg.family] == "detection", state.get("classes"), state.get("category_ids")
        )
        tmp = path.with_suffix(".tmp")
        save_weights(
            {k: v.detach().contiguous() for k, v in model.state_dict().items()},
            tmp,
            metadata={"format": "pt", **names},
        )
        tmp.replace(path)
    return path


def run_length(t: DictConfig, steps_per_epoch: int) -> tuple[int, str]:
    """(optimizer steps of the run, which limit sets them): `trainer.max_steps` where it is on
    (> 0), over as many epochs as it takes; else `trainer.max_epochs` of `steps_per_epoch` global
    batches."""
    if t.max_steps > 0:
        return t.max_steps, f"trainer.max_steps={t.max_steps} ends the run"
    if t.max_epochs <= 0:  # config validation refuses both off
        raise ValueError("set trainer.max_steps or trainer.max_epochs to a positive number")
    epochs = (
        f"trainer.max_epochs={t.max_epochs} of {steps_per_epoch} "
        f"step{'s' if steps_per_epoch != 1 else ''}"
    )
    return t.max_epochs * steps_per_epoch, f"{epochs} ends the run"
