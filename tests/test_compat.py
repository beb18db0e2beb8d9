"""The few APIs that differ between the supported torch releases (visiondist/compat.py), on the torch installed here.
CI runs this file on the newest torch and on torch 2.11."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from visiondist import compat

pytestmark = pytest.mark.smoke


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_collectives_and_timeouts_work_on_this_torch(one_rank):
    x = torch.arange(6.0).view(2, 3)
    out = torch.empty(2, 3)
    compat.all_gather_into(out, x, one_rank)
    assert torch.equal(out, x)
    compat.reduce_scatter_into(out, x * 2, one_rank)
    assert torch.equal(out, x * 2)
    compat.set_pg_timeout(timedelta(seconds=7))
    compat.set_pg_timeout(timedelta(seconds=7), dist.new_group([0]))


def test_the_pipeline_stage_methods_we_override_exist_with_their_parameters(monkeypatch):
    compat.check_pipeline_stage()
    from torch.distributed.pipelining import PipelineStage

    monkeypatch.setattr(PipelineStage, "backward_weight_one_chunk", None)  # what a release that removed it looks like
    with pytest.raises(RuntimeError, match="PipelineStage.backward_weight_one_chunk is gone"):
        compat.check_pipeline_stage()
