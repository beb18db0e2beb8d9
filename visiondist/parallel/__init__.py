"""Turn a finished single-device model into one laid out over the device mesh.

`parallelize` applies, in order: tensor-parallel plan -> (pipeline stages) -> data parallel. Models never import this
package.
"""

from __future__ import annotations

from torch import nn

from visiondist.parallel.data import unwrap, wrap_data_parallel
from visiondist.parallel.grad import clip_grad_norm, finish_gradients
from visiondist.parallel.mesh import Layout, build_layout
from visiondist.parallel.tensor import apply_tensor_parallel, full_state_dict

__all__ = [
    "Layout",
    "build_layout",
    "clip_grad_norm",
    "finish_gradients",
    "full_state_dict",
    "parallelize",
    "unwrap",
]


def parallelize(model: nn.Module, layout: Layout, sequence_parallel: bool = False) -> nn.Module:
    """Lay `model` (already on `layout.device`, with the same initial weights on every rank) out over the mesh."""
    if layout.pp > 1:
        raise NotImplementedError("pipeline parallelism is not available in this release")
    if layout.tp > 1:
        model = apply_tensor_parallel(model, layout.tp_comm, sequence_parallel)
    return wrap_data_parallel(model, layout)
