"""Turn a finished single-device model into one laid out over the device mesh.

`parallelize` applies, in order: tensor-parallel plan -> pipeline stages -> data parallel. Models never import this
package.
"""

from __future__ import annotations

from torch import nn

from visiondist.parallel.data import unwrap, wrap_data_parallel
from visiondist.parallel.grad import clip_grad_norm
from visiondist.parallel.mesh import Layout, build_layout

__all__ = ["Layout", "build_layout", "clip_grad_norm", "parallelize", "unwrap"]


def parallelize(model: nn.Module, layout: Layout) -> nn.Module:
    """Lay `model` (already on `layout.device`) out over the mesh."""
    if layout.tp > 1 or layout.pp > 1:
        raise NotImplementedError("tensor and pipeline parallelism are not available in this release")
    return wrap_data_parallel(model, layout)
