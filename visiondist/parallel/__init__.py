"""Turn a finished single-device model into one laid out over the device mesh.

`parallelize` (`apply.py`) applies, in order: tensor-parallel plan -> pipeline stages -> data parallel. This package
never imports the models: they declare their plans to it (`visiondist.models.vit_parallel`).
"""

from visiondist.utils.lazy import lazy_exports

# Imported on first use: the launcher plans a layout with `visiondist.parallel.memory` and `planner`, and needs
# neither DTensor nor the rest of torch.distributed that these bring (about 1 s of a launch).
__getattr__, __all__ = lazy_exports(__name__, {
    "apply": ("local_part", "parallelize"),
    "data": ("same_buffers", "unwrap"),
    "fsdp": ("blank_forwards", "compile_blocks", "compile_model", "enable_activation_checkpointing",
             "forwards_needed", "is_fully_sharded", "keep_matmuls_context", "local_numel", "reshard",
             "transformer_blocks"),
    "grad": ("average_over_data_parallel", "clip_grad_norm", "finish_gradients"),
    "mesh": ("Layout", "build_layout"),
    "pipeline": ("PipelineSpec", "PipelinedViT"),
    "tensor": ("full_state_dict",),
})
