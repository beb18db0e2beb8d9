"""What a training run says as it starts: the model, layout, precision, batch, length, the machine
and the data, the command that continues it, and the warnings a configuration earns, read off the
trainer's parts before the first step."""

from __future__ import annotations

import logging
from typing import Any

import torch

from visiondist.config.resolution import native_settings
from visiondist.engine.checkpointing import cadence
from visiondist.engine.optim import warmup_length
from visiondist.engine.precision import cpu_has_bf16, precision_name, precision_text
from visiondist.engine.trainer import Trainer
from visiondist.observe.console import continue_command, shown_path
from visiondist.plan.resolve import auto_words
from visiondist.utils.procenv import omp_wait_text, ranks_sharing_cpus, usable_cpus

log = logging.getLogger(__name__)


def _batch_text(tr: Trainer) -> str:
    """The start line's batch: the global batch, or under data.resolution=native the step's tokens
    and images."""
    t, sampler = tr.cfg.trainer, tr.parts.data.train_sampler
    if not hasattr(sampler, "step_images"):
        return (
            f"global batch {tr.cfg.data.batch_size} ({sampler.micro_batch} per rank x "
            f"{t.grad_accum} accumulation)"
        )
    return (
        f"{sampler.tokens_per_step} patch tokens a step (data.batch_size={tr.cfg.data.batch_size} "
        f"square images' worth; {min(sampler.step_images)}-{max(sampler.step_images)} images) "
        f"over {t.grad_accum} accumulation"
    )


def _announce_native(tr: Trainer, sampler: Any) -> None:
    d = tr.cfg.data
    _, eval_len = native_settings(d, tr.cfg.model.img_size, tr.cfg.model.patch_size)
    log.info(
        "native resolution: each image at its own aspect ratio, in sequences of %s patches (one "
        "length a step, drawn from the seed), %d-%d images a step for %d tokens; evaluation at "
        "%d; %s",
        "/".join(map(str, sampler.seq_lens)),
        min(sampler.step_images),
        max(sampler.step_images),
        sampler.tokens_per_step,
        eval_len,
        "several images to a sequence (data.native.pack)"
        if d.native.pack
        else "one image to a sequence, padded (data.native.pack=true packs them)",
    )


def announce(tr: Trainer) -> None:
    """The start-up lines of the trainer `tr`'s run (rank 0 logs them)."""
    t, parts, lay = tr.cfg.trainer, tr.parts, tr.layout
    run = lay.run
    # printed on the console before the run dir existed
    if run is not None and run.chosen_by == "parallel=auto":
        # in the console's words (`plan.resolve.announce`): plain DDP, else the layout
        log.info(
            "parallel=auto chose %s: %s",
            auto_words(run),
            run.reason,
            extra={"file_only": True},
        )
    if run is not None and run.fitted:
        log.info(run.fitted, extra={"file_only": True})
    log.info(
        "model %s: %.2fM parameters (%.2fM on this rank) | layout %s | precision %s | %s | %d "
        "step%s (%s)",
        tr.cfg.model.name,
        parts.num_params / 1e6,
        parts.rank_params / 1e6,
        layout_text(tr),
        precision_text(t, lay.device, parts.model),
        _batch_text(tr),
        parts.total_steps,
        "" if parts.total_steps == 1 else "s",
        parts.length,
    )
    if lay.is_main:  # the default run dir is new each time: the same command would start afresh
        _announce_continuing(tr, bool(run is not None and run.under_torchrun))
    _announce_machine(tr)
    _announce_data(tr)
    s, warmup = tr.cfg.schedule, warmup_length(tr.cfg.schedule, parts.total_steps)
    if warmup < s.warmup_steps and lay.is_main:
        log.warning(
            "schedule.warmup_steps=%d is not shorter than the run (%d step%s): the warmup is cut "
            "to %d step%s; set schedule.warmup_steps below the run's steps",
            s.warmup_steps,
            parts.total_steps,
            "" if parts.total_steps == 1 else "s",
            warmup,
            "" if warmup == 1 else "s",
        )
    if lay.world_size > 1:
        nodes = len(set(lay.nodes))
        log.info(
            "mesh (pp, dp, tp) over %d node%s: %s",
            nodes,
            "s" if nodes > 1 else "",
            "; ".join(lay.placement()),
        )
    if parts.pipeline is not None:
        log.info("%s", parts.pipeline.describe())


def layout_text(tr: Trainer) -> str:
    """The run's layout as the start-up line and the summary give it."""
    return tr.layout.run.describe() if tr.layout.run is not None else "one process"


def _announce_continuing(tr: Trainer, under_torchrun: bool) -> None:
    """How the run continues if it dies or is stopped: the command, and how far back it would go."""
    t = tr.cfg.trainer
    command = continue_command(tr.run_dir, under_torchrun)
    every = cadence(t)
    if every:
        log.info(
            "run dir %s: if the job dies (a crash, a kill, a lost node), %s continues it from its "
            "newest checkpoint (%s)",
            shown_path(tr.run_dir),
            command,
            every,
        )
    else:
        log.info(
            "run dir %s: a checkpoint is written when the run ends or is stopped (SIGTERM, "
            "Ctrl-C), not during it (trainer.checkpoint_every_min=0): %s continues a stopped job; "
            "one that dies outright starts again at step 1 unless trainer.checkpoint_every_min="
            "<minutes> or trainer.checkpoint_every=<steps> is set",
            shown_path(tr.run_dir),
            command,
        )


def _announce_machine(tr: Trainer) -> None:
    """The CPU's threads, and the length and precision settings that will not do what they say
    here."""
    t, lay = tr.cfg.trainer, tr.layout
    if lay.device.type == "cpu":
        log.info(
            "CPU: %d thread%s per rank; OpenMP's waiting threads %s%s",
            torch.get_num_threads(),
            "" if torch.get_num_threads() == 1 else "s",
            omp_wait_text(),
            _crowded_text(ranks_sharing_cpus(lay.run.per_node if lay.run else 1), usable_cpus()),
        )
    if precision_name(t.precision) == "16" and lay.device.type == "cpu":
        log.warning(
            "trainer.precision=16 on the CPU: CPUs have no fp16 matrix units, so a step takes "
            "many times the fp32 one (18.9x for ViT-Ti on 2 AMD EPYC cores, "
            "benchmarks/RESULTS.md); fp16 is for GPUs without bf16 (V100, T4): here use "
            "trainer.precision=bf16 or 32"
        )
    if precision_name(t.precision) == "bf16" and lay.device.type == "cpu" and not cpu_has_bf16():
        log.warning(
            "trainer.precision=bf16 on a CPU without bf16 instructions (AVX512-BF16, AMX): torch "
            "emulates bf16 matmuls, a ViT-Ti DeiT step took over 8x the fp32 one; on this machine "
            "use trainer.precision=32"
        )


def _crowded_text(ranks: int, cpus: int) -> str:
    """What ranks sharing fewer CPUs than they are mean ("" where each has one of its own)."""
    if ranks <= cpus:
        return ""
    return (
        f"; {ranks} ranks on {cpus} CPU{'s' if cpus > 1 else ''} take turns: the layout computes "
        "what it computes on GPUs (the same losses and weights), its step times say nothing of "
        "its speed there"
    )


def _announce_data(tr: Trainer) -> None:
    """The images an epoch leaves for the next, and how a native-resolution run reads its images."""
    data = tr.parts.data
    sampler = data.train_sampler
    if getattr(sampler, "joined", 0):
        log.info(
            "data.aspect_grouping: %d images of an aspect group smaller than a global batch of %d "
            "are batched with the largest group, so that no group is left out for its size",
            sampler.joined,
            tr.cfg.data.batch_size,
        )
    if sampler.dropped_per_epoch:
        batches = (
            f"{sampler.steps_per_epoch} global batches of {tr.cfg.data.batch_size}"
            if not hasattr(sampler, "step_images")
            else f"{sampler.steps_per_epoch} native steps of "
            f"{min(sampler.step_images)}-{max(sampler.step_images)} images"
        )
        log.info(
            "training uses %d of %d images per epoch (%s): %d left out of each epoch, a different "
            "random %d each time%s",
            data.num_train - sampler.dropped_per_epoch,
            data.num_train,
            batches,
            sampler.dropped_per_epoch,
            sampler.dropped_per_epoch,
            " (incomplete aspect-ratio batches)" if sampler.groups is not None else "",
        )
    if hasattr(sampler, "step_images"):  # data.resolution=native
        _announce_native(tr, sampler)
