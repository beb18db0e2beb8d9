"""The device the multi-rank tests run on, from VISIONDIST_TEST_DEVICE:

- `cpu` (the default, what CI runs): gloo processes on the CPU;
- `cuda-shared`: every rank on GPU 0 over gloo (`trainer.share_gpu=true`), on a machine of one GPU
  (`benchmarks/gpu/run.sh layouts`);
- `cuda`: one GPU per rank over NCCL (`benchmarks/gpu/run.sh multi`); a test of more ranks than GPUs
  is skipped.

The tests marked `layouts` run on any of them against the same single-process reference, on the same
device: the command lines they start get the device's overrides (`on_test_device`), the rank
functions their device and process group as the product places a job's ranks (`init_test_rank`:
`visiondist.plan.world`'s placement and backend).
"""

from __future__ import annotations

import os

TEST_DEVICES = ("cpu", "cuda-shared", "cuda")
TEST_DEVICE = os.environ.get("VISIONDIST_TEST_DEVICE", "cpu")
if TEST_DEVICE not in TEST_DEVICES:
    raise ValueError(
        f"VISIONDIST_TEST_DEVICE={TEST_DEVICE!r}: use one of {', '.join(TEST_DEVICES)}"
    )
SHARED = TEST_DEVICE == "cuda-shared"

# On a GPU, what keeps an fp32 run within the CPU tests' tolerances of its reference: IEEE fp32
# matmuls (no TF32), eager steps, one attention kernel for every process (auto times the kernels,
# and two processes may differ), JPEGs decoded by the loader, and the pipeline timeline the CPU
# records by default. A test's own later value wins.
EXACT_ON_GPU = [
    "trainer.tf32=false",
    "trainer.compile=false",
    "model.sdpa=math",
    "data.decode_on=loader",
    "parallel.timeline=true",
]


def device_overrides() -> list[str]:
    """What takes the place of `trainer.accelerator=cpu` in a test's command line on the test
    device."""
    if TEST_DEVICE == "cpu":
        return ["trainer.accelerator=cpu"]
    return [
        "trainer.accelerator=cuda",
        *(["trainer.share_gpu=true"] if SHARED else []),
        *EXACT_ON_GPU,
    ]


def on_test_device(args: list[str]) -> list[str]:
    """`args` (a tools/train.py command line that names `trainer.accelerator=cpu`) on the test
    device. Under `cuda` the ranks are pinned to what the CPU run would start (else every GPU would
    join: `parallel=tp2` on 8 GPUs is dp4 x tp2), and a command line of more ranks than GPUs skips
    the test."""
    if TEST_DEVICE == "cpu":
        return list(args)
    _need_cuda()
    out = [
        a
        for arg in args
        for a in (device_overrides() if arg == "trainer.accelerator=cpu" else [arg])
    ]
    if TEST_DEVICE == "cuda":
        ranks = cpu_ranks(args)
        _need_gpus(ranks)
        if not any(a.startswith("trainer.devices=") for a in args):
            out.append(f"trainer.devices={ranks}")
    return out


def cpu_ranks(args: list[str]) -> int:
    """The ranks `args` starts on the CPU (the layout resolved as tools/train.py resolves it)."""
    from helpers import REPO

    from visiondist.config import compose
    from visiondist.plan import resolve

    cfg = compose(REPO / "configs", [a for a in args if not a.startswith("trainer.run_dir=")])
    return resolve(cfg, {}, 0)[0].world_size


def _need_cuda() -> None:
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"VISIONDIST_TEST_DEVICE={TEST_DEVICE} needs a CUDA device; none here")


def _need_gpus(ranks: int) -> None:
    import pytest
    import torch

    if ranks > torch.cuda.device_count():
        pytest.skip(f"{ranks} ranks on NCCL need {ranks} GPUs; {torch.cuda.device_count()} here")


def ranks_on(n: int) -> str:
    """How the start-up line and the summary name `n` ranks on the test device: `2 ranks on cpu`."""
    where = "cpu" if TEST_DEVICE == "cpu" else "cuda"
    return f"{n} rank{'s' if n > 1 else ''} on {where}" + (
        ", sharing GPU 0 over gloo" if SHARED and n > 1 else ""
    )


def spawned(nprocs: int) -> None:
    """Before `helpers.spawn_ranks` starts `nprocs` ranks: on a CUDA test device, skip where there
    is no GPU (or, under `cuda`, fewer GPUs than ranks)."""
    if TEST_DEVICE != "cpu":
        _need_cuda()
    if TEST_DEVICE == "cuda":
        _need_gpus(nprocs)


def init_test_rank():
    """In a test's rank (`helpers.spawn_ranks`): this rank's device and the process group, placed
    and joined as the product places a job's ranks; fp32 matmuls in full precision on a GPU. Returns
    the device."""
    import torch
    import torch.distributed as dist

    from visiondist.plan.world import backend_for, cuda_index

    if TEST_DEVICE == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device(
        "cuda", cuda_index(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count(), SHARED)
    )
    torch.cuda.set_device(device)
    backend = backend_for("cuda", SHARED)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    _exact()
    return device


def reference_device():
    """Where a test's single-process reference runs in the pytest process: GPU 0 under either CUDA
    mode."""
    import torch

    if TEST_DEVICE == "cpu":
        return torch.device("cpu")
    _need_cuda()
    _exact()
    return torch.device("cuda", 0)


def _exact() -> None:
    from visiondist.engine.precision import set_tf32

    set_tf32(False)
