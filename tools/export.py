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
SUFFIX = {
    "safetensors": ".safetensors",
    "onnx": ".onnx",
    "pt2": ".pt2",
    "torchscript": ".pt",
    "hf": "_hf",
    "naflex": "_naflex.safetensors",
}
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
    fmt = args.get("format", "safetensors")
    if fmt not in SUFFIX:
        raise ConfigError(f"format={fmt}: choose one of {', '.join(SUFFIX)}")
    run_dir = Path(args["run_dir"]).expanduser()
    if cmd.show:
        print(config_text(load_run_config(run_dir, [], inputs=None), cmd.package))
        return 0
    # hf: the directory model_hf
    out = Path(args.get("out") or run_dir / "export" / f"model{SUFFIX[fmt]}")
    named = (
        [name for name, suffix in SUFFIX.items() if suffix.endswith(out.suffix)]
        if out.suffix
        else []
    )
    # format=pt2 out=model.onnx: a file named as what it is not
    if named and fmt not in named and fmt != "hf":
        raise ConfigError(
            f"out={args['out']}: a {out.suffix} file is what format={named[0]} writes; "
            f"format={fmt} writes {SUFFIX[fmt]}: name it {out.stem}{SUFFIX[fmt]}, or give "
            f"format={named[0]}"
        )

    from visiondist.checkpoint.export import export as export_run
    from visiondist.checkpoint.export.onnx_check import check_onnx
    from visiondist.checkpoint.export.trained import load_trained

    if not args.get("step", "0").isdigit() and args["step"] != "best":
        raise ConfigError(
            f"step={args['step']}: give a checkpoint's step number, e.g. step=500, or step=best"
        )
    try:
        step = (
            args["step"]
            if args.get("step") == "best"
            else int(args["step"])
            if "step" in args
            else None
        )
        trained = load_trained(run_dir, step)
        files = export_run(trained, fmt, out)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    except RuntimeError as exc:  # e.g. a damaged checkpoint: the message names it and what to do
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"exported {trained.cfg.model.name} from {trained.source}")
    for file in files:
        print(f"  {file}")
    if fmt == "onnx":
        check = check_onnx(trained, out)
        print(
            "  onnxruntime not installed: output not checked"
            if check is None
            else f"  {check.summary()}"
        )
    if fmt == "pt2":
        from visiondist.checkpoint.export.pt2 import check_pt2

        print(f"  {check_pt2(trained, out)}")
    return 0


def main(argv: list[str]) -> int:
    return cli_main(TOOL, CONFIGS, argv, export)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
