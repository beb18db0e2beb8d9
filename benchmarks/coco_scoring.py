"""COCO box scoring time: visiondist's evaluator backend (faster-coco-eval) vs plain pycocotools, on
the same generated ground truth and detections. Prints both times, their ratio and whether the 12
stats are identical.

    python benchmarks/coco_scoring.py                   # 1000 images, ~60k detections
    python benchmarks/coco_scoring.py --images 5000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visiondist.evaluation.coco_scoring import score


def generate(images: int, per_image: int, classes: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    """Ground truth of `images` 640x480 images (1-15 boxes each, all sizes) and about `per_image`
    detections per image: jittered true boxes with wrong classes now and then, plus false
    positives."""
    rng = np.random.default_rng(seed)
    gt_images, anns, dets = [], [], []
    for image_id in range(1, images + 1):
        gt_images.append(
            {"id": image_id, "file_name": f"{image_id}.jpg", "width": 640, "height": 480}
        )
        boxes = []
        for _ in range(rng.integers(1, 16)):
            w, h = np.exp(rng.uniform(np.log(8), np.log(400), 2))
            x, y = rng.uniform(0, 640 - min(w, 630)), rng.uniform(0, 480 - min(h, 470))
            cat = int(rng.integers(1, classes + 1))
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": image_id,
                    "category_id": cat,
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "iscrowd": int(rng.random() < 0.01),
                }
            )
            boxes.append((x, y, w, h, cat))
        for i in range(per_image):
            if i < len(boxes) * 2:
                x, y, w, h, cat = boxes[i % len(boxes)]
                x, y = x + rng.normal(0, 0.1 * w), y + rng.normal(0, 0.1 * h)
                w, h = w * np.exp(rng.normal(0, 0.1)), h * np.exp(rng.normal(0, 0.1))
                cat = cat if rng.random() < 0.8 else int(rng.integers(1, classes + 1))
                s = rng.uniform(0.3, 1.0)
            else:
                w, h = np.exp(rng.uniform(np.log(8), np.log(300), 2))
                x, y, cat, s = (
                    rng.uniform(0, 600),
                    rng.uniform(0, 440),
                    int(rng.integers(1, classes + 1)),
                    rng.uniform(0, 0.5),
                )
            dets.append((image_id, x, y, w, h, s, cat))
    cats = [{"id": c, "name": f"c{c}"} for c in range(1, classes + 1)]
    return {"images": gt_images, "annotations": anns, "categories": cats}, np.array(
        dets, dtype=np.float64
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--per-image", type=int, default=60)
    parser.add_argument("--classes", type=int, default=80)
    args = parser.parse_args()
    gt, dets = generate(args.images, args.per_image, args.classes)
    with tempfile.TemporaryDirectory() as tmp:
        ann = Path(tmp) / "instances.json"
        ann.write_text(json.dumps(gt))
        times, stats = {}, {}
        for backend in ("pycocotools", "faster-coco-eval"):
            start = time.perf_counter()
            stats[backend] = score(ann, dets, backend=backend)
            times[backend] = time.perf_counter() - start
    same = stats["pycocotools"] == stats["faster-coco-eval"]
    print(
        f"{args.images} images, {len(gt['annotations'])} ground-truth boxes, {len(dets)} "
        f"detections, {args.classes} classes"
    )
    print("| scorer | seconds | speed-up |\n|---|---|---|")
    for backend in ("pycocotools", "faster-coco-eval"):
        print(
            f"| {backend} | {times[backend]:.2f} | {times['pycocotools'] / times[backend]:.1f}x |"
        )
    print(f"12 stats identical: {same} (mAP {stats['pycocotools']['mAP']:.4f})")
    if not same:
        for name in stats["pycocotools"]:
            print(name, stats["pycocotools"][name], stats["faster-coco-eval"][name])


if __name__ == "__main__":
    main()
