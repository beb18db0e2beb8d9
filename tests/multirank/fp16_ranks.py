"""Rank-side code of the fp16 tests (run by `helpers.spawn_ranks`): the real Trainer, several runs
one after another in one process group (a launch costs seconds, a run of the tiny model about
one)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _fit(overrides: list[str], overflow_at: int = 0, nan_at: int = 0) -> dict:
    """One run of `tools/train.py overrides` on this process group. With `overflow_at`, TP rank 1
    (only) finds an inf in the gradient of the final norm's weight, a parameter every TP rank holds
    whole, at that optimizer step: its own gradient norm is inf, TP rank 0's is finite. With
    `nan_at`, TP rank 1's loss is NaN at that step."""
    from visiondist.config import compose
    from visiondist.engine.build import prepare_rank
    from visiondist.engine.run import build_trainer, run_trainer
    from visiondist.parallel import unwrap
    from visiondist.plan import rank_layout

    cfg = compose(CONFIGS, overrides)
    layout = rank_layout(cfg)
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_rank(cfg, layout, run_dir)  # logging into run_dir/train.log
    trainer = build_trainer(cfg, layout, run_dir)
    parts, state, step = trainer.parts, trainer.state, trainer.optimizer_step
    if overflow_at:
        accumulate = step._accumulate

        def overflowing(batches):
            total = accumulate(batches)
            if layout.tp_rank == 1 and state.step + 1 == overflow_at:
                unwrap(parts.model).norm.weight.grad[0] = float("inf")
            return total

        step._accumulate = overflowing
    if nan_at:
        loss = parts.task.loss

        def poisoned(*args, **kwargs):
            value = loss(*args, **kwargs)
            return (
                value * float("nan") if layout.tp_rank == 1 and state.step + 1 == nan_at else value
            )

        parts.task.loss = poisoned
    summary = run_trainer(trainer)
    model = unwrap(parts.model)
    return {
        "summary": summary,
        "tp_rank": layout.tp_rank,
        "replicated": {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if getattr(p, "tp_shard_dim", None) is None
        },
        "adam_steps": sorted({float(s["step"]) for s in parts.optimizer.state.values()}),
        "scaler": None if parts.scaler is None else parts.scaler.state_dict(),
    }


@record
def runs(cases: list[tuple]) -> list[dict]:
    """`_fit(overrides, overflow_at, nan_at)` for each case in turn."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        return [_fit(*case) for case in cases]
    finally:
        dist.destroy_process_group()
