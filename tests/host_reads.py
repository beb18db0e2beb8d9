"""`HostReads`: the operators that read a tensor's values on the host, recorded on the CPU. On a GPU
each of them is a synchronisation of the host with the device, so a step that must never wait for
the GPU can be checked without one (the GPU tests check the same steps under CUDA's sync debug
mode)."""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Scalars (.item(), bool(), int()), nonzero and boolean-mask indexing (forward and backward),
    torch.equal, unique, masked_select, each recorded by name in `seen`, and with the project's
    innermost line in `where`."""

    SYNCING = {
        "_local_scalar_dense",
        "nonzero",
        "equal",
        "is_nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "item",
    }

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else []) or []
        )
        if name in self.SYNCING or bool_index:
            self.seen.append(name)
            ours = [
                f"{f.filename.rsplit('visiondist/', 1)[-1]}:{f.lineno}"
                for f in traceback.extract_stack()
                if "/visiondist/" in f.filename and "/tests/" not in f.filename
            ]
            self.where.append(f"{name} at {ours[-1] if ours else '?'}")
        return func(*args, **(kwargs or {}))


def steps_reading_the_host(cfg, layout, run_dir):
    """Rank entry (`visiondist.launch.launch`): two training steps, then three more with every host
    read of a tensor recorded: none may happen. The default logging reads the loss every 10 steps,
    so the recorded steps read none."""
    from visiondist.engine.build import prepare_rank
    from visiondist.engine.run import build_trainer

    prepare_rank(cfg, layout, run_dir)
    trainer = build_trainer(cfg, layout, run_dir)
    batches, step = trainer.parts.task.train_batches(layout.device), trainer.optimizer_step
    for _ in range(2):
        step.train_step(batches)
    with HostReads() as reads:
        for _ in range(3):
            step.train_step(batches)
            trainer.state.step += 1
    assert reads.where == [], f"the step read device values on the host: {sorted(set(reads.where))}"
    return True
