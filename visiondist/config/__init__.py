"""Structured configs (the schema behind `configs/`), composition and validation.

Hydra composes the YAML groups into these dataclasses, so a misspelt key or a value of the wrong type fails at
composition. `validate` then checks what types cannot express (ranges, divisibility, the mesh against the
devices) and raises one `ConfigError` whose message names the fix. Both happen before any rank is started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import II, MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = "vit"
    timm_name: Optional[str] = None  # the timm architecture whose state-dict layout we export to
    img_size: int = II("patch_multiple:${data.img_size},${model.patch_size}")  # data.img_size, rounded down
    num_classes: int = II("data.num_classes")
    patch_size: int = 16
    embed_dim: int = 192
    depth: int = 12
    num_heads: int = 3
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    # detectors (family torchvision / vitdet)
    arch: Optional[str] = None  # torchvision builder, e.g. fasterrcnn_mobilenet_v3_large_fpn
    weights: Optional[str] = None  # a local state dict (.safetensors or torch file); nothing is ever downloaded
    init_from: Optional[str] = None  # ViT fine-tuning: local weights (ours or timm's); a head of another size is new
    # ResNet-FPN detectors: the backbone's ImageNet weights, a local torchvision resnet50 state dict (e.g. the
    # resnet50-0676ba61.pth file of ResNet50_Weights.IMAGENET1K_V1); as torchvision's weights_backbone does, its
    # BatchNorms become frozen (v1 models) and only the last `trainable_backbone_layers` stages train
    backbone_weights: Optional[str] = None
    trainable_backbone_layers: int = 3  # 0-5, with backbone_weights (torchvision's default: 3)
    min_size: int = II("data.min_size")  # the detector's internal resize
    max_size: int = II("data.max_size")
    fpn_channels: int = 256  # vitdet: channels of the simple feature pyramid
    anchor_scale: float = 1.0  # multiplies the detector's anchor sizes (same anchors per location, same weights)
    roi_sampling_ratio: Optional[int] = None  # RoIAlign samples per bin side (torchvision: 2)
    sync_bn: bool = False  # convert BatchNorm to SyncBatchNorm under data parallelism (CUDA)
    sdpa: str = "auto"  # attention kernel: auto (torch picks) | flash | efficient | cudnn | math
    channels_last: bool = False  # convolutions in NHWC memory layout (CNN detectors on tensor cores)
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the torchvision detector, e.g. box_score_thresh


@dataclass
class SyntheticConfig:
    """How a built-in dataset is generated on first use."""

    train_per_class: int = 500  # classification sets
    val_per_class: int = 100
    train_images: int = 2000  # detection sets
    val_images: int = 300
    image_size: int = 64
    seed: int = 0


@dataclass
class DataConfig:
    name: str = MISSING
    format: str = "imagefolder"
    root: str = MISSING
    train_split: str = "train"
    val_split: str = "val"
    num_classes: int = MISSING
    img_size: int = 224
    batch_size: int = 64  # global: summed over data-parallel ranks and accumulation steps
    eval_batch_size: int = 128  # global
    num_workers: int = 2
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    train_crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    hflip: float = 0.5
    auto_augment: str = "none"  # classification training: none | rand (RandAugment 2 ops, magnitude 9) | trivial
    mixup: float = 0.0  # mixup alpha (timm's Mixup); 0: off
    cutmix: float = 0.0  # cutmix alpha; 0: off
    mixup_prob: float = 1.0  # probability of mixing a batch at all
    mixup_switch_prob: float = 0.5  # with both on: probability of cutmix instead of mixup
    crop_pct: float = 0.875
    # detection (format coco): <root>/<images>/<file_name>, <root>/<annotations>; {split} is the split name
    annotations: str = "annotations/instances_{split}.json"
    images: str = "{split}"
    min_size: int = 800  # resize: short side to min_size unless the long side would pass max_size
    max_size: int = 1333
    color_jitter: float = 0.0
    large_scale_jitter: bool = False
    lsj_scale: list[float] = field(default_factory=lambda: [0.1, 2.0])
    aspect_grouping: bool = True  # each batch holds only landscape or only portrait images
    max_bad_images: int = 10  # consecutive unreadable training images before the run stops
    pin_memory: bool = True  # page-locked batches, copied to the GPU without blocking (CUDA only)
    prefetch_factor: int = 2  # batches each loader worker prepares ahead
    synthetic: Optional[SyntheticConfig] = None


@dataclass
class ParallelConfig:
    name: str = "ddp"
    dp: int = -1  # -1: whatever the world size leaves after tp and pp
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False  # Megatron-SP: norms and residuals sharded along tokens (needs tp > 1)
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved_1f1b | zero_bubble
    stages_per_rank: int = -1  # virtual pipeline stages per rank; -1: 2 for interleaved_1f1b / zero_bubble, else 1
    microbatches: int = -1  # micro-batches per pipeline step (per DP rank); -1: 2 x pp
    # record one pipeline step's timeline (pipeline_timeline.png / .json, the bubble); null: on the CPU yes, on CUDA
    # only when asked (true): it puts two CUDA events around every action of that step
    timeline: Optional[bool] = None
    fsdp: bool = False  # shard parameters, gradients and optimizer state over the DP ranks (FSDP2, one unit per block)
    offload: bool = False  # with fsdp: shards, gradients and optimizer state in host memory, optimizer on the CPU
    activation_checkpointing: bool = False  # recompute each block's activations in the backward (keeps its input)
    checkpoint_blocks: int = -1  # selective: only the first N blocks recompute (-1: all of them)
    # parallel=auto: choose dp / tp / pp / fsdp / offload / activation checkpointing from the memory and time model
    auto: bool = False
    device_memory_gb: float = 0.0  # per device; 0: the GPU's own (CUDA), or host memory / ranks (CPU)
    num_devices: int = -1  # planning only (tools/plan.py): -1: trainer.devices x parallel.nodes
    nodes: int = 1  # planning only: nodes of num_devices / nodes devices each (TP stays inside a node)
    headroom: float = 0.9  # a layout fits when its estimate is at most this fraction of device_memory_gb
    device_tflops: float = 400.0  # sustained dense rate per device (time model; ranks layouts, predicts no wall time)
    intra_node_gbs: float = 300.0  # per-device link bandwidth inside a node, GB/s (NVLink class)
    inter_node_gbs: float = 25.0  # per-device bandwidth between nodes, GB/s (200 Gb/s InfiniBand)
    host_gbs: float = 25.0  # device <-> host copies (offload), GB/s


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.9
    nesterov: bool = False
    decay_norm_bias: bool = False  # true: weight decay on norms, biases, embeddings too (torchvision's references)
    layer_decay: float = 1.0  # layer-wise LR decay (fine-tuning): block i gets lr x layer_decay^(depth - i); 1: off
    impl: str = "auto"  # optimizer kernels: auto (the fastest torch has on the device) | fused | foreach | loop


@dataclass
class ScheduleConfig:
    name: str = "cosine"
    warmup_steps: int = 0
    warmup_start_factor: float = 0.01  # lr multiplier at step 0 of the warmup
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of optim.lr
    milestones: list[float] = field(default_factory=lambda: [0.66, 0.88])  # step: fractions of the run
    gamma: float = 0.1


@dataclass
class TrainerConfig:
    accelerator: str = "auto"
    devices: int = -1  # ranks per node; -1: all visible GPUs, or what the mesh needs on the CPU
    max_steps: int = -1
    max_epochs: int = 10
    seed: int = 0
    precision: str = "32"  # 32 | bf16 | 16 (fp16 autocast with dynamic loss scaling)
    tf32: bool = True  # CUDA: fp32 matmuls / convolutions in TF32 (10-bit mantissa, several times faster); false: ieee
    compile: bool = False  # torch.compile each transformer block (ViT and ViTDet)
    grad_accum: int = 1
    clip_grad: float = 0.0  # max global grad norm; 0 disables clipping
    label_smoothing: float = 0.0  # classification cross-entropy
    ema_decay: float = 0.0  # model EMA, evaluated next to the model (e.g. 0.9998); 0: off
    eval_at_start: bool = False  # evaluate before the first step (e.g. the weights of model.init_from)
    eval_every: int = 0  # optimizer steps between evaluations; 0: at the end of every epoch
    log_every: int = 20
    output_dir: str = "outputs"
    run_dir: Optional[str] = None  # default: <output_dir>/<date>/<time>
    progress: bool = True
    tensorboard: bool = True
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: only at the end
    keep_last: int = 3  # complete checkpoints kept; 0: all
    resume: Optional[str] = "auto"  # auto: the run dir's latest checkpoint if any | a checkpoint or run dir | null
    stop_at_step: int = -1  # > 0: checkpoint and end this process after this step (the schedule still spans the run)
    max_restarts: int = 0  # self-launched: restart every rank this many times after a failure (resume=auto)
    dist_timeout_s: float = 600.0  # a collective waiting longer than this fails (after the first step)
    startup_timeout_s: float = 1800.0  # the same during start-up (data generation, first step)
    on_nonfinite: str = "raise"  # a non-finite loss or gradient on any rank: raise | skip (the step, on every rank)
    allow_changes: bool = False  # continuing a run (trainer.run_dir): allow another model, data or global batch


@dataclass
class BenchConfig:
    """tools/benchmark.py: what to time (the training runs read none of it)."""

    warmup: int = 3  # untimed steps first (allocation, autotuning, compilation)
    steps: int = 10  # timed steps of each loop per round (a ratio of fewer than 5 steps in all is flagged)
    rounds: int = 2  # rounds over every loop, each round in the reverse order of the last (keep it even)
    baseline: bool = True  # per configuration, plain-PyTorch loops on timm's model and on ours (single rank)
    peak: bool = True  # also measure the device's dense matmul rate in the run (MFU beside the datasheet's)
    loader_batches: int = 20  # batches of the real train loader timed on their own; 0: skip
    # appends results.jsonl and results.md here; null: the benchmark's run dir (`bench.results_dir=benchmarks` adds
    # the rows to the repository's record, benchmarks/results.md)
    results_dir: Optional[str] = None
    # more configurations timed side by side with the first, each a space-separated list of key=value overrides,
    # e.g. ["trainer.compile=true", "trainer.precision=bf16 optim.impl=fused"] (the layout stays the same)
    variants: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


def _patch_multiple(size: int, patch: int) -> int:
    """The largest multiple of the patch size not above `size` (at least one patch): a 64-pixel dataset feeds a
    /16 model 64-pixel images and a /14 model 56-pixel ones."""
    return max(1, int(size) // int(patch)) * int(patch)


if not OmegaConf.has_resolver("patch_multiple"):
    OmegaConf.register_new_resolver("patch_multiple", _patch_multiple)


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose(config_dir: str | Path, overrides: list[str], config_name: str = "train") -> DictConfig:
    """Compose `configs/<config_name>.yaml` with command-line overrides into a resolved, typed config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """A plain, picklable dict (what crosses process boundaries)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def from_container(data: dict[str, Any]) -> DictConfig:
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), data)
    return cfg  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------------------------
# Validation: everything a type cannot say. Each check raises with the value, the reason and the fix.

_ACCELERATORS = ("auto", "cpu", "cuda")
_PRECISIONS = ("32", "bf16", "16")
_OPTIMIZERS = ("adamw", "sgd")
_SCHEDULES = ("cosine", "step")
_MODEL_FAMILIES = ("vit", "torchvision", "vitdet")
_DATA_FORMATS = {"vit": "imagefolder", "torchvision": "coco", "vitdet": "coco"}


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported: use one of {', '.join(allowed)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_mandatory(cfg: DictConfig) -> None:
    """Every `???` value has been given (e.g. `data.root` of data=imagenet / coco)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        example = {"data.root": f"/path/to/{cfg.data.get('name') or 'data'}"}
        fix = " ".join(f"{key}={example.get(key, '<value>')}" for key in missing)
        raise ConfigError(f"{', '.join(missing)} must be set (??? in the config): add {fix}")


def validate(cfg: DictConfig, mandatory: bool = True) -> None:
    """Check a composed config on its own (no devices involved). Raises ConfigError. `mandatory=False`: `???` values
    may stay unset (printing the config, planning a layout: nothing reads the data)."""
    if mandatory:
        check_mandatory(cfg)
    m, d, p, o, s, t = cfg.model, cfg.data, cfg.parallel, cfg.optim, cfg.schedule, cfg.trainer
    _one_of("model.family", m.family, _MODEL_FAMILIES)
    _one_of("data.format", d.format, ("imagefolder", "coco"))
    _one_of("data.auto_augment", d.auto_augment, ("none", "rand", "trivial"))
    if d.format != _DATA_FORMATS[m.family]:
        kind = "a detector" if d.format == "imagefolder" else "a classifier"
        raise ConfigError(
            f"model={m.name} is {kind} but data={d.name} is {d.format} data: "
            f"use {'data=shapes_coco or data=coco' if kind == 'a detector' else 'data=shapes or data=imagenet'}"
        )
    if m.family == "vitdet" and 32 % m.patch_size:
        raise ConfigError(f"model.patch_size={m.patch_size} must divide 32 (detection batches are padded to 32)")
    if m.family == "torchvision" and p.tp > 1:
        raise ConfigError(f"parallel.tp={p.tp}: tensor parallelism shards ViT blocks; {m.name} has none")
    _one_of("trainer.accelerator", t.accelerator, _ACCELERATORS)
    _one_of("trainer.precision", str(t.precision), _PRECISIONS)
    _one_of("optim", o.name, _OPTIMIZERS)
    _one_of("optim.impl", o.impl, ("auto", "fused", "foreach", "loop"))
    _one_of("model.sdpa", m.sdpa, ("auto", "flash", "efficient", "cudnn", "math"))
    if t.compile and m.family == "torchvision":
        raise ConfigError(f"trainer.compile=true compiles transformer blocks; {m.name} has none: drop it")
    if t.compile and p.pp > 1 and p.schedule == "zero_bubble":
        raise ConfigError("trainer.compile=true with parallel.schedule=zero_bubble: the schedule splits each block's "
                          "backward into input and weight gradients, which a compiled block's backward cannot do; "
                          "use parallel.schedule=1f1b or interleaved_1f1b, or drop trainer.compile")
    _positive("data.prefetch_factor", d.prefetch_factor)
    b = cfg.bench
    _positive("bench.warmup", b.warmup, allow_zero=True)
    _positive("bench.steps", b.steps)
    _positive("bench.rounds", b.rounds)
    _positive("bench.loader_batches", b.loader_batches, allow_zero=True)
    for variant in b.variants:
        variant_config(cfg, variant)
    if p.checkpoint_blocks != -1:
        _positive("parallel.checkpoint_blocks", p.checkpoint_blocks)
        if not p.activation_checkpointing:
            raise ConfigError(f"parallel.checkpoint_blocks={p.checkpoint_blocks} selects the blocks that recompute: "
                              "set parallel.activation_checkpointing=true too")
    _one_of("trainer.on_nonfinite", t.on_nonfinite, ("raise", "skip"))
    _positive("trainer.max_restarts", t.max_restarts, allow_zero=True)
    if t.max_restarts > 0 and t.resume != "auto":
        raise ConfigError(f"trainer.max_restarts={t.max_restarts} restarts from the run's latest checkpoint: "
                          f"keep trainer.resume=auto (not {t.resume})")
    _positive("trainer.dist_timeout_s", t.dist_timeout_s)
    _positive("trainer.startup_timeout_s", t.startup_timeout_s)
    _one_of("schedule", s.name, _SCHEDULES)

    for key in ("num_classes", "img_size", "patch_size", "embed_dim", "depth", "num_heads"):
        _positive(f"model.{key}", m[key])
    _positive("model.mlp_ratio", m.mlp_ratio)
    _positive("model.anchor_scale", m.anchor_scale)
    if m.roi_sampling_ratio is not None:
        _positive("model.roi_sampling_ratio", m.roi_sampling_ratio)
    if m.img_size % m.patch_size:
        raise ConfigError(
            f"model.img_size={m.img_size} is not a multiple of model.patch_size={m.patch_size} ({m.name}): "
            f"use e.g. model.img_size={max(1, round(m.img_size / m.patch_size)) * m.patch_size}"
        )
    if m.embed_dim % m.num_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} does not divide model.embed_dim={m.embed_dim}")
    for key in ("drop_rate", "drop_path_rate"):
        if not 0 <= m[key] < 1:
            raise ConfigError(f"model.{key}={m[key]} must be in [0, 1)")

    _positive("optim.lr", o.lr)
    if not 0 < o.layer_decay <= 1:
        raise ConfigError(f"optim.layer_decay={o.layer_decay} must be in (0, 1] (1: off)")
    if not 0 <= t.label_smoothing < 1:
        raise ConfigError(f"trainer.label_smoothing={t.label_smoothing} must be in [0, 1)")
    if not 0 <= t.ema_decay < 1:
        raise ConfigError(f"trainer.ema_decay={t.ema_decay} must be in [0, 1) (0: off), e.g. 0.9998")
    for key in ("mixup", "cutmix"):
        _positive(f"data.{key}", d[key], allow_zero=True)
    mixing = d.mixup > 0 or d.cutmix > 0
    if m.family != "vit" and (mixing or t.label_smoothing > 0 or d.auto_augment != "none"):
        raise ConfigError(f"data.mixup / data.cutmix / data.auto_augment / trainer.label_smoothing are for "
                          f"classification; {m.name} is a detector: drop them")
    if mixing and p.pp > 1:
        raise ConfigError("data.mixup / data.cutmix with parallel.pp > 1 is not supported (the first stage mixes the "
                          "images, the last would need the same mixing of the labels): use parallel.pp=1")
    if m.init_from is not None and m.weights is not None:
        raise ConfigError("set model.weights (exact weights) or model.init_from (fine-tuning start), not both")
    if m.init_from is not None and m.family != "vit":
        raise ConfigError(f"model.init_from is for ViT classifiers; for {m.name} use model.weights")
    if m.init_from is not None and not Path(m.init_from).expanduser().is_file():
        raise ConfigError(f"model.init_from={m.init_from}: no such file")
    if m.backbone_weights is not None:
        if m.family != "torchvision" or "resnet50" not in str(m.arch):
            raise ConfigError(f"model.backbone_weights is for the ResNet-50 FPN detectors; {m.name} has no ResNet-50 "
                              "backbone (use model.weights for a whole model)")
        if not Path(m.backbone_weights).expanduser().is_file():
            raise ConfigError(f"model.backbone_weights={m.backbone_weights}: no such file")
        if not 0 <= m.trainable_backbone_layers <= 5:
            raise ConfigError(f"model.trainable_backbone_layers={m.trainable_backbone_layers}: choose 0-5 (stages of "
                              "the ResNet that train, from the last)")
    _positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive("schedule.warmup_steps", s.warmup_steps, allow_zero=True)
    if not 0 <= s.min_lr_ratio <= 1:
        raise ConfigError(f"schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")

    _positive("data.batch_size", d.batch_size)
    _positive("data.eval_batch_size", d.eval_batch_size)
    _positive("data.num_workers", d.num_workers, allow_zero=True)
    _positive("trainer.grad_accum", t.grad_accum)
    _positive("trainer.clip_grad", t.clip_grad, allow_zero=True)
    _positive("trainer.log_every", t.log_every)
    _positive("trainer.eval_every", t.eval_every, allow_zero=True)
    _positive("trainer.checkpoint_every", t.checkpoint_every, allow_zero=True)
    _positive("trainer.keep_last", t.keep_last, allow_zero=True)
    if t.resume not in (None, "auto") and not Path(str(t.resume)).expanduser().exists():
        raise ConfigError(f"trainer.resume={t.resume}: no such checkpoint or run directory "
                          "(give checkpoints/step_<N> or a run dir, `auto`, or null)")
    if t.max_steps <= 0 and t.max_epochs <= 0:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs to a positive number")

    for key in ("tp", "pp"):
        _positive(f"parallel.{key}", p[key])
    if p.dp != -1:
        _positive("parallel.dp", p.dp)
    if m.num_heads % p.tp:
        good = ", ".join(str(x) for x in _divisors(m.num_heads))
        heads = [h for h in range(p.tp, m.embed_dim + 1, p.tp) if m.embed_dim % h == 0]
        other = min(heads, key=lambda h: (abs(h - m.num_heads), -h)) if heads else None
        more = (f", or model.num_heads={other} (a multiple of {p.tp} that divides model.embed_dim={m.embed_dim})"
                if other is not None else "")
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.num_heads={m.num_heads} ({m.name}): "
            f"tensor parallelism shards attention by whole heads; use parallel.tp in {{{good}}}{more}"
        )
    hidden = int(m.embed_dim * m.mlp_ratio)
    if hidden % p.tp:
        good = ", ".join(str(x) for x in _divisors(math.gcd(hidden, m.num_heads)))
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide the MLP hidden size {hidden} of {m.name} "
            f"(embed_dim x mlp_ratio): use parallel.tp in {{{good}}}"
        )
    if p.fsdp and (p.tp > 1 or p.pp > 1):
        raise ConfigError(f"parallel.fsdp=true shards over data parallel and does not combine with tp={p.tp} / "
                          f"pp={p.pp} here: use parallel.fsdp=false, or tp=1 and pp=1")
    if p.fsdp and m.family != "vit":
        raise ConfigError(f"parallel.fsdp=true shards ViT classifiers; {m.name} is a detector: use DDP")
    if p.offload and not p.fsdp:
        raise ConfigError("parallel.offload=true moves FSDP's shards to host memory: set parallel.fsdp=true too")
    if p.activation_checkpointing and m.family == "torchvision":
        raise ConfigError(f"parallel.activation_checkpointing recomputes transformer blocks; {m.name} has none")
    if p.auto and (p.tp > 1 or p.pp > 1 or p.dp != -1 or p.fsdp):
        raise ConfigError("parallel=auto chooses dp / tp / pp / fsdp itself: drop parallel.dp/tp/pp/fsdp")
    if p.auto and m.family != "vit":
        raise ConfigError(f"parallel=auto plans ViT classifiers; for {m.name} use parallel=ddp")
    for key in ("device_memory_gb", "device_tflops", "intra_node_gbs", "inter_node_gbs", "host_gbs"):
        _positive(f"parallel.{key}", p[key], allow_zero=key == "device_memory_gb")
    _positive("parallel.nodes", p.nodes)
    if not 0 < p.headroom <= 1:
        raise ConfigError(f"parallel.headroom={p.headroom} must be in (0, 1]")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it shards tokens across the TP group)")
    if p.pp > 1 and m.family != "vit":
        raise ConfigError(f"parallel.pp={p.pp}: pipeline parallelism cuts ViT classifiers into stages of blocks; "
                          f"{m.name} is a detector: use parallel.pp=1")
    from visiondist.config.layout import check_pipeline

    try:
        check_pipeline(p.pp, p.schedule, p.stages_per_rank, p.microbatches, m.depth)
    except ValueError as exc:
        raise ConfigError(f"{exc} ({m.name})") from None


_LAYOUT_KEYS = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.auto", "trainer.devices", "trainer.accelerator",
                "data.batch_size", "trainer.grad_accum", "bench.")


def variant_config(cfg: DictConfig, overrides: str) -> DictConfig:
    """`cfg` with one benchmark variant's key=value overrides, validated. The ranks, the mesh and the batch are the
    run's: a variant changes how a step computes, not what it computes over."""
    pairs = overrides.split()
    bad = [p for p in pairs if "=" not in p]
    if not pairs or bad:
        raise ConfigError(f"bench.variants entry {overrides!r}: give key=value overrides separated by spaces")
    fixed = [p for p in pairs if p.split("=", 1)[0].startswith(_LAYOUT_KEYS)]
    if fixed:
        raise ConfigError(f"bench.variants entry {overrides!r}: {', '.join(fixed)} would change the ranks, the mesh or "
                          "the batch, which all variants share: benchmark it in a run of its own")
    try:
        merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(pairs))
    except Exception as exc:  # an unknown key or a wrong type, from the schema
        raise ConfigError(f"bench.variants entry {overrides!r}: {str(exc).splitlines()[0]}") from None
    merged.bench.variants = []
    validate(merged)
    return merged  # type: ignore[return-value]
