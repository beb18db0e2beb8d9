"""The summary of a finished training run (the table and summary.json that
`visiondist.observe.summary.report_run` writes), read off the trainer's parts and its loop state;
the start-up lines are `visiondist.engine.announce`'s."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch.distributed as dist

from visiondist.checkpoint.files import read_best
from visiondist.data.decode_fallback import WORKER_DECODED, count_worker_decoded
from visiondist.data.device_decode import decoder_name
from visiondist.data.robust import count_bad_images
from visiondist.data.shards.store import is_url
from visiondist.engine.announce import layout_text
from visiondist.engine.precision import precision_text
from visiondist.engine.trainer import Trainer
from visiondist.observe.summary import best_evaluation
from visiondist.utils.dcp import CHECKPOINTS, list_checkpoints

log = logging.getLogger(__name__)


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
        "layout": layout_text(tr),
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
        **_best_evaluation(tr),
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


def _best_evaluation(tr: Trainer) -> dict[str, Any]:
    """The best evaluation's value and step; where no trainer.best_metric keeps its checkpoint and
    the run kept none of that step, a row saying so and the setting that keeps it."""
    key, label = tr.parts.task.headline
    best = best_evaluation(tr.metrics.rows, key, label)
    step = best.get("best at step")
    kept = {s for s, _ in list_checkpoints(tr.run_dir)}
    # the final step's checkpoint is the run's last; step 0 is the weights it started from
    if step is None or tr.cfg.trainer.best_metric or step in kept or step in (0, tr.state.step):
        return best
    return {**best, "best's checkpoint": f"not kept (trainer.best_metric={key} keeps it)"}


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
