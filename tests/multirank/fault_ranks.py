"""Rank-side code of the fault-injection tests (run by `helpers.spawn_ranks`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from visiondist.faults.health import set_collective_timeout


@record
def raise_on_one_rank(failing: int, pid_dir: str) -> None:
    """`failing` raises while the others wait for it in a barrier."""
    dist.init_process_group("gloo")
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == failing:
        raise ValueError(f"injected failure on rank {failing}")
    dist.barrier()


@record
def skip_a_collective(timeout_s: float) -> None:
    """After a first all-reduce the timeout drops to `timeout_s`; rank 1 then never joins the next
    one."""
    dist.init_process_group("gloo")
    x = torch.ones(1)
    dist.all_reduce(x)
    set_collective_timeout(timeout_s, [])
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(x)


@record
def nonfinite_on_one_rank(overrides: list[str], bad_rank: int, bad_step: int) -> dict:
    """The real Trainer on 2 DP ranks; `bad_rank`'s loss is NaN at optimizer step `bad_step`."""
    from visiondist.config import compose
    from visiondist.engine.build import prepare_rank
    from visiondist.engine.run import build_trainer, run_trainer
    from visiondist.plan import rank_layout

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        cfg = compose(Path(__file__).resolve().parents[2] / "configs", overrides)
        layout = rank_layout(cfg)  # 2 ranks: dp=2
        run_dir = Path(cfg.trainer.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        prepare_rank(cfg, layout, run_dir)  # logging into run_dir/train.log
        trainer = build_trainer(cfg, layout, run_dir)
        task = trainer.parts.task
        loss = task.loss

        def poisoned(*args, **kwargs):
            value = loss(*args, **kwargs)
            if layout.rank == bad_rank and trainer.state.step + 1 == bad_step:
                return value * float("nan")
            return value

        task.loss = poisoned
        summary = run_trainer(trainer)
        parts = trainer.parts
        return {
            "summary": summary,
            "params": {n: p.detach().clone() for n, p in parts.model.module.named_parameters()},
            "adam_steps": sorted({float(s["step"]) for s in parts.optimizer.state.values()}),
        }
    finally:
        dist.destroy_process_group()
