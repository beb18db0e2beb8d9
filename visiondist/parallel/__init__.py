"""Turn a finished single-device model into one laid out over the device mesh.

`parallelize` (`apply.py`) applies, in order: tensor-parallel plan -> pipeline stages -> data parallel. This package
never imports the models: they declare their plans to it (`visiondist.models.vit_parallel`).
"""

from visiondist.parallel.apply import local_part, parallelize
from visiondist.parallel.data import same_buffers, unwrap
from visiondist.parallel.fsdp import (
    compile_blocks,
    compile_model,
    enable_activation_checkpointing,
    is_fully_sharded,
    keep_matmuls_context,
    local_numel,
    blank_forwards,
    forwards_needed,
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
