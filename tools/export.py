"""Export a trained run for use outside visiondist:

    python tools/export.py run_dir=<run dir> [step=<N>] [format=safetensors|onnx|torchscript] [out=<path>]

safetensors (default): one consolidated file in timm's (ViT) or torchvision's (detectors) key names, loadable with
strict=True without visiondist, plus <out>.json saying how to build the model (see visiondist/engine/export.py).
onnx: checked against PyTorch with ONNX Runtime when it is installed. Weights come from the run's latest checkpoint
(or `step`), whatever parallel layout wrote it, else its model.safetensors. Default out: <run dir>/export/model.<ext>.
"""

import sys
from pathlib import Path

SUFFIX = {"safetensors": ".safetensors", "onnx": ".onnx", "torchscript": ".pt"}


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0 if argv else 2
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = [a for a in argv if "=" not in a] + sorted(set(args) - {"run_dir", "step", "format", "out"})
    if unknown or "run_dir" not in args:
        print(f"error: {' '.join(unknown) or 'run_dir= is missing'}: expected run_dir=<dir> [step=<N>] "
              "[format=safetensors|onnx|torchscript] [out=<path>]", file=sys.stderr)
        return 2
    fmt = args.get("format", "safetensors")
    if fmt not in SUFFIX:
        print(f"error: format={fmt}: choose one of {', '.join(SUFFIX)}", file=sys.stderr)
        return 2
    run_dir = Path(args["run_dir"]).expanduser()
    out = Path(args.get("out") or run_dir / "export" / f"model{SUFFIX[fmt]}")

    from visiondist.config import ConfigError
    from visiondist.engine.export import check_onnx, export, load_trained

    try:
        step = int(args["step"]) if "step" in args else None
        trained = load_trained(run_dir, step)
        files = export(trained, fmt, out)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # e.g. a damaged checkpoint: the message names it and what to do
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"exported {trained.cfg.model.name} from {trained.source}")
    for file in files:
        print(f"  {file}")
    if fmt == "onnx":
        diff = check_onnx(trained, out)
        print("  onnxruntime not installed: output not checked" if diff is None else
              f"  ONNX Runtime vs PyTorch: max abs difference {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
