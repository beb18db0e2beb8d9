"""TensorRT builds the exported graphs: one fresh model of each graph form (a ViT-S/16 classifier
at 224 px, an RT-DETRv2-R18 at 640 px, a Faster R-CNN MobileNet-v3 with images up to 800 px)
exported by tools/export.py's writer, then `trtexec` with docs/deploy.md's shapes and --fp16. Prints
one line per model; skipped (exit 0) where trtexec is not on PATH, so that the script also runs end
to end on a machine without TensorRT (`--tiny`: small inputs).

    python benchmarks/gpu/trt_check.py [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from visiondist.checkpoint.export import export  # noqa: E402
from visiondist.checkpoint.export.trained import Trained  # noqa: E402
from visiondist.cli import load_config  # noqa: E402
from visiondist.models import build_model  # noqa: E402

# name, overrides, trtexec shapes (min, opt, max), as docs/deploy.md gives them
MODELS = {
    "vit_s16": (
        ["model=vit_small", "data.img_size=224"],
        ("images:1x3x224x224", "images:8x3x224x224", "images:32x3x224x224"),
    ),
    "rtdetr_v2_r18": (
        ["model=rtdetr_v2_r18", "data=shapes_coco", "model.img_size=640", "model.multi_scale=null"],
        tuple(f"images:{n}x3x640x640,sizes:{n}x2" for n in (1, 8, 16)),
    ),
    "fasterrcnn_mobilenet_v3": (
        [
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            "data.min_size=480",
            "data.max_size=800",
        ],
        (
            "images:1x3x320x320,sizes:1x2",
            "images:4x3x480x640,sizes:4x2",
            "images:8x3x800x800,sizes:8x2",
        ),
    ),
}
TINY = {"vit_s16": ["data.img_size=32", "model.depth=1"], "rtdetr_v2_r18": ["model.img_size=128"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="small models and inputs (a CPU's check of the script)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the graphs go (default: a temporary folder)"
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    trtexec = shutil.which("trtexec")
    failed = 0
    for name, (overrides, shapes) in MODELS.items():
        extra = TINY.get(name, []) if args.tiny else []
        cfg = load_config(
            REPO / "configs", [*overrides, f"data.root={out / 'absent'}", *extra], inputs=None
        )
        torch.manual_seed(0)
        trained = Trained(cfg, build_model(cfg.model).eval(), out / name, 0, None)
        path = out / f"{name}.onnx"
        export(trained, "onnx", path)
        if trtexec is None:
            size = path.stat().st_size / 2**20
            print(f"{name}: {path} written ({size:.1f} MiB); TensorRT: skipped, no trtexec")
            continue
        command = [
            trtexec,
            f"--onnx={path}",
            f"--minShapes={shapes[0]}",
            f"--optShapes={shapes[1]}",
            f"--maxShapes={shapes[2]}",
            "--fp16",
            f"--saveEngine={out / name}.engine",
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        tail = [
            line for line in done.stdout.splitlines() if "Throughput" in line or "Latency" in line
        ][:2]
        if done.returncode:
            failed += 1
            error = [line for line in (done.stdout + done.stderr).splitlines() if "ERROR" in line][
                :3
            ]
            print(f"{name}: TensorRT failed ({done.returncode}): {' | '.join(error)}")
        else:
            print(f"{name}: TensorRT built and ran it: {' | '.join(t.strip() for t in tail)}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
