"""Turn a finished single-device model into one laid out over the device mesh.

`parallelize` (`apply.py`) applies, in order: tensor-parallel plan -> pipeline stages -> data parallel. This package
never imports the models: they declare their plans to it (`visiondist.models.vit_parallel`).
"""

import importlib

# Imported on first use (PEP 562): the launcher plans a layout with `visiondist.parallel.memory` and `planner`, and
# needs neither DTensor nor the rest of torch.distributed that these bring (about 1 s of a launch).
_WHERE = {
    "apply": ["local_part", "parallelize"],
    "data": ["same_buffers", "unwrap"],
    "fsdp": ["blank_forwards", "compile_blocks", "compile_model", "enable_activation_checkpointing",
             "forwards_needed", "is_fully_sharded", "keep_matmuls_context", "local_numel", "reshard",
             "transformer_blocks"],
    "grad": ["average_over_data_parallel", "clip_grad_norm", "finish_gradients"],
    "mesh": ["Layout", "build_layout"],
    "pipeline": ["PipelineSpec", "PipelinedViT"],
    "tensor": ["full_state_dict"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


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
