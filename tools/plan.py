"""Plan the parallel layout of a model without starting anything, and check it:

    python tools/plan.py model=vit_giant trainer.devices=8 parallel.gpu=h100 \
        [parallel.nodes=4] [...]
    python tools/plan.py verify=chosen model=vit_22b trainer.devices=8 parallel.nodes=8 ...

Prints, for every layout the trainer can run on trainer.devices x parallel.nodes devices (or
parallel.num_devices), the per-device GB by component, the estimated step time and whether it fits;
then the layout `parallel=auto` would choose and the overrides that select it. The model, data
(global batch), optimizer, EMA and precision come from the same config groups as train.py. Exits 1
when no layout fits (naming the smallest device count that would).

`verify=chosen` (or `verify=all`: every layout that fits) then dry-runs the layout: the first, a
middle and the last rank of the full world are built by the training code on torch's fake process
group, with no memory behind the tensors, and step once; their measured bytes are printed beside the
plan's. Exits 1 when a rank cannot be built or a figure is off the plan
(`visiondist.verify.dryrun`). With a layout named by hand (parallel=tp4 ..., not auto), the named
layout is planned as tools/train.py plans it before any rank starts (`visiondist.plan.fit`): fitted
to the budget with gradient accumulation or activation checkpointing, or refused (exit 1);
`verify=chosen` checks it as it would run.
"""

import sys
from functools import partial
from pathlib import Path

from visiondist.api.plan_job import plan_job
from visiondist.cli import Tool, exit_now
from visiondist.cli import main as cli_main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOOL = Tool(
    name="plan.py",
    about=(
        "Plan the parallel layout of a model on N devices without starting anything: for a ViT, "
        "per-device memory by component, estimated step time and fit for every layout, then what "
        "parallel=auto would choose and the overrides that select it by hand (a detector runs "
        "DDP); a layout named by hand is checked against the budget. verify= dry-runs it at full "
        "scale. Exits 1 when nothing fits, the named layout does not, or a dry-run figure is off "
        "the plan."
    ),
    reads=(
        "configs/ as tools/train.py: model, global batch (data.batch_size), optimizer, EMA, "
        "precision; the devices from trainer.devices x parallel.nodes (or parallel.num_devices), "
        "the devices' board (parallel.gpu=h100, a100-40gb, l40s, ...) or their memory and rate "
        "(parallel.device_memory_gb, parallel.device_tflops: the time model's sustained dense "
        "bf16 rate per device); default this machine's GPU, without one its CPU memory / ranks "
        "per node; no data"
    ),
    writes="nothing: prints the table",
    examples=(
        "python tools/plan.py model=vit_22b data=imagenet trainer.precision=bf16 trainer.devices=8 "
        "parallel.nodes=8 parallel.gpu=h100",
        "python tools/plan.py verify=chosen model=vit_22b data=imagenet trainer.precision=bf16 "
        "trainer.devices=8 parallel.nodes=8 parallel.device_memory_gb=80",
        "python tools/plan.py verify=chosen model=vit_huge parallel=tp4 parallel.pp=2 "
        "trainer.devices=8 parallel.nodes=4",
    ),
    keys=(
        (
            "verify=chosen|all",
            "dry-run the chosen layout (or every layout that fits) at full scale on this "
            "machine and compare its measured bytes per rank with the plan",
        ),
    ),
    run_dir=False,
    multirun=False,
)


def main(argv: list[str]) -> int:
    return cli_main(TOOL, CONFIGS, argv, partial(plan_job, configs=CONFIGS))


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
