"""Rank-side code of the initialisation tests: a model built on the meta device, laid out, and only
this rank's tensors drawn (`visiondist.engine.build.build_laid_out`), gathered back to full tensors;
and the host memory a rank's start-up takes."""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist
from helpers import REPO
from torch.distributed.tensor import DTensor

from visiondist.cli import load_config
from visiondist.engine.build import build_laid_out, seed_everything
from visiondist.parallel import unwrap
from visiondist.parallel.tensor import SHARD_DIM
from visiondist.plan import rank_layout


def _layout(cfg):
    return rank_layout(cfg)


def _full(model, layout) -> dict[str, torch.Tensor]:
    """Every parameter of the model as one process holds it, on every rank: TP shards and FSDP
    shards gathered, pipeline stages merged."""
    mine = {}
    for name, param in unwrap(model).named_parameters():
        if isinstance(param, DTensor):
            value = param.full_tensor()
        elif getattr(param, SHARD_DIM, None) is not None:
            pieces = [torch.empty_like(param) for _ in range(layout.tp)]
            dist.all_gather(pieces, param.detach().contiguous(), group=layout.tp_comm.group)
            value = torch.cat(pieces, dim=getattr(param, SHARD_DIM))
        else:
            value = param
        mine[name] = value.detach().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: value for state in everyone for name, value in state.items()}


def laid_out_weights(cases: list[list[str]]) -> list[dict]:
    """For each case (config overrides naming a layout), the full initial weights its ranks drew,
    and whether every drop-path buffer holds its rate again."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        out = []
        for overrides in cases:
            cfg = load_config(REPO / "configs", overrides, inputs=None)
            layout = _layout(cfg)
            seed_everything(cfg.trainer.seed)
            model = build_laid_out(cfg, layout)
            buffers_ok = all(
                torch.equal(m.keep_prob, torch.tensor(1.0 - m.p))
                for m in unwrap(model).modules()
                if hasattr(m, "keep_prob")
            )
            out.append(
                {
                    "overrides": overrides,
                    "state": _full(model, layout),
                    "buffers_ok": buffers_ok,
                    "rng": torch.get_rng_state(),
                }
            )
        return out
    finally:
        dist.destroy_process_group()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def start_memory(overrides: list[str]) -> dict:
    """Host memory this rank's model build took (peak resident set above what the process held
    before it), and the bytes of the tensors it keeps."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        cfg = load_config(REPO / "configs", overrides, inputs=None)
        layout = _layout(cfg)
        seed_everything(cfg.trainer.seed)
        before = _rss()
        model = build_laid_out(cfg, layout)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        kept = sum(p.numel() * p.element_size() for p in unwrap(model).parameters())
        finite = all(torch.isfinite(p).all() for p in unwrap(model).parameters())
        dist.barrier()
        return {"increase": peak - before, "kept": kept, "finite": finite}
    finally:
        dist.destroy_process_group()
