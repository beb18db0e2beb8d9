"""What the trainer says about its run: the start-up lines (model, layout, precision, batch, length, and the
warnings a configuration earns) and the summary of a finished run (the table and summary.json that
`visiondist.observe.summary.report_run` writes), read off the trainer's figures."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from visiondist.checkpoint.files import read_best
from visiondist.observe.summary import best_evaluation
from visiondist.train.optim import warmup_length
from visiondist.train.precision import cpu_has_bf16, precision_name, precision_text
from visiondist.utils.dcp import CHECKPOINTS
from visiondist.utils.procenv import omp_wait_text

log = logging.getLogger(__name__)


def _batch_text(tr) -> str:
    """The start line's batch: the global batch, or under data.resolution=native the step's tokens and images."""
    t, sampler = tr.cfg.trainer, tr.data.train_sampler
    if not hasattr(sampler, "step_images"):
        return f"global batch {tr.cfg.data.batch_size} ({sampler.micro_batch} per rank x {t.grad_accum} accumulation)"
    return (f"{sampler.tokens_per_step} patch tokens a step (data.batch_size={tr.cfg.data.batch_size} square images' "
            f"worth; {min(sampler.step_images)}-{max(sampler.step_images)} images) over {t.grad_accum} accumulation")


def _announce_native(tr, sampler) -> None:
    from visiondist.config.native import native_settings

    d = tr.cfg.data
    _, eval_len = native_settings(d, tr.cfg.model.img_size, tr.cfg.model.patch_size)
    log.info("native resolution: each image at its own aspect ratio, in sequences of %s patches (one length a step, "
             "drawn from the seed), %d-%d images a step for %d tokens; evaluation at %d; %s",
             "/".join(map(str, sampler.seq_lens)), min(sampler.step_images), max(sampler.step_images),
             sampler.tokens_per_step, eval_len, "several images to a sequence (data.native.pack)"
             if d.native.pack else "one image to a sequence, padded (data.native.pack=true packs them)")


def announce(tr) -> None:
    """The start-up lines of the trainer `tr`'s run (rank 0 logs them)."""
    t, sampler = tr.cfg.trainer, tr.data.train_sampler
    run = getattr(tr.layout, "run", None)
    if run is not None and run.chosen_by == "parallel=auto":  # printed on the console before the run dir existed
        log.info("parallel=auto chose %s: %s", tr.layout_text, run.reason, extra={"file_only": True})
    if run is not None and run.fitted:
        log.info(run.fitted, extra={"file_only": True})
    log.info("model %s: %.2fM parameters (%.2fM on this rank) | layout %s | precision %s | %s | %d step%s (%s)",
             tr.cfg.model.name, tr.num_params / 1e6, tr.rank_params / 1e6, tr.layout_text,
             precision_text(t, tr.layout.device, tr.model), _batch_text(tr), tr.total_steps,
             "" if tr.total_steps == 1 else "s", tr.length)
    if tr.layout.is_main:  # the default run dir is new each time: the same command would start afresh
        from visiondist.observe.console import continue_command, shown_path

        command = continue_command(tr.run_dir, bool(run is not None and run.under_torchrun))
        if t.checkpoint_every > 0:
            log.info("run dir %s: if the job dies (a crash, a kill, a lost node), %s continues it from its newest "
                     "checkpoint (one every %d steps)", shown_path(tr.run_dir), command, t.checkpoint_every)
        else:
            log.info("run dir %s: a checkpoint is written when the run ends or is stopped (SIGTERM, Ctrl-C), not "
                     "during it (trainer.checkpoint_every=0): %s continues a stopped job; one that dies outright "
                     "starts again at step 1 unless trainer.checkpoint_every=<steps> is set", shown_path(tr.run_dir),
                     command)
    if tr.layout.device.type == "cpu":
        log.info("CPU: %d thread%s per rank; OpenMP's waiting threads %s", torch.get_num_threads(),
                 "" if torch.get_num_threads() == 1 else "s", omp_wait_text())
    if t.max_steps > tr.total_steps and tr.layout.is_main:
        log.warning("trainer.max_steps=%d is not reached: %s; raise trainer.max_epochs (or set it to 0) to train "
                    "%d steps", t.max_steps, tr.length, t.max_steps)
    if precision_name(t.precision) == "16" and tr.layout.device.type == "cpu":
        log.warning("trainer.precision=16 on the CPU: CPUs have no fp16 matrix units, so a step takes many times "
                    "the fp32 one (18.9x for ViT-Ti on 2 AMD EPYC cores, benchmarks/RESULTS.md); fp16 is for GPUs "
                    "without bf16 (V100, T4): here use trainer.precision=bf16 or 32")
    if precision_name(t.precision) == "bf16" and tr.layout.device.type == "cpu" and not cpu_has_bf16():
        log.warning("trainer.precision=bf16 on a CPU without bf16 instructions (AVX512-BF16, AMX): torch emulates "
                    "bf16 matmuls, a ViT-Ti DeiT step took over 8x the fp32 one; on this machine use "
                    "trainer.precision=32")
    if sampler.dropped_per_epoch:
        batches = (f"{sampler.steps_per_epoch} global batches of {tr.cfg.data.batch_size}"
                   if not hasattr(sampler, "step_images") else f"{sampler.steps_per_epoch} native steps of "
                   f"{min(sampler.step_images)}-{max(sampler.step_images)} images")
        log.info("training uses %d of %d images per epoch (%s); %d, a different random set each epoch, wait for the "
                 "next%s", tr.data.num_train - sampler.dropped_per_epoch, tr.data.num_train, batches,
                 sampler.dropped_per_epoch, " (incomplete aspect-ratio batches)" if sampler.groups is not None else "")
    if hasattr(sampler, "step_images"):  # data.resolution=native
        _announce_native(tr, sampler)
    s, warmup = tr.cfg.schedule, warmup_length(tr.cfg.schedule, tr.total_steps)
    if warmup < s.warmup_steps and tr.layout.is_main:
        log.warning("schedule.warmup_steps=%d is not shorter than the run (%d step%s): the warmup is cut to %d "
                    "step%s; set schedule.warmup_steps below the run's steps", s.warmup_steps, tr.total_steps,
                    "" if tr.total_steps == 1 else "s", warmup, "" if warmup == 1 else "s")
    if tr.layout.world_size > 1:
        nodes = len(set(tr.layout.nodes))
        log.info("mesh (pp, dp, tp) over %d node%s: %s", nodes, "s" if nodes > 1 else "",
                 "; ".join(tr.layout.placement()))
    if tr.pipeline is not None:
        log.info("%s", tr.pipeline.describe())


def run_summary(tr, final_loss: float, train_time: float, weights: Path) -> dict[str, Any]:
    """The summary of a finished run (table, summary.json): the trainer `tr`'s figures, its task's last evaluation."""
    from visiondist.data.robust import count_bad_images

    if math.isnan(final_loss):  # nothing trained in this process (resumed at the end): the run's last logged loss
        final_loss = next((r["loss"] for r in reversed(tr.metrics.rows) if r.get("loss") is not None), math.nan)
    ran = tr.step - tr.resumed_from_step
    sampler = tr.data.train_sampler
    whole = tr.earlier_seconds + train_time if tr.earlier_seconds is not None else None  # every attempt's

    def rate(steps: int, seconds: float | None) -> float | None:
        return float(f"{sampler.images(tr.step - steps, tr.step) / seconds:.3g}") if steps and seconds else None

    summary = {
        "model": tr.cfg.model.name,
        "parameters (M)": round(tr.num_params / 1e6, 3),
        "parameters per rank (M)": round(tr.rank_params / 1e6, 3),
        "layout": tr.layout_text,
        "precision": precision_text(tr.cfg.trainer, tr.layout.device, tr.model),
        "data": f"{tr.cfg.data.name}: {tr.data.num_train} train / {tr.data.num_val} val images"
                + (f" (shards of {tr.cfg.data.root})" if tr.cfg.data.get("format") == "shards" else ""),
        **tr.task.input_fields,  # the resolution (native: the resolved sequence lengths)
        "steps": tr.step,
        "epochs": float(f"{tr.step / tr.data.train_sampler.steps_per_epoch:.3g}"),
        "train time (s)": round(whole, 1) if whole is not None else None,  # the whole run's, over its attempts
        "throughput (img/s)": rate(tr.step, whole),
        **({"this attempt": f"steps {tr.resumed_from_step + 1}-{tr.step}: {train_time:.1f} s, "
                            f"{rate(ran, train_time)} img/s"} if tr.resumed_from_step else {}),
        **_steady_state(tr),
        "final train loss": None if math.isnan(final_loss) else final_loss,
        **best_evaluation(tr.metrics.rows, *tr.task.headline),
        **({"skipped steps (non-finite)": tr.skipped_steps} if tr.skipped_steps else {}),
        **({"skipped steps (fp16 overflow)": tr.overflow_steps} if tr.overflow_steps else {}),
        **({"fp16 loss scale": _exact(tr.scaler.get_scale())} if tr.scaler is not None else {}),
        **({"unreadable train images (replaced)": bad} if (bad := count_bad_images(tr.run_dir)) else {}),
        **_device_decoding(tr),
        **_without_masks(tr),
        **_shard_fetches(tr),
        **({"TP traffic per step (MB)": round(tr.tp_bytes_per_step / 1e6, 2)} if tr.tp_bytes_per_step else {}),
        **({"PP traffic per step (MB)": round(tr.pp_bytes_per_step / 1e6, 2)} if tr.pp_bytes_per_step else {}),
        **({"pipeline": f"{tr.pipeline.schedule_name}, {tr.pipeline.microbatches} micro-batches"}
           if tr.pipeline is not None else {}),
        **({"pipeline bubble (%)": round(100 * tr.bubble, 1)} if tr.bubble is not None else {}),
        **tr.task.summary(tr.last_eval),
        **({"peak GPU memory (GiB)": round(tr.peak_gpu_gib(), 2)} if tr.layout.device.type == "cuda" else {}),
        "checkpoint": str(tr.last_checkpoint),
        **({"checkpoint stall (s, mean)": round(sum(tr.checkpoint_stall_s) / len(tr.checkpoint_stall_s), 3)}
           if tr.checkpoint_stall_s else {}),
        **_best_row(tr),
        "weights": str(weights),
        "run dir": str(tr.run_dir),
    }
    return summary


def _steady_state(tr) -> dict[str, Any]:
    """The rate of this process's log windows after its first (which holds the start-up: compilation, autotuning,
    the loader's first batches), timed on the device, and its MFU on a known GPU; nothing with a single window."""
    steady = tr.timer.steady_state() if tr.timer is not None else None
    if steady is None:
        return {}
    first, last, seconds = steady
    rate = tr.data.train_sampler.images(first - 1, last) / seconds
    mfu = tr.mfu(rate)
    return {"throughput, steady state (img/s)": float(f"{rate:.4g}"),
            "steady state": f"steps {first}-{last} (the log windows after the first)",
            **({"MFU, steady state (%)": round(100 * mfu, 1)} if mfu is not None else {})}


def _best_row(tr) -> dict[str, Any]:
    """`trainer.best_metric`: the best checkpoint the run kept (this process's or, resumed, an earlier one's)."""
    best = tr.best or (read_best(tr.run_dir) if tr.cfg.trainer.best_metric else None)
    if not best:
        return {}
    return {f"best {best['metric']}": f"{best['value']:.6g} at step {best['step']}",
            "best checkpoint": str(tr.run_dir / CHECKPOINTS / f"step_{best['step']}")}


def _device_decoding(tr) -> dict:
    """data.decode_on=device: how many of rank 0's training images the device decoded, and with what."""
    count = getattr(tr.task, "worker_decoded", None)
    if count is None or not count.images:
        return {}
    from visiondist.data.device_decode import WORKER_DECODED, count_worker_decoded, decoder_name

    files = count_worker_decoded(tr.run_dir)
    named = (f" ({files} file{'s' if files != 1 else ''} of any rank, training's and evaluation's, in "
             f"{WORKER_DECODED}; a training file counts each time it is read)") if files else ""
    return {"decode_on=device (rank 0)": f"{count.images - count.fallbacks} of {count.images} images by "
                                         f"{decoder_name(tr.layout.device)}, {count.fallbacks} in the loader "
                                         f"workers{named}"}


def _without_masks(tr) -> dict:
    """A mask model on COCO: the training instances left out for want of a valid segmentation."""
    counts = getattr(getattr(getattr(tr.data, "train_loader", None), "dataset", None), "counts", None)
    if not getattr(counts, "without_mask", 0):
        return {}
    return {"instances without a valid mask (left out)": counts.without_mask}


def _shard_fetches(tr) -> dict:
    """data.format=shards from a URL: the MB of shards and indexes each DP rank (with its loader workers) fetched into
    its node's cache, gathered from every rank (a collective: every rank builds the summary). A directory is read in
    place: nothing fetched, no row."""
    from visiondist.data.shards.store import is_url

    if tr.cfg.data.get("format") != "shards" or not is_url(str(tr.cfg.data.root)):
        return {}
    import torch.distributed as dist

    store = getattr(tr.data, "store", None)
    mine = round(store.fetched.value / 1e6, 3) if store is not None else 0.0
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    return {"shard MB fetched per rank": every}


def _exact(value: float) -> float | int:
    """A whole number as an int (the summary table prints floats to 4 digits: 65536, not 6.554e+04)."""
    return int(value) if value.is_integer() else value


