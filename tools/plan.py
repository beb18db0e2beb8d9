"""Plan the parallel layout of a ViT without starting anything:

    python tools/plan.py model=vit_giant trainer.devices=8 parallel.device_memory_gb=80 [parallel.nodes=4] [...]

Prints, for every layout the trainer can run on trainer.devices x parallel.nodes devices (or parallel.num_devices),
the per-device GB by component, the estimated step time and whether it fits; then the layout `parallel=auto` would
choose and the overrides that select it. The model, data (global batch), optimizer, EMA and precision come from the
same config groups as train.py. Exits 1 when no layout fits (naming the smallest device count that would).
"""

import sys
from pathlib import Path

from omegaconf import OmegaConf

from visiondist.cli import Command, Tool, config_text, load_config, main as cli_main
from visiondist.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOOL = Tool(
    name="plan.py",
    about=("Plan the parallel layout of a ViT on N devices without starting anything: per-device memory by "
           "component, estimated step time and fit for every layout, then what parallel=auto would choose and the "
           "overrides that select it by hand. Exits 1 when nothing fits."),
    reads=("configs/ as tools/train.py: model, global batch (data.batch_size), optimizer, EMA, precision; the "
           "devices from trainer.devices x parallel.nodes (or parallel.num_devices) and parallel.device_memory_gb "
           "(default: this machine's GPU); no data"),
    writes="nothing: prints the table",
    examples=("python tools/plan.py model=vit_22b trainer.devices=8 parallel.nodes=8 parallel.device_memory_gb=80",
              "python tools/plan.py model=vit_huge data=imagenet trainer.devices=8 trainer.precision=bf16"),
    run_dir=False,
    multirun=False,
)
DEFAULT_CLASSES = 1000  # data.num_classes when it is unset and there is no data to count (the head's size)


def plan(cmd: Command) -> int:
    from rich.console import Console

    from visiondist.plan import cuda_device_count, device_memory_gb, plan_for, planning_world

    cfg = load_config(CONFIGS, cmd.overrides + cmd.search, inputs=None)  # a plan reads no data
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return 0
    if OmegaConf.is_missing(cfg.data, "num_classes"):
        print(f"data.num_classes is unset and there is no data.root to count: planned with {DEFAULT_CLASSES} "
              "classes (set data.num_classes for another head)", file=sys.stderr)
        cfg.data.num_classes = cfg.model.num_classes = DEFAULT_CLASSES
    devices, nodes = planning_world(cfg, cuda_device_count())
    t = cfg.trainer
    accelerator = "cuda" if t.accelerator != "cpu" and cuda_device_count() else "cpu"
    memory = cfg.parallel.device_memory_gb or device_memory_gb(accelerator, devices // nodes)
    try:
        result = plan_for(cfg, devices, nodes, memory)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    console = Console(width=max(120, Console().width))
    batch = f"global batch {cfg.data.batch_size}" + (f" x {t.grad_accum} accumulation" if t.grad_accum > 1 else "")
    title = (f"{cfg.model.name} ({result.layer_state / 1e9:.3g} GB of training state per block), {batch}, "
             f"{cfg.optim.name}, precision {t.precision}: {devices} devices "
             f"({nodes} node{'s' if nodes > 1 else ''} of {devices // nodes}), {memory:g} GB each")
    console.print(result.table(title))
    if result.choice is None:
        console.print(f"[bold red]nothing fits[/bold red]: {result.reason}")
        return 1
    c = result.choice.candidate
    console.print(f"parallel=auto would choose [bold]{c.name}[/bold]: {result.reason}")
    fields = " ".join(f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in c.overrides().items())
    console.print(f"the same layout by hand: {fields}", soft_wrap=True)
    return 0


def main(argv: list[str]) -> int:
    return cli_main(TOOL, CONFIGS, argv, plan)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
