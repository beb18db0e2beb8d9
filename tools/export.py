"""Export a trained run for use outside visiondist:

    python tools/export.py run_dir=<run dir> [step=<N>] [out=<path>]
        [format=safetensors|onnx|openvino|pt2|torchscript|hf|naflex] [opset=<n>]
        [half=true|int8=true]
    python tools/export.py run_dir=<run dir> benchmark=true

safetensors (default): one consolidated file in timm's (ViT) or torchvision's (detectors) key names,
loadable with strict=True without visiondist, plus <out>.json saying how to build the model (see
visiondist/checkpoint/export/). onnx: the class names (detectors: label -> COCO category id) in its
metadata, checked against PyTorch with ONNX Runtime when it is installed (detectors: on 4 val images
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
    "[format=safetensors|onnx|openvino|pt2|torchscript|hf|naflex] [out=<path>] [opset=<n>] "
    "[half=true|int8=true] [benchmark=true]"
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
            "ema=true",
            "the checkpoint's EMA of the weights (trainer.ema_decay > 0; the latest checkpoint "
            "unless step=), written as model_ema.<suffix>; step=best by a val_ema_* metric "
            "exports it without",
        ),
        (
            "format=<format>",
            "safetensors (default; plus <out>.json saying how to build the model), onnx, "
            "pt2 (classifiers: torch.export, any batch), torchscript, hf (DETR-class detectors: "
            "a from_pretrained directory), naflex (ViTs: timm's NaFlexVit, images at their own "
            "size and aspect ratio; plus <out>.json) or openvino (OpenVINO's IR: <out>.xml, .bin "
            "and a .json of the names; checked on OpenVINO's CPU plugin)",
        ),
        (
            "out=<path>",
            "the file (hf: directory) to write (default: "
            "<run>/export/model.<safetensors|onnx|pt2|pt>, hf: <run>/export/model_hf, naflex: "
            "<run>/export/model_naflex.safetensors, openvino: <run>/export/model_openvino.xml)",
        ),
        (
            "opset=<n>",
            "format=onnx, openvino: the ONNX opset the graph is written in (17 to 20; default 18, "
            "which ONNX Runtime >= 1.14 and TensorRT 10 read; 18 or more for a DETR-class "
            "detector's antialiased resize)",
        ),
        (
            "half=true",
            "format=onnx: the network's layers in float16, inputs, outputs and box decoding in "
            "float32 (default out: <run>/export/model_fp16.onnx); prints the val split's accuracy "
            "of the float32 and float16 files",
        ),
        (
            "int8=true",
            "format=onnx: convolutions and matrix products quantized to int8 (ONNX Runtime's "
            "static quantization, calibrated on 32 of the run's train images; default out: "
            "<run>/export/model_int8.onnx); prints the val split's accuracy of both files",
        ),
        (
            "benchmark=true",
            "every deployable form side by side on this machine: PyTorch eager and compiled, "
            "ONNX in float32, float16 and int8, pt2 (classifiers): size, val accuracy of each "
            "file, latency at batch 1 and 8; a table, <run>/export/benchmark/benchmark.md and "
            ".json",
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
    from visiondist.api.export_job import as_flag, export_job  # the job (torch: 2 s)

    if as_flag("benchmark", args.get("benchmark", False)):
        others = sorted(args.keys() - {"run_dir", "step", "benchmark"})
        if others:
            raise ConfigError(
                f"benchmark=true writes every format itself: drop {', '.join(others)}="
            )
        from visiondist.api.export_bench import export_benchmark

        export_benchmark(run_dir, args.get("step"))
        return 0
    try:
        export_job(
            run_dir,
            args.get("format", "safetensors"),
            args.get("step"),
            args.get("out"),
            opset=args.get("opset"),
            half=args.get("half", False),
            int8=args.get("int8", False),
            ema=args.get("ema", False),
        )
    except RuntimeError as exc:  # e.g. a damaged checkpoint: the message names it and what to do
        # (torch's own messages may start with an empty line and go on for several)
        lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        print(f"error: {lines[0].strip()}", file=sys.stderr)
        for line in lines[1:20]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    return cli_main(TOOL, CONFIGS, argv, export)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
