"""The world a job has: accelerator, ranks and ranks per node, from the config, the environment
(torchrun / srun) and the GPUs present (the loader workers each rank's share of the node's cores
allows are the rank's own question: `visiondist.data.workers.loader_workers`). The one place these
are decided; pure given `env`, the GPU count and the core count, so every branch is testable without
GPUs. Where each rank's device is and which backend joins the ranks (`cuda_index`, `backend_for`)
are decided here too, as pure functions the ranks call.

`trainer.share_gpu=true` runs a node's ranks on one GPU (its first): a test mode for layouts on
fewer GPUs than ranks. NCCL refuses two ranks on one device ("Duplicate GPU detected"), so these
ranks join over gloo, which carries CUDA tensors through host memory for its collectives. It checks
the parallel code on CUDA memory and streams; it says nothing of NCCL or of speed."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from omegaconf import DictConfig

from visiondist.config import ConfigError
from visiondist.utils.gpus import SUSTAINED_SHARE, Board, board_named, board_of_device


@dataclass(frozen=True)
class World:
    """The ranks a job runs on, found before any rank starts (`find_world`).

    Attributes:
        accelerator: "cpu" or "cuda".
        world_size: ranks in all.
        per_node: ranks on each node.
        under_torchrun: a launcher (torchrun, srun) started the ranks (`under_torchrun`); else the
            launching process starts them itself.
        share_gpu: a node's ranks share its first GPU (`trainer.share_gpu`).
    """

    accelerator: str  # "cpu" or "cuda"
    world_size: int
    per_node: int
    under_torchrun: bool
    # every rank of a node on its GPU 0, over gloo (trainer.share_gpu: a correctness test)
    share_gpu: bool = False


def under_torchrun(env: Mapping[str, str]) -> bool:
    """Whether a launcher started this process as one of its ranks: torchrun's run id, or the
    world size and local rank it sets.

    Args:
        env: the process's environment (`os.environ`, or a copy).
    """
    return "TORCHELASTIC_RUN_ID" in env or ("WORLD_SIZE" in env and "LOCAL_RANK" in env)


def cuda_device_count() -> int:
    """The CUDA devices this process sees; 0 where CUDA is not available."""
    import torch  # noqa: PLC0415 (torch, 2 s: plan/ is torch-free)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def host_memory_gb() -> float:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


# the time model's rate where neither parallel.device_tflops, parallel.gpu nor a known GPU gives one
DEFAULT_TFLOPS = 400.0


def named_board(p: DictConfig) -> Optional[Board]:
    """The board `parallel.gpu` names, or None."""
    return board_named(str(p.gpu)) if p.get("gpu") else None


def devices_named(p: DictConfig) -> bool:
    """Whether the devices are planned from the config (parallel.device_memory_gb or parallel.gpu)
    rather than read off this machine."""
    return bool(p.device_memory_gb) or named_board(p) is not None


def _board(p: DictConfig) -> Optional[Board]:
    """parallel.gpu's board, else this machine's GPU's (None: neither is known)."""
    board = named_board(p)
    return board if board is not None else _this_gpu()


@functools.cache
def _this_gpu() -> Optional[Board]:
    """This machine's GPU's board, read once (the planner asks for every layout it times)."""
    import torch  # noqa: PLC0415 (torch, 2 s: plan/ is torch-free)

    return board_of_device(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def device_tflops(p: DictConfig) -> float:
    """The time model's sustained dense bf16 rate per device (`device_rate`'s)."""
    return device_rate(p)[0]


def device_rate(p: DictConfig) -> tuple[float, str]:
    """The time model's sustained dense bf16 rate per device and where it comes from (the plan's
    "step times at" line): parallel.device_tflops, else 0.4 x the datasheet's of parallel.gpu's
    board or of this machine's GPU, else `DEFAULT_TFLOPS`."""
    if p.device_tflops:
        return float(p.device_tflops), "parallel.device_tflops"
    board = _board(p)
    if board is None:
        return DEFAULT_TFLOPS, (
            "no GPU named or found here: an H100-class figure; name yours with parallel.gpu="
            "<board> (a100-40gb, l40s, ...) or parallel.device_tflops"
        )
    whose = f"parallel.gpu={p.gpu}" if named_board(p) is not None else f"this machine's {board.key}"
    return board.sustained_tflops, (
        f"{SUSTAINED_SHARE:.2g} x the {board.bf16:g} TFLOP/s bf16 datasheet figure of {whose}"
    )


def intra_node_gbs(p: DictConfig) -> float:
    """The time model's link between a node's devices, GB/s per device: parallel.intra_node_gbs,
    else the board's (NVLink or PCIe), else NVLink's 300."""
    if p.intra_node_gbs:
        return float(p.intra_node_gbs)
    board = _board(p)
    return 300.0 if board is None else board.link_gbs


def device_memory_gb(accelerator: str, per_node: int, share_gpu: bool = False) -> float:
    """Memory of one rank's device: the GPU's (divided between the node's ranks when they share it),
    or on the CPU the host's divided between the node's ranks.

    Args:
        accelerator: "cuda" or "cpu".
        per_node: ranks on each node.
        share_gpu: the node's ranks share its first GPU.

    Returns:
        GB (1e9 bytes) for one rank.
    """
    if accelerator == "cuda":
        import torch  # noqa: PLC0415 (torch, 2 s: plan/ is torch-free)

        return (
            torch.cuda.get_device_properties(0).total_memory / 1e9 / (per_node if share_gpu else 1)
        )
    return host_memory_gb() / per_node


SHARE_HINT = (
    "or, to test the layout's correctness on fewer GPUs, trainer.share_gpu=true (every rank on "
    "GPU 0 over gloo: never faster, and NCCL untested)"
)


def cuda_index(local_rank: int, visible: int, share_gpu: bool = False) -> int:
    """The GPU of a rank: its local rank; the only visible GPU when each task is bound to one (SLURM
    `--gpus-per-task=1`, or CUDA_VISIBLE_DEVICES set per rank), whatever its local rank; GPU 0 for
    every rank of a node that shares it (`trainer.share_gpu`)."""
    if share_gpu or visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    raise ConfigError(
        f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs: start at most {visible} "
        "ranks per node, or bind one GPU per task"
    )


def backend_for(accelerator: str, share_gpu: bool = False) -> str:
    """The process group's backend: NCCL between GPUs; gloo on the CPU and between ranks that share
    one GPU (NCCL refuses two ranks on one device)."""
    return "nccl" if accelerator == "cuda" and not share_gpu else "gloo"


def find_accelerator(cfg: DictConfig, cuda_devices: int) -> str:
    accelerator = cfg.trainer.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if cuda_devices > 0 else "cpu"
    if accelerator == "cuda" and cuda_devices == 0:
        raise ConfigError(
            "trainer.accelerator=cuda but no CUDA device is visible: use trainer.accelerator=cpu"
        )
    if cfg.trainer.get("share_gpu", False) and accelerator != "cuda":
        if cuda_devices == 0:
            raise ConfigError(
                "trainer.share_gpu=true puts a node's ranks on one GPU, and this machine has no "
                "CUDA device: drop trainer.share_gpu (CPU ranks share the cores without it)"
            )
        raise ConfigError(
            f"trainer.share_gpu=true puts a node's ranks on one GPU, and trainer.accelerator="
            f"{cfg.trainer.accelerator} runs them on the CPU: drop trainer.share_gpu, or use "
            "trainer.accelerator=cuda"
        )
    if cfg.model.sync_bn and accelerator != "cuda":
        raise ConfigError(
            "model.sync_bn=true needs CUDA (SyncBatchNorm does not run on the CPU): drop it on "
            "the CPU"
        )
    return accelerator


def find_world(cfg: DictConfig, env: Mapping[str, str], cuda_devices: int) -> World:
    """The ranks this job runs: torchrun's / srun's, else trainer.devices, else dp x tp x pp, else
    every GPU (or tp x pp processes on the CPU or on one shared GPU).

    Args:
        cfg: the composed config (`trainer.*`, `parallel.*`).
        env: the environment (torchrun's / srun's variables).
        cuda_devices: the GPUs this process sees.

    Returns:
        The job's `World`.

    Raises:
        ConfigError: the ranks asked for do not fit the devices here, naming the fix.
    """
    t, p = cfg.trainer, cfg.parallel
    accelerator = find_accelerator(cfg, cuda_devices)
    share = bool(t.get("share_gpu", False))
    model_parallel = p.tp * p.pp
    torchrun = under_torchrun(env)
    if torchrun:
        world = int(env["WORLD_SIZE"])
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        if t.max_restarts > 0:
            raise ConfigError(
                f"trainer.max_restarts={t.max_restarts}: under torchrun the restarts are "
                "torchrun's: pass --max-restarts to torchrun (with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set) and drop trainer.max_restarts"
            )
        if t.devices > 0 and t.devices != per_node:
            raise ConfigError(
                f"trainer.devices={t.devices} but torchrun started {per_node} ranks per node: "
                f"drop trainer.devices or pass --nproc-per-node={t.devices} to torchrun"
            )
    elif t.devices > 0:
        world = per_node = t.devices
    elif p.dp > 0:
        world = per_node = p.dp * model_parallel
    elif accelerator == "cuda" and not share:
        world = per_node = cuda_devices
        if cuda_devices < model_parallel:
            raise ConfigError(
                f"parallel.tp x parallel.pp = {p.tp} x {p.pp} needs {model_parallel} GPUs on this "
                f"node but only {cuda_devices} {'is' if cuda_devices == 1 else 'are'} visible: "
                "lower parallel.tp/pp, run on more GPUs, or use trainer.accelerator=cpu to run "
                f"the ranks as CPU processes, {SHARE_HINT}"
            )
    else:
        world = per_node = model_parallel
    if accelerator == "cuda" and per_node > cuda_devices and not share:
        raise ConfigError(
            f"{per_node} ranks per node need {per_node} GPUs but only {cuda_devices} "
            f"{'is' if cuda_devices == 1 else 'are'} visible: lower parallel.dp/tp/pp or "
            f"trainer.devices, or use trainer.accelerator=cpu, {SHARE_HINT}"
        )
    return World(accelerator, world, per_node, torchrun, share)


def planning_world(cfg: DictConfig, cuda_devices: int) -> tuple[int, int]:
    """(devices, nodes) for `tools/plan.py`, which plans for devices it need not have:
    parallel.num_devices, else parallel.dp x tp x pp where dp is given (as tools/train.py takes it),
    else trainer.devices (or this node's GPUs) x parallel.nodes.

    Args:
        cfg: the composed config (`parallel.num_devices`, `parallel.nodes`, `trainer.devices`).
        cuda_devices: the GPUs this process sees.

    Raises:
        ConfigError: no device count is given and none is visible, or the nodes do not split them.
    """
    p, t = cfg.parallel, cfg.trainer
    if t.devices == 0:
        raise ConfigError("trainer.devices=0: give the devices of a node to plan for, 1 or more")
    per_node = t.devices if t.devices > 0 else cuda_devices
    if p.num_devices > 0:
        devices, nodes = p.num_devices, p.nodes
    elif t.devices <= 0 and p.dp > 0:  # parallel.dp=N, as tools/train.py reads it: the ranks
        devices, nodes = p.dp * max(1, p.tp) * max(1, p.pp), p.nodes
    elif per_node > 0:
        devices, nodes = per_node * p.nodes, p.nodes
    else:
        raise ConfigError(
            "no GPU here: say how many devices to plan for, e.g. trainer.devices=8 (per node) "
            "parallel.nodes=2, or parallel.num_devices=16"
        )
    if devices % nodes:
        raise ConfigError(
            f"parallel.num_devices={devices} does not split over parallel.nodes={nodes}"
        )
    return devices, nodes
