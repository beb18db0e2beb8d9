"""Turn a finished single-device model into one laid out over the device mesh, at run time on every
rank.

`parallelize` (`apply.py`) applies, in order: tensor-parallel plan -> pipeline stages -> data
parallel. `mesh.py`: the mesh and the rank's `Layout`; `tensor.py` and `collectives.py`: the TP
styles and their autograd collectives; `stages.py`, `pipeline.py`, `schedules.py` and `timeline.py`:
the stage cut, the pipelined model, torch's schedules and what a schedule did (the bubble, a PNG);
`fsdp.py`: FSDP2, activation checkpointing, compile; `data.py`: DDP; `grad.py`: gradient averaging
and the global norm. Which layout to run is decided before the ranks start, in `visiondist.plan`.

Imports: `compat`, `utils` and `config` only; never the models, which declare their plans to it
(`visiondist.models.vit_parallel`).
"""

from visiondist.parallel.apply import local_part, parallelize
from visiondist.parallel.data import same_buffers, unwrap
from visiondist.parallel.fsdp import (
    blank_forwards,
    compile_blocks,
    compile_model,
    enable_activation_checkpointing,
    forwards_needed,
    is_fully_sharded,
    keep_matmuls_context,
    local_numel,
    reshard,
    transformer_blocks,
)
from visiondist.parallel.grad import average_over_data_parallel, clip_grad_norm, finish_gradients
from visiondist.parallel.mesh import Layout, build_layout
from visiondist.parallel.pipeline import PipelinedViT, PipelineSpec
from visiondist.parallel.tensor import full_state_dict

__all__ = [
    "Layout",
    "PipelineSpec",
    "PipelinedViT",
    "average_over_data_parallel",
    "blank_forwards",
    "build_layout",
    "clip_grad_norm",
    "compile_blocks",
    "compile_model",
    "enable_activation_checkpointing",
    "finish_gradients",
    "forwards_needed",
    "full_state_dict",
    "is_fully_sharded",
    "keep_matmuls_context",
    "local_numel",
    "local_part",
    "parallelize",
    "reshard",
    "same_buffers",
    "transformer_blocks",
    "unwrap",
]
