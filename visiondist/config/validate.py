"""Validation: everything a type cannot say, one check per config group, each raising a
`ConfigError` with the value, the reason and the fix. What a model family supports (TP, pipelines,
FSDP, ...) is its `ModelSpec`'s to say (`visiondist.models.registry.check_support`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from visiondist.config.layout import SCHEDULES
from visiondist.config.model_checks import check_model
from visiondist.config.resolution import check_native
from visiondist.config.rules import one_of, positive
from visiondist.config.schema import DETECTION_FORMATS, ConfigError
from visiondist.utils.dcp import step_of
from visiondist.utils.gpus import board_named

# --------------------------------------------------------------------------------------------------
# Validation: everything a type cannot say. Each check raises with the value, the reason and the
# fix.

_ACCELERATORS = ("auto", "cpu", "cuda")
_PRECISIONS = ("32", "bf16", "16")
_OPTIMIZERS = ("adamw", "sgd")
_SCHEDULES = ("cosine", "step")
# trainer.loggers: metrics.csv (always written: the summary and the plots read it), TensorBoard, and
# the experiment trackers, each an optional package installed by the extra of its name
# (visiondist/observe/trackers.py)
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
# tracker -> the module it imports (the extra has its name)
TRACKERS = {"wandb": "wandb", "mlflow": "mlflow"}


def check_mandatory(cfg: DictConfig) -> None:
    """Every `???` value has been given (e.g. `data.root` of data=imagenet / coco).

    Args:
        cfg: a composed config.

    Raises:
        ConfigError: naming each missing key and a value to give it.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        example = {"data.root": f"/path/to/{cfg.data.get('name') or 'data'}"}
        fix = " ".join(f"{key}={example.get(key, '<value>')}" for key in missing)
        raise ConfigError(f"{', '.join(missing)} must be set (??? in the config): add {fix}")


def validate(cfg: DictConfig, mandatory: bool = True) -> None:
    """Check a composed config on its own (no devices, no model family's capabilities: those are
    `visiondist.models.registry.check_support`'s). Raises ConfigError. `mandatory=False`: `???`
    values may stay unset (printing the config, planning a layout: nothing reads the data).

    Args:
        cfg: a composed config.
        mandatory: every `???` value must be given.

    Raises:
        ConfigError: the first rule the config breaks, naming the fix.
    """
    if mandatory:
        check_mandatory(cfg)
    check_model(cfg.model)
    _check_data(cfg.data)
    _check_optim(cfg.optim)
    _check_schedule(cfg.schedule)
    _check_trainer(cfg.trainer)
    _check_parallel(cfg.parallel)
    _check_across(cfg)
    _check_bench(cfg)


def _check_data(d: DictConfig) -> None:
    one_of("data.format", d.format, ("imagefolder", "shards", *DETECTION_FORMATS))
    one_of("data.auto_augment", d.auto_augment, ("none", "rand", "trivial"))
    one_of("data.interpolation", d.interpolation, ("bilinear", "bicubic"))
    one_of("data.augment_on", d.augment_on, ("device", "loader"))
    one_of("data.decode_on", d.decode_on, ("auto", "loader", "device"))
    if d.decode_on == "device" and d.augment_on == "loader" and d.auto_augment != "none":
        raise ConfigError(
            "data.decode_on=device leaves the images encoded until they reach the device, where "
            "data.augment_on=loader cannot augment them: use data.augment_on=device"
        )
    if d.decode_on == "device" and d.format not in ("imagefolder", "shards"):
        raise ConfigError(
            f"data.decode_on=device decodes ImageFolder training images; data.format={d.format} "
            "decodes in the loader: use data.decode_on=loader"
        )
    one_of("data.random_erasing_mode", d.random_erasing_mode, ("pixel", "rand", "const"))
    if not 0 <= d.random_erasing <= 1:
        raise ConfigError(
            f"data.random_erasing={d.random_erasing} is a probability per image: use a value in "
            "[0, 1] (DeiT's recipe: 0.25)"
        )
    positive("data.prefetch_factor", d.prefetch_factor)
    if d.format == "shards" and d.streams != -1:
        positive("data.streams", d.streams)
    for key in ("mixup", "cutmix"):
        positive(f"data.{key}", d[key], allow_zero=True)
    positive("data.batch_size", d.batch_size)
    positive("data.eval_batch_size", d.eval_batch_size)
    if d.num_workers < -1:
        raise ConfigError(
            f"data.num_workers={d.num_workers}: use a count of loader workers per rank, 0 (the "
            "rank loads its batches itself) or -1 (as many as the cores per rank allow, at most "
            "16)"
        )


def _check_optim(o: DictConfig) -> None:
    one_of("optim", o.name, _OPTIMIZERS)
    one_of("optim.impl", o.impl, ("auto", "fused", "foreach", "loop"))
    positive("optim.lr", o.lr)
    if not 0 < o.layer_decay <= 1:
        raise ConfigError(f"optim.layer_decay={o.layer_decay} must be in (0, 1] (1: off)")
    positive("optim.weight_decay", o.weight_decay, allow_zero=True)


def _check_schedule(s: DictConfig) -> None:
    one_of("schedule", s.name, _SCHEDULES)
    if s.warmup_steps < -1:
        raise ConfigError(
            f"schedule.warmup_steps={s.warmup_steps}: give a count of steps, 0 (no warmup) or -1 "
            "(a fifth of the run, at most schedule.warmup_auto_max)"
        )
    positive("schedule.warmup_auto_max", s.warmup_auto_max, allow_zero=True)
    if not 0 <= s.min_lr_ratio <= 1:
        raise ConfigError(f"schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")


def _check_trainer(t: DictConfig) -> None:
    one_of("trainer.accelerator", t.accelerator, _ACCELERATORS)
    if str(t.precision) not in _PRECISIONS:  # compose() makes fp32 / fp16 32 / 16
        raise ConfigError(
            f"trainer.precision={t.precision!r} is not supported: use one of 32 (or fp32), bf16, "
            "16 (or fp16: autocast with loss scaling)"
        )
    one_of("trainer.on_nonfinite", t.on_nonfinite, ("raise", "skip"))
    one_of("trainer.fp8", t.fp8, ("off", "tensorwise", "rowwise"))
    one_of("trainer.fp8_layers", t.fp8_layers, ("auto", "all", "mlp"))
    if t.fp8 != "off" and str(t.precision) != "bf16":
        raise ConfigError(
            f"trainer.fp8={t.fp8} runs the blocks' linear layers in float8 and the rest in bf16: "
            f"set trainer.precision=bf16 too (not {t.precision})"
        )
    if t.compile not in (True, False, "auto", "model", "blocks"):
        raise ConfigError(
            f"trainer.compile={t.compile!r}: use auto (compile on CUDA), true, false, model (the "
            "whole model in one graph) or blocks (each transformer block)"
        )
    if t.cuda_graphs not in (True, False, "auto"):
        raise ConfigError(f"trainer.cuda_graphs={t.cuda_graphs!r}: use auto, true or false")
    if t.cuda_graphs is True and t.compile is False:
        raise ConfigError(
            "trainer.cuda_graphs=true replays the compiled model: drop trainer.compile=false"
        )
    if t.get("compile_autotune", False) and t.compile is False:
        raise ConfigError(
            "trainer.compile_autotune=true tunes the compiled kernels: drop trainer.compile=false"
        )
    unknown = [name for name in t.loggers if name not in LOGGERS]
    if unknown:
        raise ConfigError(
            f"trainer.loggers has {', '.join(map(repr, unknown))}: use any of "
            f"{', '.join(LOGGERS)}, e.g. trainer.loggers=[csv,tensorboard,wandb]"
        )
    positive("trainer.max_restarts", t.max_restarts, allow_zero=True)
    if t.max_restarts > 0 and t.resume != "auto":
        raise ConfigError(
            f"trainer.max_restarts={t.max_restarts} restarts from the run's latest checkpoint: "
            f"keep trainer.resume=auto (not {t.resume})"
        )
    positive("trainer.dist_timeout_s", t.dist_timeout_s)
    positive("trainer.startup_timeout_s", t.startup_timeout_s)
    if not 0 <= t.label_smoothing < 1:
        raise ConfigError(f"trainer.label_smoothing={t.label_smoothing} must be in [0, 1)")
    if not 0 <= t.ema_decay < 1:
        raise ConfigError(
            f"trainer.ema_decay={t.ema_decay} must be in [0, 1) (0: off), e.g. 0.9998"
        )
    for key in ("grad_accum", "log_every"):
        positive(f"trainer.{key}", t[key])
    for key in ("clip_grad", "checkpoint_every", "keep_last"):
        positive(f"trainer.{key}", t[key], allow_zero=True)
    if t.eval_every != -1:
        positive(
            "trainer.eval_every",
            t.eval_every,
            allow_zero=True,
            fix="give the optimizer steps between evaluations, 0 (every epoch) or -1 (only at the "
            "end of the run)",
        )
    positive(
        "trainer.checkpoint_every_min",
        float(t.get("checkpoint_every_min", 0)),
        allow_zero=True,
        fix="give the minutes between checkpoints, e.g. 30 (0: only at the end of the run and on "
        "a stop)",
    )
    one_of("trainer.best_mode", t.best_mode, ("auto", "max", "min"))
    if t.resume not in (None, "auto") and not Path(str(t.resume)).expanduser().exists():
        raise ConfigError(
            f"trainer.resume={t.resume}: no such checkpoint or run directory "
            f"(give checkpoints/step_<N> or a run dir, `auto`, or null){_steps_beside(t.resume)}"
        )
    if t.max_steps <= 0 and t.max_epochs <= 0:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs to a positive number")


def _steps_beside(resume: object) -> str:
    """'; <run>/checkpoints holds step_3, step_6' for a checkpoint step that is not among them."""
    asked = Path(str(resume)).expanduser()
    folder = asked.parent
    if step_of(asked) is None or not folder.is_dir():
        return ""
    steps = sorted(s for p in folder.iterdir() if (s := step_of(p)) is not None)
    held = ", ".join(f"step_{s}" for s in steps)
    return f"; {folder} holds {held}" if steps else f"; {folder} holds no checkpoint"


def check_trackers_installed(loggers) -> None:
    """Each tracker in `loggers` (trainer.loggers) can be imported here; else one line naming the
    extra that installs it. Looked up without importing it (find_spec), so that the check costs
    nothing before the ranks start."""
    for name in dict.fromkeys(loggers):
        module = TRACKERS.get(name)
        if module is None:
            continue
        if module in sys.modules:
            found = sys.modules[module] is not None  # None: imports of it are refused
        else:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            raise ConfigError(
                f"trainer.loggers has {name} but {module} is not installed: "
                f'pip install -e ".[{name}]" (or drop {name} from trainer.loggers)'
            )


FIT_MODES = ("auto", "refuse", "off")  # parallel.fit: visiondist.plan.fit


def _check_parallel(p: DictConfig) -> None:
    one_of("parallel.schedule", p.schedule, SCHEDULES)
    for key in ("tp", "pp"):
        positive(f"parallel.{key}", p[key])
    if p.dp != -1:
        positive("parallel.dp", p.dp)
    if p.checkpoint_blocks != -1:
        positive("parallel.checkpoint_blocks", p.checkpoint_blocks)
        if not p.activation_checkpointing:
            raise ConfigError(
                f"parallel.checkpoint_blocks={p.checkpoint_blocks} selects the blocks that "
                "recompute: set parallel.activation_checkpointing=true too"
            )
    one_of("parallel.checkpoint_keep", p.checkpoint_keep, ("input", "matmuls"))
    if p.checkpoint_keep != "input" and not p.activation_checkpointing:
        raise ConfigError(
            f"parallel.checkpoint_keep={p.checkpoint_keep} says what checkpointed blocks keep: set "
            "parallel.activation_checkpointing=true too"
        )
    if p.fsdp and (p.tp > 1 or p.pp > 1):
        raise ConfigError(
            f"parallel.fsdp=true shards over data parallel and does not combine with tp={p.tp} / "
            f"pp={p.pp} here: use parallel.fsdp=false, or tp=1 and pp=1"
        )
    if p.shard_size and not p.fsdp:
        raise ConfigError(
            f"parallel.shard_size={p.shard_size} sets FSDP's shard groups (HSDP): set "
            "parallel.fsdp=true too"
        )
    if p.shard_size < -1:
        raise ConfigError(
            f"parallel.shard_size={p.shard_size}: use -1 (one node), 0 (every DP rank) or a group "
            "size"
        )
    if p.offload and not p.fsdp:
        raise ConfigError(
            "parallel.offload=true moves FSDP's shards to host memory: set parallel.fsdp=true too"
        )
    for key in (
        "device_memory_gb",
        "host_memory_gb",
        "device_tflops",
        "intra_node_gbs",
        "inter_node_gbs",
        "host_gbs",
    ):
        # 0: from the board (parallel.gpu or this machine's GPU)
        zero_ok = key.endswith("memory_gb") or key in ("device_tflops", "intra_node_gbs")
        positive(f"parallel.{key}", p[key], allow_zero=zero_ok)
    if p.get("gpu"):
        try:
            board_named(str(p.gpu))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    positive("parallel.nodes", p.nodes)
    one_of("parallel.fit", p.fit, FIT_MODES)
    if not 0 < p.headroom <= 1:
        raise ConfigError(f"parallel.headroom={p.headroom} must be in (0, 1]")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=true needs parallel.tp > 1 (it shards tokens across the "
            "TP group)"
        )


def _check_across(cfg: DictConfig) -> None:
    """Rules between groups that hold for every model family."""
    p, t = cfg.parallel, cfg.trainer
    check_native(cfg)
    if t.compile in (True, "model", "blocks") and p.pp > 1 and p.schedule == "zero_bubble":
        raise ConfigError(
            f"trainer.compile={str(t.compile).lower()} with parallel.schedule=zero_bubble: the "
            "schedule splits each block's backward into input and weight gradients, which a "
            "compiled block's backward cannot do; use parallel.schedule=1f1b or "
            "interleaved_1f1b, or drop trainer.compile"
        )
    if t.fp8 != "off":
        if p.tp > 1:
            raise ConfigError(
                f"trainer.fp8={t.fp8} with parallel.tp={p.tp}: float8 layers are not tensor "
                "parallel here; use DDP, FSDP or a pipeline (parallel.tp=1), or drop trainer.fp8"
            )
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError(
                f"trainer.fp8={t.fp8} trains in float8 with torchao, which is not installed: "
                "pip install -e '.[fp8]' (or pip install torchao)"
            )


def _check_bench(cfg: DictConfig) -> None:
    b = cfg.bench
    positive("bench.warmup", b.warmup, allow_zero=True)
    positive("bench.steps", b.steps)
    positive("bench.rounds", b.rounds)
    # each variant: `variant_config`
    positive("bench.loader_batches", b.loader_batches, allow_zero=True)
    # bench.plain_loops=reference
    loops = [b.plain_loops] if isinstance(b.plain_loops, str) else b.plain_loops
    unknown = [str(r) for r in loops if r not in ("reference", "same_model")]
    if unknown:
        raise ConfigError(
            f"bench.plain_loops has {', '.join(unknown)}: use reference (timm's model, or "
            "transformers' for a DETR) and / or same_model (visiondist's model), e.g. "
            "bench.plain_loops=[reference]"
        )
