"""A benchmark's result rows: each configuration's timed step against its own plain loops, the
hardware's peaks (MFU against the datasheet and the measured matmul rate), FLOPs per image, memory,
traffic per step, the loader's rate beside the step's and a DETR-class matcher's share. `harness.py`
times the loops (`loops.py`); `report.py` prints and records the rows.
"""

from __future__ import annotations

import statistics
from datetime import datetime
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from visiondist.bench.loops import OursRun, Timed
from visiondist.bench.measure import (
    PeakMemory,
    device_input_work,
    device_name,
    train_flops_per_image,
)
from visiondist.bench.plain_loop import PlainLoop
from visiondist.bench.report import ratio_check, step_summary
from visiondist.engine.build import run_of
from visiondist.models.registry import spec_of
from visiondist.parallel import Layout, transformer_blocks
from visiondist.plan.budget import layout_memory
from visiondist.utils.peaks import datasheet_tflops, matmul_tflops, peak_kind


def _ratios(ours: Timed, plain: dict[str, Timed], first: Timed | None) -> dict[str, Any]:
    """The row's ratios of median step times, each with its uncertainty and, when it means nothing,
    why."""
    reference, same = plain.get("reference"), plain.get("same_model")
    pairs = {
        "ours_over_plain": (ours, reference or same),
        "harness_overhead": (ours, same),
        "model_difference": (same, reference if same else None),
        "over_first": (ours, first),
    }
    values, uncertainty, warnings = {}, {}, {}
    for key, (a, b) in pairs.items():
        if a is None or b is None:
            values[key] = 1.0 if key == "over_first" else None
            continue
        values[key] = statistics.median(a.times) / statistics.median(b.times)
        uncertainty[key], why = ratio_check(a.times, b.times)
        if why:
            warnings[key] = why
    return {
        **values,
        "ratio_uncertainty": uncertainty,
        "ratio_warnings": warnings,
        "ratio_reliable": not warnings,
    }


def _plain_summary(loop: PlainLoop, timed: Timed, built_from: str, batch: int) -> dict[str, Any]:
    return {
        "model": loop.model_name,
        "built_from": built_from,
        "compile_scope": loop.compile_scope,
        "compile_faults": timed.faults,
        "optimizer": loop.optimizer_name,
        "steps_timed": len(timed.times),
        "step": step_summary(timed.times),
        "images_per_s": batch / statistics.median(timed.times),
        "peak_memory_gb": loop.peak_memory_gb,
    }


def collect_results(
    cfg: DictConfig,
    layout: Layout,
    runs: list[OursRun],
    plains: list[dict[str, PlainLoop]],
    groups: list[list[Timed]],
    order: list[list[str]],
    family: str,
    loader_rates: list[float | None],
) -> list[dict[str, Any]]:
    """One result per configuration: its step against its own plain loops, the hardware's peaks and
    the rest."""
    device, batch = layout.device, cfg.data.batch_size
    name = device_name(device)
    kinds = [peak_kind(run.cfg.trainer.precision, run.cfg.trainer.tf32, device) for run in runs]
    measured = (
        {kind: matmul_tflops(device, kind) for kind in sorted(set(kinds))} if cfg.bench.peak else {}
    )
    flops: dict[str, float] = {}
    for run in runs:  # a variant may change the model's shape
        key = OmegaConf.to_yaml(run.cfg.model)
        flops[key] = flops.get(key) or train_flops_per_image(run.cfg.model, run.batches[0], family)
    cpu = device.type == "cpu"
    common = {
        "date": datetime.now().strftime("%Y-%m-%d"),
        "device": name,
        "torch": torch.__version__,
        "model": cfg.model.name,
        "img_size": cfg.model.img_size
        if family == "classification" or cfg.model.get("family") == "detr"
        else cfg.data.min_size,
        "layout": run_of(runs[0].layout).describe(),
        "ranks": layout.world_size,
        "batch": batch,
        "configurations": [run.name or "-" for run in runs],
        "order": order,
        "memory_kind": "peak RSS of the whole process (every loop)"
        if cpu
        else "max allocated (each loop)",
    }
    results = []
    for i, (run, kind) in enumerate(zip(runs, kinds)):
        c, ours = run.cfg, groups[i][0]
        images_per_s = batch / statistics.median(ours.times)
        gflops = flops[OmegaConf.to_yaml(c.model)] / 1e9
        achieved = gflops * images_per_s / layout.world_size / 1e3  # TFLOP/s per device
        datasheet = datasheet_tflops(name, kind) if device.type == "cuda" else None
        grad_bytes = sum(p.numel() * p.element_size() for p in run.parts.model.parameters())
        switches = run_of(run.layout)
        dp_bytes = (
            2 * (layout.dp - 1) / layout.dp * grad_bytes
            if layout.dp > 1 and not switches.fsdp
            else 0.0
        )
        timed_plain = dict(zip(plains[i], groups[i][1:]))
        results.append(
            {
                **common,
                "variant": run.name or "-",
                "precision": str(c.trainer.precision),
                # input work the step does on the device (timed in ours and in the plain loops,
                # which get decoded images)
                "device_input": device_input_work(c.data) if family == "classification" else [],
                "compile": switches.compile,
                "compile_scope": _compile_scope(run),
                "optimizer": run.optimizer_name,
                # graph breaks, recompile-limit hits, compiling while timed, in ours or its plain
                # loops: the row failed
                "compile_faults": [
                    f"{t.label.split(':')[1]}: {f}" for t in groups[i] for f in t.faults
                ],
                "sdpa": c.model.sdpa,
                "attention_order": run.attention,
                "fp8": c.trainer.fp8,
                "activation_checkpointing": switches.activation_checkpointing,
                "channels_last": bool(c.model.channels_last),
                "steps_timed": len(ours.times),
                "images_per_s": images_per_s,
                "step": step_summary(ours.times),
                "gflops_per_image": gflops,
                # whether the input path keeps up: the real loader's images/s over what this step
                # consumes
                "loader_images_per_s": loader_rates[i],
                "loader_over_step": loader_rates[i] / images_per_s if loader_rates[i] else None,
                **_matcher_share(run.parts.model, batch / images_per_s),
                "tflops_per_device": achieved,
                "peak_kind": kind,
                "peak_tflops_datasheet": datasheet,
                "mfu_datasheet": achieved / datasheet if datasheet else None,
                "peak_tflops_matmul": measured.get(kind),
                "mfu_matmul": achieved / measured[kind] if measured else None,
                "peak_memory_gb": PeakMemory.rss_gb() if cpu else run.peak_memory_gb,
                "peak_reserved_gb": run.peak_reserved_gb,
                "planned_gb": _planned_gb(c, switches, layout),
                "tp_bytes_per_step": run.tp_bytes,
                "pp_bytes_per_step": run.pp_bytes,
                # DDP's gradient all-reduce, ring: 2(n-1)/n of the gradients (analytic)
                "dp_bytes_per_step": dp_bytes,
                **{
                    f"plain_{role}": (
                        _plain_summary(plains[i][role], timed_plain[role], run.name or "-", batch)
                        if role in plains[i]
                        else None
                    )
                    for role in ("reference", "same_model")
                },
                **_ratios(ours, timed_plain, groups[0][0] if i else None),
            }
        )
    return results


def _planned_gb(cfg: DictConfig, run, layout: Layout) -> float | None:
    """The memory plan's bytes on this rank's device (its pipeline stage, its FSDP shard) for the
    configuration (ViTs: what `tools/plan.py` and the fit of a named layout count), in GB; None for
    a model the planner does not model."""
    if spec_of(cfg.model).planner_shape is None:
        return None
    # a variant's accumulation is its config's
    run = run.replace(grad_accum=int(cfg.trainer.grad_accum))
    return layout_memory(cfg, run, layout.pp_rank, layout.dp_rank).device / 1e9


def _matcher_share(model: torch.nn.Module, step_s: float) -> dict[str, Any]:
    """A DETR-class detector's Hungarian matching per step (the criterion's host time: scipy's
    solving, and the wait for the cost matrices, which on a GPU holds the forward queued before
    them) beside the step's time."""
    criterion = next(
        (c for m in model.modules() if (c := getattr(m, "criterion", None)) is not None), None
    )
    if criterion is None or not criterion.calls:
        return {}
    solve_ms = 1e3 * criterion.host_seconds["solve"] / criterion.calls
    wait_ms = 1e3 * criterion.host_seconds["wait"] / criterion.calls
    return {
        "matcher_solve_ms": solve_ms,
        "matcher_wait_ms": wait_ms,
        "matcher_solve_share": solve_ms / (1e3 * step_s) if step_s else None,
    }


def _compile_scope(run: OursRun) -> str:
    """What `trainer.compile` compiled: the whole model (replayed as CUDA graphs or not), or each
    transformer block (on this rank)."""
    switches = run_of(run.layout)
    if not switches.compile:
        return "none"
    if switches.compile_scope == "model":
        return "whole model" + (", CUDA graphs" if switches.cuda_graphs else "")
    return f"per block ({len(transformer_blocks(run.parts.model))} blocks)"
