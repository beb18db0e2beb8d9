"""Ranks sharing one GPU (`trainer.share_gpu`), decided without a GPU: refused unless asked for by
name, every rank on GPU 0 over gloo when asked, the memory model's figure summed over the ranks that
share it; and which rank a job's line names when one is killed. The runs themselves:
`benchmarks/gpu/run.sh layouts` (tests/devices.py)."""

from types import SimpleNamespace

import pytest
from helpers import REPO

from visiondist.cli import load_config
from visiondist.config import ConfigError
from visiondist.plan import resolve
from visiondist.plan.world import backend_for, cuda_index

CONFIGS = REPO / "configs"
# 6 heads: tp2 divides
SMALL = ["model=vit_small", "model.depth=4", "data.batch_size=32", "parallel.auto=false"]


def _plan(overrides, gpus):
    return resolve(load_config(CONFIGS, overrides), {}, gpus)[0]


def test_more_ranks_than_gpus_is_refused_naming_the_test_mode():
    with pytest.raises(
        ConfigError,
        match=r"need 2 GPUs but only 1 is visible: .*or, to test the layout's correctness "
        r"on fewer GPUs, trainer.share_gpu=true \(every rank on GPU 0 over gloo",
    ):
        _plan([*SMALL, "parallel.dp=2"], gpus=1)
    with pytest.raises(
        ConfigError,
        match=r"parallel.tp x parallel.pp = 2 x 1 needs 2 GPUs on this node but only 1 is "
        r"visible: .*trainer.accelerator=cpu .*trainer.share_gpu=true",
    ):
        _plan([*SMALL, "parallel=tp2"], gpus=1)
    with pytest.raises(
        ConfigError,
        match="trainer.share_gpu=true puts a node's ranks on one GPU, and this machine has "
        r"no CUDA device: drop trainer.share_gpu \(CPU ranks share the cores without "
        r"it\)$",
    ):
        _plan([*SMALL, "parallel=tp2", "trainer.share_gpu=true"], gpus=0)
    with pytest.raises(
        ConfigError,
        match="and trainer.accelerator=cpu runs them on the CPU: drop trainer.share_gpu",
    ):
        _plan([*SMALL, "parallel=tp2", "trainer.share_gpu=true", "trainer.accelerator=cpu"], gpus=1)


@pytest.mark.parametrize(
    "overrides,ranks",
    [
        (["parallel=tp2"], 2),
        (["parallel=dp2_tp2"], 4),
        (["parallel=pp2"], 2),
        (["parallel=fsdp", "trainer.devices=4"], 4),
    ],
)
def test_shared_ranks_are_the_layout_on_gpu_0(overrides, ranks):
    """The ranks the layout names (as on the CPU), on CUDA, marked shared; each found at GPU 0 and
    joined over gloo, while a GPU per rank keeps its local rank's GPU and NCCL."""
    run = _plan([*SMALL, *overrides, "trainer.share_gpu=true"], gpus=1)
    assert (run.world_size, run.accelerator, run.share_gpu) == (ranks, "cuda", True)
    assert f"({ranks} ranks on cuda, sharing GPU 0 over gloo)" in run.describe()
    assert [cuda_index(r, 1, run.share_gpu) for r in range(ranks)] == [0] * ranks
    # asked for: GPU 0 even with more
    assert [cuda_index(r, 8, run.share_gpu) for r in range(ranks)] == [0] * ranks
    assert backend_for(run.accelerator, run.share_gpu) == "gloo"
    own = _plan([*SMALL, *overrides], gpus=8)
    assert not own.share_gpu and "sharing" not in own.describe()
    assert [cuda_index(r, 8, own.share_gpu) for r in range(4)] == [0, 1, 2, 3]
    assert backend_for(own.accelerator, own.share_gpu) == "nccl" and backend_for("cpu") == "gloo"


def test_the_start_up_line_sums_the_memory_of_the_ranks_sharing_the_gpu():
    """dp2 x pp2 on one GPU: the memory model's bytes of all four ranks (two per pipeline stage, the
    stages apart), said at start-up for correctness only; a GPU smaller than that sum is refused,
    naming the fix."""
    from visiondist.launch.shared import shared_gpu_line
    from visiondist.plan.resolve import layout_memory

    cfg = load_config(CONFIGS, [*SMALL, "parallel=dp2_pp2", "trainer.share_gpu=true"])
    run = resolve(cfg, {}, 1)[0]
    stages = [layout_memory(cfg, run, pp_rank=r).device for r in range(2)]
    assert stages[0] != stages[1]
    total = 2 * sum(stages) / 1e9
    line = shared_gpu_line(cfg, run, 80.0)
    assert line.startswith(
        "trainer.share_gpu=true: 4 ranks share cuda:0 over gloo, a test of correctness only"
    )
    assert (
        f"the memory model plans {total:.3g} GB for them together ({max(stages) / 1e9:.3g} GB on "
        "the busiest" in line
    )
    with pytest.raises(
        ConfigError, match=rf"4 ranks on one GPU need {total:.3g} GB together .* run fewer ranks"
    ):
        shared_gpu_line(cfg, run, total * 0.9)
    detector = load_config(
        CONFIGS,
        [
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            "parallel.dp=2",
            "trainer.share_gpu=true",
        ],
    )
    assert "no memory figure" in shared_gpu_line(detector, resolve(detector, {}, 1)[0], 80.0)


def test_parallel_auto_plans_each_shared_rank_its_part_of_the_gpu(monkeypatch):
    import torch

    from visiondist.plan.world import device_memory_gb

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80e9)
    )
    assert device_memory_gb("cuda", 4) == 80.0
    assert device_memory_gb("cuda", 4, share_gpu=True) == 20.0


def test_a_killed_rank_is_named_over_its_peers_lost_connection():
    """The root cause of a job whose rank was killed (exit code -9, no record of its own): that
    rank, unless a rank recorded a failure of its own (then that record is the cause)."""
    from pathlib import Path

    from visiondist.faults.failures import Failure, killed_rank

    lost = Failure(
        0,
        "rank 0 failed at step 4 (training): RuntimeError: Connection closed by peer",
        0.0,
        Path("f"),
    )
    own = Failure(
        0, "rank 0 failed at step 4 (training): NonFiniteStep: non-finite loss", 0.0, Path("f")
    )
    assert killed_rank({0: 1, 1: -9}, lost) == (1, "SIGKILL")
    assert killed_rank({1: -9}, None) == (1, "SIGKILL")
    assert killed_rank({0: 1, 1: -9}, own) is None
    assert killed_rank({0: 1}, lost) is None
