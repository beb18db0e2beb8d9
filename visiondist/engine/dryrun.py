"""The dry run: a layout checked at full scale on one machine, before anyone pays for the cluster.

Chosen ranks of the full world are built one after another in this process, each by the training code itself
(`build_layout`, the TP plan, the pipeline's stage cut and schedule, FSDP2) over torch's fake process group at the
job's world size, which accepts every collective and moves nothing; the model lives on the meta device (under FSDP
on fake tensors, which FSDP2 requires), so no rank's memory is ever allocated. Each rank then runs one training step
(forward, backward, the gradient reductions, clipping, the optimizer) and its figures are read off the built objects:

- parameters, gradients and optimizer state: the bytes of this rank's tensors (shards, stages) after the step;
- activations: what autograd saves for the backward of one micro-batch through this rank's stages (saved-tensor
  hooks; parameters and views of them left out); autocast is emulated on meta tensors by running the same ops in
  the autocast dtype (matmuls, convolutions and attention; norms and softmax in fp32);
- collectives: the payload of every collective the step issues (all-reduce, all-gather, reduce-scatter, send,
  receive), per mesh dimension, counted where the call is dispatched;
- start-up peak: with the meta-device build a rank allocates only its own shards, then draws each parameter's full
  value on the host one at a time to cut its part: its parameters on the device plus the largest full tensor.

Beside each figure: the planner's (`visiondist.parallel.memory`) and the ratio; a figure more than `TOLERANCE` off
is flagged. A layout the code cannot build or step fails here, naming the rank, not on the cluster. Under DDP the
gradients are reduced by the same bucketed all-reduce the pipeline uses (DDP's reducer needs real tensors).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from visiondist.config.layout import RunLayout
from visiondist.engine.precision import autocast_dtype
from visiondist.models import build_deferred
from visiondist.parallel import (
    PipelinedViT,
    PipelineSpec,
    average_over_data_parallel,
    build_layout,
    clip_grad_norm,
    finish_gradients,
    local_numel,
    parallelize,
)
from visiondist.parallel.grad import mean_over_group
from visiondist.parallel.memory import (
    FLOAT,
    GB,
    ViTShape,
    collective_bytes,
    saved_per_microbatch,
    saved_storages,
)
from visiondist.parallel.stages import stage_indices

TOLERANCE = 0.10  # a measured figure further than this from the plan is flagged
EXACT = ("parameters", "gradients", "optimizer")  # the planner counts these exactly: any difference is flagged


# -- the fake world ------------------------------------------------------------------------------------------------


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of `world_size` on torch's fake process group (for CPU and meta tensors)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    devices = dist.Backend.backend_capability.setdefault("fake", ["cpu"])
    if "meta" not in devices:
        devices.append("meta")  # the pipeline's sends carry meta tensors
    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter", "send": "send",
          "recv": "recv", "broadcast": "broadcast", "tp_all_reduce": "all_reduce", "tp_all_gather": "all_gather",
          "tp_reduce_scatter": "reduce_scatter"}


def _kind(op_name: str) -> Optional[str]:
    namespace, _, name = op_name.partition(".")
    if namespace not in ("c10d", "_c10d_functional", "visiondist"):
        return None
    name = name.split(".")[0].strip("_").replace("_base", "").replace("_into_tensor", "").replace("_tensor", "")
    for key, kind in _KINDS.items():
        if name.startswith(key):
            return kind
    return None


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return local_numel(t) * t.element_size()


class Traffic(TorchDispatchMode):
    """Bytes of each collective call, keyed "<mesh dim> <kind>": the payload (the largest tensor an all-gather or
    reduce-scatter touches; every tensor an all-reduce, send or receive carries). The TP ops are counted as such;
    the c10d calls inside them are not seen again."""

    def __init__(self, groups: dict, other: str = "world"):
        super().__init__()
        self.groups = groups  # process group -> mesh dim name
        self.other = other  # the name of any other group's traffic
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def _dim(self, args, op_name: str) -> str:
        if op_name.startswith("visiondist."):
            return "tp"
        for arg in args:
            name = self.groups.get(_group_key(arg))
            if name is not None:
                return name
        return self.other

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _kind(str(func))
        if kind is not None:
            tensors = _tensors(list(args)) + _tensors(out)
            size = sum(map(_nbytes, _tensors(args[0]))) if kind in ("all_reduce", "send", "recv", "broadcast") \
                else max(map(_nbytes, tensors), default=0)
            key = f"{self._dim(args, str(func))} {kind}"
            self.bytes[key] = self.bytes.get(key, 0) + size
            self.calls[key] = self.calls.get(key, 0) + 1
        return out


def _group_key(arg) -> Optional[int]:
    if isinstance(arg, dist.ProcessGroup):
        return id(arg)
    unwrap = getattr(dist.ProcessGroup, "unbox", None)
    if unwrap is not None and type(arg).__name__ == "ScriptObject":
        try:
            return id(unwrap(arg))
        except Exception:  # not a process group
            return None
    return None


LOW_PRECISION_OPS = (F.linear, F.conv2d, F.scaled_dot_product_attention, torch.matmul, torch.bmm, torch.mm,
                     torch.addmm, torch.baddbmm)
FP32_OPS = (F.layer_norm, F.softmax, F.log_softmax, F.cross_entropy)  # autocast runs these in fp32


class AsOnDevice(TorchFunctionMode):
    """Meta and fake tensors computing as a GPU would, for what autograd saves: autocast (torch has none for them),
    by casting the fp32 inputs of the ops autocast runs in its lower precision (matmuls, convolutions, attention;
    norms and softmax stay fp32); and fused attention (saving q, k, v, the output and its log-sum-exp, as the flash
    and memory-efficient kernels do, where meta tensors would take the unfused path and save the tokens x tokens
    matrix), unless `model.sdpa=math` asks for the unfused one."""

    def __init__(self, dtype: Optional[torch.dtype], fused_attention: bool = True):
        super().__init__()
        self.dtype, self.fused_attention = dtype, fused_attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.dtype is not None and func in LOW_PRECISION_OPS:
            def cast(x):
                return x.to(self.dtype) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        if self.dtype is not None and func in FP32_OPS:
            def widen(x):
                return x.float() if isinstance(x, torch.Tensor) and x.dtype == self.dtype else x

            args = tuple(widen(a) for a in args)
            kwargs = {k: widen(v) for k, v in kwargs.items()}
        if func is F.scaled_dot_product_attention and self.fused_attention and not kwargs and len(args) == 3:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args)[0]
        return func(*args, **kwargs)


# -- one rank ------------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    name: str
    measured: int
    planned: Optional[int]

    @property
    def ratio(self) -> Optional[float]:
        if self.planned is None:
            return None
        if self.planned == 0:
            return 1.0 if self.measured == 0 else math.inf
        return self.measured / self.planned

    @property
    def off(self) -> bool:
        if self.planned is None:
            return False
        if self.name in EXACT:
            return self.measured != self.planned
        return abs(self.ratio - 1) > TOLERANCE


@dataclass
class RankReport:
    rank: int
    coordinate: tuple[int, int, int]  # (pp, dp, tp)
    figures: list[Figure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def flagged(self) -> list[Figure]:
        return [f for f in self.figures if f.off]

    def figure(self, name: str) -> Figure:
        return next(f for f in self.figures if f.name == name)


def _local_bytes(tensors) -> int:
    return sum(_nbytes(t) for t in tensors if t is not None)


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(_local_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
               for state in optimizer.state.values())


def _images(cfg: DictConfig, n: int, device: str) -> torch.Tensor:
    size = int(cfg.model.img_size)
    return torch.zeros(n, 3, size, size, device=device)


def measure_detector_rank(cfg: DictConfig, run: RunLayout, rank: int) -> tuple[tuple[int, int, int], dict, dict]:
    """A detector's rank (DDP): the model built as training builds it (on the CPU: torchvision's detectors need real
    values to sample boxes), one real forward and backward of a synthetic micro-batch at the configured size, the DP
    reduction over the fake group, the optimizer step."""
    from visiondist.engine.measure import synthetic_batch
    from visiondist.engine.optim import build_optimizer

    with fake_world(rank, run.world_size):
        layout = build_layout(run.dp, run.tp, run.pp, torch.device("cpu"), rank % run.per_node, run=run)
        model, _ = build_deferred(cfg.model, weights=False)
        model = parallelize(model, layout, wrap=False).train()
        accum = int(cfg.trainer.grad_accum)
        micro = int(cfg.data.batch_size) // run.dp // accum
        images, targets = synthetic_batch(cfg, "detection", micro, torch.device("cpu"), seed=rank)
        images = [image.float() / 255 for image in images]
        traffic = Traffic({id(layout.dp_group): "dp"})
        with traffic:
            for i in range(accum):
                if i == 0:
                    with saved_storages(model) as saved:
                        losses = model(images, targets)
                else:
                    losses = model(images, targets)
                (sum(loss.float() for loss in losses.values()) / accum).backward()
            params = list(model.parameters())
            if run.dp > 1:  # what DDP's reducer does, in the same 25 MB buckets
                mean_over_group([p.grad for p in params if p.grad is not None], layout.dp_group, layout.dp)
            clip_grad_norm(params, float(cfg.trainer.clip_grad), layout)
            optimizer = build_optimizer(cfg.optim, model)
            optimizer.step()
        figures = {"parameters": _local_bytes(params), "gradients": _local_bytes(p.grad for p in params),
                   "optimizer": _optimizer_bytes(optimizer), "activations": saved["bytes"]}
        return tuple(layout.mesh.get_coordinate()), figures, traffic.bytes


def planned_detector(cfg: DictConfig, run: RunLayout) -> tuple[dict, dict]:
    """The plan of a detector's rank: its state counted from the model built on the meta device (activations are
    not modelled for detectors: the dry run reports them measured only)."""
    from omegaconf import OmegaConf

    from visiondist.models import build_model
    from visiondist.parallel.memory import module_state

    with torch.device("meta"):
        model = build_model(OmegaConf.merge(cfg.model, {"weights": None, "init_from": None}))
    mem = module_state(model, str(cfg.optim.name), float(getattr(cfg.optim, "momentum", 0.9)))
    figures = {"parameters": mem.params, "gradients": mem.grads, "optimizer": mem.optimizer, "activations": None}
    return figures, ({"dp all_reduce": mem.grads} if run.dp > 1 else {})


def measure_rank(cfg: DictConfig, run: RunLayout, rank: int) -> tuple[tuple[int, int, int], dict, dict]:
    """Build `rank` of `run` with the training code on a fake process group and run one step: its coordinate,
    its bytes by component, and its collective bytes per step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from visiondist.engine.optim import build_optimizer

    with fake_world(rank, run.world_size):
        layout = build_layout(run.dp, run.tp, run.pp, torch.device("cpu"), rank % run.per_node, run=run)
        device = "cpu" if run.fsdp else "meta"  # FSDP2 steps only materialised (here: fake) tensors
        layout = replace(layout, device=torch.device(device))
        model, _ = build_deferred(cfg.model, weights=False)
        model = parallelize(model, layout, run.sequence_parallel, PipelineSpec.from_layout(run), fsdp=run.fsdp,
                            shard_size=run.shard_size,
                            offload=run.offload, activation_checkpointing=run.activation_checkpointing,
                            checkpoint_blocks=run.checkpoint_blocks, param_dtype=autocast_dtype(cfg.trainer.precision),
                            wrap=False)
        fake = FakeTensorMode(allow_non_fake_inputs=True) if run.fsdp else nullcontext()
        emulate = (autocast_dtype(cfg.trainer.precision), str(cfg.model.sdpa) != "math")
        autocast = AsOnDevice(*emulate)
        for module in model.modules():  # a checkpointed block recomputes (on autograd's thread) as it ran forward
            if getattr(module, "checkpointing", False):
                module.recompute_context = lambda: (nullcontext(), AsOnDevice(*emulate))
        groups = {id(layout.mesh.get_group(dim)): dim for dim in ("pp", "dp", "tp")}
        with fake:
            if run.fsdp:
                model.to_empty(device="cpu")
            local = int(cfg.data.batch_size) // run.dp
            accum = int(cfg.trainer.grad_accum)
            micro = local // accum // (run.microbatches if run.pp > 1 else 1)
            with autocast:
                activations = _saved_one_microbatch(model, cfg, micro, device)
            if isinstance(model, PipelinedViT):  # the stages' outputs as the step computes them (autocast)
                with autocast:
                    model.use_static_shapes(_images(cfg, micro, device))
            traffic = Traffic(groups, other="dp" if run.fsdp else "world")  # HSDP's groups are FSDP's own
            with traffic, autocast:  # the backward too: recomputed blocks must see what their forward saw
                _train_step(model, layout, cfg, run, local // accum, device)
                optimizer = build_optimizer(cfg.optim, model, int(cfg.model.depth))
                optimizer.step()
            params = list(model.parameters())
            figures = {"parameters": _local_bytes(params), "gradients": _local_bytes(p.grad for p in params),
                       "optimizer": _optimizer_bytes(optimizer), "activations": activations}
            figures["start-up"] = figures["parameters"] + max(FLOAT * _full_numel(p, run.tp) for p in params)
        return tuple(layout.mesh.get_coordinate()), figures, traffic.bytes


def _full_numel(param: torch.Tensor, tp: int) -> int:
    """Elements of the full tensor a rank draws to cut `param` from (a DTensor's shape is already the full one)."""
    from visiondist.parallel.tensor import SHARD_DIM

    return param.numel() * (tp if getattr(param, SHARD_DIM, None) is not None else 1)


def _saved_one_microbatch(model: nn.Module, cfg: DictConfig, micro: int, device: str) -> int:
    """Bytes saved for the backward of one micro-batch's forward through this rank's stages (or whole model)."""
    if isinstance(model, PipelinedViT):
        images = _images(cfg, micro, device)
        boundary = model._enter(images).detach().requires_grad_(True)
        outputs = []  # kept until the end: a freed graph's storages would be reused and counted once
        with saved_storages(model) as saved:
            for stage, index in zip(model._stages, model.stage_ids):
                outputs.append(stage(images if index == 0 else boundary))
        return saved["bytes"]
    with saved_storages(model) as saved:
        model(_images(cfg, micro, device))
    return saved["bytes"]


def _train_step(model: nn.Module, layout, cfg: DictConfig, run: RunLayout, batch: int, device: str) -> None:
    """What `Trainer.train_step` does to the gradients, with zeros for data: every accumulation step's forward and
    backward (or pipeline step), TP's partial gradients, the DP average, the global-norm clip."""
    accum = int(cfg.trainer.grad_accum)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    for _ in range(accum):
        if isinstance(model, PipelinedViT):
            model.train_step(_images(cfg, batch, device) if model.is_first else None,
                             labels if model.is_last else None, 1.0 / accum)
        else:
            (F.cross_entropy(model(_images(cfg, batch, device)).float(), labels) / accum).backward()
    params = list(model.parameters())
    finish_gradients(params, layout)
    if isinstance(model, PipelinedViT):
        average_over_data_parallel(params, layout)
    elif run.dp > 1 and not run.fsdp:  # what DDP's reducer does, in the same 25 MB buckets
        mean_over_group([p.grad for p in params if p.grad is not None], layout.dp_group, layout.dp)
    clip_grad_norm(params, float(cfg.trainer.clip_grad), layout)


# -- the plan's figures --------------------------------------------------------------------------------------------


def planned_rank(cfg: DictConfig, shape: ViTShape, run: RunLayout,
                 coordinate: tuple[int, int, int]) -> tuple[dict, dict]:
    """The planner's bytes by component and collective bytes for the rank at `coordinate`, for one micro-batch's
    saved activations."""
    from visiondist.parallel.memory import tensor_shapes
    from visiondist.plan.resolve import layout_memory

    pp_rank, dp_rank, _ = coordinate
    t = cfg.trainer
    mem = layout_memory(cfg, run, pp_rank, dp_rank)
    blocks = mem.detail["blocks"]
    figures = {"parameters": mem.params, "gradients": mem.grads, "optimizer": mem.optimizer,
               "activations": saved_per_microbatch(shape, mem.detail["micro_batch"], run.tp, blocks, str(t.precision),
                                                   run.activation_checkpointing, run.sequence_parallel,
                                                   pp_rank == 0, pp_rank == run.pp - 1, run.fsdp),
               "start-up": mem.params + FLOAT * max(math.prod(x) for x in tensor_shapes(shape))}
    stages = tuple(stage_indices(pp_rank, run.pp, run.stages_per_rank)) if run.pp > 1 else (0,)
    traffic = collective_bytes(shape, mem, run.dp, run.tp, run.pp, int(t.grad_accum), str(t.precision), run.fsdp,
                               run.activation_checkpointing, run.sequence_parallel, stages,
                               run.pp * run.stages_per_rank)
    return figures, traffic


# -- the whole dry run ---------------------------------------------------------------------------------------------


def chosen_ranks(run: RunLayout) -> list[int]:
    """The first rank of the first stage, one rank in the middle of every dim, the last rank of the last stage."""
    def rank(pp: int, dp: int, tp: int) -> int:
        return (pp * run.dp + dp) * run.tp + tp

    middle = rank(run.pp // 2, run.dp // 2, run.tp // 2)
    return sorted({0, middle, run.world_size - 1})


def dry_run(cfg: DictConfig, shape: Optional[ViTShape], run: RunLayout, ranks: Optional[list[int]] = None,
            progress=None) -> list[RankReport]:
    """Measure `ranks` (default `chosen_ranks`) of `run` and set each beside the plan; `shape`: the model family's
    planner shape (None: a detector, planned from its tensors)."""
    reports = []
    for rank in ranks if ranks is not None else chosen_ranks(run):
        start = time.perf_counter()
        try:
            measure = measure_rank if shape is not None else measure_detector_rank
            coordinate, measured, traffic = measure(cfg, run, rank)
        except Exception as exc:
            raise DryRunError(f"rank {rank} of {run.describe()} failed to build or step: "
                              f"{type(exc).__name__}: {exc}") from exc
        if shape is not None:
            planned, planned_traffic = planned_rank(cfg, shape, run, coordinate)
        else:
            planned, planned_traffic = planned_detector(cfg, run)
        report = RankReport(rank, coordinate)
        report.figures = [Figure(k, v, planned.get(k)) for k, v in measured.items()]
        kinds = sorted(set(traffic) | set(planned_traffic), key=lambda k: ("pp dp tp world".find(k[:2]), k))
        report.figures += [Figure(k, traffic.get(k, 0), planned_traffic.get(k)) for k in kinds]
        report.seconds = time.perf_counter() - start
        reports.append(report)
        if progress is not None:
            progress(report)
    return reports


class DryRunError(RuntimeError):
    """A rank of the layout could not be built or stepped by the training code."""


def _gb(n: int) -> str:
    if n >= 1e8 or n == 0:
        return f"{n / GB:.4g}"
    return f"{n / 1e6:.3g} MB" if n >= 1e4 else f"{n} B"


def report_table(reports: list[RankReport], title: str = ""):
    """A rich Table: per rank and figure, measured GB, planned GB, ratio; flagged rows in red."""
    from rich.table import Table

    table = Table(title=title or None, title_justify="left", caption=(
        f"GB per rank (unless marked MB or B); collectives: bytes per optimizer step, each call's payload; parameters, "
        f"gradients and optimizer state must match exactly, the rest within {100 * TOLERANCE:.0f}%"),
        caption_justify="left")
    for col, justify in (("rank (pp, dp, tp)", "left"), ("figure", "left"), ("measured", "right"),
                         ("planned", "right"), ("ratio", "right"), ("", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for report in reports:
        for i, f in enumerate(report.figures):
            who = f"{report.rank} {report.coordinate}" if i == 0 else ""
            ratio = "-" if f.ratio is None else f"{f.ratio:.3f}"
            table.add_row(who, f.name, _gb(f.measured), "-" if f.planned is None else _gb(f.planned), ratio,
                          "OFF" if f.off else "", style="bold red" if f.off else None,
                          end_section=i == len(report.figures) - 1)
    return table
