"""Export a trained run for use outside visiondist:

    python tools/export.py run_dir=<run dir> [step=<N>] [out=<path>]
        [format=safetensors|onnx|pt2|torchscript|hf|naflex]

safetensors (default): one consolidated file in timm's (ViT) or torchvision's (detectors) key names,
loadable with strict=True without visiondist, plus <out>.json saying how to build the model (see
visiondist/checkpoint/export/). onnx: the class names (detectors: label -> COCO category id) in its
metadata, checked against PyTorch with ONNX Runtime when it is installed (detectors: on 3 val images
of the run's data when it is here; the number of boxes compared is printed). hf (DETR-class
detectors): the directory transformers' from_pretrained reads (config.json, model.safetensors,
preprocessor_config.json). Weights come from the run's latest checkpoint (or `step`), whatever
parallel layout wrote it, else its model.safetensors. Default out: <run dir>/export/model.<ext>.
"""

import sys
from pathlib import Path

from visiondist.cli import Command, Tool, config_text, exit_now, load_run_config
from visiondist.cli import main as cli_main
from visiondist.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXPECTED = (
    "expected run_dir=<dir> [step=<N>|best] "
    "[format=safetensors|onnx|pt2|torchscript|hf|naflex] [out=<path>]"
)
TOOL = Tool(
    name="export.py",
    about=(
        "Export a trained run for use outside visiondist: one consolidated file that timm (ViT) "
        "or torchvision (detectors) loads with strict=True, or ONNX (checked against PyTorch with "
        "ONNX Runtime when installed), or torch.export's ExportedProgram (classifiers), or "
        "TorchScript, or (DETR-class detectors) the directory transformers' from_pretrained "
        "reads. Takes no config overrides: the model comes from the run's config.yaml."
    ),
    keys=(
        ("run_dir=<dir>", "the training run to export (required)"),
        (
            "step=<N>",
            "its checkpoint checkpoints/step_<N> (default: the latest checkpoint, else "
            "model.safetensors), whatever parallel layout wrote it; step=best: the best one by "
            "trainer.best_metric",
        ),
        (
            "format=<format>",
            "safetensors (default; plus <out>.json saying how to build the model), onnx, "
            "pt2 (classifiers: torch.export, any batch), torchscript, hf (DETR-class detectors: "
            "a from_pretrained directory) or naflex (ViTs: timm's NaFlexVit, images at their own "
            "size and aspect ratio; plus <out>.json)",
        ),
        (
            "out=<path>",
            "the file (hf: directory) to write (default: "
            "<run>/export/model.<safetensors|onnx|pt2|pt>, hf: <run>/export/model_hf, naflex: "
            "<run>/export/model_naflex.safetensors)",
        ),
    ),
    reads="<run>/config.yaml and the run's newest checkpoint (or step=), else its "
    "model.safetensors",
    writes="<run>/export/model.<ext> (safetensors: and model.json; hf: the directory model_hf), "
    "or out=<path>; prints the files",
    examples=(
        "python tools/export.py run_dir=outputs/2026-11-21/21-10-24",
        "python tools/export.py run_dir=outputs/2026-11-21/21-10-24 format=onnx out=vit.onnx",
        "python tools/export.py run_dir=outputs/2026-11-21/21-10-24 step=500 format=pt2",
    ),
    config=False,
    run_dir=False,
    multirun=False,
)


def export(cmd: Command) -> int:
    args = cmd.args
    if "run_dir" not in args:
        raise ConfigError(f"run_dir= is missing: {EXPECTED}")
    run_dir = Path(args["run_dir"]).expanduser()
    if cmd.show:
        print(config_text(load_run_config(run_dir, [], inputs=None), cmd.package))
        return 0
    from visiondist.api.jobs import export_job  # visiondist.export's job (torch: 2 s)

    try:
        export_job(run_dir, args.get("format", "safetensors"), args.get("step"), args.get("out"))
    except RuntimeError as exc:  # e.g. a damaged checkpoint: the message names it and what to do
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    return cli_main(TOOL, CONFIGS, argv, export)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
