"""Rank-side code of tests/multirank/test_fit.py (run by `helpers.spawn_ranks`): each case is a
`tools/train.py` command line, resolved by every rank as under torchrun (`visiondist.plan.resolve`:
the named layout fitted to the device alike on each rank), the rank's config given the fitted
accumulation as the launcher gives it (`visiondist.plan.fit.as_run`), then trained by the real
Trainer; the runs one after another in one process group (a launch costs seconds, a run of the tiny
model about one)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _fit(overrides: list[str], device: torch.device) -> dict:
    from visiondist.cli import load_config
    from visiondist.engine.build import prepare_rank
    from visiondist.engine.run import build_trainer, run_trainer
    from visiondist.parallel import build_layout
    from visiondist.plan import resolve
    from visiondist.plan.fit import as_run

    cfg = load_config(CONFIGS, [*overrides, "trainer.max_restarts=0"])  # restarts are torchrun's
    run, _ = resolve(cfg, dict(os.environ))
    cfg = as_run(cfg, run)
    OmegaConf.set_readonly(cfg, True)
    layout = build_layout(
        run.dp, run.tp, run.pp, device, int(os.environ.get("LOCAL_RANK", 0)), run=run
    )
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    prepare_rank(cfg, layout, run_dir)  # logging into run_dir/train.log
    run_trainer(build_trainer(cfg, layout, run_dir))
    return {"grad_accum": run.grad_accum, "fitted": run.fitted}


@record
def runs(cases: list[list[str]]) -> list[dict]:
    """`_fit(overrides)` for each case in turn."""
    from devices import init_test_rank

    device = init_test_rank()
    torch.set_num_threads(1)
    try:
        return [_fit(case, device) for case in cases]
    finally:
        dist.destroy_process_group()
