"""What a training run says: the start-up lines (model, layout, precision, batch, length, and the
warnings a configuration earns) and the summary of a finished run (the table and summary.json that
`visiondist.observe.summary.report_run` writes), read off the trainer's parts and its loop state."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from visiondist.checkpoint.files import read_best
from visiondist.config.resolution import native_settings
from visiondist.data.device_decode import WORKER_DECODED, count_worker_decoded, decoder_name
from visiondist.data.robust import count_bad_images
from visiondist.data.shards.store import is_url
from visiondist.engine.checkpointing import cadence
from visiondist.engine.optim import warmup_length
from visiondist.engine.precision import cpu_has_bf16, precision_name, precision_text
from visiondist.engine.trainer import Trainer
from visiondist.observe.console import continue_command, shown_path
from visiondist.observe.summary import best_evaluation
from visiondist.utils.dcp import CHECKPOINTS
from visiondist.utils.procenv import omp_wait_text

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
        log.info(
            "parallel=auto chose %s: %s", run.describe(), run.reason, extra={"file_only": True}
        )
    if run is not None and run.fitted:
        log.info(run.fitted, extra={"file_only": True})
    log.info(
        "model %s: %.2fM parameters (%.2fM on this rank) | layout %s | precision %s | %s | %d "
        "step%s (%s)",
        tr.cfg.model.name,
        parts.num_params / 1e6,
        parts.rank_params / 1e6,
        _layout_text(tr),
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


def _layout_text(tr: Trainer) -> str:
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
            "CPU: %d thread%s per rank; OpenMP's waiting threads %s",
            torch.get_num_threads(),
            "" if torch.get_num_threads() == 1 else "s",
            omp_wait_text(),
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


def _announce_data(tr: Trainer) -> None:
    """The images an epoch leaves for the next, and how a native-resolution run reads its images."""
    data = tr.parts.data
    sampler = data.train_sampler
    if getattr(sampler, "joined", 0):
        log.info(
            "data.aspect_grouping: %d images of an aspect group smaller than a global batch of %d "
            "are batched with the largest group, so that every image is trained",
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


def run_summary(tr: Trainer, train_time: float) -> dict[str, Any]:
    """The summary of a finished run (table, summary.json): the trainer `tr`'s figures, its task's
    last evaluation. `train_time`: this process's training seconds."""
    state, parts, lay = tr.state, tr.parts, tr.layout
    final_loss = state.final_loss
    # nothing trained in this process (resumed at the end): the run's last logged loss
    if math.isnan(final_loss):
        final_loss = next(
            (r["loss"] for r in reversed(tr.metrics.rows) if r.get("loss") is not None), math.nan
        )
    started = state.resumed.step
    ran = state.step - started
    sampler, data = parts.data.train_sampler, parts.data
    earlier = state.resumed.earlier_seconds
    whole = earlier + train_time if earlier is not None else None  # every attempt's

    def rate(steps: int, seconds: float | None) -> float | None:
        return (
            float(f"{sampler.images(state.step - steps, state.step) / seconds:.3g}")
            if steps and seconds
            else None
        )

    return {
        "model": tr.cfg.model.name,
        "parameters (M)": round(parts.num_params / 1e6, 3),
        "parameters per rank (M)": round(parts.rank_params / 1e6, 3),
        "layout": _layout_text(tr),
        "precision": precision_text(tr.cfg.trainer, lay.device, parts.model),
        "data": f"{tr.cfg.data.name}"
        + (f" ({tr.cfg.data.found})" if tr.cfg.data.get("found") else "")
        + f": {data.num_train} train / {data.num_val} val images"
        + (f" (shards of {tr.cfg.data.root})" if tr.cfg.data.get("format") == "shards" else ""),
        **parts.task.input_fields,  # the resolution (native: the resolved sequence lengths)
        "steps": state.step,
        "epochs": float(f"{state.step / sampler.steps_per_epoch:.3g}"),
        # the whole run's, over its attempts
        "train time (s)": round(whole, 1) if whole is not None else None,
        "throughput (img/s)": rate(state.step, whole),
        **(
            {
                "this attempt": f"steps {started + 1}-{state.step}: {train_time:.1f} s, "
                f"{rate(ran, train_time)} img/s"
            }
            if started
            else {}
        ),
        **_steady_state(tr),
        "final train loss": None if math.isnan(final_loss) else final_loss,
        **best_evaluation(tr.metrics.rows, *parts.task.headline),
        **_step_counts(tr),
        **_input_rows(tr),
        **_layout_rows(tr),
        **parts.task.summary(state.last_eval),
        **(
            {"peak GPU memory (GiB)": round(peak, 2)}
            if (peak := tr.utilisation.peak_gpu_gib()) is not None
            else {}
        ),
        **_checkpoint_rows(tr),
        "weights": str(state.weights),
        "run dir": str(tr.run_dir),
    }


def _step_counts(tr: Trainer) -> dict[str, Any]:
    """The steps skipped (non-finite, fp16 overflow) and fp16's loss scale."""
    state, scaler = tr.state, tr.parts.scaler
    return {
        **({"skipped steps (non-finite)": state.skipped_steps} if state.skipped_steps else {}),
        **({"skipped steps (fp16 overflow)": state.overflow_steps} if state.overflow_steps else {}),
        **({"fp16 loss scale": _exact(scaler.get_scale())} if scaler is not None else {}),
    }


def _input_rows(tr: Trainer) -> dict[str, Any]:
    """What the input path met: unreadable images, the device's decoding, masks left out, shards
    fetched."""
    return {
        **(
            {"unreadable train images (replaced)": bad}
            if (bad := count_bad_images(tr.run_dir))
            else {}
        ),
        **_device_decoding(tr),
        **_without_masks(tr),
        **_shard_fetches(tr),
    }


def _layout_rows(tr: Trainer) -> dict[str, Any]:
    """The traffic a step moves between ranks, and the pipeline's schedule and bubble."""
    state, pipe = tr.state, tr.parts.pipeline
    return {
        **(
            {"TP traffic per step (MB)": round(state.tp_bytes_per_step / 1e6, 2)}
            if state.tp_bytes_per_step
            else {}
        ),
        **(
            {"PP traffic per step (MB)": round(state.pp_bytes_per_step / 1e6, 2)}
            if state.pp_bytes_per_step
            else {}
        ),
        **(
            {"pipeline": f"{pipe.schedule_name}, {pipe.microbatches} micro-batches"}
            if pipe is not None
            else {}
        ),
        **(
            {"pipeline bubble (%)": round(100 * state.bubble, 1)}
            if state.bubble is not None
            else {}
        ),
    }


def _checkpoint_rows(tr: Trainer) -> dict[str, Any]:
    """The newest checkpoint, how long saving held training up, and the best checkpoint kept."""
    checkpoints = tr.checkpoints
    stall = checkpoints.stall_s
    return {
        "checkpoint": str(checkpoints.last_checkpoint),
        **({"checkpoint stall (s, mean)": round(sum(stall) / len(stall), 3)} if stall else {}),
        **_best_row(tr),
    }


def _steady_state(tr: Trainer) -> dict[str, Any]:
    """The rate of this process's log windows after its first (which holds the start-up:
    compilation, autotuning, the loader's first batches), timed on the device, and its MFU on a
    known GPU; nothing with a single window."""
    steady = tr.state.timer.steady_state() if tr.state.timer is not None else None
    if steady is None:
        return {}
    first, last, seconds = steady
    rate = tr.parts.data.train_sampler.images(first - 1, last) / seconds
    mfu = tr.utilisation.mfu(rate)
    wait = _steady_wait(tr, first, last)
    waited = {} if wait is None else {"waiting for data, steady state (%)": round(100 * wait, 1)}
    return {
        "throughput, steady state (img/s)": float(f"{rate:.4g}"),
        "steady state": f"steps {first}-{last} (the log windows after the first)",
        **({"MFU, steady state (%)": round(100 * mfu, 1)} if mfu is not None else {}),
        **waited,
    }


def _steady_wait(tr: Trainer, first: int, last: int) -> Optional[float]:
    """The share of steps `first` to `last` spent waiting for data: metrics.csv's log lines' shares
    of their windows, weighted by the windows' steps; None without a line."""
    rows = [
        r
        for r in tr.metrics.rows
        if r.get("data_wait") is not None and first <= r.get("step", 0) <= last
    ]
    if not rows:
        return None
    before = [first - 1, *(r["step"] for r in rows)]
    waited = sum(r["data_wait"] * (r["step"] - b) for b, r in zip(before, rows))
    return waited / (rows[-1]["step"] - (first - 1))


def _best_row(tr: Trainer) -> dict[str, Any]:
    """`trainer.best_metric`: the best checkpoint the run kept (this process's or, resumed, an
    earlier one's)."""
    best = tr.state.best or (read_best(tr.run_dir) if tr.cfg.trainer.best_metric else None)
    if not best:
        return {}
    return {
        f"best {best['metric']}": f"{best['value']:.6g} at step {best['step']}",
        "best checkpoint": str(tr.run_dir / CHECKPOINTS / f"step_{best['step']}"),
    }


def _device_decoding(tr: Trainer) -> dict[str, Any]:
    """data.decode_on=device: how many of rank 0's training images the device decoded, and with
    what."""
    count = getattr(tr.parts.task, "worker_decoded", None)
    if count is None or not count.images:
        return {}
    files = count_worker_decoded(tr.run_dir)
    named = (
        (
            f" ({files} file{'s' if files != 1 else ''} of any rank, training's and evaluation's, "
            f"in {WORKER_DECODED}; a training file counts each time it is read)"
        )
        if files
        else ""
    )
    return {
        "decode_on=device (rank 0)": f"{count.images - count.fallbacks} of {count.images} images "
        f"by {decoder_name(tr.layout.device)}, {count.fallbacks} in "
        f"the loader workers{named}"
    }


def _without_masks(tr: Trainer) -> dict[str, Any]:
    """A mask model on COCO: the training instances left out for want of a valid segmentation."""
    counts = getattr(
        getattr(getattr(tr.parts.data, "train_loader", None), "dataset", None), "counts", None
    )
    without_mask = getattr(counts, "without_mask", 0)
    if not without_mask:
        return {}
    return {"instances without a valid mask (left out)": without_mask}


def _shard_fetches(tr: Trainer) -> dict[str, Any]:
    """data.format=shards from a URL: the MB of shards and indexes each DP rank (with its loader
    workers) fetched into its node's cache, gathered from every rank (a collective: every rank
    builds the summary). A directory is read in place: nothing fetched, no row."""
    if tr.cfg.data.get("format") != "shards" or not is_url(str(tr.cfg.data.root)):
        return {}
    store = getattr(tr.parts.data, "store", None)
    mine = round(store.fetched.value / 1e6, 3) if store is not None else 0.0
    every: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    return {"shard MB fetched per rank": every}


def _exact(value: float) -> float | int:
    """A whole number as an int (the summary table prints floats to 4 digits: 65536, not
    6.554e+04)."""
    return int(value) if value.is_integer() else value
