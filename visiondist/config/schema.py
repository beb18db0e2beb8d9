"""The structured configs: the schema behind `configs/`. Hydra composes the YAML groups into these
dataclasses, so a misspelt key or a value of the wrong type fails at composition."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import II, MISSING


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


@dataclass
class ModelConfig:
    """`model=<name>` (configs/model/): what is trained, a family's network and where its weights
    start. The ViT fields shape the ViTs (and ViTDet's backbone); the detector fields the others."""

    name: str = MISSING  # the model config's name (configs/model/<name>.yaml), which sets it
    # vit | torchvision | vitdet | detr: the builder and what the family supports
    # (visiondist.models.registry)
    family: str = "vit"
    timm_name: Optional[str] = None  # the timm architecture whose state-dict layout we export to
    # data.img_size, rounded down: the square input side in pixels, a multiple of patch_size
    img_size: int = II("patch_multiple:${data.img_size},${model.patch_size}")
    # classifier outputs, or a detector's object classes (no background); default: the data's
    num_classes: int = II("data.num_classes")
    patch_size: int = 16  # ViT: the side of a patch (a token), in pixels
    embed_dim: int = 192  # ViT: the width, features per token (192: ViT-Ti)
    depth: int = 12  # ViT: transformer blocks
    num_heads: int = 3  # ViT: attention heads, dividing embed_dim
    mlp_ratio: float = 4.0  # ViT: the MLP's hidden size as a multiple of embed_dim
    qkv_bias: bool = True  # ViT: biases on the query, key and value projections
    drop_rate: float = 0.0  # ViT: dropout before the head, a probability; 0: off
    # ViT: stochastic depth, the last block's drop probability (0 at the first, linear between);
    # 0: off
    drop_path_rate: float = 0.0
    # detectors (family torchvision / vitdet)
    arch: Optional[str] = None  # torchvision builder, e.g. fasterrcnn_mobilenet_v3_large_fpn
    # a state dict: a local .safetensors or torch file, or by name one of torchvision's weight enums
    # or (DETR-class) a Hugging Face repo, read from its library's cache and fetched there by the
    # launching process where the network allows (visiondist.utils.pretrained) (null: the family's
    # initialisation)
    weights: Optional[str] = None
    # where weights is a run's checkpoint (eval, predict): its EMA of the weights instead (tools'
    # ema=true; a checkpoint of a run with trainer.ema_decay > 0)
    weights_ema: bool = False
    # ViT fine-tuning: local weights (ours or timm's); a head of another size is new (null: none)
    init_from: Optional[str] = None
    # ResNet-FPN detectors: the backbone's ImageNet weights, a local torchvision resnet50 state dict
    # (e.g. the resnet50-0676ba61.pth file of ResNet50_Weights.IMAGENET1K_V1); as torchvision's
    # weights_backbone does, its BatchNorms become frozen (v1 models) and only the last
    # `trainable_backbone_layers` stages train (null: none, the backbone starts at random)
    backbone_weights: Optional[str] = None
    trainable_backbone_layers: int = 3  # 0-5, with backbone_weights (torchvision's default: 3)
    min_size: int = II("data.min_size")  # the detector's internal resize (pixels): data.min_size
    max_size: int = II("data.max_size")  # its long side's limit (pixels): data.max_size
    fpn_channels: int = 256  # vitdet: channels of the simple feature pyramid
    # a mask head: vitdet's is off unless true; torchvision's maskrcnn_* always have one
    # (null: the family's default)
    masks: Optional[bool] = None
    # multiplies the detector's anchor sizes (same anchors per location, same weights); 1: as built
    anchor_scale: float = 1.0
    roi_sampling_ratio: Optional[int] = None  # RoIAlign samples per bin side (torchvision: 2)
    sync_bn: bool = False  # convert BatchNorm to SyncBatchNorm under data parallelism (CUDA)
    sdpa: str = "auto"  # attention kernel: auto (torch picks) | flash | efficient | cudnn | math
    # convolutions in NHWC memory layout (CNN detectors on tensor cores)
    channels_last: bool = False
    # DETR-class detectors: the square sides a training batch is drawn from (RT-DETR's schedule:
    # 480-800 around 640), in pixels; null: model.img_size only
    multi_scale: Optional[list[int]] = None
    # DETR-class detectors: object queries (null: the published 300)
    num_queries: Optional[int] = None
    # passed to the torchvision detector, e.g. box_score_thresh (a DETR-class detector: values of
    # the library's config); empty: the builder's defaults
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class NativeConfig:
    """data.resolution=native (a ViT classifier): each image at its own aspect ratio, as a sequence
    of patches (visiondist.data.native)."""

    # training sequence lengths, one drawn per step; each step holds data.batch_size x (the square
    # model's token count) tokens. Empty: half, once and twice the square model's count (98, 196,
    # 392 for 224 px / 16)
    seq_lens: list[int] = field(default_factory=list)
    eval_seq_len: int = -1  # the evaluation's sequence length; -1: the square model's token count
    # several images to a sequence (attention kept inside each), instead of one padded
    pack: bool = False


@dataclass
class SyntheticConfig:
    """How a built-in dataset is generated on first use."""

    train_per_class: int = 500  # classification sets: training images per class
    val_per_class: int = 100  # classification sets: validation images per class
    train_images: int = 2000  # detection sets: training images
    val_images: int = 300  # detection sets: validation images
    image_size: int = 64  # the images' side, in pixels (their area's, with max_aspect)
    seed: int = 0  # the generator's seed: the same set on every machine
    # shapes: images of aspect ratios (width / height) log-uniform in [1 / max_aspect, max_aspect],
    # each of the area of an image_size square; 1: all square
    max_aspect: float = 1.0


# the detection formats, each read as COCO once resolved (visiondist.data.formats); `auto` resolves
# to one of them from the folder
DETECTION_FORMATS = ("coco", "yolo", "voc", "auto")


@dataclass
class DataConfig:
    """`data=<name>` (configs/data/): what the ranks read, and how the images are augmented and
    batched."""

    name: str = MISSING  # the data config's name (configs/data/<name>.yaml), which sets it
    # imagefolder (a folder per class) | coco (COCO instances JSON) | shards (tools/data.py pack) |
    # yolo (a data.yaml) | voc (Pascal VOC) | auto (detection: the folder says which of coco, yolo
    # or voc, visiondist.data.formats; resolved before any rank starts)
    format: str = "imagefolder"
    root: str = MISSING  # the data set's directory (shards: or URL); the data config or the user
    train_split: str = "train"  # the training split: its folder, or {split} below
    val_split: str = "val"  # the validation split
    # classes of the data set (detection: object classes, no background); the data config sets it
    num_classes: int = MISSING
    # classification: the square side images are cropped to, in pixels (model.img_size rounds it
    # down to the patch size)
    img_size: int = 224
    batch_size: int = 64  # global: summed over data-parallel ranks and accumulation steps
    eval_batch_size: int = 128  # global
    # loader worker processes per rank; 0: the rank reads itself; -1: what the node's CPUs allow
    num_workers: int = 2
    # per channel (RGB) of pixel values in [0, 1]: the normalisation; ImageNet's by default
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])  # as mean
    # classification training: the random-resized crop's area range, fractions of the image
    train_crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    hflip: float = 0.5  # training: the probability of a horizontal flip; 0: none
    # classification training: none | rand (RandAugment 2 ops, magnitude 9) | trivial
    auto_augment: str = "none"
    # where auto_augment runs: device (the whole batch after the copy) | loader (workers)
    augment_on: str = "device"
    # training JPEGs decoded by: loader (OpenCV in the workers) | device (nvJPEG, batched) | auto
    # (visiondist.data.decode_choice: the device only where the workers cannot feed the step; the
    # loader on the CPU)
    decode_on: str = "auto"
    # timm's random erasing: probability per image (DeiT: 0.25); 0: off. On the device
    random_erasing: float = 0.0
    # pixel (per-pixel normal noise) | rand (one normal colour) | const (zeros)
    random_erasing_mode: str = "pixel"
    mixup: float = 0.0  # mixup alpha (timm's Mixup); 0: off
    cutmix: float = 0.0  # cutmix alpha; 0: off
    mixup_prob: float = 1.0  # probability of mixing a batch at all
    mixup_switch_prob: float = 0.5  # with both on: probability of cutmix instead of mixup
    # classification evaluation: resize to img_size / crop_pct, then the centre img_size (timm's)
    crop_pct: float = 0.875
    # classification with a ViT: square (each image cropped and resized to model.img_size) | native
    # (its own aspect ratio, as many patches as its step's sequence length holds: data.native)
    resolution: str = "square"
    native: NativeConfig = field(default_factory=NativeConfig)  # resolution=native's settings
    # classification resize filter (OpenCV), train crop and eval resize alike: bilinear | bicubic;
    # written into the export's timm config, so that timm's eval transform resizes the same way
    interpolation: str = "bilinear"
    # detection (format coco): <root>/<images>/<file_name>, <root>/<annotations>; {split} is the
    # split name (an absolute path stands for itself: yolo and voc point into their cached index)
    annotations: str = "annotations/instances_{split}.json"
    images: str = "{split}"  # the images' folder under root
    # what format auto (or yolo / voc) found in root, set before any rank starts: yolo, voc, or
    # coco (<layout>); null: not looked for
    found: Optional[str] = None
    min_size: int = 800  # resize: short side to min_size unless the long side would pass max_size
    max_size: int = 1333  # pixels, as min_size
    # detection training: brightness, contrast and saturation jitter (hue a quarter of it, at most
    # 0.5), applied to 80% of images; 0: off
    color_jitter: float = 0.0
    # detection training: large-scale jitter, each image scaled by lsj_scale, then padded and
    # cropped to a min_size square
    large_scale_jitter: bool = False
    lsj_scale: list[float] = field(default_factory=lambda: [0.1, 2.0])  # its scale range
    aspect_grouping: bool = True  # each batch holds only landscape or only portrait images
    max_bad_images: int = 10  # consecutive unreadable training images before the run stops
    pin_memory: bool = True  # page-locked batches, copied to the GPU without blocking (CUDA only)
    prefetch_factor: int = 2  # batches each loader worker prepares ahead
    # format shards (tools/data.py pack): root is the packed directory or an http(s):// URL
    # shard-aware order: parts of each epoch; a multiple of the nodes, a divisor of the batch;
    # -1: the largest divisor of the batch up to 8 (`data.sampler.shard_streams`)
    streams: int = -1
    # where remote shards are kept; null: $XDG_CACHE_HOME/visiondist/shards
    cache_dir: Optional[str] = None
    # per data set and node: least recently used shards are dropped beyond it
    cache_gb: float = 100.0
    fetch_retries: int = 3  # more attempts per shard before the job ends naming its URL
    # a built-in data set (data=shapes, shapes_coco): how it is generated; null: a real one
    synthetic: Optional[SyntheticConfig] = None


@dataclass
class ParallelConfig:
    """`parallel=<layout>` (configs/parallel/): how the ranks share the model and the batch
    (`visiondist.plan` resolves it), and the figures the planner plans with."""

    name: str = "ddp"  # the layout config's name (configs/parallel/<name>.yaml)
    dp: int = -1  # -1: whatever the world size leaves after tp and pp
    tp: int = 1  # tensor-parallel ranks (inside one node, dividing the heads); 1: off
    pp: int = 1  # pipeline stages over ranks; 1: off
    # Megatron-SP: norms and residuals sharded along tokens (needs tp > 1)
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved_1f1b | zero_bubble
    # virtual pipeline stages per rank; -1: 2 for interleaved_1f1b / zero_bubble, else 1
    stages_per_rank: int = -1
    microbatches: int = -1  # micro-batches per pipeline step (per DP rank); -1: 2 x pp
    # record one pipeline step's timeline (pipeline_timeline.png / .json, the bubble); null: on the
    # CPU yes, on CUDA only when asked (true): it puts two CUDA events around every action of that
    # step
    timeline: Optional[bool] = None
    # shard parameters, gradients and optimizer state over the DP ranks (FSDP2, one unit per block)
    fsdp: bool = False
    # with fsdp: shard inside groups of this many DP ranks and replicate across the groups (HSDP):
    # -1: the ranks of one node (replicate across nodes); 0: every DP rank (plain FSDP)
    shard_size: int = 0
    # with fsdp: shards, gradients and optimizer state in host memory, optimizer on the CPU
    offload: bool = False
    # recompute each block's activations in the backward (keeps its input)
    activation_checkpointing: bool = False
    checkpoint_blocks: int = -1  # selective: only the first N blocks recompute (-1: all of them)
    # input: a block keeps its input | matmuls: also its matmuls' and attention's outputs
    checkpoint_keep: str = "input"
    # a named layout whose plan does not fit the device (its memory, or device_memory_gb): auto adds
    # what fits it at the least cost in the time model (more gradient accumulation, selective or
    # whole-block checkpointing) and says so; refuse stops before any rank starts, naming the
    # settings that fit; off runs it as named (a warning)
    fit: str = "auto"
    # parallel=auto (configs/parallel/auto.yaml, the default option): choose dp / tp / pp / fsdp /
    # offload / activation checkpointing from the memory and time model (DDP whenever it fits);
    # false, as every named layout (parallel=tp2, ...) leaves it: the layout its dp / tp / pp name
    auto: bool = False
    # planning for a GPU this machine does not have: its board by name (h100, a100-40gb, l40s, ...:
    # visiondist/utils/gpus.py), which gives device_memory_gb and device_tflops where they are 0
    gpu: str = ""
    # per device; 0: parallel.gpu's, the GPU's own (CUDA), or host memory / ranks (CPU)
    device_memory_gb: float = 0.0
    # per node, for what offload keeps on the host; 0: this machine's memory
    host_memory_gb: float = 0.0
    num_devices: int = -1  # planning only (tools/plan.py): -1: trainer.devices x parallel.nodes
    # planning only: nodes of num_devices / nodes devices each (TP stays inside a node)
    nodes: int = 1
    # a layout fits when its estimate is at most this fraction of device_memory_gb
    headroom: float = 0.9
    # sustained dense bf16 rate per device, TFLOP/s (time model; ranks layouts, predicts no wall
    # time); 0: 0.4 x the datasheet's of parallel.gpu or this GPU (400 for an H100), else 400
    device_tflops: float = 0.0
    # per-device link bandwidth inside a node, GB/s; 0: parallel.gpu's or this GPU's (NVLink: 300,
    # PCIe 4: 25, PCIe 5: 50), else 300
    intra_node_gbs: float = 0.0
    inter_node_gbs: float = 25.0  # per-device bandwidth between nodes, GB/s (200 Gb/s InfiniBand)
    host_gbs: float = 25.0  # device <-> host copies (offload), GB/s


@dataclass
class OptimConfig:
    """`optim=<name>` (configs/optim/): the optimizer."""

    name: str = "adamw"  # adamw | sgd
    lr: float = 5e-4  # the peak learning rate (after the warmup; the schedule scales it)
    # AdamW's decoupled decay / SGD's L2 term (not on norms, biases, embeddings: decay_norm_bias)
    weight_decay: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's (beta1, beta2)
    eps: float = 1e-8  # AdamW's epsilon
    momentum: float = 0.9  # SGD's momentum
    nesterov: bool = False  # SGD: Nesterov momentum
    # true: weight decay on norms, biases, embeddings too (torchvision's references)
    decay_norm_bias: bool = False
    # layer-wise LR decay (fine-tuning): block i gets lr x layer_decay^(depth - i); 1: off
    layer_decay: float = 1.0
    # optimizer kernels: auto (the fastest torch has on the device) | fused | foreach | loop
    impl: str = "auto"


@dataclass
class ScheduleConfig:
    """`schedule=<name>` (configs/schedule/): the learning rate over the run's optimizer
    steps."""

    name: str = "cosine"  # cosine (down to min_lr_ratio) | step (gamma at each milestone)
    # optimizer steps of linear warmup from warmup_start_factor x lr; 0: none; -1: a fifth of the
    # run's steps, at most warmup_auto_max
    warmup_steps: int = -1
    warmup_auto_max: int = 30  # the most optimizer steps warmup_steps=-1 gives
    warmup_start_factor: float = 0.01  # lr multiplier at step 0 of the warmup
    min_lr_ratio: float = 0.01  # cosine floor, as a fraction of optim.lr
    # step: fractions of the run
    milestones: list[float] = field(default_factory=lambda: [0.66, 0.88])
    gamma: float = 0.1  # step: the lr multiplier at each milestone


@dataclass
class TrainerConfig:
    """`trainer=<name>` (configs/trainer/): the run itself: its devices and length, precision
    and compilation, what it logs and saves, and how it meets faults."""

    accelerator: str = "auto"  # auto (CUDA where a GPU is visible, else the CPU) | cpu | cuda
    devices: int = -1  # ranks per node; -1: all visible GPUs, or what the mesh needs on the CPU
    # a node's ranks on its first GPU, over gloo: a test of a layout's correctness on fewer GPUs
    # than ranks (never faster; NCCL, which refuses two ranks on one GPU, is not what runs). Without
    # it, more ranks than GPUs is refused
    share_gpu: bool = False
    # optimizer steps of the run; the first of max_steps and max_epochs ends it (<= 0: that one off)
    max_steps: int = -1
    max_epochs: int = 3  # passes over the training set
    seed: int = 0  # the run's seed: initial weights, data order, augmentation
    precision: str = "32"  # 32 (or fp32) | bf16 | 16 (or fp16: autocast with dynamic loss scaling)
    # off | tensorwise | rowwise: the blocks' linear layers in float8 (torchao), with precision=bf16
    fp8: str = "off"
    # auto: the layers torchao's filter picks for the recipe | all: every one it can run
    fp8_layers: str = "auto"
    # | mlp: the MLPs' fc1 and fc2 only
    # CUDA: fp32 matmuls / convolutions in TF32 (10-bit mantissa, several times faster); false: ieee
    tf32: bool = True
    # torch.compile: auto (on CUDA) | true | false | model | blocks (see plan.resolve)
    compile: Any = "auto"
    # the compiled model replayed as CUDA graphs: auto (narrow ViTs on one GPU) | true | false
    cuda_graphs: Any = "auto"
    # torch.compile's max-autotune mode: GEMM templates timed against cuBLAS (minutes)
    compile_autotune: bool = False
    # micro-batches accumulated per optimizer step (data.batch_size split among them); 1: none
    grad_accum: int = 1
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    label_smoothing: float = 0.0  # classification cross-entropy: the share spread; 0: none
    ema_decay: float = 0.0  # model EMA, evaluated next to the model (e.g. 0.9998); 0: off
    # evaluate before the first step (e.g. the weights of model.init_from)
    eval_at_start: bool = False
    # optimizer steps between evaluations; 0: at the end of every epoch; -1: at the end of the run
    eval_every: int = 0
    log_every: int = 10  # optimizer steps between log lines
    output_dir: str = "outputs"  # where run dirs are made, relative to the working directory
    run_dir: Optional[str] = None  # default: <output_dir>/<date>/<time>
    progress: bool = True  # rank 0: the live bar in a terminal, evaluation bars and spinners
    # rank 0: curves.png and the per-class (and detectors' val image) PNGs; false: none
    plots: bool = True
    # where rank 0 sends the metrics: csv (metrics.csv, always written), tensorboard, wandb, mlflow
    # (observe/trackers.py; wandb and mlflow are the extras of those names)
    loggers: list[str] = field(default_factory=lambda: ["csv", "tensorboard"])
    project: str = "visiondist"  # the W&B project / MLflow experiment of wandb / mlflow runs
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: by the minutes only
    # minutes of the run between checkpoints (rank 0's clock); 0: off
    checkpoint_every_min: float = 30.0
    keep_last: int = 3  # complete checkpoints kept; 0: all
    # the step waits only for the copy to host memory; the write overlaps training
    checkpoint_async: bool = False
    # also keep the best checkpoint by this evaluation metric (val_top1, val_mAP); null: none
    best_metric: Optional[str] = None
    best_mode: str = "auto"  # auto (min for a loss, else max) | max | min
    # auto: the run dir's latest checkpoint if any | a checkpoint or run dir | null
    resume: Optional[str] = "auto"
    # > 0: checkpoint and end this process after this step (the schedule still spans the run);
    # -1: off
    stop_at_step: int = -1
    # self-launched: restart every rank this many times after a failure (resume=auto)
    max_restarts: int = 0
    # self-launched: after SIGTERM / Ctrl-C, how long the ranks get to finish their step and write a
    # checkpoint before they are ended; -1: 300 s plus the checkpoint's planned size at 50 MB/s
    stop_timeout_s: float = -1.0
    # a collective waiting longer than this fails (after the first step)
    dist_timeout_s: float = 600.0
    startup_timeout_s: float = 1800.0  # the same during start-up (data generation, first step)
    # a non-finite loss or gradient on any rank: raise | skip (the step, on every rank)
    on_nonfinite: str = "raise"
    # continuing a run (trainer.run_dir): allow another model, data or global batch
    allow_changes: bool = False


@dataclass
class BenchConfig:
    """tools/benchmark.py: what to time (the training runs read none of it)."""

    warmup: int = 3  # untimed steps first (allocation, autotuning, compilation)
    # timed steps of each loop per round (a ratio of fewer than 5 steps in all is flagged)
    steps: int = 10
    # rounds over every loop, each round in the reverse order of the last (keep it even)
    rounds: int = 2
    # per configuration, plain-PyTorch loops on timm's model and on ours (single rank)
    baseline: bool = True
    # which of them: reference (timm's model; the transformers model for DETRs), same_model
    # (visiondist's model)
    # a list, or one name
    plain_loops: Any = field(default_factory=lambda: ["reference", "same_model"])
    # also measure the device's dense matmul rate in the run (MFU beside the datasheet's)
    peak: bool = True
    loader_batches: int = 20  # batches of the real train loader timed on their own; 0: skip
    # appends results.jsonl and results.md here; null: the benchmark's run dir
    # (`bench.results_dir=benchmarks` adds the rows to the repository's record,
    # benchmarks/results.md)
    results_dir: Optional[str] = None
    # more configurations timed side by side with the first, each a space-separated list of
    # key=value overrides, e.g. ["trainer.compile=true", "trainer.precision=bf16 optim.impl=fused"]
    # (the layout stays the same)
    variants: list[str] = field(default_factory=list)


@dataclass
class PredictConfig:
    """tools/predict.py: what to predict and what to write (the training runs read none of it)."""

    # an image, a folder (recursively), a glob, a .txt list of paths, or a video file
    source: Optional[str] = None
    # the output folder; null: <run>/predict/<date>_<time>/ (outputs/predict/... for weights=)
    out: Optional[str] = None
    # classifiers: the labels (and probabilities) kept per image, at most the class count
    topk: int = 5
    score_thresh: float = 0.25  # detectors: the detections kept (every output) score at least this
    max_det: int = 100  # detectors: at most this many detections per image, highest scores first
    # detectors: keep only these class names (or COCO category ids)
    classes: Optional[list[str]] = None
    save_images: str = "32"  # the first N images drawn into images/ ("all": every one; "0": none)
    vid_stride: int = 1  # a video: every n-th frame predicted
    batch_size: int = 0  # images per batch over all ranks; 0: data.eval_batch_size
    # detectors: also labels/<image stem>.txt a file an image, in YOLO's form (class cx cy w h
    # score, normalised to the image; class: the position in the trained class names)
    save_txt: bool = False


@dataclass
class TrainConfig:
    """The whole config (configs/train.yaml): a field per config group.

    Attributes:
        model: the network trained (`model=<name>`).
        data: what the ranks read (`data=<name>`).
        parallel: the layout over the ranks (`parallel=<name>`).
        optim: the optimizer (`optim=<name>`).
        schedule: the learning rate over the steps (`schedule=<name>`).
        trainer: the run itself (`trainer=<name>`).
        bench: what tools/benchmark.py times.
        predict: what tools/predict.py predicts and writes.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)


def upgrade_saved(saved: Any) -> Any:
    """A run's config.yaml from before `trainer.loggers` in today's keys: `trainer.tensorboard:
    <bool>` becomes `trainer.loggers` ([csv, tensorboard] or [csv]), so that such a run can still be
    continued. `saved`: a DictConfig, changed in place and returned."""
    trainer = saved.get("trainer") if hasattr(saved, "get") else None
    if trainer is None or "tensorboard" not in trainer:
        return saved
    tensorboard = trainer.pop("tensorboard")
    if "loggers" not in trainer:
        trainer["loggers"] = ["csv", "tensorboard"] if tensorboard else ["csv"]
    return saved
